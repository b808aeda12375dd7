"""The rollout role: one `RolloutWorker` per rank (the `rollout.scheduler`: `ctb` or `vanilla`),
one store transaction per tick (`rollout.report_interval_s`), weight reload at each boundary.

Per tick: test the boundary (a new version published and planned: reload the
weights in place, which drops the prefix cache, and let the scheduler decide
again; leave if the plan gives this rank another role, handing its tasks over
with their progress), release in-flight training tasks that could no longer be
trained within the staleness bound (they restart elsewhere or here with a fresh
prefill), and send one report: finished trajectories, failures, releases,
metrics, task whereabouts and the claim of enough new tasks that the worker
holds up to `rollout.max_concurrency` unfinished ones (it admits them by its
scheduler: CTB by KV token budget, probes and priorities). An evaluation runs on
the weights it evaluates. Each tick observes, asks the pure decisions of
:mod:`tiderl.run.rollout_tick` (which weights to hold, what to claim, how to count
the tick), then acts.
RWT (`rwt_s`) counts the seconds the rank had free slots but nothing to claim
(the feeder holds tasks back for staleness, or the buffer is full), even while
it played other tasks; `rollout_idle_s` counts the seconds it had no task at
all (its accelerator idle: the paper's RWT); `rollout_busy_s` the seconds at least
one of its tasks waited on the engine (ERS's supply rate).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import defaultdict
from typing import NoReturn

from tiderl.config import JobConfig
from tiderl.rollout.agent_loop import Phase, TaskRun
from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import Engine, EngineStats
from tiderl.run.weights import WeightsRejected, WeightsSource, close_weight_server, receive
from tiderl.rollout.local_env import EnvLink
from tiderl.rollout.trajectory import GroupSpec, TaskProgress, TaskSpec, Trajectory
from tiderl.rollout.worker import RolloutWorker, WorkerReport
from tiderl.run.context import RankContext, RunStopped
from tiderl.run.rollout_tick import Versions, WeightsStep, claim_kinds, tick_metric
from tiderl.store.types import (ClaimRequest, EventRecord, FinishedTrajectory, MetricPoint, PlanRecord, RankReport,
                                Role, TaskClaim, TaskFailure, TaskKind, TaskWhereabouts)

log = logging.getLogger(__name__)
STATS_S = 2.0  # how often a rollout rank records its engine and scheduler counters


class RankWorker(RolloutWorker):
    """The worker of a rollout rank; remembers the weights version of each task's first
    generation (the oldest version its trajectory will carry) for the staleness bound."""

    @functools.cached_property
    def first_version(self) -> dict[str, int]:
        """Task id -> the weights version of its first generation."""
        return {}

    async def before_generate(self, run: TaskRun, env: EnvLink) -> None:
        await super().before_generate(run, env)
        # Nothing awaits between here and the engine call: a reload meanwhile only makes
        # the generation newer, so this is a lower bound of the task's versions.
        self.first_version.setdefault(run.spec.task_id, self.engine.weights_version)


class RolloutRole:
    """Store claims in, the worker in between, one `RankReport` per tick out."""

    def __init__(self, cfg: JobConfig, rank: int, engine: Engine, pool: EnvLink, fmt: ChatFormat) -> None:
        from tiderl.rollout.from_config import budget_limits, loop_limits, priority_weights
        from tiderl.rollout.schedulers import make_scheduler

        self.cfg, self.rank = cfg, rank
        self.claims: dict[str, TaskClaim] = {}
        self.finished: list[FinishedTrajectory] = []
        self.failed: list[TaskFailure] = []
        self.given_back: list[int] = []  # tasks that failed on a dead engine
        self.worker = RankWorker(
            engine, pool, fmt, make_scheduler(cfg.rollout.scheduler, priority_weights(cfg)), loop_limits(cfg),
            sink=self._sink, budget_tokens=cfg.rollout.kv_budget_tokens,
            max_resident_tasks=cfg.rollout.max_concurrency, on_failure=self._failed,
            budget_limits=budget_limits(cfg))
        self.runner: asyncio.Task[WorkerReport] | None = None
        self._batches = 0

    def _sink(self, traj: Trajectory) -> None:
        claim = self.claims.pop(traj.task.task_id)
        self.worker.first_version.pop(traj.task.task_id, None)
        found = traj.env_info.get("found")
        self.finished.append(FinishedTrajectory(
            task_id=claim.task_id, token_ids=traj.token_ids, loss_mask=traj.loss_mask, logprobs=traj.logprobs,
            token_versions=traj.versions, num_turns=traj.num_turns, reward=traj.reward,
            success=bool(found) if found is not None else traj.reward > 0, env_s=traj.env_s, finish=traj.finish or None,
            images=tuple(i.data for i in traj.images), prunes=tuple(traj.prunes), env=traj.task.env))

    def _failed(self, spec: TaskSpec, error: BaseException) -> None:
        claim = self.claims.pop(spec.task_id)
        self.worker.first_version.pop(spec.task_id, None)
        if self.worker.engine.failure is not None:  # not the task's fault: it goes back, no attempt counted
            self.given_back.append(claim.task_id)
        else:
            self.failed.append(TaskFailure(claim.task_id, f"{type(error).__name__}: {error}"))

    def add(self, claims: list[TaskClaim]) -> None:
        """Claims -> worker groups. Tasks of one store group claimed together form one worker
        group (CTB probes one of them first); a later claim of the same store group is a
        new worker group, since a worker group is added once."""
        cfg = self.cfg
        by_group: dict[int, list[TaskSpec]] = defaultdict(list)
        self._batches += 1
        for claim in claims:
            progress = TaskProgress.from_json(claim.progress) if claim.progress else None
            spec = TaskSpec(task_id=str(claim.task_id), group_id=f"{claim.group_id}#{self._batches}",
                            env=cfg.env.name, seed=claim.seed, options=dict(cfg.env.options),
                            is_eval=claim.kind is TaskKind.EVAL, eval_version=claim.eval_version,
                            task_type=cfg.env.name, progress=progress)
            self.claims[spec.task_id] = claim
            if progress is not None and progress.first_version is not None:
                self.worker.first_version[spec.task_id] = progress.first_version
            by_group[claim.group_id].append(spec)
        self.worker.add_groups(GroupSpec(group_id=specs[0].group_id, tasks=tuple(specs))
                               for specs in by_group.values())
        if self.runner is None or self.runner.done():
            self._check_runner()
            self.runner = asyncio.create_task(self.worker.run(), name=f"rollout worker of rank {self.rank}")

    def _check_runner(self) -> None:
        if self.runner is not None and self.runner.done() and not self.runner.cancelled():
            error = self.runner.exception()
            if error is not None:
                raise error

    def holds_evaluation(self, version: int) -> bool:
        """Whether unfinished evaluation tasks of weights `version` are on this rank."""
        return any(c.kind is TaskKind.EVAL and c.eval_version == version for c in self.claims.values())

    def stale(self, bound: int) -> list[str]:
        """Training tasks in flight whose first generation is older than `bound`."""
        return [tid for tid, v in self.worker.first_version.items()
                if v < bound and tid in self.claims and self.claims[tid].kind is TaskKind.TRAIN]

    async def release(self, report: RankReport, task_ids: list[str] | None = None, *, handoff: bool = False) -> None:
        """Abandon these tasks (default: all) and give them back to the pool in `report`. With
        `handoff`, tasks stopped at a turn boundary keep their env session and go back with
        their progress, so the next rank carries them on (a fresh prefill, no replay)."""
        for spec, progress in await self.worker.abandon(task_ids, handoff=handoff):
            self.worker.first_version.pop(spec.task_id, None)
            claim = self.claims.pop(spec.task_id, None)
            if claim is None:  # it failed as it stopped (on a dead engine): `_failed` gave it back already
                continue
            task_id = claim.task_id
            report.released.append(task_id)
            if progress is not None:
                report.handed_over[task_id] = progress.to_json()

    def drain(self, report: RankReport) -> None:
        self._check_runner()
        report.finished += self.finished
        report.failed += self.failed
        report.released += self.given_back
        self.finished, self.failed, self.given_back = [], [], []

    async def close(self) -> None:
        if self.runner is not None and not self.runner.done():
            self.runner.cancel()
            await asyncio.gather(self.runner, return_exceptions=True)


def _weights(ctx: RankContext) -> WeightsSource:
    return WeightsSource(ctx.store, ctx.paths.weights, ctx.model_dir)


def rank_engine(ctx: RankContext) -> Engine:
    """The rank's engine (`rollout.engine`), built once from the job config and kept across role changes.
    Built on the base model (version 0, which the trainer never prunes): an engine takes a while to
    start (a minute on a shared CPU host), longer than the trainer keeps a version's files while it
    publishes (a rank that joined rollout late once chased pruned versions for the rest of the run);
    the caller then reloads the weights it plans to hold, a reload's cost."""
    from tiderl.rollout.from_config import make_engine

    if ctx.engine is None:
        t0 = time.monotonic()
        base = _weights(ctx).path(0)
        built = make_engine(ctx.config, base, weights_version=0)
        up_s = time.monotonic() - t0
        log.info("rank %d: %s engine up in %.1f s (the base model)", ctx.rank, ctx.config.rollout.engine, up_s)
        ctx.store.record_event(f"rank{ctx.rank}", "engine_up", f"rank {ctx.rank}: engine up in {up_s:.1f} s",
                               rank=ctx.rank, data={"seconds": round(up_s, 3)})
        ctx.engine = built
    return ctx.engine


async def release_engine(ctx: RankContext) -> None:
    """A rank that leaves rollout for the trainer frees what its engine holds on the accelerator (weights and
    KV cache, vLLM's sleep mode: a GPU), so that the actor or the reference fits there; an engine that cannot
    (a CPU) keeps them. The event `engine_released` records it."""
    engine = ctx.engine
    if engine is None or engine.memory_released:
        return
    t0 = time.monotonic()
    if await engine.release_memory():
        seconds = time.monotonic() - t0
        log.info("rank %d: engine memory released for the trainer (%.2f s)", ctx.rank, seconds)
        ctx.store.record_event(f"rank{ctx.rank}", "engine_released", f"rank {ctx.rank}: engine memory released "
                               f"for the trainer in {seconds:.2f} s", rank=ctx.rank, data={"seconds": round(seconds, 3)})


async def _restore(ctx: RankContext, engine: Engine) -> None:
    """Back in rollout: the engine takes its memory back (the weights it held, an empty KV cache)."""
    if engine.memory_released:
        t0 = time.monotonic()
        await engine.restore_memory()
        seconds = time.monotonic() - t0
        ctx.store.record_event(f"rank{ctx.rank}", "engine_restored", f"rank {ctx.rank}: engine memory restored "
                               f"in {seconds:.2f} s", rank=ctx.rank, data={"seconds": round(seconds, 3)})


async def _reload(ctx: RankContext, engine: Engine, version: int, report: RankReport) -> int | None:
    """Reload the engine with the weights of `version` (or newer, where it was pruned); returns the
    version it holds then, or None where `version` was rejected (the engine keeps its weights). With
    `trainer.weight_sync: transfer` the engine first asks the trainer leader's server, and reads the
    files only where that fails while the run goes on (raises RunStopped where it has ended: the leader
    stopped its server)."""
    if ctx.config.trainer.weight_sync == "transfer" and version > 0 and engine.receives_weights:
        got = await receive(ctx, engine, version)
        if isinstance(got, int):
            return got
        # The leader stops its server when the run ends: a rank that asks after that has nothing to load.
        ctx.position()  # raises RunStopped once the run is over
        report.events.append(EventRecord("weights_transfer_failed", f"rank {ctx.rank}: weights v{version} not "
                                          f"received ({got[:300]}); loading the files", {"version": version}))
        log.warning("rank %d: weights v%d not received (%s); loading the files", ctx.rank, version, got)
    try:
        weights = await _weights(ctx).aload(version, lambda w: engine.reload_weights(w.path, w.version))
    except WeightsRejected as e:
        report.events.append(EventRecord("weights_rejected", f"rank {ctx.rank}: {e}; keeping "
                                          f"v{engine.weights_version}", {"version": version}))
        log.error("rank %d: %s; keeping weights v%d", ctx.rank, e, engine.weights_version)
        return None
    if weights.version != weights.asked:
        report.events.append(EventRecord("weights_newer", f"rank {ctx.rank}: weights v{weights.asked} were "
                                          f"pruned; it loaded v{weights.version}"))
    return weights.version


def _chat(ctx: RankContext) -> ChatFormat:
    from tiderl.rollout.from_config import chat_format

    if ctx.chat is None:
        ctx.chat = chat_format(str(ctx.model_dir), ctx.config.model)
    return ctx.chat


def _pool(ctx: RankContext) -> EnvLink:
    from tiderl.envs.launch import make_pool

    if ctx.pool is None:
        ctx.pool = make_pool(ctx.config.env, ctx.env_urls, ctx.paths.root)
    return ctx.pool


async def run_rollout(ctx: RankContext, plan: PlanRecord) -> PlanRecord | None:
    """Roll out from `plan.version` on; returns the plan of the first version that moves this rank
    to another role (None: the run stopped)."""
    cfg = ctx.config
    close_weight_server(ctx)  # a rank that led the trainer before: the next leader serves the weights
    engine = rank_engine(ctx)
    await _restore(ctx, engine)
    report = RankReport(rank=ctx.rank, role=Role.ROLLOUT, version=plan.version)
    if engine.weights_version < plan.version:
        await _reload(ctx, engine, plan.version, report)
    role = RolloutRole(cfg, ctx.rank, engine, _pool(ctx), _chat(ctx))
    # Which weights to hold, what to claim: tiderl.run.rollout_tick (an evaluation runs on the weights
    # it evaluates). The engine may hold weights newer than the plan (the planned ones were pruned) or
    # older (rejected: damaged files).
    v = Versions(held=engine.weights_version, planned=plan.version)
    stats = RolloutStats(ctx.rank)
    last = time.monotonic()
    try:
        while True:
            await asyncio.sleep(cfg.rollout.report_interval_s)
            # Observe: the tick's time, the worker's results, the boundary.
            now = time.monotonic()
            tick_s, last = now - last, now
            metric = tick_metric(role.worker.num_unfinished, role.worker.num_generating)
            if metric is not None:
                report.metrics.append(MetricPoint(metric.value, tick_s, v.held, "rollout"))
            role.drain(report)
            if engine.failure is not None:
                await _engine_failed(ctx, role, report, v.held, engine.failure)
            stats.observe(role)
            nxt = ctx.boundary(v.planned)
            if nxt is not None:
                if nxt.roles.get(ctx.rank) is not Role.ROLLOUT:
                    await role.release(report, handoff=True)  # carried on by the ranks still rolling out
                    role.drain(report)
                    report.events.append(EventRecord("role_switch", f"rank {ctx.rank}: rollout -> "
                                                     f"{nxt.roles[ctx.rank].value} at version {nxt.version}"))
                    await stats.add_to(report, role, engine, v.held)
                    _send(ctx, report, nxt.version, nxt.roles[ctx.rank])
                    return nxt
                v = v.at_boundary(nxt.version)
                await role.release(report, role.stale(v.stale_bound(ctx.system.max_staleness)))
                role.drain(report)
            # Decide and act: the weights.
            step, v = v.weights_step(role.holds_evaluation(v.held))
            if step is WeightsStep.KEEP:
                report.events.append(EventRecord("weights_kept", f"rank {ctx.rank} keeps weights v{v.held} "
                                                 f"past v{v.planned} for its evaluation tasks"))
            elif step is WeightsStep.RELOAD:
                t0 = time.monotonic()
                try:
                    loaded = await _reload(ctx, engine, v.planned, report)
                except Exception:
                    if engine.failure is None:
                        raise
                    await _engine_failed(ctx, role, report, v.held, engine.failure)  # a load that left a mix
                v = v.reloaded(loaded)
                if loaded is not None:
                    report.metrics.append(MetricPoint("reload_s", time.monotonic() - t0, loaded, "rollout"))
                    update = getattr(engine, "last_update", None)
                    if update is not None and update.version == loaded:  # how long its requests stood still
                        report.metrics.append(MetricPoint(f"weights_{update.path}_stall_s", update.stall_s, loaded,
                                                          "rollout"))
                        if update.via:  # a transfer: mapped from the leader's shared memory, or sent
                            report.metrics.append(MetricPoint(f"weights_{update.via}_bytes", float(update.nbytes),
                                                              loaded, "rollout"))
                    evals = [tid for tid, c in role.claims.items() if c.kind is TaskKind.EVAL]
                    await role.release(report, evals)  # they may only run on the weights they evaluate
                    role.worker.poke()  # new weights, fewer tasks: the scheduler decides again
                    role.drain(report)
            # The claim, in the tick's one transaction, after its releases.
            free = cfg.rollout.max_concurrency - role.worker.num_unfinished
            if free > 0:
                report.claim = ClaimRequest(limit=free, kinds=claim_kinds(v), weights_version=v.held, spread=True)
            if stats.due(now):
                await stats.add_to(report, role, engine, v.held)
            claims = _send(ctx, report, v.held, Role.ROLLOUT)
            starved = report.claim is not None and not claims
            if claims:
                role.add(claims)
            report = RankReport(rank=ctx.rank, role=Role.ROLLOUT, version=v.held)
            if starved:  # free slots and nothing to claim: the rank waited this tick
                report.metrics.append(MetricPoint("rwt_s", tick_s, v.held, "rollout"))
    except RunStopped:
        await role.release(report)
        role.drain(report)
        await stats.add_to(report, role, engine, v.held)
        if not report.is_empty():
            _send(ctx, report, v.held, Role.ROLLOUT)
        return None
    finally:
        await role.close()


class EngineFailed(RuntimeError):
    """The rank's engine died: the rank ends (its tasks given back) and the launcher starts it afresh."""


async def _engine_failed(ctx: RankContext, role: RolloutRole, report: RankReport, version: int,
                         failure: BaseException) -> NoReturn:
    """The engine can generate nothing more (vLLM failed on a request, its process died, an update left a mix
    of weights): every task of the rank goes back to the pool in this tick's report, with no attempt counted,
    and the rank ends (raises EngineFailed), so that a fresh start takes its place. A rank that stayed up
    would claim tasks only to fail them."""
    await role.release(report)
    role.drain(report)
    message = f"rank {ctx.rank}: its engine failed ({type(failure).__name__}: {str(failure)[:300]}); " \
              f"{len(report.released)} tasks given back, the rank ends"
    report.events.append(EventRecord("engine_failed", message, {"tasks": len(report.released)}))
    log.error("%s", message)
    _send(ctx, report, version, Role.ROLLOUT)
    raise EngineFailed(message) from failure


class RolloutStats:
    """Every `STATS_S` seconds, the rank's rollout counters since the last sample as metrics:
    the engine's prefix-cache queries and hits (vLLM's own counters), prompt and generated
    tokens, preemptions, its KV usage, and CTB's pauses and resumes with the tasks resident
    and paused now."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.next_at = time.monotonic() + STATS_S
        self.engine_before: EngineStats | None = None
        self.pauses = self.resumes = self.admitted = self.kept = self.evicted = 0
        self.phases: dict[str, tuple[Phase, float]] = {}  # task -> (phase, since when, Unix s)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def observe(self, role: "RolloutRole") -> None:
        """Note every running task's phase changes (called each tick)."""
        now = time.time()
        runs = role.worker.running()
        self.phases = {tid: (run.phase, self.phases[tid][1] if tid in self.phases and
                             self.phases[tid][0] is run.phase else now) for tid, run in runs.items()}

    def whereabouts(self, role: "RolloutRole") -> list[TaskWhereabouts]:
        out = []
        for tid, run in role.worker.running().items():
            claim = role.claims.get(tid)
            if claim is None or tid not in self.phases:
                continue
            phase, since = self.phases[tid]
            out.append(TaskWhereabouts(task_id=claim.task_id, turn=run.num_turns, phase=_PHASE_NAMES[phase],
                                       phase_since=since, env_server=role.worker.server_of(run)))
        return out

    async def add_to(self, report: RankReport, role: "RolloutRole", engine: Engine, version: int) -> None:
        self.next_at = time.monotonic() + STATS_S
        stats = await engine.stats()
        delta = stats if self.engine_before is None else stats.minus(self.engine_before)
        self.engine_before = stats
        w = role.worker
        points = {"prefix_cache_queries": delta.prefix_cache_queries, "prefix_cache_hits": delta.prefix_cache_hits,
                  "prompt_tokens": delta.prompt_tokens, "generation_tokens": delta.generation_tokens,
                  "preemptions": delta.num_preemptions, "kv_usage": stats.kv_usage,
                  "ctb_pauses": w.report.num_pauses - self.pauses, "ctb_resumes": w.report.num_resumes - self.resumes,
                  "tasks_resident": w.num_resident, "tasks_paused": w.num_paused,
                  "ctb_admitted": w.report.num_admitted - self.admitted,
                  "ctb_prefix_kept": w.report.prefix_kept_turns - self.kept,
                  "ctb_prefix_evicted": w.report.prefix_evicted_turns - self.evicted,
                  "ctb_budget_tokens": w.budget_tokens}
        self.pauses, self.resumes = w.report.num_pauses, w.report.num_resumes
        self.admitted, self.kept, self.evicted = (w.report.num_admitted, w.report.prefix_kept_turns,
                                                  w.report.prefix_evicted_turns)
        report.metrics += [MetricPoint(name, value, version, "rollout") for name, value in points.items()]
        report.whereabouts += self.whereabouts(role)


_PHASE_NAMES = {Phase.STARTING: "env", Phase.GENERATING: "generate", Phase.WAITING_ENV: "env",
                Phase.PAUSED: "paused", Phase.FINISHED: "env"}


def _send(ctx: RankContext, report: RankReport, version: int, role: Role) -> list[TaskClaim]:
    report.version, report.role = version, role
    r = ctx.config.rollout
    result = ctx.store.report(report, max_attempts=r.task_attempts, retry_backoff_s=r.retry_backoff_s)
    if result["accepted"]:
        ctx.bell("finished").ring()  # a group may be complete: the actor gathering a step looks now
    return result["claims"]
