"""`trainer:` section: GRPO, the actor and reference models, RA2P and weight publishing."""

from __future__ import annotations

from typing import Literal

from tiderl.config.schema import option, section


@section
class TrainerConfig:
    num_steps: int = option(20, ge=1, help="Training steps (actor updates) of the run.")
    groups_min: int = option(
        2, ge=1, help="B_min: fewest complete groups a step may train on (elastic global batch)."
    )
    groups_ideal: int = option(
        4, ge=1, help="B_ideal: groups a step trains on when enough are ready (elastic global batch)."
    )
    micro_batch_tokens: int = option(
        2048,
        ge=16,
        help="Token budget of one actor rank's share of a micro-batch (one forward pass); a global "
        "micro-batch holds up to this times the number of actor ranks.",
    )
    lr: float = option(1e-4, gt=0, help="AdamW learning rate (the peak, with a decaying `lr_schedule`).")
    lr_schedule: Literal["constant", "linear", "cosine"] = option(
        "constant",
        help="Learning rate over the run's steps: `constant`, or decaying from `lr` at step 0 to "
        "`lr` x `lr_final_ratio` at `num_steps` (`linear` or `cosine`). A function of the step's "
        "version only, so a resumed run and every data-parallel actor use the same value.",
    )
    lr_final_ratio: float = option(
        0.0, ge=0, le=1, help="A decaying `lr_schedule` reaches `lr` times this at `num_steps`."
    )
    lr_warmup_steps: int = option(
        0,
        ge=0,
        help="Steps over which the learning rate rises linearly to its schedule's value (step k of a warm-up "
        "of W trains at (k + 1) / W of it). AdamW's first updates move every weight by about `lr` whatever "
        "the gradient's size: a warm-up keeps a noisy first policy gradient from wrecking a small model.",
    )
    grad_clip: float = option(1.0, gt=0, help="Gradient-norm clip.")
    clip_eps: float = option(0.2, gt=0, help="PPO-style clip of the importance ratio (1 +/- eps).")
    dual_clip: float | None = option(
        3.0,
        gt=1,
        help="Dual-clip PPO: for a negative advantage A, a token's loss is at most -c A (c this value, > 1), "
        "however much likelier the token is now than when it was sampled. null: the plain clip only.",
    )
    off_policy: Literal["none", "decoupled"] = option(
        "none",
        help="Off-policy correction of stale or engine-mismatched tokens. `none`: the ratio is clipped against "
        "the engine's log-probabilities (the behaviour policy). `decoupled`: decoupled PPO, the ratio against "
        "the trainer's weights at the step's start and the surrogate weighted by min(pi / mu, is_cap) "
        "(truncated importance sampling; with one optimizer step per batch the two coincide).",
    )
    skip_flat_groups: bool = option(
        False,
        help="Train no group whose rewards are all equal (zero advantages: no policy-gradient signal, yet its "
        "tokens would count in the token mean and the KL act on them; DAPO's filter). Its trajectories are "
        "still consumed. A step whose every group is flat trains them as before.",
    )
    mask_truncated: bool = option(
        False,
        help="Overlong masking (DAPO): train none of the tokens of a trajectory its task's turn or context limit "
        "cut (`env.max_turns`, `model.max_context_tokens`); its reward still counts in its group's advantages, "
        "and it is consumed. Off: a cut trajectory trains like any other, with the reward it got. A step whose "
        "every trajectory was cut trains them as before.",
    )
    is_cap: float = option(2.0, gt=1, help="`off_policy: decoupled`: the cap C of the importance weight min(pi / mu, C).")
    kl_coef: float = option(0.01, ge=0, help="Weight of the KL penalty against the reference model.")
    kl_estimator: Literal["k1", "k3"] = option("k3", help="KL estimator: `k1` (log-ratio) or `k3` (unbiased, non-negative).")
    ra2p_mode: Literal["auto", "decoupled", "colocated", "vanilla_stream", "vanilla_stream_offload"] = option(
        "auto",
        help="Ref/actor execution: `auto` (RA2P cost model picks decoupled or colocated each step), "
        "a fixed RA2P mode, or a naive baseline.",
    )
    keep_versions: int = option(3, ge=1, help="Weight versions kept in weights/ (older ones are deleted).")
    checkpoint_every: int = option(5, ge=1, help="Checkpoint optimizer state every M steps.")
    keep_checkpoints: int = option(2, ge=1, help="Optimizer checkpoints kept in ckpt/ (older ones are deleted).")
    weight_sync: Literal["files", "transfer"] = option(
        "files",
        help="How the rollout engines get each version: `files` (each engine checks weights/vN against its SHA256SUMS "
        "and reads it) or `transfer` (pulled from the trainer leader through vLLM's weight-transfer API: mapped from "
        "its shared memory on its host, sent over TCP elsewhere, every bucket checked; an engine that cannot reach it "
        "reads the files). The trainer writes weights/vN either way. Measured on one CPU host, the transfer is 1.6-3.5x "
        "page-cached files on the leader's host and slower over TCP (docs/trainer.md).",
    )
    backend: str = option(
        "torch",
        help="Trainer backend: `torch` (PyTorch + transformers, the actor replicated on every data-parallel rank) or "
        "`fsdp` (FSDP2: the actor's weights, gradients and AdamW state sharded over the data-parallel ranks).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = option(
        "auto",
        help="The trainer's compute precision: `auto` is bf16 on a GPU that supports it, fp32 on a CPU. Weights, "
        "gradient reduction and AdamW state stay fp32.",
    )
    activation_checkpointing: bool = option(
        False, help="Recompute each decoder layer in the backward instead of keeping its activations (memory for time)."
    )
    weight_decay: float = option(0.0, ge=0, help="AdamW weight decay.")
    max_aggregate: int = option(
        64, ge=1, help="Colocated RA2P: most ready micro-batches one ref/actor burst aggregates (memory cap)."
    )
    actor_ranks: int = option(
        1, ge=1, help="Data-parallel actor ranks (ranks 0..N-1). Rank 0 leads: it gathers each step's data, "
        "broadcasts it (chunk by chunk for a streaming system) to the others and publishes the weights; gradients "
        "are all-reduced."
    )

    def __post_init__(self) -> None:
        if self.groups_ideal < self.groups_min:
            raise ValueError(f"groups_ideal: must be >= groups_min ({self.groups_min}), got {self.groups_ideal}")
