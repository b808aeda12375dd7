"""The rollout role: engine + agent loops, reporting once per tick, weight reload at each boundary.

Per tick: test the boundary (a new version published and planned: reload the
weights in place, which drops the prefix cache; leave if the plan gives this
rank another role), release in-flight training tasks that could no longer be
trained within the staleness bound (they restart elsewhere or here with a
fresh prefill), claim tasks up to the concurrency cap, and send one report
(finished trajectories, failures, releases, RWT) in one transaction.
RWT counts the seconds the rank had free slots but nothing to claim (the
feeder holds tasks back for staleness, or the buffer is full).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from tiderl.run.agent import AgentSettings, Episode, play_task
from tiderl.run.context import RankContext, RunStopped
from tiderl.run.plan_io import VersionPlan
from tiderl.store.types import (EventRecord, FinishedTrajectory, MetricPoint, RankReport, Role, TaskClaim,
                                TaskFailure, TaskKind)

log = logging.getLogger(__name__)
TICK_S = 0.25


@dataclass
class Running:
    claim: TaskClaim
    episode: Episode
    task: asyncio.Task[FinishedTrajectory]


def _engine(ctx: RankContext, version: int) -> Any:
    """The rank's vLLM engine, built once from the job config and kept across role changes."""
    from tiderl.rollout.from_config import vllm_engine

    engine = ctx.cache.get("engine")
    if engine is None:
        t0 = time.monotonic()
        engine = vllm_engine(ctx.config, ctx.weights_dir(version), weights_version=version)
        log.info("rank %d: vLLM engine up in %.1f s (weights v%d)", ctx.rank, time.monotonic() - t0, version)
        ctx.cache["engine"] = engine
    return engine


def _chat(ctx: RankContext):
    from transformers import AutoTokenizer

    from tiderl.rollout.chat import ChatFormat

    if "chat" not in ctx.cache:
        ctx.cache["chat"] = ChatFormat(AutoTokenizer.from_pretrained(str(ctx.model_dir)))
    return ctx.cache["chat"]


def _pool(ctx: RankContext):
    from tiderl.envs.launch import make_pool

    if "pool" not in ctx.cache:
        ctx.cache["pool"] = make_pool(ctx.config.env, ctx.env_urls)
    return ctx.cache["pool"]


async def run_rollout(ctx: RankContext, plan: VersionPlan) -> VersionPlan | None:
    """Roll out from `plan.version` on; returns the plan of the first version that moves this rank
    to another role (None: the run stopped)."""
    cfg = ctx.config
    engine = _engine(ctx, plan.version)
    if engine.weights_version != plan.version:
        await engine.reload_weights(ctx.weights_dir(plan.version), plan.version)
    fmt, pool = _chat(ctx), _pool(ctx)
    train = AgentSettings(cfg.env.name, dict(cfg.env.options), cfg.env.max_turns, cfg.model.max_context_tokens,
                          cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    evaluate = replace(train, temperature=cfg.rollout.eval_temperature)
    version = plan.version
    running: dict[int, Running] = {}
    report = RankReport(rank=ctx.rank, role=Role.ROLLOUT, version=version)
    last = time.monotonic()
    try:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            tick_s, last = now - last, now
            for tid, r in list(running.items()):
                if not r.task.done():
                    continue
                del running[tid]
                error = r.task.exception()
                if error is None:
                    report.finished.append(r.task.result())
                else:
                    report.failed.append(TaskFailure(tid, f"{type(error).__name__}: {error}"))
            nxt = ctx.boundary(version)
            if nxt is not None:
                if nxt.roles.get(ctx.rank) is not Role.ROLLOUT:
                    report.released += _cancel(running, list(running))
                    report.events.append(EventRecord("role_switch", f"rank {ctx.rank}: rollout -> "
                                                     f"{nxt.roles[ctx.rank].value} at version {nxt.version}"))
                    _send(ctx, report, nxt.version, nxt.roles[ctx.rank])
                    return nxt
                t0 = time.monotonic()
                await engine.reload_weights(ctx.weights_dir(nxt.version), nxt.version)
                version = nxt.version
                report.metrics.append(MetricPoint("reload_s", time.monotonic() - t0, version, "rollout"))
                bound = version - ctx.system.max_staleness
                stale = [tid for tid, r in running.items() if r.claim.kind is TaskKind.TRAIN
                         and r.episode.min_version is not None and r.episode.min_version < bound]
                report.released += _cancel(running, stale)
            free = cfg.rollout.max_concurrency - len(running)
            if free > 0:
                claims = ctx.store.claim_tasks(ctx.rank, free)
                for claim in claims:
                    ep = Episode()
                    running[claim.task_id] = Running(claim, ep, asyncio.create_task(
                        play_task(claim, engine, pool, fmt, evaluate if claim.kind is TaskKind.EVAL else train, ep)))
                if not claims and len(running) < cfg.rollout.max_concurrency:
                    report.metrics.append(MetricPoint("rwt_s", tick_s, version, "rollout"))
            _send(ctx, report, version, Role.ROLLOUT)
            report = RankReport(rank=ctx.rank, role=Role.ROLLOUT, version=version)
    except RunStopped:
        report.released += _cancel(running, list(running))
        if not report.is_empty():
            _send(ctx, report, version, Role.ROLLOUT)
        return None
    finally:
        for r in running.values():
            r.task.cancel()


def _cancel(running: dict[int, Running], ids: list[int]) -> list[int]:
    """Stop these tasks; those that had not finished go back to the pool (a finished one is reported)."""
    released = []
    for tid in ids:
        r = running.pop(tid)
        r.task.cancel()
        released.append(tid)
    return released


def _send(ctx: RankContext, report: RankReport, version: int, role: Role) -> None:
    report.version, report.role = version, role
    ctx.store.report(report)
