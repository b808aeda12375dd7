"""The control plane: one CPU process per run that feeds tasks, plans every version and watches ranks.

    python -m tiderl.run.control RUN_DIR

Each tick (every TICK_S, and at once when the actor rings the `published` bell: tiderl.run.bell):
observe (store: published version, buffer, heartbeats) -> decide
(feed allowance, the plan of a newly published version: ERS for `tiderl`,
the fixed split otherwise) -> act (add groups, write the plan, return a dead
rank's claims) -> record (metrics, events). It keeps nothing that is not in
the store: killed and restarted, it carries on where the store says.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from tiderl.config import JobConfig, load_job
from tiderl.observe import MetricsServer, TensorBoardLog
from tiderl.paths import RunPaths, use_private_umask
from tiderl.run.bell import Bell
from tiderl.policy import admission, ers
from tiderl.policy.ers.model import describe
from tiderl.policy.ers.signals import HISTORY_FACTOR, ErsSnapshot, EvaluationMemory, build_signals
from tiderl.policy.ra2p import Ra2pMode, StageTimes
from tiderl.systems import (FetchPolicy, SystemBehaviour, behaviour, evaluation_due, feed_allowance, feed_batch_groups,
                            initial_roles, oldest_trainable_version)
from tiderl.store import RunStore
from tiderl.store.types import (GroupState, MetricPoint, NewGroup, PlanRecord, RankReport, RankState, Role, RunState,
                                TaskKind)

log = logging.getLogger("tiderl.control")
TICK_S = 0.2
WATCH_S = 1.0  # heartbeats are checked (one write: the watch is also the control plane's heartbeat) this often
EVAL_SEED_BASE = 1_000_000_000  # evaluation prompts: a fixed set, disjoint from the training seeds
OUTSTANDING = (GroupState.OPEN, GroupState.READY, GroupState.CLAIMED)
CONTROL_RANK = -1  # the control plane's metrics rows carry this rank


def train_seed(job_seed: int, index: int) -> int:
    return job_seed * 10_000_000 + index


class ControlPlane:
    def __init__(self, config: JobConfig, store: RunStore, *, planned: Bell | None = None) -> None:
        """`planned`: the bell rung after each plan is written (tiderl.run.bell; None: no bell)."""
        self.config = config
        self.store = store
        self.planned = planned
        self.system: SystemBehaviour = behaviour(config.system, max_staleness=config.rollout.max_staleness,
                                                 ra2p_mode=config.trainer.ra2p_mode)
        self.limits = ers.ErsLimits.from_config(config.ers, config.trainer.groups_min, config.trainer.groups_ideal,
                                                self.system.max_staleness, rank_tasks=config.rollout.max_concurrency,
                                                group_size=config.rollout.group_size,
                                                evaluation_tasks=config.rollout.eval_round_tasks)
        self._watched_at = float("-inf")
        self._observed: dict[int, ers.StepObservation] = {}  # version -> its step, as ERS reads it
        # The roles an evaluation's preemptive plan replaced (in memory: a resumed run plans on from its
        # current roles, as the rate planner would).
        self._evaluation_memory = EvaluationMemory()
        # The fetch size of the latest plan, which the feed bound counts in (groups_ideal until a plan;
        # a resumed run plans again before its next step).
        self._planned_fetch = config.trainer.groups_ideal
        self._inflight_cap: int | None = None  # ERS's adaptive admission (None: the staleness bound's)
        self._drawn_before: int | None = None  # training groups a fork's source drew (0: a run of its own)

    # ---- one tick --------------------------------------------------------------------------
    def tick(self) -> bool:
        """One pass; returns False once the run is over."""
        state, version = self.store.position()
        if state.is_terminal:
            return False
        now = time.monotonic()
        if now - self._watched_at < WATCH_S:
            dead = None
        else:
            self._watched_at = now
            dead = self.store.reclaim_expired(self.config.launch.heartbeat_timeout_s, control_tick=True)
            self.expire_evaluations()
        if dead is not None and dead.dead_ranks:
            log.warning("ranks %s missed heartbeats: %d tasks and %d trajectories back in the pool",
                        dead.dead_ranks, dead.tasks_returned, dead.trajectories_returned)
        planned = self.store.latest_planned_version()
        if planned is None or planned < version:
            self.plan(version)
            self.drop_doomed(version)
        if version < self.config.trainer.num_steps:
            self.feed()
        self.feed_eval(version)
        if version >= self.config.trainer.num_steps and self._evals_open() == 0:
            self.store.set_run_state(RunState.FINISHED, f"{version} steps done")
            log.info("run finished at version %d", version)
            return False
        return True

    # ---- feeding ---------------------------------------------------------------------------
    def feed(self) -> None:
        counts = self.store.groups_by_state(TaskKind.TRAIN)
        # The version is read after the counts, not taken from the start of the tick: a version published
        # in between consumed groups that the older version still counts on, and feeding on it created
        # groups that no remaining step trains (generated, then outstanding when the run ended). Read after
        # them, the version is at least as new as the counts (a publish is one transaction); one published
        # after the counts only makes this tick feed less, and the next tick feeds the rest.
        version = self.store.position()[1]
        total, outstanding = sum(counts.values()), sum(counts[s] for s in OUTSTANDING)
        ideal = self.config.trainer.groups_ideal
        # No more groups than the remaining steps can train (generation past the end is waste).
        remaining = (self.config.trainer.num_steps - version) * ideal - outstanding
        n = min(feed_allowance(outstanding, self._feed_batch(), self.system.max_staleness, self._inflight_cap),
                max(0, remaining))
        if n:
            g = self.config.rollout.group_size
            first = self._first_seed_index() + total
            self.store.add_groups([NewGroup(TaskKind.TRAIN, train_seed(self.config.seed, first + i), g)
                                   for i in range(n)])

    def _first_seed_index(self) -> int:
        """Where this run's training prompts start: after those its source drew for a fork (which then trains
        none of the source's prompts again), else at the first."""
        if self._drawn_before is None:
            origin = self.store.fork_origin()
            self._drawn_before = origin.source_train_groups if origin is not None else 0
        return self._drawn_before

    def drop_doomed(self, version: int) -> list[int]:
        """Drop the open training groups that hold a trajectory older than the staleness bound of step
        `version` (RunStore.drop_doomed_groups): the trainer would drop them when it claimed them, after
        their remaining tasks had been generated for nothing. Their places are fed again."""
        bound = oldest_trainable_version(version, self.system.max_staleness)
        dropped = self.store.drop_doomed_groups(
            bound, f"a trajectory older than version {bound}, the staleness bound of step {version}")
        if dropped:
            log.info("version %d: %d open groups dropped, a trajectory of each older than version %d",
                     version, len(dropped), bound)
        return dropped

    def _feed_batch(self) -> int:
        """The batch the feed bound counts in, for the latest plan's fetch size."""
        return feed_batch_groups(self.system.fetch_policy is FetchPolicy.MIN, self._planned_fetch,
                                 self.config.trainer.groups_ideal)

    def eval_due(self, version: int) -> bool:
        """An evaluation round plays version `version` (version 0 included)."""
        rollout = self.config.rollout
        return evaluation_due(version, rollout.eval_every_steps, rollout.eval_groups, self.config.trainer.num_steps)

    def feed_eval(self, version: int) -> None:
        if not self.eval_due(version):
            return
        if not self.store.has_evaluation(version):
            size = self.config.rollout.eval_group_size
            self.store.add_groups([NewGroup(TaskKind.EVAL, EVAL_SEED_BASE + i, size,
                                            eval_version=version) for i in range(self.config.rollout.eval_groups)])

    def expire_evaluations(self) -> int:
        """Fail the evaluation tasks that can no longer run anywhere. A rollout rank that holds the
        weights of an evaluation keeps them until its evaluation tasks are done (rollout_role) and
        ranks only ever load newer weights: once every running rollout rank holds weights newer
        than an evaluation's version, nobody can run its pending tasks. Returns how many failed."""
        if not self._evals_open():
            return 0
        held = [r.version for r in self.store.ranks() if r.role is Role.ROLLOUT and r.state is RankState.RUNNING]
        if not held:
            return 0
        expired = self.store.expire_evaluations(min(held))
        if expired:
            log.warning("%d evaluation tasks expired: no rollout rank holds their weights version any more", expired)
        return expired

    def _evals_open(self) -> int:
        return self.store.groups_by_state(TaskKind.EVAL)[GroupState.OPEN]

    # ---- planning --------------------------------------------------------------------------
    def plan(self, version: int) -> PlanRecord:
        cfg = self.config
        # The first plan of a run (of a fork too, whose store starts at its checkpoint's version) is the initial split.
        current = self.store.roles_at(version - 1) if version > 0 else {}
        if not current:
            current = initial_roles(cfg.launch.num_ranks, cfg.launch.rollout_fraction, self.system.spare_role,
                                    cfg.trainer.actor_ranks)
        fetch = cfg.trainer.groups_min if self.system.fetch_policy is FetchPolicy.MIN else cfg.trainer.groups_ideal
        mode = self.system.ra2p_mode or Ra2pMode.COLOCATED
        reason = "fixed"
        if self.system.uses_ers:
            ranks = sorted(current)
            signals = self.signals(version, current)
            before = [current[r] for r in ranks]
            decision = ers.plan(before, signals, self.limits)
            self._evaluation_memory.note(tuple(before), decision.reason)
            current = dict(zip(ranks, decision.roles))
            fetch = decision.fetch_groups
            mode = self.system.ra2p_mode or decision.mode  # a fixed trainer.ra2p_mode wins over ERS's
            reason = decision.reason.value
            self._ask_engines(version, decision.warm)
            if decision.moves:
                old, new = (describe(signals, self.limits, r) for r in (before, decision.roles))
                seen = (f" (predicted trajectory tokens trained {old['predicted_trained_tok_s']:.0f} -> "
                        f"{new['predicted_trained_tok_s']:.0f} a second, "
                        f"{new['predicted_trained_tok_s'] / old['predicted_trained_tok_s'] - 1:+.1%})"
                        if old and new and old['predicted_trained_tok_s'] > 0 else "")
                log.info("version %d: ERS %s moves %s%s", version, reason,
                         ", ".join(f"rank {m.rank} {m.from_role.value}->{m.to_role.value}" for m in decision.moves), seen)
        self._planned_fetch = fetch
        if self.system.uses_ers and cfg.ers.adaptive_admission and cfg.ers.enabled:
            cap = admission.inflight_cap(self._inflight_cap, self._observations(version), self._feed_batch(),
                                         self.system.max_staleness)
            if cap != self._inflight_cap:
                log.info("version %d: ERS admits at most %d training groups in flight (was %s)", version, cap,
                         self._inflight_cap if self._inflight_cap is not None else "the staleness bound's")
            self._inflight_cap = cap
        plan = PlanRecord(version=version, roles=current, ra2p_mode=mode, fetch_groups=fetch)
        self.store.plan_roles(version, current, ra2p_mode=mode, fetch_groups=fetch, reason=reason)
        if self.planned is not None:
            self.planned.ring()
        self._record_step(version)
        return plan

    def signals(self, version: int, roles: dict[int, Role]) -> ers.ErsSignals:
        """The ERS signals of the boundary before `version`, through the builder the simulator uses too."""
        cfg = self.config
        buf = self.store.buffer_state()
        oldest = self.store.measure.oldest_ready_at()
        previous = self.store.plan_at(version - 1) if version > 0 else None
        before = self.store.plan_at(version - 2) if version > 1 else None
        change = 0
        if previous is not None and before is not None:
            change = len(previous.ranks_with(Role.ROLLOUT)) - len(before.ranks_with(Role.ROLLOUT))
        snapshot = ErsSnapshot(
            roles=tuple(roles[r] for r in sorted(roles)),
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
            ready_tokens=buf.ready_tokens, ready_groups=buf.groups_ready,
            oldest_ready_age_s=max(0.0, time.time() - oldest) if oldest else None,
            steps=self._observations(version),
            # preemptive rollout for an evaluation that starts now (version 0's too) or is still running
            is_eval_open=self.eval_due(version) or self._evals_open() > 0,
            fetch_groups=previous.fetch_groups if previous else None, last_rollout_change=change,
            stage_times=self._stage_times(), fill_steps=self.system.max_staleness + 1,
            pre_evaluation_roles=self._evaluation_memory.roles,
            engine_ranks=self.store.ranks_with_event("engine_up"),
            inflight_cap=self._inflight_cap)  # the cap the feed keeps now, as the simulator hands it
        return build_signals(snapshot, cfg.ers.history_steps)

    def _ask_engines(self, version: int, ranks: tuple[int, ...]) -> None:
        """Ask the idle ranks of a plan's `warm` to start their engines (engines on demand: the rank reads
        its `engine_wanted` event at the boundary; asked once: a restarted rank reads it again)."""
        asked = self.store.ranks_with_event("engine_wanted", since_start=False) if ranks else frozenset()
        for rank in ranks:
            if rank not in asked:
                log.info("version %d: ERS asks idle rank %d to start its engine (it joins rollout once up)",
                         version, rank)
                self.store.record_event("control", "engine_wanted", f"rank {rank}: start the engine (ERS wants "
                                        f"it in rollout from version {version} on)", rank=rank,
                                        data={"version": version})

    def _observations(self, version: int) -> tuple[ers.StepObservation, ...]:
        """The finished steps up to `version` (the newest HISTORY_FACTOR x history_steps), read from the
        store once each."""
        rows = {r["version"]: r for r in self.store.measure.version_rows()}
        first = version - HISTORY_FACTOR * self.config.ers.history_steps
        wanted = [v for v in range(max(1, first), version + 1) if v in rows]
        for v in wanted:
            if v not in self._observed and v - 1 in rows:
                self._observed[v] = self._observe(v, rows[v - 1], rows[v])
        return tuple(self._observed[v] for v in wanted if v in self._observed)

    def _observe(self, version: int, before: dict, row: dict) -> ers.StepObservation:
        start, end = float(before["created_at"]), float(row["created_at"])
        window = self.store.measure.step_window(version, start, end)
        roles = self.store.roles_at(version - 1)  # the roles of the step that trained version - 1 into `version`
        counts = {role: sum(1 for r in roles.values() if r is role) for role in Role}
        actors = max(1, counts[Role.ACTOR])
        return ers.StepObservation(
            version=version, duration_s=end - start, consumed_tokens=window.consumed_tokens,
            rollout_ranks=counts[Role.ROLLOUT], actor_ranks=counts[Role.ACTOR], ref_ranks=counts[Role.REF],
            produced_tokens=window.produced_tokens, groups_completed=window.groups_completed,
            group_latency_sum_s=window.group_latency_sum_s, group_env_sum_s=window.group_env_sum_s,
            rollout_idle_rank_s=window.rank_s.get(("rollout_idle_s", Role.ROLLOUT.value), 0.0),
            rollout_busy_rank_s=window.rank_s.get(("rollout_busy_s", Role.ROLLOUT.value), 0.0),
            tasks_completed=window.tasks_completed, task_env_sum_s=window.task_env_sum_s,
            task_slot_sum_s=window.task_slot_sum_s, task_wait_sum_s=window.task_wait_sum_s,
            trainer_wait_s=min(end - start, window.rank_s.get(("twt_s", Role.ACTOR.value), 0.0) / actors),
            # The trainer counts readiness in one rank's shares (micro_batch_tokens); ERS and the RA2P
            # cost model in global micro-batches of `actors` shares.
            tprm_s=row["tprm_s"] * actors if row["tprm_s"] is not None else None,
            ras_microbatches=int(row["ras"]) // actors if row["ras"] is not None else 0,
            stale_dropped_tokens=window.stale_dropped_tokens, evaluation=window.evaluation)

    def _stage_times(self) -> StageTimes | None:
        names = ("t_ref_s", "t_act_f_s", "t_act_b_s", "t_swap_s")
        values = self.store.measure.latest_metrics(names)
        return StageTimes(**values) if len(values) == len(names) else None

    def _record_step(self, version: int) -> None:
        steps = [s for s in self.store.steps() if s["version"] == version]
        if not steps or not steps[0]["goodput_tok_s"]:
            return
        self.store.report(RankReport(rank=CONTROL_RANK, metrics=[
            MetricPoint("step_goodput_tok_s", steps[0]["goodput_tok_s"], version, "control")]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiderl.run.control")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    use_private_umask()  # as the launcher's (a Slurm task may not have inherited it)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s control %(levelname)s %(name)s: %(message)s")
    paths = RunPaths(args.run_dir)
    config = load_job(paths.config)
    store = RunStore.for_run_dir(paths.root, config.store)
    plane = ControlPlane(config, store, planned=Bell(paths.bell("planned")))
    published = Bell(paths.bell("published"))
    exporter = MetricsServer.start(paths.root, store, config)  # monitor.metrics_port; docs/observability.md
    board = TensorBoardLog.start(paths.root, store, config)  # monitor.tensorboard
    try:
        while plane.tick():
            if exporter is not None:
                exporter.tick()
            if board is not None:
                board.tick()
            published.wait(TICK_S)  # a publish is planned for (and fed after) at once, not at the next tick
    finally:
        if exporter is not None:
            exporter.close()
        if board is not None:
            board.close()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
