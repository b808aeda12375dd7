"""The ERS side of the simulation's step boundary (a part of :class:`tiderl.sim.simulator.Simulation`).

What ERS reads, built as the control plane builds it: the training groups completed in a step
(:class:`GroupSums`), the step as a :class:`~tiderl.policy.ers.StepObservation`, the rollout ranks'
idle and busy rank-seconds, the trainer's stage times and the snapshot handed to
:func:`tiderl.policy.ers.signals.build_signals`. And what its plan does: roles changed, ranks
leaving or joining rollout, engines started on the base model where a rank has none.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiderl.policy import ers
from tiderl.policy.ers import ErsSignals, Role, StepObservation
from tiderl.policy.ers.signals import ErsSnapshot, EvaluationMemory, build_signals
from tiderl.policy.ra2p import Ra2pMode, StageTimes, time_per_ready_microbatch_s
from tiderl.sim.tasks import SimGroup, SimTask

if TYPE_CHECKING:
    from tiderl.sim.costs import Costs
    from tiderl.sim.rollout import RolloutSide
    from tiderl.sim.spec import ClusterSpec
    from tiderl.sim.trainer import SimStepStats


@dataclass(slots=True)
class GroupSums:
    """The training groups completed in a step, summed as the store's step window sums them
    (tiderl.store.types.StepWindow)."""

    groups: int = 0
    tokens: int = 0
    latency_s: float = 0.0  # creation to completion
    env_s: float = 0.0  # each group's slowest task's environment seconds
    tasks: int = 0
    task_env_s: float = 0.0
    task_slot_s: float = 0.0  # placement (a real rank's claim) to the task's end
    task_wait_s: float = 0.0  # the group's release to that placement

    def add(self, group: SimGroup, released: float, t: float) -> None:
        env = [x.plan.start_latency_s + sum(x.plan.env_latency_s) for x in group.tasks]
        self.groups += 1
        self.tokens += sum(group.seq_tokens)
        self.latency_s += t - released
        self.env_s += max(env)
        self.tasks += len(env)
        self.task_env_s += sum(env)
        self.task_slot_s += sum(x.finished_s - x.placed_s for x in group.tasks)
        self.task_wait_s += sum(max(0.0, x.placed_s - released) for x in group.tasks)


class ErsBoundary:
    """ERS at the step boundary: the signals it reads and its plan applied (a mixin of `Simulation`)."""

    cluster: ClusterSpec
    costs: Costs
    rollout: RolloutSide
    roles: list[Role]
    engines: dict[int, float]  # rank -> when its engine is up (inf: starting)
    parked_engines: bool
    mode: Ra2pMode
    fetch: int
    version: int
    staleness: int
    done: bool
    buffer: deque[SimGroup]
    consumed_tasks: list[SimTask]
    step_stats: list[SimStepStats]
    observations: list[StepObservation]
    groups_seen: GroupSums
    evaluation_memory: EvaluationMemory
    history_steps: int
    inflight_cap: int | None
    last_rollout_change: int
    last_publish_s: float
    step_dropped_tokens: int
    ers_reason: str | None
    rwt_at_publish: float
    rwt_since_publish: float
    empty_at_publish: float
    busy_at_publish: float
    _num: Callable[[Role], int]
    _eval_due: Callable[[int], bool]

    def _stage_times(self) -> StageTimes:
        """The stage times as the trainer measures them: of a micro-batch of the recent sequences, at the
        speed the last step's compute ran (a shared host slows it; the real trainer's clocks see that)."""
        seqs = [x.plan.total_tokens for x in self.consumed_tasks[-256:]] or [2048]
        mean_len = sum(seqs) / len(seqs)
        last = self.step_stats[-1] if self.step_stats else None
        slow = last.wall_s / last.work_s if last is not None and last.work_s > 0 else 1.0
        fwd = self.cluster.training.micro_batch_tokens / mean_len * self.costs.forward_s(round(mean_len)) * slow
        c = self.costs
        return StageTimes(t_ref_s=fwd * c.ref_ratio, t_act_f_s=fwd, t_act_b_s=c.backward_ratio * fwd,
                          t_swap_s=c.swap_s * slow)

    def _signals(self, t: float, stats: SimStepStats | None) -> ErsSignals:
        """The snapshot the control plane would take now, through the same builder."""
        snapshot = ErsSnapshot(
            roles=tuple(self.roles),
            micro_batch_tokens=self.cluster.training.micro_batch_tokens,
            ready_tokens=sum(sum(g.seq_tokens) for g in self.buffer),
            ready_groups=len(self.buffer),
            oldest_ready_age_s=t - self.buffer[0].ready_s if self.buffer else None,
            steps=tuple(self.observations),
            is_eval_open=self._eval_due(self.version + 1) if stats else self._eval_due(0),
            fetch_groups=self.fetch,
            last_rollout_change=self.last_rollout_change,
            stage_times=self._stage_times() if self.consumed_tasks else None,
            fill_steps=self.staleness + 1,
            pre_evaluation_roles=self.evaluation_memory.roles,
            # Engine starts not priced (engine_start_s 0): every rank joins rollout at a reload's cost.
            engine_ranks=(frozenset(r for r, up in self.engines.items() if up <= t) if self.costs.engine_start_s
                          else None),
            inflight_cap=self.inflight_cap,  # the cap the feed keeps now, as the control plane hands it
        )
        return build_signals(snapshot, self.history_steps)

    def _observe_step(self, t: float, stats: SimStepStats, block: float) -> None:
        """The step that just ended, as ERS sees it (the control plane records the same)."""
        duration = t - self.last_publish_s
        seen = self.groups_seen
        actors = max(1, stats.num_actors)
        self.observations.append(StepObservation(
            version=self.version + 1, duration_s=duration, consumed_tokens=stats.consumed_tokens,
            rollout_ranks=self._num(Role.ROLLOUT), actor_ranks=stats.num_actors, ref_ranks=stats.num_refs,
            produced_tokens=seen.tokens, groups_completed=seen.groups,
            group_latency_sum_s=seen.latency_s, group_env_sum_s=seen.env_s,
            rollout_idle_rank_s=self._rollout_idle_rank_s(t),
            rollout_busy_rank_s=self._rollout_busy_rank_s(),
            tasks_completed=seen.tasks, task_env_sum_s=seen.task_env_s,
            task_slot_sum_s=seen.task_slot_s, task_wait_sum_s=seen.task_wait_s,
            trainer_wait_s=min(duration, stats.actor_wait_gpu_s / actors + block),
            tprm_s=time_per_ready_microbatch_s(stats.ready_rel_s),
            ras_microbatches=sum(1 for a in stats.ready_rel_s if a <= 0),
            stale_dropped_tokens=self.step_dropped_tokens,
            evaluation=self._eval_due(self.version)))  # the step played this version's evaluation round
        self.groups_seen = GroupSums()
        self.step_dropped_tokens = 0

    def _rollout_busy_rank_s(self) -> float:
        """Rollout rank-seconds with the engine generating since the last publish (after the accounting
        of _rollout_idle_rank_s at the same time)."""
        busy = self.rollout.accounts["busy"]
        since, self.busy_at_publish = busy - self.busy_at_publish, busy
        return since

    def _rollout_idle_rank_s(self, t: float) -> float:
        """Rollout rank-seconds holding no task since the last publish (as the real ranks count
        `rollout_idle_s`); sets the step's RWT (nothing to play: behind the staleness bound) beside it."""
        self.rollout.account_all(t, force=True)
        rwt = self.rollout.rwt_rank_s()
        self.rwt_since_publish = rwt - self.rwt_at_publish
        self.rwt_at_publish = rwt
        empty = self.rollout.empty_rank_s()
        since, self.empty_at_publish = empty - self.empty_at_publish, empty
        return since

    def _apply_plan(self, t: float, plan: ers.ErsPlan, stall_s: float) -> None:
        self.evaluation_memory.note(tuple(self.roles), plan.reason)
        before = self._num(Role.ROLLOUT)
        for move in plan.moves:
            if move.from_role is Role.ROLLOUT:
                if move.rank in self.rollout.ranks:  # (not while its engine still starts)
                    self.rollout.remove_rank(t, move.rank)  # its engine stays up
            elif move.to_role is Role.ROLLOUT:
                if move.rank not in self.engines:
                    self._start_engine(t, move.rank)
                if self.engines[move.rank] <= t:
                    self.rollout.add_rank(t, move.rank, stall_s)
            elif move.to_role is Role.IDLE and self.parked_engines and move.rank not in self.engines:
                self._start_engine(t, move.rank)
        for rank in plan.warm:
            if rank not in self.engines:
                self._start_engine(t, rank)
        self.roles = list(plan.roles)
        self.mode = plan.mode
        self.fetch = plan.fetch_groups
        self.last_rollout_change = self._num(Role.ROLLOUT) - before
        self.ers_reason = plan.reason.value

    def _start_engine(self, t: float, rank: int) -> None:
        """The rank starts its engine (on the base model, as the run's ranks do); it plays tasks once the
        engine is up and holds the published weights (a reload)."""
        if self.costs.engine_start_s <= 0:  # not priced: up at once
            self.engines[rank] = t
            return
        self.engines[rank] = math.inf
        self.rollout.start_engine(t, rank, self._engine_up)

    def _engine_up(self, t: float, rank: int) -> None:
        self.engines[rank] = t
        if self.roles[rank] is Role.ROLLOUT and rank not in self.rollout.ranks and not self.done:
            self.rollout.add_rank(t, rank, self.costs.weight_sync_s)
            self.rollout.dispatch(t)
