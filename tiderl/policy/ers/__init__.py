"""Elastic Resource Scaling (ERS): the role map, RA2P mode and fetch size of
the next version, planned at a sync boundary from readiness signals (paper
section 5.2).

Pure: no torch, no database, no HTTP, no processes. The control plane (and
the simulator) calls :func:`plan` after the actor update of step k and before
the weights of version k+1 are published; the plan takes effect at that
boundary.

The planner's shape: ``plan = overrides(choose(model(signals)))``.
- :mod:`tiderl.policy.ers.inputs`: the limits (:class:`ErsLimits`, the `ers:` config section) and the
  records of what was measured (:class:`StepObservation`, :class:`ErsSignals`);
  :mod:`tiderl.policy.ers.signals`: the one builder of the signals from a snapshot of the run
  (:class:`~tiderl.policy.ers.signals.ErsSnapshot`, :func:`~tiderl.policy.ers.signals.build_signals`).
- :mod:`tiderl.policy.ers.model`: the rate model, the predicted rollout supply, trainer demand and
  goodput of every split (``ers.policy: rate``).
- :mod:`tiderl.policy.ers.choose`: the split picked from the model and the moves toward it
  (:func:`~tiderl.policy.ers.choose.plan_rate`).
- :mod:`tiderl.policy.ers.overrides`: the rules around the choice, each a named function: before it
  (the first that applies replaces it) ERS disabled, evaluation steps that take actor ranks (with
  ``elastic_actors``), cold start and evaluation steps (preemptive rollout, on a shared host within
  the host's room), an evaluation's end; after it, engines on
  demand; and the paper's threshold rules (``ers.policy: paper``), taken in place of the rate choice.
- :mod:`tiderl.policy.ers.trainer`: the trainer's side, its step model and re-partition between
  actor and ref ranks.
- :mod:`tiderl.policy.ers.outputs`: the plan (:class:`ErsPlan`, :class:`RoleMove`, :class:`ErsReason`).
The control plane and the simulator call :func:`plan` and build the signals with
:func:`tiderl.policy.ers.signals.build_signals` and :meth:`ErsLimits.from_config`.

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
  it adds nothing (tiderl.policy.ers.choose judges a split by them). Not even at cold start: on
  hilo-bench x cpu, in the simulator, one spare engine's start beside the working ranks cost 30% of
  goodput (docs/RESULTS.md); only a plan that measured a gain from the rank pays for it.
- Moves pick the highest-index eligible rank, or for actors leaving, the
  lowest-index actor (deterministic; lay the role map out as rollout ranks
  first, then actors, so the boundary between them is where ranks move).

   the actor ranks keep their role; with it, actor ranks never drop below
   ``min_actor_ranks`` through a move.
2. Moves are only ROLLOUT <-> REF, ROLLOUT <-> ACTOR (``elastic_actors``),
   IDLE -> ROLLOUT, ROLLOUT -> IDLE in a rate plan with a shared host
   (``host``, tiderl.policy.ers.choose), and ACTOR <-> REF in a rate plan's
   trainer re-partition, or where its moves pass a rank through rollout (``elastic_actors``); ``moves`` lists exactly the
   ranks whose role changed.
3. At most ``max_moves_per_step`` moves (with ``max_rollout_moves_per_step`` set, at most that many
   moves to rollout and ``max_moves_per_step`` others), except a preemptive plan, its
   return at the evaluation's end and a trainer re-partition (it leaves the rollout side as it is and costs one
   regroup of the actors however many ranks it moves).
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
    evaluation (or ACTOR, with ``elastic_actors``); every other rank keeps its role.
11. Pure: equal inputs give equal plans.
14. Engines on demand (``engines_on_demand`` with a shared host and ``engine_ranks`` known): no rank
    whose engine is not up moves from IDLE to ROLLOUT; each such move the rules chose leaves the rank
    IDLE and lists it in ``warm`` (the rest of the plan as the rules chose it; the reason
    ``engine_start`` where nothing else moves).
    ``warm`` holds only IDLE ranks without an engine, and is empty otherwise.
15. An evaluation step with ``elastic_actors`` (not at cold start, not on a shared host) and an evaluation
    step measured (``evaluation_step``): besides invariant 6, actor ranks move to rollout (the lowest-index
    first, never below ``min_actor_ranks``) only as many as give the shortest predicted evaluation step,
    and only where it beats the preemptive split's by more than ``rate_margin``
    (tiderl.policy.ers.overrides, ``evaluation_split``); the moves are exempt from the limits as the
    preemptive ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiderl.policy.ers.inputs import ErsLimits, ErsPolicy, ErsSignals, StepObservation
from tiderl.policy.ers.outputs import ErsPlan, ErsReason, RoleMove
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
    "plan",
]


def plan(roles: Sequence[Role], signals: ErsSignals, limits: ErsLimits) -> ErsPlan:
    """The next role map, RA2P mode and fetch size, by ``limits.policy`` (see the invariants above;
    the rate planner's own are in tiderl.policy.ers.choose): the rules before the choice
    (:data:`~tiderl.policy.ers.overrides.BEFORE_CHOICE`), else the choice, then the rules after it
    (:data:`~tiderl.policy.ers.overrides.AFTER_CHOICE`)."""
    # The stages build on the records above and the model on tiderl.policy.admission, which reads them:
    # imported here, not above.
    from tiderl.policy.ers import choose, overrides

    current = tuple(roles)
    planned = overrides.before_choice(current, signals, limits)
    if planned is None:
        if limits.policy is ErsPolicy.RATE:
            planned = choose.plan_rate(current, signals, limits)
        else:
            planned = overrides.plan_paper(current, signals, limits)
    return overrides.after_choice(current, planned, signals, limits)
