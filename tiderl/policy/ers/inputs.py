"""The inputs of the ERS planner: its limits (:class:`ErsLimits`, the `ers:` config section) and the
records of what a mechanism measured (:class:`StepObservation`, one finished step; :class:`ErsSignals`,
what the planner reads at a sync boundary). :mod:`tiderl.policy.ers.signals` builds the signals from a
snapshot of the run; the package docstring (:mod:`tiderl.policy.ers`) states the planner's shape.

Pure: no torch, no database, no HTTP, no processes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import StageTimes
from tiderl.roles import Role

__all__ = ["ErsLimits", "ErsPolicy", "ErsSignals", "StepObservation"]


class ErsPolicy(enum.Enum):
    PAPER = "paper"
    """The paper's threshold rules on HoL latency, RAS and the generation deficit
    (tiderl.policy.ers.overrides)."""
    RATE = "rate"
    """The rate-matching planner (tiderl.policy.ers.model, tiderl.policy.ers.choose): the split where
    generation meets consumption."""


ABLATIONS: dict[str, str] = {
    "regime": "what the window measured overrides the model (tiderl.policy.ers.choose, invariant 4)",
    "walk": "an unmeasured split goes on the way the last plan moved (choose, invariant 10)",
    "repartition": "the trainer's ranks divided anew between actor and ref where no split move pays "
                   "(choose, invariant 8)",
    "slot_bound": "a split's supply is at most what its task slots play, the wait for a slot taken out of "
                  "the generation latency (tiderl.policy.ers.model, choose invariant 11)",
    "latency_memory": "the generation latency of the splits tried in the last steps, beside the current one's "
                      "(tiderl.policy.ers.signals)",
}
"""The rate planner's rules an ablation can switch off (`ErsLimits.ablate`; `tiderl sim --system tiderl~RULE`),
each with what it does. The rules with their own switch (`evaluation_actors`, `adaptive_retention`,
`preemptive_rollout`) are ablated through it."""


@dataclass(frozen=True, slots=True)
class ErsLimits:
    """The `ers:` config section plus the elastic batch bounds (in groups)."""

    groups_min: int
    groups_ideal: int
    enabled: bool = True
    hol_tau: float = 1.0
    max_moves_per_step: int = 1
    max_rollout_moves_per_step: int | None = None
    """Most moves to rollout at one boundary (None: max_moves_per_step bounds every move)."""
    min_rollout_ranks: int = 1
    min_actor_ranks: int = 1
    max_ref_ranks: int | None = None
    elastic_actors: bool = False
    preemptive_rollout: bool = True
    evaluation_actors: bool = True
    """With elastic_actors: evaluation steps may take actor ranks (tiderl.policy.ers.overrides.evaluation_split)."""
    adaptive_retention: bool = True
    policy: ErsPolicy = ErsPolicy.PAPER
    max_staleness: int = 1
    """The system's staleness bound (versions): at most (max_staleness + 1) batches are in flight."""
    rate_margin: float = 0.05
    """Rate planner hysteresis: move only for a predicted goodput gain above this share."""
    rank_tasks: int | None = None
    """Tasks a rollout rank plays at once (rollout.max_concurrency; a simulated engine's max_num_seqs). None:
    no bound. With fewer rollout ranks than the groups in flight need, the bound caps them."""
    group_size: int = 1
    """Tasks of a training group (rollout.group_size)."""
    host: HostShare | None = None
    """Ranks that share one host's compute (None: each rank its own accelerator). With it the rate planner
    predicts how a busy rank slows the others and may leave a rollout rank IDLE."""
    decoupled_step_s: float = 0.0
    """A decoupled step's coordination with its ref ranks beyond their work, once a step (0: not priced)."""
    engines_on_demand: bool = False
    """With a shared host: an idle rank starts its engine only when a plan wants it in rollout, and joins
    rollout once it is up (invariant 14). False: every idle rank keeps an engine up while parked."""
    ablate: frozenset[str] = frozenset()
    """Rules of the rate planner switched off, for an ablation (names of :data:`ABLATIONS`; empty: every
    rule on)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ablate) - set(ABLATIONS))
        if unknown:
            raise ValueError(f"ablate: unknown rule {unknown[0]!r} (known: {', '.join(ABLATIONS)})")
        if not 1 <= self.groups_min <= self.groups_ideal:
            raise ValueError(f"groups_min: need 1 <= groups_min <= groups_ideal, got {self.groups_min}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.rate_margin < 0:
            raise ValueError(f"rate_margin: must be >= 0, got {self.rate_margin}")
        if self.decoupled_step_s < 0:
            raise ValueError(f"decoupled_step_s: must be >= 0, got {self.decoupled_step_s}")
        if self.rank_tasks is not None and self.rank_tasks < 1:
            raise ValueError(f"rank_tasks: must be >= 1, got {self.rank_tasks}")
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size}")
        if self.max_rollout_moves_per_step is not None and self.max_rollout_moves_per_step < 1:
            raise ValueError(f"max_rollout_moves_per_step: must be >= 1 or None, got {self.max_rollout_moves_per_step}")

    @property
    def rollout_moves(self) -> int:
        """Most moves to rollout at one boundary."""
        return self.max_moves_per_step if self.max_rollout_moves_per_step is None else self.max_rollout_moves_per_step

    @classmethod
    def from_config(cls, ers: object, groups_min: int, groups_ideal: int, max_staleness: int = 1,
                    host: HostShare | None = None, rank_tasks: int | None = None, group_size: int = 1,
                    decoupled_step_s: float | None = None) -> ErsLimits:
        """From the job's `ers:` section (tiderl.config.ers.ErsConfig, read by attribute),
        the trainer's elastic batch bounds and the system's staleness bound. `host`: the shared host
        (the simulator's measured one); None: the section's `host_slots` and `rollout_host_weight`.
        `decoupled_step_s`: the simulator's measured one; None: the section's."""
        slots = getattr(ers, "host_slots", None)
        if host is None and slots is not None:
            host = HostShare(slots, ers.rollout_host_weight)  # type: ignore[attr-defined]
        if decoupled_step_s is None:
            decoupled_step_s = getattr(ers, "decoupled_step_s", 0.0)
        return cls(
            host=host,
            decoupled_step_s=decoupled_step_s,
            rank_tasks=rank_tasks,
            group_size=group_size,
            groups_min=groups_min,
            groups_ideal=groups_ideal,
            policy=ErsPolicy(ers.policy),  # type: ignore[attr-defined]
            max_staleness=max_staleness,
            rate_margin=ers.rate_margin,  # type: ignore[attr-defined]
            enabled=ers.enabled,  # type: ignore[attr-defined]
            hol_tau=ers.hol_tau,  # type: ignore[attr-defined]
            max_moves_per_step=ers.max_moves_per_step,  # type: ignore[attr-defined]
            max_rollout_moves_per_step=ers.max_rollout_moves_per_step,  # type: ignore[attr-defined]
            min_rollout_ranks=ers.min_rollout_ranks,  # type: ignore[attr-defined]
            min_actor_ranks=ers.min_actor_ranks,  # type: ignore[attr-defined]
            max_ref_ranks=ers.max_ref_ranks,  # type: ignore[attr-defined]
            elastic_actors=ers.elastic_actors,  # type: ignore[attr-defined]
            preemptive_rollout=ers.preemptive_rollout,  # type: ignore[attr-defined]
            evaluation_actors=getattr(ers, "evaluation_actors", True),
            adaptive_retention=ers.adaptive_retention,  # type: ignore[attr-defined]
            engines_on_demand=host is not None and ers.idle_engines == "on_demand",  # type: ignore[attr-defined]
        )


@dataclass(frozen=True, slots=True)
class StepObservation:
    """One finished training step, as the control plane and the simulator both record it."""

    version: int
    """The version the step published."""
    duration_s: float
    """From the previous publish to this one."""
    consumed_tokens: int
    """Trajectory tokens the step trained on."""
    rollout_ranks: int
    actor_ranks: int
    ref_ranks: int
    produced_tokens: int = 0
    """Tokens of the training groups that completed during the step (generation supply)."""
    groups_completed: int = 0
    """Training groups that completed during the step."""
    group_latency_sum_s: float = 0.0
    """Sum over those groups of the seconds from the group's creation to its completion."""
    group_env_sum_s: float = 0.0
    """Sum over those groups of their slowest task's environment seconds (session start and steps)."""
    rollout_idle_rank_s: float = 0.0
    """Rollout rank-seconds with no task to play (staleness bound, empty pool) during the step."""
    rollout_busy_rank_s: float = 0.0
    """Rollout rank-seconds with the engine generating (0: not measured)."""
    tasks_completed: int = 0
    """Tasks of the training groups that completed during the step."""
    task_env_sum_s: float = 0.0
    """Sum over those tasks of their environment seconds (session start and steps)."""
    task_slot_sum_s: float = 0.0
    """Sum over those tasks of their seconds in a rollout rank's task slot (from the rank's claim to the
    task's end; 0: not measured)."""
    task_wait_sum_s: float = 0.0
    """Sum over those tasks of the seconds from their group's creation to that claim: their wait for a
    task slot (and for the rank's next claim)."""
    trainer_wait_s: float = 0.0
    """Seconds the actor group waited for ready data during the step."""
    tprm_s: float | None = None
    """TPRM the step observed (None: no post-start arrival)."""
    ras_microbatches: int = 0
    """Micro-batches (global: every actor rank's share) ready when the step started (its RAS)."""
    stale_dropped_tokens: int = 0
    """Tokens of the training groups the trainer dropped during the step as older than the staleness
    bound (generated, never trained)."""
    evaluation: bool = False
    """An evaluation ran during the step: its tasks took rollout capacity and the trainer's wait and the
    groups' latency are partly the evaluation's, so the rate window and the latency memory leave it out."""


@dataclass(frozen=True, slots=True)
class ErsSignals:
    """What the control plane measured when step k ended."""

    ras_microbatches: int
    """Ready micro-batches in the buffer now: the RAS of the next step."""
    ready_groups: int
    """Complete groups ready now: the volume of the next global batch."""
    hol_latency_s: float
    """Age of the oldest ready micro-batch now (0 when none)."""
    tprm_s: float | None
    """TPRM observed during step k (None: no post-start arrival)."""
    step_history_s: tuple[float, ...] = ()
    """Durations of the recent steps, oldest first. Empty: cold start."""
    is_eval_next: bool = False
    """An evaluation starts with the next step or is still running (the real control plane: an
    evaluation group is open; the simulator: the next step is an evaluation step, as its
    evaluation never outlasts the step: the publish waits for it)."""
    fetch_groups: int | None = None
    """The fetch size step k used (None: groups_ideal)."""
    last_rollout_change: int = 0
    """Rollout ranks added (+) or removed (-) by the previous plan."""
    stage_times: StageTimes | None = None
    """Per-share RA2P stage times of the actor group, for the break-even RAS. None: HoL only."""
    microbatches_per_step: int = 0
    """Micro-batches a full step consumes (for the break-even RAS)."""
    rollout_idle_ranks: float = 0.0
    """Rollout rank-seconds idle for lack of admissible work (RWT) in step k / its duration."""
    window: tuple[StepObservation, ...] = ()
    """The recent steps the rate planner estimates its rates from, oldest first."""
    group_latency_s: float | None = None
    """Mean seconds from a training group's creation to its completion, over the window."""
    tokens_per_group: float | None = None
    """Mean tokens of a completed training group, over the window."""
    group_env_s: float | None = None
    """Mean environment seconds (start and steps) of the slowest task of each such group."""
    gen_latency_by_rollout: tuple[tuple[int, float], ...] = ()
    """(rollout ranks, mean group latency beyond the environment's and the slot wait) of each recent settled
    split, newest measurement per rollout count: how generation latency answers to rollout ranks."""
    slot_wait_s: float = 0.0
    """Mean seconds a group of the window waited for a task slot (0: not measured); part of group_latency_s
    (tiderl.policy.ers.signals)."""
    inflight_cap: int | None = None
    """ERS's adaptive admission cap the feed keeps now (tiderl.policy.admission; None: the staleness bound's
    (staleness + 1) batches): the rate planner's groups in flight are ``admission.inflight_bound`` with it."""
    micro_batch_tokens: int = 0
    """Tokens of one actor rank's share of a micro-batch (trainer.micro_batch_tokens; 0: unknown)."""
    pre_evaluation_roles: tuple[Role, ...] | None = None
    """The role map an evaluation's preemptive rule replaced, when that evaluation is over at this boundary
    (None: no evaluation just ended)."""
    engine_ranks: frozenset[int] | None = None
    """Ranks whose engine is up now (None: not tracked; every rank joins rollout at a reload's cost)."""
    evaluation_steps: tuple[StepObservation, ...] = ()
    """The finished steps during which an evaluation ran, after the pipeline's fill: the newest one of each
    rollout-rank count, newest last. The next evaluation's split is predicted from them
    (tiderl.policy.ers.overrides.evaluation_split)."""
    walk: ErsSignals | None = None
    """The signals as they were at the end of the newest split the rate window measured, while the current
    split is not measured yet (None otherwise): the rate planner may go on with the previous plan's walk
    toward the split it predicted from them (tiderl.policy.ers.choose, invariant 10)."""
