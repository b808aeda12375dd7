"""The discrete-event simulation of one system on one workload and cluster.

One event heap (time, sequence, callback). The rollout side
(:mod:`tiderl.sim.rollout`) and the trainer (:mod:`tiderl.sim.trainer`)
schedule their own events; this module owns the event loop, the release of
the groups (evaluation rounds and the staleness bound's feed), the trainer's
claims and the asynchronous step boundaries:

- asynchronous systems: the trainer consumes ``fetch`` ready groups per step,
  then the optimizer step; the publish of version k+1 waits for the
  evaluation tasks of version k (anchored weights); at the publish the ERS
  plan (if any) changes roles, every rollout engine reloads weights (stall +
  cache flush + interrupted requests re-prefilled), the staleness bound lets
  the feeder release ``groups_per_step`` more groups
  (released <= (version + max_staleness + 1) x B_ideal, AReaL's rule);
- ``sync``: every GPU rolls out the whole batch (and evaluation rounds), then
  switches to training (offload/onload of states), trains, switches back
  (:mod:`tiderl.sim.sync_steps`).

What ERS reads at a boundary and how its plan changes the roles are in
:mod:`tiderl.sim.ers_boundary`; the per-step records in :mod:`tiderl.sim.step_records`.

No speedup is written into the model: goodput, waits and hit rates come out
of these mechanics and the costs of :mod:`tiderl.sim.costs`.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, replace

from tiderl.policy import admission, ers
from tiderl.policy.ctb import PriorityWeights
from tiderl.policy.ctb_budget import BudgetLimits
from tiderl.policy.ers import ErsLimits, Role, StepObservation
from tiderl.policy.ers.signals import EvaluationMemory
from tiderl.policy.ra2p import Ra2pMode
from tiderl.sim.costs import derive_costs
from tiderl.sim.ers_boundary import ErsBoundary, GroupSums
from tiderl.sim.rollout import RolloutSide
from tiderl.sim.spec import ClusterSpec, WorkloadSpec
from tiderl.sim.step_records import StepRecord, StepRecords
from tiderl.sim.sync_steps import SyncSteps
from tiderl.sim.systems import System
from tiderl.sim.tasks import SimGroup, SimTask, Stage
from tiderl.sim.trainer import SimStepStats, Trainer
from tiderl.sim.workload import TaskSampler
from tiderl.systems import evaluation_due, feed_allowance, feed_batch_groups, oldest_trainable_version


class SimulationStalled(RuntimeError):
    """The event heap ran dry before the last step: a mechanic deadlocked."""


class Simulation(ErsBoundary, StepRecords, SyncSteps):
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
                                                        decoupled_step_s=self.costs.decoupled_step_s,
                                                        evaluation_tasks=workload.eval_round_tasks),
                                  enabled=system.ers and e.enabled)
        if system.ablate:  # an ablation: rules with a switch of their own through it, the others by name
            from tiderl.sim.systems import ABLATION_SWITCHES

            self.ers_limits = replace(self.ers_limits, **{r: False for r in system.ablate if r in ABLATION_SWITCHES},
                                      ablate=frozenset(r for r in system.ablate if r not in ABLATION_SWITCHES))
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
        return evaluation_due(version, self.workload.eval_every_steps, self.workload.eval_groups, self.steps)

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

    def _end(self, t: float) -> None:
        self.rollout.account_all(t, force=True)
        self.end_s = t
        self.done = True

    def result(self, wall_s: float) -> dict:
        from tiderl.sim.metrics import summarize

        return summarize(self, wall_s)

    def step_rows(self) -> list[dict]:
        return [asdict(r) for r in self.records]
