"""The GRPO step mechanics shared by every RA2P mode.

A micro-batch goes through ``forward`` (actor logprobs, graph kept, and the
policy's entropy at the trained tokens, from the same logits) and
``finish`` (loss built from the forward output and the micro-batch's
``ref_logprobs``, then backward). RA2P's decoupled mode calls ``finish`` only
when the reference result arrives; the other modes call it right away.
:class:`StepAccumulator` gathers the loss statistics and timings of a step
and reduces them across data-parallel ranks for reporting.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tiderl.trainer.backend import ActorBackend, ActorForward, RefBackend
from tiderl.trainer.batch import MicroBatch
from tiderl.trainer.grpo import KlEstimator, LossParts, OffPolicy, grpo_loss


@dataclass(frozen=True, slots=True)
class LossConfig:
    clip_eps: float = 0.2
    kl_coef: float = 0.01
    kl_estimator: KlEstimator = "k3"
    dual_clip: float | None = 3.0
    off_policy: OffPolicy = "none"
    is_cap: float = 2.0


MISMATCH_KEYS = ("logprob_mismatch_on_policy", "logprob_mismatch_stale")  # StepStats' fields, metrics by these names


@dataclass(slots=True)
class StepAccumulator:
    """Sums over the micro-batches a rank trained in one step, plus its timings."""

    version: int
    pg_sum: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    ratio_sum: float = 0.0
    clipped_sum: float = 0.0
    mismatch_sum: float = 0.0
    on_policy_mismatch_sum: float = 0.0  # tokens sampled with the weights being trained (version == self.version)
    on_policy_tokens: int = 0
    is_weight_sum: float = 0.0
    is_truncated_sum: float = 0.0
    loss_sum: float = 0.0
    num_tokens: int = 0
    num_micro_batches: int = 0
    num_sequences: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    swap_s: float = 0.0
    num_swaps: int = 0
    wait_ref_s: float = 0.0
    wait_data_s: float = 0.0
    ref_s: float = 0.0  # reference forwards run on this rank
    num_ref: int = 0
    actor_forward_s: float = 0.0
    actor_backward_s: float = 0.0  # loss + backward
    trajectory_ids: list[int | str] = field(default_factory=list)

    def add(self, mb: MicroBatch, parts: LossParts, logprobs: torch.Tensor | None = None,
            entropy: torch.Tensor | None = None) -> None:
        """Add a trained micro-batch; `logprobs` (the trainer's, [B, T-1]) splits the engine mismatch by
        whether a token was sampled with the weights being trained; `entropy` ([B, T-1], ActorForward's) is
        summed over the trained tokens."""
        if entropy is not None:
            self.entropy_sum += float(torch.where(mb.loss_mask > 0, entropy.detach().cpu(), 0.0).sum())
        if logprobs is not None:
            on_policy = (mb.loss_mask > 0) & (mb.token_versions == self.version)
            gap = (logprobs.detach().cpu() - mb.old_logprobs).abs()
            self.on_policy_mismatch_sum += float(torch.where(on_policy, gap, torch.zeros_like(gap)).sum())
            self.on_policy_tokens += int(on_policy.sum())
        self.pg_sum += parts.pg_sum
        self.kl_sum += parts.kl_sum
        self.ratio_sum += parts.ratio_sum
        self.clipped_sum += parts.clipped_sum
        self.mismatch_sum += parts.mismatch_sum
        self.is_weight_sum += parts.is_weight_sum
        self.is_truncated_sum += parts.is_truncated_sum
        self.loss_sum += float(parts.loss.detach())
        self.num_tokens += parts.num_tokens
        self.num_micro_batches += 1
        self.num_sequences += len(mb.trajectory_ids)
        self.trajectory_ids.extend(mb.trajectory_ids)
        # Staleness of each trained token: versions behind the weights being trained.
        model = mb.loss_mask > 0
        if bool(model.any()):
            stale = (self.version - mb.token_versions[model]).clamp(min=0)
            self.staleness_sum += float(stale.sum())
            self.staleness_max = max(self.staleness_max, int(stale.max()))

    def add_swap(self, seconds: float) -> None:
        self.swap_s += seconds
        self.num_swaps += 1


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step's figures, global over the data-parallel group."""

    version: int
    loss: float
    pg_loss: float
    kl: float
    entropy: float
    """Mean entropy (nats) of the policy over the trained tokens, at the start of the step (token-weighted)."""
    clip_frac: float
    ratio_mean: float
    grad_norm: float
    num_tokens: int
    num_sequences: int
    num_micro_batches: int
    staleness_mean: float
    staleness_max: int
    swap_s: float
    num_swaps: int
    wait_ref_s: float
    wait_data_s: float
    t_ref_s: float  # mean seconds of one reference forward of a share (0: none ran here)
    t_act_f_s: float  # mean seconds of one actor forward of a share
    t_act_b_s: float  # mean seconds of one loss + backward of a share
    t_swap_s: float  # mean seconds of one ref<->actor swap (0: none)
    optimizer_s: float  # gradient reduction + clipping + AdamW step
    duration_s: float
    logprob_mismatch_on_policy: float = math.nan
    """Mean |trainer - engine| log-prob of the tokens sampled with the weights being trained: the engine's own
    error, ~1e-6 in fp32 (NaN: no such token this step)."""
    logprob_mismatch_stale: float = math.nan
    """The same of the older versions' tokens: mostly the policy's change since (NaN: none)."""
    is_weight_mean: float = 1.0  # mean importance weight applied (trainer.off_policy)
    is_truncated_frac: float = 0.0  # share of tokens whose weight was truncated at trainer.is_cap


def forward(actor: ActorBackend, mb: MicroBatch, acc: StepAccumulator) -> ActorForward:
    t0 = time.perf_counter()
    out = actor.train_forward(mb)
    acc.actor_forward_s += time.perf_counter() - t0
    return out


def reference(ref: RefBackend, mb: MicroBatch, acc: StepAccumulator) -> torch.Tensor:
    t0 = time.perf_counter()
    logprobs = ref.logprobs(mb)
    acc.ref_s += time.perf_counter() - t0
    acc.num_ref += 1
    return logprobs


def finish(
    actor: ActorBackend,
    mb: MicroBatch,
    out: ActorForward,
    ref_logprobs: torch.Tensor | None,
    loss: LossConfig,
    normalizer: float,
    acc: StepAccumulator,
) -> None:
    """Build the micro-batch's GRPO loss from the actor's forward `out` (needs ``ref_logprobs`` when
    kl_coef > 0) and backward it."""
    t0 = time.perf_counter()
    logprobs = out.logprobs
    device = logprobs.device
    parts = grpo_loss(
        logprobs,
        mb.old_logprobs.to(device),
        None if ref_logprobs is None else ref_logprobs.to(device),
        mb.advantages.to(device),
        mb.loss_mask.to(device),
        clip_eps=loss.clip_eps,
        kl_coef=loss.kl_coef,
        kl_estimator=loss.kl_estimator,
        normalizer=normalizer,
        dual_clip=loss.dual_clip,
        off_policy=loss.off_policy,
        is_cap=loss.is_cap,
    )
    actor.backward(parts.loss)
    acc.actor_backward_s += time.perf_counter() - t0
    acc.add(mb, parts, logprobs, out.entropy)


def reduce_stats(
    acc: StepAccumulator, grad_norm: float, optimizer_s: float, started: float, group: dist.ProcessGroup | None
) -> StepStats:
    """Global step figures: sums all-reduced over ``group`` (timings: the slowest rank)."""
    sums = torch.tensor(
        [acc.loss_sum, acc.pg_sum, acc.kl_sum, acc.ratio_sum, acc.clipped_sum, acc.num_tokens,
         acc.num_sequences, acc.num_micro_batches, acc.staleness_sum, acc.num_swaps, acc.mismatch_sum,
         acc.is_weight_sum, acc.is_truncated_sum, acc.on_policy_mismatch_sum, acc.on_policy_tokens,
         acc.entropy_sum],
        dtype=torch.float64,
    )
    per = max(acc.num_micro_batches, 1)
    maxes = torch.tensor([acc.staleness_max, acc.swap_s, acc.wait_ref_s, acc.wait_data_s,
                          acc.ref_s / max(acc.num_ref, 1), acc.actor_forward_s / per, acc.actor_backward_s / per,
                          acc.swap_s / max(acc.num_swaps, 1), optimizer_s,
                          time.perf_counter() - started], dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    (loss, pg, kl, ratio, clipped, tokens, seqs, mbs, stale, swaps, mismatch, weight, truncated, fresh_mismatch,
     fresh, entropy) = sums.tolist()
    n = max(tokens, 1.0)
    return StepStats(
        version=acc.version,
        loss=loss,
        pg_loss=pg / n,
        kl=kl / n,
        entropy=entropy / n,
        clip_frac=clipped / n,
        ratio_mean=ratio / n,
        grad_norm=grad_norm,
        num_tokens=int(tokens),
        num_sequences=int(seqs),
        num_micro_batches=int(mbs),
        staleness_mean=stale / n,
        staleness_max=int(maxes[0]),
        swap_s=float(maxes[1]),
        num_swaps=int(swaps),
        wait_ref_s=float(maxes[2]),
        wait_data_s=float(maxes[3]),
        t_ref_s=float(maxes[4]),
        t_act_f_s=float(maxes[5]),
        t_act_b_s=float(maxes[6]),
        t_swap_s=float(maxes[7]),
        optimizer_s=float(maxes[8]),
        duration_s=float(maxes[9]),
        logprob_mismatch_on_policy=fresh_mismatch / fresh if fresh else math.nan,
        logprob_mismatch_stale=(mismatch - fresh_mismatch) / (tokens - fresh) if tokens > fresh else math.nan,
        is_weight_mean=weight / n if tokens else 1.0,
        is_truncated_frac=truncated / n,
    )
