"""The output layer in chunks: each sampled token's log-probability (and the policy's entropy at the trained
tokens) without a ``[B, T, V]`` logits tensor.

A 152k vocabulary makes the logits the largest activation of a step: a micro-batch of 8,192 tokens holds
2.3 GiB of them in bf16, and the log-softmax, its fp32 copy and their gradient three times that in fp32.
Here the model runs with its output layer replaced, for that forward only, by the identity, so its
output is the final hidden states ``[B, T, H]``; then each chunk of at most :data:`CHUNK_ELEMENTS`
logits (:func:`chunk_tokens` positions) is computed from the output layer's weight, reduced to its
log-probabilities at the next tokens and, detached, its entropy where the loss mask is set, and let go.
With gradients on, each chunk is checkpointed (non-reentrant), so the backward computes its logits
again instead of keeping them: one chunk's logits are held at a time, for one more product with the
output layer per micro-batch (at a 152k vocabulary about 7% of a 7B model's forward FLOPs, 2-3% of its
step's).

A sharded actor gets the same: FSDP2 keeps the root module's parameters (the output layer's among them)
gathered after the forward for its backward, and the hidden states are the forward's output, so its
backward hooks run as they do for logits.

A model whose forward changes its logits after the output layer (soft-capping, a logit scale) would not
give its hidden states back: that is checked on every forward of the chunked path, and a model found to
(or one whose output layer is not a plain ``nn.Linear``) runs whole from then on, its full logits reduced by the same functions
(:func:`whole`). The results are the same either way (tests/test_trainer_logits.py).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from tiderl.trainer.grpo import next_token_logprobs, row_entropy, token_entropy, token_logprobs

log = logging.getLogger("tiderl.trainer")
CHUNK_ELEMENTS = 1 << 25  # logits a chunk holds (128 MiB in fp32; 220 positions at a 152k vocabulary)
_RUN_WHOLE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models found to change their logits


def chunk_tokens(vocab: int) -> int:
    """Positions a chunk of :data:`CHUNK_ELEMENTS` logits covers."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def output_logprobs(model: torch.nn.Module, run: Callable[[], Any], input_ids: torch.Tensor, *,
                    temperature: float, banned: tuple[int, ...] = (),
                    loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``run()`` (the model's forward, returning an output with ``.logits``) reduced to ``[B, T-1]``
    log-probabilities of ``input_ids``' next tokens under softmax(logits / temperature) without the
    `banned` ids, and with a `loss_mask` ``[B, T-1]`` the entropy there (detached, 0 elsewhere)."""
    if not temperature > 0:
        raise ValueError(f"output logprobs: temperature must be > 0, got {temperature}")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or model in _RUN_WHOLE:
        return whole(run().logits, input_ids, temperature, banned, loss_mask)
    captured: list[torch.Tensor] = []

    def identity(x: torch.Tensor) -> torch.Tensor:
        # A view (transformers slices the positions it keeps) is copied: an FSDP2 root must not return one
        # (an in-place op on it would drop its backward hook), and the copy is [B, T, H], not [B, T, V].
        y = x.clone() if x._is_view() else x
        captured.append(y)
        return y

    head.forward = identity  # type: ignore[method-assign]  # this forward only: the instance's attribute
    try:
        out = run()
    finally:
        del head.forward
    hidden = out.logits
    if len(captured) != 1 or not _same(hidden, captured[0]):
        # Found once per model, so each later forward runs once: whole.
        _RUN_WHOLE.add(model)
        log.info("%s changes its logits after the output layer: its logits are computed whole",
                 type(model).__name__)
        return whole(run().logits, input_ids, temperature, banned, loss_mask)
    return chunked(hidden, head, input_ids, temperature, banned, loss_mask)


def _same(out: torch.Tensor, hidden: torch.Tensor) -> bool:
    if out is hidden:
        return True
    return out.shape == hidden.shape and torch.equal(out.detach(), hidden.detach().to(out.dtype))


def chunked(hidden: torch.Tensor, head: torch.nn.Linear, input_ids: torch.Tensor, temperature: float,
            banned: tuple[int, ...], loss_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probabilities (and entropy) of :func:`output_logprobs` from the final hidden states, a chunk
    of positions at a time."""
    b, t, width = hidden.shape
    if input_ids.shape != (b, t):
        raise ValueError(f"output logprobs: hidden states {tuple(hidden.shape)} do not match input_ids "
                         f"{tuple(input_ids.shape)}")
    flat = hidden[:, :-1].reshape(-1, width)
    target = input_ids[:, 1:].reshape(-1).to(hidden.device)
    mask = None if loss_mask is None else loss_mask.reshape(-1).to(hidden.device) > 0
    ids = torch.tensor(banned, device=hidden.device) if banned else None
    step = chunk_tokens(head.out_features)
    grad = torch.is_grad_enabled() and (flat.requires_grad or head.weight.requires_grad)
    logprobs: list[torch.Tensor] = []
    entropy: list[torch.Tensor] = []
    for s in range(0, flat.shape[0], step):
        m = None if mask is None else mask[s:s + step]
        args = (flat[s:s + step], head.weight, head.bias, target[s:s + step], m, temperature, ids)
        lp, ent = checkpoint(_piece, *args, use_reentrant=False) if grad else _piece(*args)
        logprobs.append(lp)
        if ent is not None:
            entropy.append(ent)
    lp_all = torch.cat(logprobs).reshape(b, t - 1)
    return lp_all, (torch.cat(entropy).reshape(b, t - 1) if mask is not None else None)


def _piece(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
           mask: torch.Tensor | None, temperature: float, ids: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: its logits, their log-probabilities at `target` and (detached) entropy where `mask`."""
    logits = torch.nn.functional.linear(h, weight, bias)
    lp = next_token_logprobs(logits, target, temperature, ids)
    if mask is None:
        return lp, None
    ent = torch.zeros(mask.shape, dtype=torch.float32, device=h.device)
    with torch.no_grad():
        rows = mask.nonzero(as_tuple=True)[0]
        if rows.numel():
            ent[rows] = row_entropy(logits.detach()[rows], temperature, ids)
    return lp, ent


def whole(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, banned: tuple[int, ...],
          loss_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`output_logprobs` from a model's full ``[B, T, V]`` logits (a model run whole)."""
    lp = token_logprobs(logits, input_ids.to(logits.device), temperature=temperature, banned=banned)
    if loss_mask is None:
        return lp, None
    return lp, token_entropy(logits, loss_mask, temperature=temperature, banned=banned)
