"""The cost of one tick's report (tools/bench_store.py --profile): the SQL statements one
`RunStore.report` sends, and its wall and client-CPU time, one process alone on a fresh store."""

from __future__ import annotations

import random
import time
from pathlib import Path

from store_load import _traj

from tiderl.config.store import StoreConfig
from tiderl.store import ClaimRequest, MetricPoint, NewGroup, RankReport, RankState, Role, RunStore, TaskKind


def profile_reports(run_dir: Path, store_url: str | None, *, reports: int = 200, tokens: int = 512,
                    spread: bool = False, warmup: int = 10) -> dict:
    """What one typical `RunStore.report` costs, one process alone on a fresh store: a rank's tick with one
    finished trajectory of `tokens` tokens (the task it claimed the tick before), a metric, its heartbeat,
    the claim of one task (`spread`: as a real rollout rank claims, with `ClaimRequest.spread`).

    Counts the SQL statements the store sends (SQLAlchemy's `before_cursor_execute`: an executemany is one;
    SQLite's `BEGIN IMMEDIATE` and PostgreSQL's writer lock, `SELECT pg_advisory_xact_lock`, are among them;
    the driver's own BEGIN and COMMIT and the pool's connection check on PostgreSQL are not) and times each
    report: wall and this process's CPU (the client's Python, SQLAlchemy and driver work; the server's own
    CPU is not in it)."""
    from sqlalchemy import event

    run_dir.mkdir(parents=True, exist_ok=True)
    s = RunStore.for_run_dir(run_dir, StoreConfig(url=store_url))
    s.create_schema()
    s.init_run(name="profile", system="tiderl", config_yaml="system: tiderl\n")
    s.register_initial_version("weights/v0", "0")
    s.register_rank(0, Role.ROLLOUT)
    s.set_rank_state(0, RankState.RUNNING)
    group_size = 8
    s.add_groups([NewGroup(TaskKind.TRAIN, i, group_size) for i in range(-(-(reports + warmup + 2) // group_size))])
    statements: list[str] = []

    @event.listens_for(s.engine, "before_cursor_execute")
    def _count(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        statements.append(statement.split(None, 1)[0].upper())

    rng = random.Random(0)
    held: list = []
    walls: list[float] = []
    cpus: list[float] = []
    per_report: list[int] = []
    kinds: dict[str, int] = {}
    claimed = 0
    for i in range(warmup + reports):
        report = RankReport(rank=0, role=Role.ROLLOUT, version=0,
                            finished=[_traj(c.task_id, rng, tokens) for c in held],
                            claim=ClaimRequest(limit=1, weights_version=0, spread=spread),
                            metrics=[MetricPoint("rollout_busy_s", 1.0, 0, "rollout")])
        del statements[:]
        w0, c0 = time.perf_counter(), time.process_time()
        out = s.report(report)
        w1, c1 = time.perf_counter(), time.process_time()
        held = out["claims"]
        if i < warmup:
            continue
        claimed += len(held)
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
        per_report.append(len(statements))
        for k in statements:
            kinds[k] = kinds.get(k, 0) + 1
    s.close()
    walls.sort()
    cpus.sort()
    n = len(walls)
    return {
        "reports": n, "tokens": tokens, "spread": spread, "claimed": claimed,
        "statements_per_report": round(sum(per_report) / n, 2),
        "statements_min_max": [min(per_report), max(per_report)],
        "statement_kinds_per_report": {k: round(v / n, 2) for k, v in sorted(kinds.items())},
        "wall_ms_mean": round(1000 * sum(walls) / n, 2), "wall_ms_p50": round(1000 * walls[n // 2], 2),
        "cpu_ms_mean": round(1000 * sum(cpus) / n, 2), "cpu_ms_p50": round(1000 * cpus[n // 2], 2),
    }
