"""The discrete-event simulation of one system on one workload and cluster.

(Over 450 lines: the step boundary ties the trainer, the rollout side, ERS and the evaluation
rounds together in one event order; the rollout side and the trainer are modules of their own.)

One event heap (time, sequence, callback). The rollout side
(:mod:`tiderl.sim.rollout`) and the trainer (:mod:`tiderl.sim.trainer`)
schedule their own events; this module owns the step boundaries:

- asynchronous systems: the trainer consumes ``fetch`` ready groups per step,
  then the optimizer step; the publish of version k+1 waits for the
  evaluation tasks of version k (anchored weights); at the publish the ERS
  plan (if any) changes roles, every rollout engine reloads weights (stall +
  cache flush + interrupted requests re-prefilled), the staleness bound lets
  the feeder release ``groups_per_step`` more groups
  (released <= (version + max_staleness + 1) x B_ideal, AReaL's rule);
- ``sync``: every GPU rolls out the whole batch (and evaluation rounds), then
  switches to training (offload/onload of states), trains, switches back.

No speedup is written into the model: goodput, waits and hit rates come out
of these mechanics and the costs of :mod:`tiderl.sim.costs`.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from tiderl.policy import admission, ers
from tiderl.policy.ctb import PriorityWeights
from tiderl.policy.ctb_budget import BudgetLimits
from tiderl.policy.ers import ErsLimits, ErsSignals, Role, StepObservation
from tiderl.policy.ers_signals import ErsSnapshot, EvaluationMemory, build_signals
from tiderl.policy.ra2p import Ra2pMode, StageTimes, choose_mode, time_per_ready_microbatch_s
from tiderl.sim.costs import derive_costs
from tiderl.sim.rollout import RolloutSide, SimGroup, SimTask, Stage
from tiderl.sim.spec import ClusterSpec, WorkloadSpec
from tiderl.sim.systems import System
from tiderl.sim.trainer import SimStepStats, Trainer
from tiderl.sim.workload import TaskSampler
from tiderl.systems import feed_allowance, feed_batch_groups, oldest_trainable_version


class SimulationStalled(RuntimeError):
    """The event heap ran dry before the last step: a mechanic deadlocked."""


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


@dataclass(slots=True)
class StepRecord:
    version: int
    end_s: float
    duration_s: float
    rollout_ranks: int
    actor_ranks: int
    ref_ranks: int
    mode: str
    fetch_groups: int
    consumed_tokens: int
    ras: int
    tprm_s: float | None
    compute_s: float
    predicted_decoupled_s: float | None
    predicted_colocated_s: float | None
    twt_gpu_s: float
    eval_block_s: float
    ers_reason: str | None
    ready_groups: int = 0
    hol_s: float = 0.0
    consumed_gen_tokens: int = 0
    rwt_gpu_s: float = 0.0
    stale_dropped_groups: int = 0  # dropped at this step's claims
    inflight_cap: int | None = None  # ERS's adaptive admission for the step (None: the staleness bound's)


class Simulation:
    def __init__(
        self,
        workload: WorkloadSpec,
        cluster: ClusterSpec,
        system: System,
        *,
        steps: int,
        seed: int,
        rollout_fraction: float | None = None,
    ) -> None:
        self.workload = workload
        self.cluster = cluster
        self.system = system
        self.steps = steps
        self.costs = derive_costs(cluster)
        self.num_gpus = cluster.num_gpus
        self.b_ideal = workload.groups_per_step
        self.b_min = max(1, math.ceil(cluster.training.min_batch_fraction * self.b_ideal))
        self.staleness = 0 if system.synchronous else cluster.training.max_staleness
        if system.max_staleness is not None:
            self.staleness = system.max_staleness
        self.sampler = TaskSampler(workload, seed)
        self.reserve = {t.name: round(t.gen_tokens_per_turn) for t in workload.task_types}
        self.heap: list = []
        self.seq = 0
        self.done = False
        self.version = 0
        self.buffer: deque[SimGroup] = deque()
        self.rollout = RolloutSide(
            self.costs,
            self.schedule,
            self._group_done,
            ctb=system.ctb,
            env_concurrency=cluster.env_concurrency,
            weights=PriorityWeights(context_scale_tokens=workload.max_context_tokens),
            budget_limits=(BudgetLimits(floor_tokens=self.costs.kv_capacity_tokens,
                                        max_factor=cluster.rollout.ctb_max_overcommit)
                           if cluster.rollout.ctb_budget == "adaptive" else None),
            block_tokens=cluster.rollout.kv_block_size,
        )
        self.trainer = Trainer(
            self.costs, system.trainer, cluster.training.micro_batch_tokens, self.schedule, self._compute_done,
            gather_first=system.gather_first, host=self.rollout.set_trainer_busy,
        )
        self.rollout.on_speed = self.trainer.speed_changed
        fraction = rollout_fraction or system.rollout_fraction or cluster.training.default_rollout_fraction
        self.rollout_fraction = None if system.synchronous else fraction
        num_rollout = min(self.num_gpus - 1, max(1, round(fraction * self.num_gpus)))
        num_refs = system.fixed_refs or 0  # a fixed decoupled split: dedicated ref ranks
        num_actor = self.num_gpus - num_rollout - num_refs
        if num_actor < 1:
            raise ValueError(f"{system.label}: {num_rollout} rollout and {num_refs} ref ranks leave no actor "
                             f"rank of {self.num_gpus}")
        if cluster.training.actor_ranks is not None:
            num_actor = min(num_actor, cluster.training.actor_ranks)
        # Spare ranks (a fixed actor group smaller than the rest): ref ranks under ERS, else idle.
        spare = Role.REF if system.ers else Role.IDLE
        self.roles: list[Role] = ([Role.ROLLOUT] * num_rollout + [Role.ACTOR] * num_actor + [Role.REF] * num_refs
                                  + [spare] * (self.num_gpus - num_rollout - num_actor - num_refs))
        if system.synchronous:
            self.roles = [Role.ROLLOUT] * self.num_gpus
        e = cluster.ers
        if system.ers_policy is not None:
            e = replace(e, policy=system.ers_policy)
        self.ers_limits = replace(ErsLimits.from_config(e, self.b_min, self.b_ideal, self.staleness,
                                                        host=self.costs.host, rank_tasks=self.costs.max_num_seqs,
                                                        group_size=workload.group_size,
                                                        decoupled_step_s=self.costs.decoupled_step_s),
                                  enabled=system.ers and e.enabled)
        self.history_steps = e.history_steps
        # When each rank's engine is up (absent: it has none). The rollout ranks' start before t = 0; a rank
        # parked idle starts its own at once unless engines start on demand (then at the plan that warms
        # it); a ref rank only when it joins rollout (the run builds an engine once, on the base model, and
        # keeps it across roles).
        self.engines: dict[int, float] = {i: 0.0 for i, r in enumerate(self.roles) if r is Role.ROLLOUT}  # inf: starting
        self.parked_engines = (system.ers and self.ers_limits.enabled and not self.ers_limits.engines_on_demand
                               and not system.synchronous)
        self.adaptive_admission = self.ers_limits.enabled and e.adaptive_admission
        self.inflight_cap: int | None = None  # ERS's adaptive admission (None: the staleness bound's)
        self.evaluation_memory = EvaluationMemory()
        self.mode = Ra2pMode.DECOUPLED if system.fixed_refs else Ra2pMode.COLOCATED
        self.fetch = self.b_min if system.fetch_min else self.b_ideal
        self.last_rollout_change = 0
        self.next_group = {False: 0, True: 0}
        self.next_task = 0
        self.train_released = 0
        self.trained_groups = 0  # training groups of the published steps
        self.eval_outstanding = 0
        self.publish_waiting = False
        self.opt_done_s = 0.0
        self.last_publish_s = 0.0
        self.phase = "rollout"
        self.phase_done = 0
        self.ers_reason: str | None = None
        # Results.
        self.records: list[StepRecord] = []
        self.timeline: list[dict] = []
        self.step_stats: list[SimStepStats] = []
        self.consumed_tasks: list[SimTask] = []
        self.eval_tasks_done: list[SimTask] = []
        self.staleness_seen: list[int] = []
        self.dropped_groups = 0  # training groups dropped as older than the staleness bound
        self.dropped_gen_tokens = 0
        self.dropped_at_record = 0
        self.step_dropped_tokens = 0  # this step's, for ERS (trajectory tokens, as produced_tokens)
        self.twt_gpu_s = 0.0
        self.eval_block_gpu_s = 0.0
        self.regroup_gpu_s = 0.0
        self.rwt_at_publish = 0.0
        self.rwt_since_publish = 0.0
        self.empty_at_publish = 0.0
        self.busy_at_publish = 0.0
        # What ERS reads: one StepObservation per step, and the training groups completed in the step.
        self.observations: list[StepObservation] = []
        self.groups_seen = GroupSums()  # this step's
        self.end_s = 0.0

    # -- event loop --------------------------------------------------------------------------
    def schedule(self, t: float, fn: Callable[..., None], *args: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn, args))

    def run(self) -> dict:
        wall = time.perf_counter()
        self._start()
        while self.heap and not self.done:
            t, _, fn, args = heapq.heappop(self.heap)
            self.rollout.now = t
            fn(t, *args)
        if not self.done:
            raise SimulationStalled(
                f"{self.system.label}: no event left at version {self.version} "
                f"(buffer {len(self.buffer)} groups, candidates {len(self.rollout.candidates)}, "
                f"orphans {len(self.rollout.orphans)}, live tasks {len(self.rollout.tasks)})"
            )
        return self.result(time.perf_counter() - wall)

    def _start(self) -> None:
        t = 0.0
        for i, role in enumerate(self.roles):
            if role is Role.ROLLOUT:
                self.rollout.add_rank(t, i, 0.0)
        if self.system.synchronous:
            self._sync_start_version(t)
            return
        if self.system.ers:
            plan = ers.plan(self.roles, self._signals(t, None), self.ers_limits)
            for i, role in enumerate(plan.roles):
                if role is Role.ROLLOUT:  # the cold start's rollout ranks start their engines with the others
                    self.engines.setdefault(i, 0.0)
            self._apply_plan(t, plan, stall_s=0.0)
        self._record_roles(t)
        self._release(t)
        self._begin_step(t)

    # -- tasks -------------------------------------------------------------------------------
    def _new_groups(self, count: int, is_eval: bool) -> list[SimGroup]:
        size = self.workload.eval_group_size if is_eval else self.workload.group_size
        groups = []
        for _ in range(count):
            index = self.next_group[is_eval]
            self.next_group[is_eval] += 1
            plans = self.sampler.group(index, self.version, size, is_eval)
            tasks = []
            for plan in plans:
                tasks.append(SimTask(self.next_task, plan, is_eval, self.reserve[plan.task_type]))
                self.next_task += 1
            group = SimGroup(("e" if is_eval else "t", index), tasks, is_eval, plans[0].task_type, self.version)
            for task in tasks:
                task.group = group
            groups.append(group)
        return groups

    def _eval_due(self, version: int) -> bool:
        w = self.workload
        return w.eval_every_steps > 0 and w.eval_groups > 0 and version % w.eval_every_steps == 0

    def _release(self, t: float) -> None:
        """Release this version's evaluation round and what the staleness bound allows."""
        if self._eval_due(self.version):
            self.eval_outstanding = self.workload.eval_groups
            self.rollout.release(t, self._new_groups(self.workload.eval_groups, True), front=True)
        self._release_training(t)

    def _release_training(self, t: float) -> None:
        # Groups in flight (released, not yet trained or dropped) <= (max_staleness + 1) x the batch the coming
        # step fetches (`feed_batch_groups`, as the run's control plane): AReaL's (version + s + 1) x B
        # rule. A group dropped as stale is no longer outstanding either: its place is fed again. A group
        # the running step claimed is outstanding until the step publishes, as the control plane counts
        # the store's claimed groups: feeding on its place at a mid-step drop released groups a step
        # early, at the older version, and the staleness bound dropped them in turn.
        done = self.trained_groups + self.dropped_groups
        allowed = feed_allowance(self.train_released - done, self._feed_batch(), self.staleness, self.inflight_cap)
        if allowed > 0:
            self.train_released += allowed
            groups = self._new_groups(allowed, False)
            for group in groups:
                group.released_s = t
            self.rollout.release(t, groups)

    def _feed_batch(self) -> int:
        """The batch the feed bound counts in (the run's control plane's function)."""
        return feed_batch_groups(self.system.fetch_min, self.fetch, self.b_ideal)

    @staticmethod
    def _after(t: float, *intervals: float) -> float:
        """When a chain of pollers has noticed something that happened at t: the pollers run on
        their own clocks, so each adds half its interval on average."""
        return t + sum(intervals) / 2

    def _group_done(self, t: float, group: SimGroup) -> None:
        c = self.cluster.control
        # A polled control loop: the group reaches the store at its rank's next report and the
        # trainer sees it at its next poll, or its next look at the bell the report rang (each half
        # an interval later on average).
        seen = self._after(t, c.report_interval_s, c.woken_s(c.poll_s))
        if seen > t:
            self.schedule(seen, self._group_seen, group)
        else:
            self._group_seen(t, group)

    def _group_seen(self, t: float, group: SimGroup) -> None:
        if group.is_eval:
            self.eval_tasks_done.extend(group.tasks)
            self.eval_outstanding -= 1
            if self.eval_outstanding == 0:
                if self.system.synchronous and self.phase == "eval":
                    self._sync_rollout_phase(t)
                elif self.publish_waiting:
                    self._publish(t)
            return
        self.buffer.append(group)
        group.seen_s = t
        self.groups_seen.add(group, group.released_s if group.released_s is not None else t, t)
        if self.system.synchronous:
            self.phase_done += 1
            if self.phase_done == self.b_ideal:
                self.rollout.off = True
                self.rollout.account_all(t)
                self.schedule(t + self.costs.phase_switch_s, self._sync_train)
            return
        self._offer(t)

    def _offer(self, t: float) -> None:
        bound = oldest_trainable_version(self.version, self.staleness)
        claimed, dropped = self.trainer.offer(t, self.buffer, lambda g: g.version_start < bound)
        for group in claimed:
            group.claimed_s, group.claim_version = t, self.version
            self.consumed_tasks.extend(group.tasks)
            self.staleness_seen.append(self.version - group.version_start)
        if dropped:
            # The real trainer drops a stale group when it claims it (the store marks it failed); the
            # control plane sees the freed place at its next tick and feeds a new group.
            self.dropped_groups += len(dropped)
            self.dropped_gen_tokens += sum(g.gen_tokens for g in dropped)
            self.step_dropped_tokens += sum(sum(g.seq_tokens) for g in dropped)
            c = self.cluster.control
            self.schedule(self._after(t, c.control_tick_s, c.report_interval_s), self._refeed)

    # -- asynchronous steps ------------------------------------------------------------------
    def _num(self, role: Role) -> int:
        return sum(1 for r in self.roles if r is role)

    def _begin_step(self, t: float) -> None:
        self.trainer.begin_step(t, self._num(Role.ACTOR), self._num(Role.REF), self.mode, self.fetch)
        self._offer(t)

    def _compute_done(self, t: float) -> None:
        self.schedule(t + self.costs.optimizer_s(self._num(Role.ACTOR)), self._optimized)

    def _optimized(self, t: float) -> None:
        self.opt_done_s = t
        if self.system.synchronous:
            self._sync_publish(t)
        elif self.eval_outstanding > 0:
            self.publish_waiting = True  # the evaluation round holds the version's weights
        else:
            self._publish(t)

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

    def _publish(self, t: float) -> None:
        self.publish_waiting = False
        stats = self.trainer.finish_step()
        self.trained_groups = len(self.consumed_tasks) // self.workload.group_size
        self.step_stats.append(stats)
        block = t - self.opt_done_s
        self.eval_block_gpu_s += block * (stats.num_actors + stats.num_refs)
        self.twt_gpu_s += stats.twt_gpu_s + block * (stats.num_actors + stats.num_refs)
        self.ers_reason = None
        self._record_step(t, stats, block)
        self._observe_step(t, stats, block)
        signals = self._signals(t, stats)
        self.records[-1].ready_groups = signals.ready_groups
        self.records[-1].hol_s = signals.hol_latency_s
        self.records[-1].rwt_gpu_s = self.rwt_since_publish
        plan = ers.plan(self.roles, signals, self.ers_limits) if self.system.ers else None
        self.version += 1
        self.rollout.version = self.version
        self.last_publish_s = t
        if self.version >= self.steps:
            self._end(t)
            return
        sync_s = self.costs.weight_sync_s
        self.rollout.flush_all(t, sync_s)
        restart_s = sync_s
        if plan is not None:
            actors = self._num(Role.ACTOR)
            self._apply_plan(t, plan, sync_s)
            self.records[-1].ers_reason = plan.reason.value
            if self._num(Role.ACTOR) != actors:
                restart_s = max(sync_s, self.costs.regroup_s(self._num(Role.ACTOR)))
                self.regroup_gpu_s += restart_s * self._num(Role.ACTOR)
        if self.adaptive_admission:  # with the plan, as the control plane decides it
            self.inflight_cap = admission.inflight_cap(self.inflight_cap, self.observations, self._feed_batch(),
                                                       self.staleness)
        self._record_roles(t)
        c = self.cluster.control
        # A polled control loop: the plan of the new version is written at the next control tick and
        # the ranks act on it at their next poll; new groups are fed at that tick and claimed by the
        # rollout ranks at their next report (each wait half an interval on average; the publish and
        # the plan ring bells, so with bells those waits are a bell's look).
        planned = self._after(t, c.woken_s(c.control_tick_s), c.woken_s(c.poll_s))
        fed = self._after(t, c.woken_s(c.control_tick_s), c.report_interval_s)
        if fed > t:
            self.schedule(fed, self._feed)
        else:
            self._feed(t)
        self.schedule(planned + restart_s, self._begin_step)

    def _feed(self, t: float) -> None:
        # The control plane's tick after a publish: the open groups the new version's staleness bound
        # dooms are dropped (their places fed again at once), then the feed.
        doomed = self.rollout.drop_doomed(oldest_trainable_version(self.version, self.staleness))
        if doomed:
            self.dropped_groups += len(doomed)
            self.dropped_gen_tokens += sum(sum(x.plan.gen_tokens) for g in doomed for x in g.tasks
                                           if x.stage is Stage.DONE)
            self.step_dropped_tokens += sum(x.plan.total_tokens for g in doomed for x in g.tasks
                                            if x.stage is Stage.DONE)
        self._release(t)
        self.rollout.dispatch(t)

    def _refeed(self, t: float) -> None:
        """The places of dropped groups fed again (no evaluation round: that belongs to a publish)."""
        if not self.done:
            self._release_training(t)
            self.rollout.dispatch(t)

    # -- synchronous system ------------------------------------------------------------------
    def _sync_start_version(self, t: float) -> None:
        self.rollout.off = False
        self.rollout.account_all(t)
        self._record_roles(t)
        if self._eval_due(self.version):
            self.phase = "eval"
            self.eval_outstanding = self.workload.eval_groups
            self.rollout.release(t, self._new_groups(self.workload.eval_groups, True), front=True)
        else:
            self._sync_rollout_phase(t)

    def _sync_rollout_phase(self, t: float) -> None:
        self.phase = "rollout"
        self.phase_done = 0
        self.train_released += self.b_ideal
        groups = self._new_groups(self.b_ideal, False)
        for group in groups:
            group.released_s = t
        self.rollout.release(t, groups)

    def _sync_train(self, t: float) -> None:
        self.phase = "train"
        self.trainer.begin_step(t, self.num_gpus, 0, Ra2pMode.COLOCATED, self.b_ideal)
        self._offer(t)

    def _sync_publish(self, t: float) -> None:
        stats = self.trainer.finish_step()
        self.step_stats.append(stats)
        self.twt_gpu_s += stats.twt_gpu_s
        self.ers_reason = None
        self._record_step(t, stats, 0.0)
        self.version += 1
        self.rollout.version = self.version
        self.last_publish_s = t
        if self.version >= self.steps:
            self._end(t)
            return
        # Back to rollout: the engines wake with the new weights and an empty cache.
        self.rollout.flush_all(t, self.costs.phase_switch_s)
        self.schedule(t + self.costs.phase_switch_s, self._sync_start_version)

    # -- records -----------------------------------------------------------------------------
    def _record_roles(self, t: float) -> None:
        if self.system.synchronous:
            entry = {"version": self.version, "t_s": round(t, 3), "rollout": self.num_gpus,
                     "actor": self.num_gpus, "ref": 0, "mode": "time-shared"}
        else:
            entry = {"version": self.version, "t_s": round(t, 3), "rollout": self._num(Role.ROLLOUT),
                     "actor": self._num(Role.ACTOR), "ref": self._num(Role.REF), "mode": self.mode.value}
        self.timeline.append(entry)

    def _record_step(self, t: float, stats: SimStepStats, block: float) -> None:
        ready = stats.ready_rel_s
        prediction = None
        if ready:
            prediction = choose_mode(ready, self._stage_times(), stats.num_actors, max(1, stats.num_refs))
        self.records.append(
            StepRecord(
                version=self.version,
                end_s=t,
                duration_s=t - self.last_publish_s,
                rollout_ranks=self._num(Role.ROLLOUT) if not self.system.synchronous else self.num_gpus,
                actor_ranks=stats.num_actors,
                ref_ranks=stats.num_refs,
                mode=stats.mode.value,
                fetch_groups=stats.fetch_groups,
                consumed_tokens=stats.consumed_tokens,
                ras=sum(1 for a in ready if a <= 0),
                tprm_s=time_per_ready_microbatch_s(ready),
                compute_s=stats.compute_done_s - stats.start_s,
                predicted_decoupled_s=prediction.decoupled_s if prediction else None,
                predicted_colocated_s=prediction.colocated_s if prediction else None,
                twt_gpu_s=stats.twt_gpu_s + block * (stats.num_actors + stats.num_refs),
                eval_block_s=block,
                ers_reason=None,
                consumed_gen_tokens=stats.consumed_gen_tokens,
                stale_dropped_groups=self.dropped_groups - self.dropped_at_record,
                inflight_cap=self.inflight_cap,
            )
        )
        self.dropped_at_record = self.dropped_groups

    def _end(self, t: float) -> None:
        self.rollout.account_all(t, force=True)
        self.end_s = t
        self.done = True

    def result(self, wall_s: float) -> dict:
        from tiderl.sim.metrics import summarize

        return summarize(self, wall_s)

    def step_rows(self) -> list[dict]:
        return [asdict(r) for r in self.records]
