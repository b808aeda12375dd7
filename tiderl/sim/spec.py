"""Workload and cluster files of `tiderl sim`: typed, frozen, validated sections
built with the project's config machinery (errors name the file and the key).
"""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path
from typing import Literal

import yaml

from tiderl.config.ers import ErsConfig
from tiderl.config.schema import ConfigError, build, option, section
from tiderl.config.yamlio import load_yaml


@section
class Drift:
    """A quantity that drifts linearly from `start` to `end` over the workload's `drift_steps`."""

    start: float = option(help="Value at step 0.")
    end: float = option(help="Value at step `drift_steps` and later.")

    def at(self, step: int, drift_steps: int) -> float:
        frac = min(1.0, max(0.0, step / drift_steps)) if drift_steps > 0 else 1.0
        return self.start + (self.end - self.start) * frac


@section
class LatencyDist:
    """A lognormal latency given by its mean and 99th percentile, in seconds."""

    mean_s: float = option(gt=0, help="Mean latency, seconds.")
    p99_s: float = option(gt=0, help="99th-percentile latency, seconds (> mean).")

    def __post_init__(self) -> None:
        if self.p99_s <= self.mean_s:
            raise ValueError(f"p99_s: must be > mean_s ({self.mean_s}), got {self.p99_s}")

    def lognormal_params(self) -> tuple[float, float]:
        """(mu, sigma) of the lognormal with this mean and p99."""
        # mean = exp(mu + s^2/2), p99 = exp(mu + 2.326 s) -> s^2/2 - 2.326 s + ln(p99/mean) = 0
        z = 2.3263478740408408
        c = math.log(self.p99_s / self.mean_s)
        disc = z * z - 2 * c
        sigma = z - math.sqrt(disc) if disc > 0 else z
        return math.log(self.mean_s) - sigma * sigma / 2, sigma


@section
class TaskType:
    name: str = option(help="Task family (e.g. `webshop`).")
    share: float = option(gt=0, help="Share of groups of this type (normalised over the types).")
    prompt_tokens: int = option(ge=1, help="Tokens of the first prompt (system prompt + instruction).")
    turns_mean: Drift = option(help="Mean turns per task over training.")
    turns_min: int = option(1, ge=1, help="Fewest turns of a task.")
    turns_max: int = option(ge=1, help="Turn limit of a task.")
    turns_group_icc: float = option(
        0.0, ge=0, le=1, help="Share of the turns' variance that a group's tasks share (their intraclass "
        "correlation): a group plays one prompt, so an easy one is short for every task (0: independent).")
    tokens_mean: Drift = option(
        help="Mean text tokens of a whole trajectory (prompt + generated + observations) over training; "
        "images (`image_tokens`) come on top."
    )
    gen_tokens_per_turn: float = option(gt=0, help="Mean tokens the model generates in one turn.")
    gen_tokens_sigma: float = option(0.5, ge=0, help="Lognormal sigma of the generated tokens per turn.")
    obs_tokens_sigma: float = option(0.5, ge=0, help="Lognormal sigma of the observation tokens per turn.")
    env_latency: LatencyDist = option(help="Latency of one environment step (`/observation`).")
    env_start: LatencyDist = option(help="Latency of starting an environment session (`/start`).")
    image_tokens: int = option(
        0, ge=0, help="Context tokens of one image (a screenshot): the first prompt and every observation carry "
        "one (0: text only). The workload's `max_images` / `keep_images` window prunes them.")

    def __post_init__(self) -> None:
        if self.turns_max < self.turns_min:
            raise ValueError(f"turns_max: must be >= turns_min ({self.turns_min}), got {self.turns_max}")
        for label, value in (("start", self.turns_mean.start), ("end", self.turns_mean.end)):
            if not self.turns_min <= value <= self.turns_max:
                raise ValueError(f"turns_mean: {label} must lie in [turns_min, turns_max], got {value}")


@section
class WorkloadPhase:
    """A change of the workload from a training step on: groups that start at or after `from_step`
    (the version their tasks are released under) sample with these settings. A key left out keeps
    the value of the phase before (the task types' own values before the first phase)."""

    from_step: int = option(ge=1, help="First step (version) whose new groups sample with this phase.")
    env_latency_scale: float | None = option(
        None,
        gt=0,
        help="Factor on every task type's `env_latency` (mean and p99; relative to the task type, not "
        "to the phase before). null: as the phase before (1 before the first phase).",
    )
    env_start_scale: float | None = option(
        None,
        gt=0,
        help="Factor on every task type's `env_start` (mean and p99; relative to the task type). "
        "null: as the phase before.",
    )
    gen_tokens_scale: float | None = option(
        None,
        gt=0,
        help="Factor on every task type's generated tokens per turn (relative to the task type): the agent's "
        "outputs grow or shrink during training; the observations stay as they were. null: as the phase before.",
    )
    share: dict[str, float] | None = option(
        None,
        help="New shares of training groups by task type name (>= 0; 0 drops the type from the mix; "
        "types not named keep their share from the phase before). Evaluation groups keep the task "
        "types' own shares. null: as the phase before.",
    )

    def __post_init__(self) -> None:
        if self.from_step < 1:
            raise ValueError(f"from_step: must be >= 1, got {self.from_step}")
        for name in ("env_latency_scale", "env_start_scale", "gen_tokens_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        if self.share is not None:
            shares = {}
            for key, value in self.share.items():
                if not isinstance(key, str):
                    raise ValueError(f"share: keys must be task type names, got {key!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                    raise ValueError(f"share: {key} must be a number >= 0, got {value!r}")
                shares[key] = float(value)
            object.__setattr__(self, "share", types.MappingProxyType(shares))


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedPhase:
    """The settings in force from `from_step` on (0: the workload as written), every key filled in."""

    from_step: int
    env_latency_scale: float
    env_start_scale: float
    shares: tuple[float, ...]
    """Training-group share of each task type, in `task_types` order (not normalised)."""
    gen_tokens_scale: float = 1.0
    """Factor on every task type's generated tokens per turn."""


@section
class WorkloadSpec:
    name: str = option(help="Workload name.")
    group_size: int = option(ge=1, help="GRPO group size G: tasks per prompt.")
    groups_per_step: int = option(ge=1, help="Groups one training step consumes: B_ideal.")
    eval_every_steps: int = option(0, ge=0, help="Evaluate every N versions, version 0 included (0: never).")
    eval_groups: int = option(0, ge=0, help="Evaluation prompts per evaluation round.")
    eval_group_size: int = option(1, ge=1, help="Tasks per evaluation prompt.")
    max_context_tokens: int = option(ge=64, help="Context limit of one task; a task reaching it ends.")
    drift_steps: int = option(100, ge=1, help="Steps over which the drifting statistics move from start to end.")
    task_types: tuple[TaskType, ...] = option(help="Task families of the mix.")
    phases: tuple[WorkloadPhase, ...] = option(
        (),
        help="Changes of the workload during the run (environment latency, task mix), each from a step "
        "on, in increasing `from_step` order. Empty: the workload is the same throughout (up to the drift).",
    )
    max_images: int | None = option(
        None, ge=2, help="The sliding image window (the run's `rollout.max_images`): once a task's context "
        "holds this many images, the oldest are pruned down to `keep_images` and the trajectory is split there "
        "(each part is trained with the context the engine saw). null: images are never pruned.")
    keep_images: int = option(1, ge=1, help="Images a pruned context keeps, the most recent (with `max_images`).")

    def __post_init__(self) -> None:
        if not self.task_types:
            raise ValueError("task_types: at least one task type is required")
        if self.max_images is not None and not self.keep_images < self.max_images:
            raise ValueError(f"keep_images: must be < max_images ({self.max_images}), got {self.keep_images}")
        names = [t.name for t in self.task_types]
        if len(set(names)) != len(names):
            raise ValueError(f"task_types: task type names must be unique, got {names}")
        previous = 0
        for i, phase in enumerate(self.phases):
            if phase.from_step <= previous:
                raise ValueError(
                    f"phases: [{i}].from_step must be greater than the phase before's ({previous}), "
                    f"got {phase.from_step}"
                )
            previous = phase.from_step
            unknown = sorted(set(phase.share or {}) - set(names))
            if unknown:
                raise ValueError(
                    f"phases: [{i}].share names unknown task types {unknown} (task types: {', '.join(names)})"
                )
        for i, resolved in enumerate(self.resolved_phases()):
            if not sum(resolved.shares) > 0:
                raise ValueError(f"phases: [{i - 1}].share leaves no task type with a share > 0")

    def resolved_phases(self) -> tuple[ResolvedPhase, ...]:
        """The workload as written (from step 0), then each phase with what it leaves out carried over."""
        current = ResolvedPhase(0, 1.0, 1.0, tuple(t.share for t in self.task_types))
        out = [current]
        for phase in self.phases:
            shares = current.shares
            if phase.share is not None:
                shares = tuple(phase.share.get(t.name, s) for t, s in zip(self.task_types, shares))
            current = ResolvedPhase(
                phase.from_step,
                current.env_latency_scale if phase.env_latency_scale is None else phase.env_latency_scale,
                current.env_start_scale if phase.env_start_scale is None else phase.env_start_scale,
                shares,
                current.gen_tokens_scale if phase.gen_tokens_scale is None else phase.gen_tokens_scale,
            )
            out.append(current)
        return tuple(out)

    def phase_at(self, step: int) -> ResolvedPhase:
        """The settings in force for a group that starts at `step`."""
        resolved = self.resolved_phases()
        return next(r for r in reversed(resolved) if step >= r.from_step)

    @property
    def eval_round_tasks(self) -> int:
        """Tasks of one evaluation round (0: no evaluation), as `RolloutConfig.eval_round_tasks` of a job."""
        return self.eval_groups * self.eval_group_size if self.eval_every_steps else 0


@section
class GpuSpec:
    name: str = option(help="Accelerator model.")
    memory_gb: float = option(gt=0, help="Device memory, GB (1e9 bytes).")
    hbm_tb_s: float = option(gt=0, help="Memory bandwidth, TB/s.")
    bf16_tflops: float = option(gt=0, help="Dense BF16 peak, TFLOP/s.")
    pcie_gb_s: float = option(gt=0, help="Host link bandwidth per direction, GB/s.")
    nvlink_gb_s: float = option(gt=0, help="GPU-GPU bandwidth inside a node per direction, GB/s.")
    internode_gb_s: float = option(gt=0, help="Network bandwidth per GPU between nodes, GB/s.")
    gpus_per_node: int = option(ge=1, help="GPUs per node.")


@section
class ModelSpec:
    name: str = option(help="Policy model.")
    params_b: float = option(gt=0, help="Parameters, billions.")
    layers: int = option(ge=1, help="Transformer layers.")
    hidden: int = option(ge=1, help="Hidden size.")
    kv_heads: int = option(ge=1, help="Key/value heads (GQA).")
    head_dim: int = option(ge=1, help="Head dimension.")
    bytes_per_param: float = option(2.0, gt=0, help="Bytes per weight (BF16: 2).")
    train_state_bytes_per_param: float = option(
        16.0, gt=0, help="Actor training state per parameter (BF16 weights, FP32 grads and Adam state)."
    )


@section
class EfficiencySpec:
    decode_mbu: float = option(gt=0, le=1, help="Share of memory bandwidth a decode iteration achieves.")
    rollout_mfu: float = option(gt=0, le=1, help="Share of peak FLOP/s for rollout prefill/decode compute.")
    train_mfu: float = option(gt=0, le=1, help="Share of peak FLOP/s for training forward/backward.")
    link_efficiency: float = option(gt=0, le=1, help="Share of nominal PCIe/NVLink/network bandwidth achieved.")
    decode_step_overhead_s: float = option(ge=0, help="Fixed CPU/launch cost of one engine iteration, s.")


@section
class RolloutSpec:
    gpu_memory_utilization: float = option(0.9, gt=0, le=1, help="vLLM share of device memory (roofline only).")
    activation_reserve_gb: float = option(
        0.0, ge=0, help="Memory vLLM keeps for activations/graphs, GB (roofline only)."
    )
    max_num_seqs: int = option(ge=1, help="vLLM: most sequences in one batch.")
    prefill_chunk_tokens: int = option(ge=1, help="vLLM: tokens per iteration (chunked prefill budget).")
    weight_reload_s: float = option(ge=0, help="Engine-side cost of loading new weights, beyond the transfer, s.")
    engine_start_s: float = option(
        0.0, ge=0, help="A rank's engine start (building the engine on the base model), alone on its device or "
        "host, s: paid by a rank that joins rollout without an engine, and on a shared host its cores are taken "
        "while it starts (it runs at the host's share). 0: not priced.")
    kv_capacity_tokens: int | None = option(None, ge=1, help="Override the derived KV capacity per rank.")
    kv_block_size: int = option(16, ge=1, help="vLLM: tokens per KV block (its default on GPUs); CTB's adaptive "
                                "budget judges a turn's prefix in whole blocks.")
    ctb_budget: Literal["fixed", "adaptive"] = option("adaptive", help="CTB's token budget, as the run's `rollout.ctb_budget`: `fixed` (the "
                             "engine's KV capacity) or `adaptive` (tiderl.policy.ctb_budget, the run's default).")
    ctb_max_overcommit: float = option(4.0, ge=1.0, help="Ceiling of the adaptive budget, a multiple of the KV "
                                       "capacity (the run's `rollout.ctb_max_overcommit`).")


@section
class TrainingSpec:
    micro_batch_tokens: int = option(ge=1, help="Tokens of one actor rank's share of a micro-batch.")
    max_staleness: int = option(ge=0, help="Staleness bound in versions (async systems).")
    min_batch_fraction: float = option(gt=0, le=1, help="B_min = ceil(fraction x B_ideal).")
    switch_overhead_s: float = option(ge=0, help="Fixed cost of one ref/actor switch beyond the transfer, s.")
    communicator_init_s: float = option(
        ge=0, help="Rebuilding the actor group's communicators when a rank joins or leaves it, s."
    )
    swap_s: float | None = option(None, ge=0, help="Override the derived ref/actor swap time.")
    weight_sync_s: float | None = option(None, ge=0, help="Override the derived weight-sync time.")
    optimizer_s: float | None = option(None, ge=0, help="Override the derived optimizer-step time.")
    actor_ranks: int | None = option(
        None,
        ge=1,
        help="Fixed number of actor ranks. null: every rank that does not roll out is a data-parallel actor. "
        "N: N actors; the remaining ranks are spare (idle in a fixed partition, ref ranks under ERS), as "
        "in `tiderl run`, which has one actor rank.",
    )
    default_rollout_fraction: float = option(gt=0, le=1, help="Rollout share of fixed partitions (and TideRL's start).")
    rollout_fraction_sweep: tuple[float, ...] = option(help="Rollout shares swept for fixed-partition systems.")


@section
class MeasuredSpec:
    """Costs measured on the machine itself (`tools/calibrate_cpu.py`), used instead of the roofline."""

    decode_step_s: float = option(ge=0, help="Engine iteration time with no running sequence (intercept), s.")
    decode_s_per_seq: float = option(ge=0, help="Iteration time added by each running sequence, s.")
    prefill_s_per_token: float = option(gt=0, help="Prefill time per prompt token, s.")
    actor_forward_s_per_token: float = option(gt=0, help="Actor forward (with autograd) per trained token, s.")
    actor_backward_s_per_token: float = option(gt=0, help="Actor backward per trained token, s.")
    ref_forward_s_per_token: float = option(gt=0, help="Reference forward (no autograd) per trained token, s.")
    swap_s: float = option(ge=0, help="One ref/actor switch (offload one model, onload the other), s.")
    weight_sync_s: float = option(ge=0, help="Engine weight reload from the published files, s.")
    optimizer_s: float = option(ge=0, help="Optimizer step plus writing the new weights, s.")
    kv_capacity_tokens: int = option(ge=1, help="KV cache tokens of one engine.")
    decoupled_step_s: float = option(
        0.0,
        ge=0,
        help="A decoupled step's coordination beyond its pipeline of measured stages (the step's input to the "
        "ref ranks, their log-probs back to the actors), once a step, s.",
    )
    turn_overhead_s: float = option(
        0.0,
        ge=0,
        help="Latency of one turn outside the engine iterations and the environment: the request's "
        "way into the engine process and back, and the agent loop around it, s.",
    )
    rollout_busy_cores: float = option(
        1.0,
        gt=0,
        help="Cores a rollout rank keeps busy while its engine has work (its own process and the "
        "engine's process), counted against host_compute_slots.",
    )
    host_compute_slots: float | None = option(
        None,
        gt=0,
        help="Every rank is a process on one host: busy ranks share it, each running at "
        "min(1, slots / busy ranks) of its measured speed. null: every rank has its own accelerator.",
    )


@section
class ControlSpec:
    """Polling intervals of a control loop that works by ticks (0: event-driven, no delay)."""

    report_interval_s: float = option(
        0.0, ge=0, help="A rollout rank reports finished trajectories and claims new tasks once per interval, s."
    )
    poll_s: float = option(0.0, ge=0, help="Trainer and ranks poll the store (ready groups, new plans) this often, s.")
    control_tick_s: float = option(0.0, ge=0, help="The control plane plans and feeds once per tick, s.")
    bell_s: float | None = option(
        None, ge=0, help="The run's bells (tiderl/run/bell.py): a waiter looks at a bell this often, s. The waits a "
        "bell ends take it instead of the poll or tick: the control plane's for a publish, the ranks' for a plan, "
        "the trainer's for a finished group (None: no bells, every wait is the poll's or the tick's)."
    )

    def woken_s(self, interval_s: float) -> float:
        """The interval of a wait that a bell ends: the bell's where the run has them."""
        return interval_s if self.bell_s is None else min(self.bell_s, interval_s)


@section
class ClusterSpec:
    name: str = option(help="Cluster name.")
    num_gpus: int = option(ge=2, help="GPUs (ranks) of the job.")
    env_concurrency: int = option(ge=1, help="Environment sessions the env cluster runs at once.")
    gpu: GpuSpec | None = option(None, help="Accelerator (roofline costs; not needed with `measured`).")
    model: ModelSpec | None = option(
        None, help="Policy model (rollout, actor and ref share the architecture; roofline costs)."
    )
    efficiency: EfficiencySpec | None = option(None, help="Achieved shares of the hardware peaks (roofline costs).")
    measured: MeasuredSpec | None = option(
        None, help="Measured costs of this machine: replace the roofline (gpu, model, efficiency)."
    )
    rollout: RolloutSpec = option(help="Rollout engine.")
    training: TrainingSpec = option(help="Trainer.")
    ers: ErsConfig = option(
        default_factory=ErsConfig, help="ERS planner: the `ers:` section of a job (tiderl.config.ers), read the same way."
    )
    control: ControlSpec = option(default_factory=ControlSpec, help="Control-loop polling intervals.")

    def __post_init__(self) -> None:
        if self.measured is None and None in (self.gpu, self.model, self.efficiency):
            raise ValueError("measured: without measured costs, gpu, model and efficiency are all required")
        if self.training.actor_ranks is not None and self.training.actor_ranks >= self.num_gpus:
            raise ValueError(f"training: actor_ranks must leave a rollout rank ({self.num_gpus} ranks)")


def _load(cls: type, path: str | Path) -> object:
    source = str(path)
    try:
        data = load_yaml(Path(path).read_text(), source)
    except FileNotFoundError as e:
        raise ConfigError(source, "", "file not found") from e
    except yaml.YAMLError as e:
        raise ConfigError(source, "", f"not valid YAML: {e}") from e
    return build(cls, data, source)


def load_workload(path: str | Path) -> WorkloadSpec:
    return _load(WorkloadSpec, path)  # type: ignore[return-value]


def load_cluster(path: str | Path) -> ClusterSpec:
    return _load(ClusterSpec, path)  # type: ignore[return-value]
