"""Elastic global batch and micro-batch formation, pure Python (no torch, no store).

A step trains on a global batch of complete groups whose size lies in
``[B_min, B_ideal]`` (``trainer.groups_min`` / ``trainer.groups_ideal``). Its
trajectories are packed into micro-batches by a token budget: the padded
size of a micro-batch (sequences x longest sequence, what the forward pass
really computes) stays within ``budget_tokens``.

Invariants:
- ``groups_to_take`` is 0 below ``B_min`` and otherwise lies in
  ``[B_min, B_ideal]`` and never exceeds the ready count;
- ``form_micro_batches`` puts every sequence in exactly one micro-batch;
- every micro-batch's padded size is within the budget, except a single
  sequence longer than the budget, which gets a micro-batch of its own
  (a trajectory is never split);
- micro-batches come largest first, so the last one is the smallest (the
  small final micro-batch that shortens RA2P's pipeline flush);
- the result depends only on the token counts (ties broken by index), so
  every rank that forms the batch from the same data gets the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence


def groups_to_take(num_ready_groups: int, groups_min: int, groups_ideal: int, target: int | None = None) -> int:
    """How many ready groups a step consumes: 0 (wait) below ``B_min``, else up to ``target``.

    ``target`` (default ``B_ideal``) lets the planner fetch less, toward
    ``B_min`` (adaptive data retention); it is clamped into ``[B_min, B_ideal]``.
    """
    if groups_min < 1 or groups_ideal < groups_min:
        raise ValueError(f"groups_to_take: need 1 <= groups_min <= groups_ideal, got {groups_min}, {groups_ideal}")
    if num_ready_groups < 0:
        raise ValueError(f"groups_to_take: num_ready_groups must be >= 0, got {num_ready_groups}")
    if num_ready_groups < groups_min:
        return 0
    want = groups_ideal if target is None else min(max(target, groups_min), groups_ideal)
    return min(num_ready_groups, want)


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens a right-padded batch of these sequences computes."""
    return len(lengths) * max(lengths) if lengths else 0


def form_micro_batches(token_counts: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Pack sequence indices into micro-batches of padded size <= ``budget_tokens``.

    First-fit decreasing: longest sequences first, each into the first
    micro-batch it fits; micro-batches are returned by padded size, largest
    first, and hold their indices longest first.
    """
    if budget_tokens < 1:
        raise ValueError(f"form_micro_batches: budget_tokens must be >= 1, got {budget_tokens}")
    for i, n in enumerate(token_counts):
        if n < 1:
            raise ValueError(f"form_micro_batches: sequence {i} has {n} tokens (need >= 1)")
    order = sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i))
    bins: list[list[int]] = []
    for i in order:
        for b in bins:
            # Items arrive longest first, so b[0] is the bin's longest sequence.
            if (len(b) + 1) * token_counts[b[0]] <= budget_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    sizes = [padded_tokens([token_counts[i] for i in b]) for b in bins]
    ranked = sorted(range(len(bins)), key=lambda j: (-sizes[j], j))
    return [bins[j] for j in ranked]
