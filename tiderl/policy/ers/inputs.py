"""The planner's inputs: its limits (:class:`ErsLimits`, the `ers:` section) and what a mechanism measured
(:class:`StepObservation`, one finished step; :class:`ErsSignals`, the view at a sync boundary). docs/ers.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import StageTimes
from tiderl.roles import Role

__all__ = ["ABLATIONS", "ErsLimits", "ErsPolicy", "ErsSignals", "StepObservation"]


class ErsPolicy(enum.Enum):
    PAPER = "paper"  # the paper's threshold rules (tiderl.policy.ers.overrides.plan_paper)
    RATE = "rate"  # the rate planner (tiderl.policy.ers.model, tiderl.policy.ers.choose)


ABLATIONS: dict[str, str] = {
    "regime": "what the window measured overrides the model (tiderl.policy.ers.choose.regime)",
    "walk": "an unmeasured split goes on the way the last plan moved (tiderl.policy.ers.choose)",
    "repartition": "the trainer's ranks divided anew between actor and ref where no split move pays",
    "slot_bound": "a split's supply is at most what its task slots play, the slot wait out of its latency",
    "latency_memory": "the generation latency of the splits tried in the last steps, beside the current one's",
    "valley": "a move only where the split it reaches at this boundary is predicted no slower than the current one",
    "idle_moves": "the rollout ranks the window measured idle may all leave rollout at one boundary",
}
"""Rules of the rate planner an ablation switches off (`ErsLimits.ablate`, `tiderl sim --system tiderl~RULE`).
Rules with a switch of their own (`evaluation_actors`, `adaptive_retention`, `preemptive_rollout`) go through it."""

_FROM_SECTION = ("enabled", "hol_tau", "max_moves_per_step", "max_rollout_moves_per_step", "min_rollout_ranks",
                 "min_actor_ranks", "max_ref_ranks", "elastic_actors", "preemptive_rollout", "evaluation_actors",
                 "adaptive_retention", "rate_margin")


@dataclass(frozen=True, slots=True)
class ErsLimits:
    """The `ers:` config section (tiderl.config.ers) plus the trainer's elastic batch bounds, in groups."""

    groups_min: int
    groups_ideal: int
    enabled: bool = True
    hol_tau: float = 1.0
    max_moves_per_step: int = 1
    max_rollout_moves_per_step: int | None = None  # None: max_moves_per_step bounds the moves to rollout too
    min_rollout_ranks: int = 1
    min_actor_ranks: int = 1
    max_ref_ranks: int | None = None
    elastic_actors: bool = False
    preemptive_rollout: bool = True
    evaluation_actors: bool = True  # with elastic_actors: evaluation steps may take actor ranks
    adaptive_retention: bool = True
    policy: ErsPolicy = ErsPolicy.PAPER
    max_staleness: int = 1  # at most (max_staleness + 1) batches in flight
    rate_margin: float = 0.05  # the rate planner moves only for a predicted gain above this share
    rank_tasks: int | None = None  # tasks a rollout rank plays at once (None: no bound)
    group_size: int = 1
    host: HostShare | None = None  # ranks sharing one host's compute (None: an accelerator each)
    decoupled_step_s: float = 0.0  # a decoupled step's coordination with its ref ranks, once a step
    evaluation_tasks: int = 0  # tasks of one evaluation round (0: no evaluation): the evaluation rule's prior
    engines_on_demand: bool = False  # shared host: an idle rank starts its engine only when a plan wants it
    ablate: frozenset[str] = frozenset()  # rules of ABLATIONS switched off

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ablate) - set(ABLATIONS))
        if unknown:
            raise ValueError(f"ablate: unknown rule {unknown[0]!r} (known: {', '.join(ABLATIONS)})")
        if not 1 <= self.groups_min <= self.groups_ideal:
            raise ValueError(f"groups_min: need 1 <= groups_min <= groups_ideal, got {self.groups_min}")
        for name, low in (("max_staleness", 0), ("rate_margin", 0), ("decoupled_step_s", 0), ("group_size", 1),
                          ("evaluation_tasks", 0),
                          ("rank_tasks", 1), ("max_rollout_moves_per_step", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")

    @property
    def rollout_moves(self) -> int:
        """Most moves to rollout at one boundary."""
        return self.max_moves_per_step if self.max_rollout_moves_per_step is None else self.max_rollout_moves_per_step

    @classmethod
    def from_config(cls, ers: Any, groups_min: int, groups_ideal: int, max_staleness: int = 1,
                    host: HostShare | None = None, rank_tasks: int | None = None, group_size: int = 1,
                    decoupled_step_s: float | None = None, evaluation_tasks: int = 0) -> ErsLimits:
        """From the job's `ers:` section (tiderl.config.ers.ErsConfig). `host` and `decoupled_step_s`: the
        simulator's measured ones; None: the section's (`host_slots`, `rollout_host_weight`)."""
        if host is None and ers.host_slots is not None:
            host = HostShare(ers.host_slots, ers.rollout_host_weight)
        if decoupled_step_s is None:
            decoupled_step_s = ers.decoupled_step_s
        return cls(groups_min, groups_ideal, **{name: getattr(ers, name) for name in _FROM_SECTION},
                   policy=ErsPolicy(ers.policy), max_staleness=max_staleness, rank_tasks=rank_tasks,
                   group_size=group_size, host=host, decoupled_step_s=decoupled_step_s,
                   evaluation_tasks=evaluation_tasks,
                   engines_on_demand=host is not None and ers.idle_engines == "on_demand")


@dataclass(frozen=True, slots=True)
class StepObservation:
    """One finished training step, as the control plane and the simulator both record it."""

    version: int  # the version the step published
    duration_s: float  # from the previous publish to this one
    consumed_tokens: int  # trajectory tokens the step trained on
    rollout_ranks: int
    actor_ranks: int
    ref_ranks: int
    produced_tokens: int = 0  # tokens of the training groups that completed during the step
    groups_completed: int = 0
    group_latency_sum_s: float = 0.0  # their seconds from creation to completion, summed
    group_env_sum_s: float = 0.0  # their slowest task's environment seconds (start and steps), summed
    rollout_idle_rank_s: float = 0.0  # rollout rank-seconds with no task to play
    rollout_busy_rank_s: float = 0.0  # rollout rank-seconds with the engine generating (0: not measured)
    tasks_completed: int = 0  # tasks of those groups
    task_env_sum_s: float = 0.0  # their environment seconds, summed
    task_slot_sum_s: float = 0.0  # their seconds in a rank's task slot, claim to end (0: not measured)
    task_wait_sum_s: float = 0.0  # their seconds from the group's creation to that claim
    trainer_wait_s: float = 0.0  # seconds the actor group waited for ready data
    tprm_s: float | None = None  # TPRM the step observed (None: no arrival after its start)
    ras_microbatches: int = 0  # global micro-batches ready when the step started (its RAS)
    stale_dropped_tokens: int = 0  # tokens the trainer dropped as older than the staleness bound
    evaluation: bool = False  # an evaluation ran during the step (no rate window reads it)


@dataclass(frozen=True, slots=True)
class ErsSignals:
    """What the planner reads when step k ended (tiderl.policy.ers.signals.build_signals makes it)."""

    ras_microbatches: int  # ready micro-batches now: the next step's RAS
    ready_groups: int  # complete groups ready now
    hol_latency_s: float  # age of the oldest ready micro-batch (0: none)
    tprm_s: float | None  # TPRM of step k (None: no arrival after its start)
    step_history_s: tuple[float, ...] = ()  # recent step durations, oldest first (empty: cold start)
    is_eval_next: bool = False  # an evaluation starts with the next step or is still running
    fetch_groups: int | None = None  # the fetch size of step k (None: groups_ideal)
    last_rollout_change: int = 0  # rollout ranks the previous plan added (+) or removed (-)
    stage_times: StageTimes | None = None  # the actor group's per-share RA2P stage times
    microbatches_per_step: int = 0
    rollout_idle_ranks: float = 0.0  # rollout rank-seconds idle for lack of admissible work / step k's duration
    window: tuple[StepObservation, ...] = ()  # the rate window, oldest first
    group_latency_s: float | None = None  # means over the window's completed groups: latency,
    tokens_per_group: float | None = None  # tokens,
    group_env_s: float | None = None  # environment seconds of the slowest task,
    slot_wait_s: float = 0.0  # and wait for a task slot (0: not measured)
    gen_latency_by_rollout: tuple[tuple[int, float], ...] = ()  # the latency memory: (rollout ranks, L_gen)
    inflight_cap: int | None = None  # the adaptive admission cap (None: the staleness bound's)
    micro_batch_tokens: int = 0  # one actor rank's share of a micro-batch (0: unknown)
    pre_evaluation_roles: tuple[Role, ...] | None = None  # the map an evaluation replaced, once it is over
    engine_ranks: frozenset[int] | None = None  # ranks whose engine is up (None: not tracked)
    evaluation_steps: tuple[StepObservation, ...] = ()  # newest evaluation step of each rollout count
    walk: ErsSignals | None = None  # the newest measured split's signals, while the current one is unmeasured
