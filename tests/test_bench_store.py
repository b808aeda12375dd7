"""tools/bench_store.py, so that the store benchmark cannot rot: its figures from the processes' logs, and
the tool itself at a tiny size (it runs, drives the real store from processes, and prints one JSON line per
(backend, ranks) with the figures docs/RESULTS.md cites)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_store import summarize
from store_load_profile import profile_reports
from store_load_ranks import RankLoadSpec, run_rank_load

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("backend", "ranks", "need_commits_per_s", "sustained_commits_per_s", "kept_up", "p50_ms", "p99_ms",
          "tick_lag_p99_ms", "capacity_commits_per_s", "headroom", "errors", "processes_ok", "loadavg_before",
          "loadavg_after", "date")


def check_row(row: dict, ranks: int) -> None:
    assert all(k in row for k in FIELDS), sorted(set(FIELDS) - set(row))
    assert row["ranks"] == ranks
    # ranks / tick_s + ranks / heartbeat_s, plus the control plane's watch and the trainer's claims (~1/s each)
    assert ranks < row["need_commits_per_s"] < ranks + 5, row  # a tick each; their reports beat for them
    assert row["sustained_commits_per_s"] > 0 and row["capacity_commits_per_s"] > 0, row
    assert 0 < row["p50_ms"] <= row["p99_ms"], row
    assert row["headroom"] == pytest.approx(row["capacity_commits_per_s"] / row["need_commits_per_s"], rel=0.02)
    assert row["errors"] == 0 and row["processes_ok"], row
    assert row["task_claims"] > 0, "no rank claimed a task"


def test_summarize_figures() -> None:
    """Need, sustained, latency, capacity and headroom from the processes' logs (pure: no store)."""
    spec = RankLoadSpec(run_dir="-", num_ranks=2, warmup_s=1.0, open_s=10.0, closed_s=6.0)
    (o0, o1), (c0, c1) = spec.open_window, spec.closed_window
    t0 = 1000.0
    # Each rank: one 10 ms report a second and one 20 ms heartbeat every 2 s in the open window, plus one
    # report before it (warm-up, not counted); 40 reports a second in the closed window.
    rank_writes = [[t0 + 0.5, 0.01, "report"]] + [[t0 + o0 + i + 0.1, 0.01, "report"] for i in range(10)] + \
        [[t0 + o0 + 2 * i + 0.2, 0.02, "heartbeat"] for i in range(5)] + \
        [[t0 + c0 + i / 40, 0.005, "report"] for i in range(int((c1 - c0) * 40))]
    log = {"lags": [[t0 + o0 + i, 0.001] for i in range(10)], "claims": 10, "starved": 0, "errors": []}
    res = {"t0": t0, "setup_s": 1.0, "num_workers": 2, "exit_codes": [0, 0, 0, 0], "results": [
        {"role": "ranks", "logs": [log | {"writes": rank_writes}], "retries": 0},
        {"role": "ranks", "logs": [log | {"writes": rank_writes}], "retries": 1},
        {"role": "control", "logs": [log | {"writes": [[t0 + o0 + i, 0.01, "watch"] for i in range(10)]}]},
        {"role": "trainer", "logs": [log | {"writes": []}]}]}
    row = summarize(spec, res)
    assert row["need_commits_per_s"] == 2 * 1.0 + 1.0  # 2 ranks x 1 tick (their reports beat for them) + the watch
    assert row["sustained_commits_per_s"] == 4.0 and row["kept_up"]
    assert (row["p50_ms"], row["p99_ms"]) == (10.0, 20.0)
    assert row["capacity_commits_per_s"] == 80.0 and row["headroom"] == pytest.approx(80.0 / 3, abs=0.01)
    assert row["lock_retries"] == 1 and row["errors"] == 0 and row["processes_ok"]


@pytest.mark.slow  # 10-27 s, by the machine's load
def test_bench_store_tiny_sqlite(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_store.py"), "--ranks", "4", "--backends",
                          "sqlite-local", "--workers", "1", "--warmup-s", "0.3", "--open-s", "1.5", "--closed-s", "2",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, run.stdout
    assert rows[0]["backend"] == "sqlite-local"
    check_row(rows[0], 4)
    assert len(rows[0]["loadavg_before"]) == 3


@pytest.mark.slow  # 20-35 s on a loaded 2-core machine
@pytest.mark.postgres
def test_rank_load_tiny_postgresql(pg_server, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = RankLoadSpec(run_dir=str(run_dir), num_ranks=4, num_workers=2, warmup_s=0.5, open_s=2, closed_s=2,
                        store_url=pg_server.url)
    (tmp_path / "out").mkdir()
    row = {"backend": "postgresql", "ranks": 4, **summarize(spec, run_rank_load(spec, tmp_path / "out")),
           "loadavg_before": [0, 0, 0], "loadavg_after": [0, 0, 0], "date": "-"}
    check_row(row, 4)
    assert not (run_dir / "run.db").exists(), "the ranks wrote to SQLite, not to the PostgreSQL store"


def test_profile_counts_the_statements_and_times_of_a_report(tmp_path: Path) -> None:
    """`--profile`: statements and ms (wall, client CPU) per typical report, on a fresh store in this process."""
    row = profile_reports(tmp_path / "run", None, reports=16, tokens=64, warmup=2)
    assert row["reports"] == 16 and row["claimed"] == 16  # one task claimed per report, each finished the next
    # A tick completing no group: 7 (BEGIN, heartbeat, done+owned, trajectory, completion check, metric, claim);
    # every 8th completes its group of 8 (advantages: a SELECT and two UPDATEs more).
    assert row["statements_min_max"] == [7, 10], row
    assert row["statement_kinds_per_report"]["BEGIN"] == 1.0
    assert 0 < row["cpu_ms_mean"] and 0 < row["wall_ms_mean"]
    spread = profile_reports(tmp_path / "run-spread", None, reports=8, tokens=64, warmup=2, spread=True)
    assert spread["statements_min_max"][0] == 8  # the rank's share: one statement of four counts
