"""The run store at 32, 128, 512 ranks: commits/s sustained at the ranks' own pace, commit latency, and
headroom (capacity / need), on SQLite on local disk, SQLite on JuiceFS and PostgreSQL.

    .venv/bin/python tools/bench_store.py --ranks 32,128,512 [--backends sqlite-local,sqlite-juicefs,postgresql]
        [--tick-s 1.0] [--heartbeat-s 2.0] [--workers 32] [--open-s 15] [--closed-s 10]
        [--pg-synchronous-commit off] [--pg-url postgresql+psycopg://USER@HOST:PORT/DB]

Prints one JSON line per (backend, ranks), with the load average before and after it.

    .venv/bin/python tools/bench_store.py --profile 200 [--backends sqlite-local,postgresql] [--tokens 512]

instead times N reports of one typical tick in this process alone, on a fresh store per backend
(`store_load_profile.profile_reports`): SQL statements per report, wall and client-CPU ms per report, one
JSON line per (backend, plain or spread claim).

What it drives (tools/store_load_ranks.py, `run_rank_load`): the real `RunStore`, through the public methods a
rank, the control plane and a trainer call, from real processes. 512 Python processes with SQLAlchemy do
not fit on a small machine, so a fixed pool of `--workers` processes plays the ranks, each rank a thread
with its own RunStore (its own engine and connection: its own SQLite file handle, its own PostgreSQL
session) and its own schedule. Every rank tick is its own transaction (`RunStore.report`: heartbeat,
the trajectories of the tasks claimed last tick, a metric, the claim of the next tasks), after a read of
the run's position; every rank also beats every `--heartbeat-s` on its own, as a rank's heartbeat thread
does (a write of its own). One control-plane process reads the run's position and group counts every
0.2 s, writes its heartbeat watch (`reclaim_expired`) once a second (from when every rank has beaten
since the start: setting up hundreds of ranks takes longer than the heartbeat timeout) and feeds groups;
one trainer claims ready groups once a second and publishes a version every 10 s. What differs from N real ranks: the
Python work of the ranks of one process shares one interpreter lock, and all of it shares this machine's
CPUs with the database (on a cluster the ranks run elsewhere): capacity here is a lower bound.

- need: ranks / tick_s (+ ranks / heartbeat_s where the tick is not shorter than the heartbeat period: a
  rank's heartbeat thread writes only when no report beat for it), plus the control plane's and
  trainer's writes per second.
- Open loop (`--open-s`, after `--warmup-s`): every rank at its own phase and period, late ticks not
  skipped. `sustained_commits_per_s`: write transactions that ended in the window; `kept_up`: sustained
  >= 95% of the need; `p50_ms`/`p99_ms`: the ranks' commit latency (call to return, lock waits and
  retries included); `tick_lag_p99_ms`: how late ticks started (a store that cannot keep up shows here).
- Closed loop (`--closed-s`): the same mix (a heartbeat every heartbeat_s / tick_s ticks) back to back
  on every rank, flat out: `capacity_commits_per_s`. `headroom` = capacity / need.

PostgreSQL runs on a server this tool starts (tools/pg_server.py), or on `--pg-url`. The server it
starts has fsync and full-page writes on (a real server's durability) and `synchronous_commit` as
`--pg-synchronous-commit` says: `off` (default) loses at most the last fraction of a second of commits
if the server's machine crashes, never corrupts, like SQLite's WAL with synchronous=NORMAL, which the
store uses on local disk; `on` waits for a disk flush per commit, and the store's writers of one run
take turns (an advisory lock), so one flush at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jfs_mount import JuiceFSUnavailable, juicefs_mount  # noqa: E402
from pg_server import PostgresUnavailable, postgres_server  # noqa: E402
from store_load_profile import profile_reports  # noqa: E402
from store_load_ranks import RankLoadSpec, run_rank_load  # noqa: E402

BACKENDS = ("sqlite-local", "sqlite-juicefs", "postgresql")
KEPT_UP = 0.95  # sustained / need at or above which the store kept up with the ranks


def percentile_ms(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of `values` (seconds), in ms."""
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered))) - 1))], 1)


def summarize(spec: RankLoadSpec, res: dict) -> dict:
    """The figures of one run of `run_rank_load`: need, sustained, latency, capacity, headroom."""
    t0 = res["t0"]
    (o0, o1), (c0, c1) = ((t0 + a, t0 + b) for a, b in (spec.open_window, spec.closed_window))
    rank_logs = [lg for r in res["results"] if r["role"] == "ranks" for lg in r["logs"]]
    other_logs = [lg for r in res["results"] if r["role"] != "ranks" for lg in r["logs"]]

    def ended(logs: list[dict], a: float, b: float) -> list[list]:
        return [w for lg in logs for w in lg["writes"] if a <= w[0] < b]

    background_per_s = len(ended(other_logs, o0, o1)) / spec.open_s
    # A rank's heartbeat thread writes only where its reports did not beat within heartbeat_s.
    beats = spec.num_ranks / spec.heartbeat_s if spec.tick_s >= spec.heartbeat_s else 0.0
    need = spec.num_ranks / spec.tick_s + beats + background_per_s
    sustained = len(ended(rank_logs + other_logs, o0, o1)) / spec.open_s
    capacity = len(ended(rank_logs + other_logs, c0, c1)) / (c1 - c0)
    open_lat = [w[1] for w in ended(rank_logs, o0, o1)]
    closed_lat = [w[1] for w in ended(rank_logs, c0, c1)]
    lags = [lag for lg in rank_logs for ts, lag in lg["lags"] if o0 <= ts < o1]
    errors = [e for lg in rank_logs + other_logs for e in lg["errors"]]
    return {
        "processes": res["num_workers"] + 2,
        "rank_threads_per_process": -(-spec.num_ranks // res["num_workers"]),
        "tick_s": spec.tick_s,
        "heartbeat_s": spec.heartbeat_s,
        "need_commits_per_s": round(need, 1),
        "sustained_commits_per_s": round(sustained, 1),
        "kept_up": sustained >= KEPT_UP * need,
        "p50_ms": percentile_ms(open_lat, 50),
        "p99_ms": percentile_ms(open_lat, 99),
        "tick_lag_p99_ms": percentile_ms(lags, 99),
        "capacity_commits_per_s": round(capacity, 1),
        "capacity_p50_ms": percentile_ms(closed_lat, 50),
        "capacity_p99_ms": percentile_ms(closed_lat, 99),
        "headroom": round(capacity / need, 2),
        "task_claims": sum(lg["claims"] for lg in rank_logs),
        "starved_ticks": sum(lg["starved"] for lg in rank_logs),
        "lock_retries": sum(r.get("retries", 0) for r in res["results"]),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "processes_ok": all(c == 0 for c in res["exit_codes"]),
        "setup_s": round(res["setup_s"], 1),
    }


def measure(backend: str, ranks: int, run_dir: Path, store_url: str | None, args: argparse.Namespace) -> dict:
    spec = RankLoadSpec(run_dir=str(run_dir), num_ranks=ranks, num_workers=args.workers, tick_s=args.tick_s,
                        heartbeat_s=args.heartbeat_s, tasks_per_tick=args.tasks_per_tick,
                        traj_tokens=args.tokens, warmup_s=args.warmup_s, open_s=args.open_s,
                        closed_s=args.closed_s, store_url=store_url)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    with tempfile.TemporaryDirectory() as out:
        res = run_rank_load(spec, Path(out))
    row = {"backend": backend, "ranks": ranks, **summarize(spec, res)}
    if backend == "postgresql":
        row["pg_synchronous_commit"] = "server's own" if args.pg_url else args.pg_synchronous_commit
    row |= {"wall_s": round(time.time() - started, 1), "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="32,128,512", help="Comma-separated rank counts.")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"Comma-separated, of {', '.join(BACKENDS)}.")
    p.add_argument("--workers", type=int, default=32, help="Processes playing the ranks (threads in each).")
    p.add_argument("--tick-s", type=float, default=1.0, help="A rank's report period (rollout.report_interval_s).")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="A rank's heartbeat period (launch.heartbeat_s).")
    p.add_argument("--tasks-per-tick", type=int, default=1, help="Tasks each rank finishes and claims per tick.")
    p.add_argument("--tokens", type=int, default=512, help="Tokens per reported trajectory.")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--open-s", type=float, default=15.0, help="Open-loop phase (at the need), measured.")
    p.add_argument("--closed-s", type=float, default=10.0, help="Closed-loop phase (flat out); its first second "
                   "is not measured.")
    p.add_argument("--pg-synchronous-commit", choices=("on", "off"), default="off",
                   help="synchronous_commit of the server this tool starts.")
    p.add_argument("--pg-url", default=None, help="Benchmark this PostgreSQL database (postgresql+psycopg://...) "
                   "instead of starting a server; each rank count leaves a schema run_* there.")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="Instead of the rank load: time N reports of one typical tick (1 trajectory of --tokens "
                   "tokens, a metric, a heartbeat, a claim of one task) in this process alone, on each backend, "
                   "and print statements and ms (wall and client CPU) per report.")
    p.add_argument("--dir", type=Path, default=None, help="Where local-disk runs go (default: a temporary "
                   "directory).")
    args = p.parse_args()
    rank_counts = [int(x) for x in args.ranks.split(",") if x]
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backend(s) {sorted(unknown)}; want {', '.join(BACKENDS)}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, ExitStack() as stack:
        for backend in backends:
            try:
                if backend == "sqlite-juicefs":
                    base, url = stack.enter_context(juicefs_mount(Path(tmp) / "jfs")), None
                elif backend == "postgresql" and args.pg_url:
                    base, url = Path(tmp) / "pg", args.pg_url
                elif backend == "postgresql":
                    server = stack.enter_context(postgres_server(
                        max_connections=max(rank_counts) + 64,
                        settings={"fsync": "on", "full_page_writes": "on", "shared_buffers": "256MB",
                                  "synchronous_commit": args.pg_synchronous_commit}))
                    base, url = Path(tmp) / "pg", server.url
                else:
                    base, url = Path(tmp) / "local", None
            except (JuiceFSUnavailable, PostgresUnavailable) as e:
                print(json.dumps({"backend": backend, "error": str(e)}), flush=True)
                continue
            if args.profile:
                for spread in (False, True):
                    run_dir = base / f"profile-{int(spread)}"
                    row = {"backend": backend, "mode": "profile", "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
                    row |= profile_reports(run_dir, url, reports=args.profile, tokens=args.tokens, spread=spread)
                    row |= {"loadavg_after": [round(x, 2) for x in os.getloadavg()],
                            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
                    print(json.dumps(row), flush=True)
                continue
            for ranks in rank_counts:
                print(f"[bench_store] {backend}, {ranks} ranks ...", file=sys.stderr, flush=True)
                print(json.dumps(measure(backend, ranks, base / f"run-{ranks}", url, args)), flush=True)


if __name__ == "__main__":
    main()
