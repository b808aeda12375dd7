"""Elastic Resource Scaling (ERS): the role map, RA2P mode and fetch size of
the next version, planned at a sync boundary from readiness signals (paper
section 5.2).

(Over 450 lines: the role map's rules (cold start, evaluation, the paper's thresholds), the signals and
limits every planner reads, and the invariants they all keep are one contract; the rate planner lives
in tiderl.policy.ers_rate.)

Pure: no torch, no database, no HTTP, no processes. The control plane (and
the simulator) calls :func:`plan` after the actor update of step k and before
the weights of version k+1 are published; the plan takes effect at that
boundary.

Roles and moves
- ERS moves ranks between ``ROLLOUT`` and ``REF``: a rollout rank becomes a
  dedicated ref rank for the decoupled RA2P mode, or a ref rank returns to
  rollout and the actors run colocated. This costs nothing on the critical
  path (the paper's zero-overhead elasticity).
- With ``elastic_actors`` (the paper's "individual DP ranks are schedulable
  resources"), a data-parallel actor rank may also move to rollout, or a
  rollout rank join the actor group; the caller pays the group rebuild.
  Ref ranks go first when the trainer shrinks; a new trainer rank is a ref
  rank only if the decoupled mode then beats the colocated one (RA2P cost
  model), otherwise an actor rank.
- A ref rank is added only while there is none or the refs cannot keep up
  with the actors (M t_ref / R > t_act_f + t_act_b, :func:`tiderl.policy.ra2p.refs_keep_up`): a further
  one would idle.
- ``IDLE`` ranks are put back to rollout at cold start and evaluation (on a shared host, while it has
  room for them).
- Engines on demand (``engines_on_demand``, a shared host): a rank that holds no engine yet
  (``signals.engine_ranks``) does not go from ``IDLE`` to rollout: it stays idle and the plan asks it
  to start one (``warm``); it joins rollout at a later boundary, once its engine is up, at a reload's
  cost. An engine's start takes minutes of the host's cores (the ranks' processes share them), and
  counted as a rollout rank while it starts, the rank would make its split's measurements say that
  it adds nothing (tiderl.policy.ers_rate judges a split by them). Not even at cold start: on
  hilo-bench x cpu, in the simulator, one spare engine's start beside the working ranks cost 30% of
  goodput (docs/RESULTS.md); only a plan that measured a gain from the rank pays for it.
- Moves pick the highest-index eligible rank, or for actors leaving, the
  lowest-index actor (deterministic; lay the role map out as rollout ranks
  first, then actors, so the boundary between them is where ranks move).

Signals (:class:`ErsSignals`)
- Consumption deficit: the oldest ready micro-batch has waited longer than
  ``hol_tau`` x the mean recent step time, or RAS is at or above the RA2P
  break-even point (the smallest RAS for which the decoupled mode is cheaper,
  with later micro-batches every TPRM). -> one more trainer rank (a ref rank,
  or an actor rank, see above).
- Generation deficit: fewer complete groups ready than ``groups_ideal``
  (the next batch cannot be full). -> a trainer rank back to rollout (ref
  ranks first); colocated once no ref rank is left. Not when the rollout
  ranks already idled, for lack of admissible work (the staleness bound),
  at least one rank's worth of the last step: a further rollout rank would
  idle too. On a shared host, only while the host runs a further busy
  rollout rank at full speed (the preemptive rule's room, below): the
  paper's rules know no contention, and on hilo-bench x cpu, with the spare
  ref rank kept, they made it a second engine at a cost of 21%
  (docs/RESULTS.md). If the previous plan had
  scaled rollout down, the fetch size moves halfway toward ``groups_min``
  (adaptive data retention).
- Cold start (no step history) and evaluation steps: preemptive maximum
  rollout (every ref and idle rank to rollout, colocated), exempt from the
  move limit because it only adds rollout capacity; once the evaluation is
  over (``pre_evaluation_roles``), the ranks it sent from ref or idle to
  rollout go back to those roles in one plan (also exempt: it undoes the
  preemptive move, and the split before it was the planner's); actor ranks are not
  moved preemptively (they return one per step at most). On a shared host
  (``host``, tiderl.policy.host) rollout capacity is the host's, not the
  ranks': an idle rank returns to rollout only while the host runs every
  busy rollout rank at full speed (``host.speed(rollout + 1) == 1``, the
  trainer waiting); ref ranks beyond that become IDLE (a ref rank's
  decoupled step pays a coordination the colocated one does not: on this
  project's CPU host it costs more than the ref saves, docs/RESULTS.md).

Invariants (each has a test in tests/test_policy_ers.py)
1. The plan has as many ranks as the current map; without ``elastic_actors``
   the actor ranks keep their role; with it, actor ranks never drop below
   ``min_actor_ranks`` through a move.
2. Moves are only ROLLOUT <-> REF, ROLLOUT <-> ACTOR (``elastic_actors``),
   IDLE -> ROLLOUT, ROLLOUT -> IDLE in a rate plan with a shared host
   (``host``, tiderl.policy.ers_rate), and ACTOR <-> REF in a rate plan's
   trainer re-partition or valley escape (``elastic_actors``); ``moves`` lists exactly the
   ranks whose role changed.
3. At most ``max_moves_per_step`` moves (with ``max_rollout_moves_per_step`` set, at most that many
   moves to rollout and ``max_moves_per_step`` others), except a preemptive plan, its
   return at the evaluation's end, a trainer re-partition (it leaves the rollout side as it is and costs one
   regroup of the actors however many ranks it moves) and a rate plan leaving a valley (a split on the
   way predicted slower than the current one: tiderl.policy.ers_rate, invariant 9).
4. Rollout ranks never drop below ``min_rollout_ranks`` through a move, and
   REF ranks never exceed ``max_ref_ranks``.
5. The mode is DECOUPLED iff the plan has at least one REF rank.
6. Cold start or an evaluation step (with ``preemptive_rollout``): no REF
   rank, colocated, every idle rank back to rollout (on a shared host, only
   while ``host.speed(rollout ranks, 0) == 1``; the others idle).
7. Consumption deficit: trainer ranks (actor + ref) never decrease.
8. Generation deficit without consumption deficit: trainer ranks never
   increase; they do not decrease either while ``rollout_idle_ranks >= 1``,
   nor, on a shared host, beyond the host's room for busy rollout ranks.
12. REF ranks grow only while there is none or the refs cannot keep up with
    the actors (given the stage times).
9. ``fetch_groups`` stays in [groups_min, groups_ideal]; it is below
   ``groups_ideal`` only after a rollout scale-down followed by a generation
   deficit (adaptive retention), and returns to ``groups_ideal`` otherwise.
10. Disabled: the role map is unchanged and the mode follows it.
13. An evaluation's end (``pre_evaluation_roles``, ``preemptive_rollout``):
    only ROLLOUT ranks move, each to the REF or IDLE role it held before the
    evaluation; every other rank keeps its role.
11. Pure: equal inputs give equal plans.
14. Engines on demand (``engines_on_demand`` with a shared host and ``engine_ranks`` known): no rank
    whose engine is not up moves from IDLE to ROLLOUT; each such move the rules chose leaves the rank
    IDLE and lists it in ``warm`` (the rest of the plan as the rules chose it; the reason
    ``engine_start`` where nothing else moves).
    ``warm`` holds only IDLE ranks without an engine, and is empty otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.policy.host import HostShare
from tiderl.policy.ra2p import Ra2pMode, StageTimes, break_even_ras, choose_mode, refs_keep_up
from tiderl.roles import Role

__all__ = [
    "ErsLimits",
    "ErsPlan",
    "ErsPolicy",
    "ErsReason",
    "ErsSignals",
    "Role",
    "RoleMove",
    "StepObservation",
    "await_engines",
    "finish_plan",
    "move_roles",
    "plan",
]


class ErsReason(enum.Enum):
    DISABLED = "disabled"
    COLD_START = "cold_start"
    EVALUATION = "evaluation"
    EVALUATION_END = "evaluation_end"
    """The evaluation is over: the ref and idle ranks its preemptive rule sent to rollout go back."""
    CONSUMPTION_DEFICIT = "consumption_deficit"
    GENERATION_DEFICIT = "generation_deficit"
    STEADY = "steady"
    RATE_TO_ROLLOUT = "rate_to_rollout"
    RATE_TO_TRAINER = "rate_to_trainer"
    RATE_REBALANCE = "rate_rebalance"
    RATE_REPARTITION = "rate_repartition"
    """The trainer's ranks divided anew between actor and ref (the rollout side as it is)."""
    RATE_TO_IDLE = "rate_to_idle"
    """A rollout rank left idle: on a shared host it slowed the others more than it added."""
    ENGINE_START = "engine_start"
    """Idle ranks the rules sent to rollout start their engines first (engines on demand); nothing moves."""


class ErsPolicy(enum.Enum):
    PAPER = "paper"
    """The paper's threshold rules on HoL latency, RAS and the generation deficit (this module)."""
    RATE = "rate"
    """The rate-matching planner (tiderl.policy.ers_rate): the split where generation meets consumption."""


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

    def __post_init__(self) -> None:
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
    (tiderl.policy.ers_signals)."""
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
    walk: ErsSignals | None = None
    """The signals as they were at the end of the newest split the rate window measured, while the current
    split is not measured yet (None otherwise): the rate planner may go on with the previous plan's walk
    toward the split it predicted from them (tiderl.policy.ers_rate, invariant 10)."""


@dataclass(frozen=True, slots=True)
class RoleMove:
    rank: int
    from_role: Role
    to_role: Role


@dataclass(frozen=True, slots=True)
class ErsPlan:
    roles: tuple[Role, ...]
    mode: Ra2pMode
    fetch_groups: int
    moves: tuple[RoleMove, ...]
    reason: ErsReason
    warm: tuple[int, ...] = ()
    """Idle ranks asked to start their engine (engines on demand, invariant 14)."""


def _mode_of(roles: Sequence[Role]) -> Ra2pMode:
    return Ra2pMode.DECOUPLED if Role.REF in roles else Ra2pMode.COLOCATED


def consumption_deficit(roles: Sequence[Role], signals: ErsSignals, limits: ErsLimits) -> bool:
    """HoL latency above tau x mean step time, or RAS at/above the decoupled break-even point."""
    history = signals.step_history_s
    if history and signals.hol_latency_s > limits.hol_tau * (sum(history) / len(history)):
        return True
    if signals.stage_times is None or signals.microbatches_per_step <= 0 or signals.ras_microbatches <= 0:
        return False
    actors = sum(1 for r in roles if r is Role.ACTOR)
    refs = max(1, sum(1 for r in roles if r is Role.REF))
    if actors == 0:
        return False
    n = max(signals.microbatches_per_step, signals.ras_microbatches)
    tprm = signals.tprm_s if signals.tprm_s is not None else 0.0
    even = break_even_ras(signals.stage_times, tprm, n, actors, refs)
    return even is not None and signals.ras_microbatches >= even


def plan(roles: Sequence[Role], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """The next role map, RA2P mode and fetch size, by ``limits.policy`` (see the module invariants;
    the rate planner's own are in tiderl.policy.ers_rate)."""
    current = tuple(roles)
    return await_engines(current, _plan(current, signals, limits), signals, limits)


def await_engines(current: tuple[Role, ...], planned: ErsPlan, signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """Engines on demand (invariant 14): an idle rank without an engine up stays idle and starts one."""
    up = signals.engine_ranks
    if not limits.engines_on_demand or limits.host is None or up is None:
        return planned
    waiting = tuple(m.rank for m in planned.moves
                    if m.from_role is Role.IDLE and m.to_role is Role.ROLLOUT and m.rank not in up)
    if not waiting:
        return planned
    new = tuple(Role.IDLE if i in waiting else r for i, r in enumerate(planned.roles))
    done = finish_plan(current, new, planned.fetch_groups, planned.reason)
    reason = planned.reason if done.moves else ErsReason.ENGINE_START
    return ErsPlan(done.roles, done.mode, done.fetch_groups, done.moves, reason,
                   tuple(sorted(set(planned.warm) | set(waiting))))


def _plan(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    fetch = limits.groups_ideal
    if not limits.enabled:
        return ErsPlan(current, _mode_of(current), fetch, (), ErsReason.DISABLED)

    cold = not signals.step_history_s
    if limits.preemptive_rollout and (cold or signals.is_eval_next):
        new = max_rollout(current, limits.host)
        reason = ErsReason.COLD_START if cold else ErsReason.EVALUATION
        return finish_plan(current, new, fetch, reason)
    restore = signals.pre_evaluation_roles
    if limits.preemptive_rollout and not cold and restore is not None and len(restore) == len(current):
        new = tuple(old if now is Role.ROLLOUT and old in (Role.REF, Role.IDLE) else now
                    for now, old in zip(current, restore))
        if new != current:
            return finish_plan(current, new, fetch, ErsReason.EVALUATION_END)
    if limits.policy is ErsPolicy.RATE:
        from tiderl.policy import ers_rate  # it builds on this module's types: imported here, not above

        return ers_rate.plan_rate(current, signals, limits)
    return plan_paper(current, signals, limits)


def plan_paper(current: tuple[Role, ...], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """The paper's threshold rules (section 5.2), after the cold-start and evaluation rules."""
    fetch = limits.groups_ideal

    num_rollout = sum(1 for r in current if r is Role.ROLLOUT)
    num_ref = sum(1 for r in current if r is Role.REF)
    num_actor = sum(1 for r in current if r is Role.ACTOR)
    if consumption_deficit(current, signals, limits):
        budget = min(limits.max_moves_per_step, max(num_rollout - limits.min_rollout_ranks, 0))
        new = list(current)
        for _ in range(budget):
            ref_room = limits.max_ref_ranks is None or num_ref < limits.max_ref_ranks
            ref_room = ref_room and not refs_keep_up(num_actor, num_ref, signals.stage_times)
            if ref_room and (not limits.elastic_actors or _decoupled_pays(num_actor, num_ref + 1, signals)):
                target = Role.REF
                num_ref += 1
            elif limits.elastic_actors:
                target = Role.ACTOR
                num_actor += 1
            else:
                break
            new = list(move_roles(tuple(new), Role.ROLLOUT, target, 1))
        return finish_plan(current, tuple(new), fetch, ErsReason.CONSUMPTION_DEFICIT)

    if signals.ready_groups < limits.groups_ideal:
        budget = limits.rollout_moves if signals.rollout_idle_ranks < 1.0 else 0
        budget = min(budget, host_room(num_rollout, limits.host))
        from_ref = min(budget, num_ref)
        new = move_roles(current, Role.REF, Role.ROLLOUT, from_ref)
        if limits.elastic_actors:
            from_actor = min(budget - from_ref, max(num_actor - limits.min_actor_ranks, 0))
            new = move_roles(new, Role.ACTOR, Role.ROLLOUT, from_actor, lowest_first=True)
        if limits.adaptive_retention and signals.last_rollout_change < 0:
            previous = signals.fetch_groups if signals.fetch_groups is not None else limits.groups_ideal
            fetch = max(limits.groups_min, (previous + limits.groups_min) // 2)
        return finish_plan(current, new, fetch, ErsReason.GENERATION_DEFICIT)

    return finish_plan(current, current, fetch, ErsReason.STEADY)


def _decoupled_pays(num_actor: int, num_ref: int, signals: ErsSignals) -> bool:
    """Would the decoupled mode with `num_ref` ref ranks beat colocated on the observed readiness?"""
    if signals.stage_times is None or num_actor < 1 or signals.microbatches_per_step <= 0:
        return False
    n = max(signals.microbatches_per_step, signals.ras_microbatches)
    tprm = signals.tprm_s if signals.tprm_s is not None else 0.0
    ras = min(signals.ras_microbatches, n)
    ready = [0.0] * ras + [tprm * (i + 1) for i in range(n - ras)]
    return choose_mode(ready, signals.stage_times, num_actor, num_ref).mode is Ra2pMode.DECOUPLED


def move_roles(roles: tuple[Role, ...], src: Role, dst: Role, count: int, lowest_first: bool = False) -> tuple[Role, ...]:
    new = list(roles)
    order = range(len(new)) if lowest_first else reversed(range(len(new)))
    for rank in order:
        if count <= 0:
            break
        if new[rank] is src:
            new[rank] = dst
            count -= 1
    return tuple(new)


def host_room(rollout: int, host: HostShare | None) -> int:
    """Further rollout ranks the host runs with every busy rollout rank at full speed (without a shared
    host: no limit, a number larger than any role map)."""
    if host is None:
        return 1 << 30
    room = 0
    while host.speed(rollout + room + 1, 0.0) >= 1.0:
        room += 1
    return room


def max_rollout(roles: tuple[Role, ...], host: HostShare | None) -> tuple[Role, ...]:
    """Preemptive maximum rollout: ref and idle ranks to rollout, on a shared host only while it runs each
    busy rollout rank at full speed (the others idle)."""
    room = host_room(sum(1 for r in roles if r is Role.ROLLOUT), host)
    new = []
    for r in roles:
        if r in (Role.REF, Role.IDLE):
            r = Role.ROLLOUT if room > 0 else Role.IDLE
            room -= 1
        new.append(r)
    return tuple(new)


def finish_plan(old: tuple[Role, ...], new: tuple[Role, ...], fetch: int, reason: ErsReason) -> ErsPlan:
    moves = tuple(RoleMove(i, a, b) for i, (a, b) in enumerate(zip(old, new)) if a is not b)
    return ErsPlan(new, _mode_of(new), fetch, moves, reason)
