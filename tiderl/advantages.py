"""Group-relative advantages of GRPO, pure Python (no torch, no store).

Shared by the store, which writes a group's advantages when the group
completes, and the trainer; it imports neither (a top-level module, so the
store does not depend on the trainer package).

A group is the G trajectories of one prompt. Its advantages are
``(r - mean(r)) / (std(r) + eps)`` with the sample standard deviation
(``ddof = 1``, as ``torch.std`` computes it). Advantages exist only for
complete groups: an incomplete group raises, because normalising over a
partial group would give its members a different baseline from the one they
get when the group completes.

Invariants:
- the advantages of a group sum to 0 (up to float rounding);
- a group whose rewards are all equal gets all-zero advantages (no signal);
- a group of size 1 gets advantage 0 (its std is undefined);
- the order of the advantages follows the order of the rewards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypeVar

K = TypeVar("K")

DEFAULT_EPS = 1e-6


class IncompleteGroupError(ValueError):
    """A group was handed over for normalisation before all its trajectories ended."""


def group_advantages(rewards: Sequence[float], eps: float = DEFAULT_EPS) -> list[float]:
    """``(r - mean) / (std + eps)`` over one complete group's rewards."""
    n = len(rewards)
    if n == 0:
        raise ValueError("group_advantages: empty group")
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"group_advantages: reward {i} is not finite ({r!r})")
    if n == 1 or max(rewards) == min(rewards):
        # Exactly zero: float rounding of the mean must not turn "no signal" into a tiny gradient.
        return [0.0] * n
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def advantages_by_group(
    rewards: Mapping[K, Sequence[float]], group_size: int, eps: float = DEFAULT_EPS
) -> dict[K, list[float]]:
    """Advantages of several groups; every group must have exactly ``group_size`` rewards."""
    if group_size < 1:
        raise ValueError(f"advantages_by_group: group_size must be >= 1, got {group_size}")
    out: dict[K, list[float]] = {}
    for key, group in rewards.items():
        if len(group) != group_size:
            raise IncompleteGroupError(
                f"group {key!r} has {len(group)} of {group_size} rewards; advantages need the whole group"
            )
        out[key] = group_advantages(group, eps)
    return out
