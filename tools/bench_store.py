"""Run-store throughput with N processes, on local disk and on JuiceFS, and the commit rate a
run of the paper's size needs with TideRL's per-tick batching.

    .venv/bin/python tools/bench_store.py [--writers 4] [--claimers 2] [--groups-local 2000] [--groups-juicefs 200] [--no-juicefs]

Prints one JSON object: per filesystem, claims/s (tasks claimed by rollout ranks plus
trajectories claimed by trainers), commits/s (write transactions), lock retries; then the
commit budget of a 32-rank run (paper section 6: 4 nodes x 8 H100) with reports batched per
tick against per-turn reporting, and the headroom left on each filesystem.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jfs_mount import JuiceFSUnavailable, juicefs_mount  # noqa: E402
from store_load import LoadSpec, run_load  # noqa: E402


def measure(run_dir: Path, args: argparse.Namespace, num_groups: int) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = LoadSpec(run_dir=str(run_dir), num_writers=args.writers, num_claimers=args.claimers,
                    num_readers=args.readers, num_groups=num_groups, group_size=args.group_size,
                    heartbeat_timeout_s=60.0, deadline_s=600)
    with tempfile.TemporaryDirectory() as out:
        res = run_load(spec, Path(out))
    writers = [r for r in res["results"] if r["role"] == "writer"]
    claimers = [r for r in res["results"] if r["role"] == "claimer"]
    # From the moment every worker was set up (imports, engine, rank row) to the last one's end:
    # process start-up is not store throughput.
    wall = max(r["t_end"] for r in writers + claimers) - max(r["t_ready"] for r in writers + claimers)
    commits = sum(r["commits"] for r in writers + claimers)
    task_claims = sum(r["claims"] for r in writers)
    traj_claims = sum(len(r["claimed"]) for r in claimers)
    return {
        "processes": args.writers + args.claimers + args.readers,
        "wall_s": round(res["wall_s"], 2),
        "measured_s": round(wall, 2),
        "claims_per_s": round((task_claims + traj_claims) / wall, 1),
        "commits_per_s": round(commits / wall, 1),
        "lock_retries": sum(r["retries"] for r in writers + claimers),
        "exit_codes_ok": all(c == 0 for c in res["exit_codes"]),
    }


def commit_budget(tick_s: float) -> dict:
    """Commits/s a paper-size run needs. Sources: paper section 6.1 (32 H100s), Table 3 / 6.5 (a step of
    ~1,300 concurrent WebShop tasks), Table 4 (several turns per task; we take 1 turn per 3 s per task)."""
    ranks = 32
    concurrent_tasks = 1312
    turn_period_s = 3.0
    control_commits_per_s = 2.0  # the watch of heartbeats (1/s), task feed, plans, metrics
    trainer_commits_per_step = 4.0
    step_s = 60.0
    # Per tick every rank commits one report (heartbeat, finished trajectories, metrics and its claim).
    batched = ranks / tick_s + control_commits_per_s + trainer_commits_per_step / step_s
    per_turn = concurrent_tasks / turn_period_s + batched
    return {"ranks": ranks, "concurrent_tasks": concurrent_tasks, "tick_s": tick_s,
            "needed_commits_per_s_batched": round(batched, 1),
            "needed_commits_per_s_if_per_turn": round(per_turn, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--claimers", type=int, default=2)
    p.add_argument("--readers", type=int, default=1)
    p.add_argument("--groups-local", type=int, default=2000, help="Groups to play through on local disk.")
    p.add_argument("--groups-juicefs", type=int, default=200, help="Groups on JuiceFS (about 10x slower).")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--tick-s", type=float, default=1.0, help="Rank report period assumed for the budget.")
    p.add_argument("--no-juicefs", action="store_true")
    args = p.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("[bench_store] local disk ...", file=sys.stderr)
        out["local"] = measure(Path(tmp) / "local", args, args.groups_local)
        if not args.no_juicefs:
            print("[bench_store] JuiceFS ...", file=sys.stderr)
            try:
                with juicefs_mount(Path(tmp) / "jfs") as mnt:
                    out["juicefs"] = measure(mnt / "run", args, args.groups_juicefs)
            except JuiceFSUnavailable as e:
                out["juicefs"] = {"error": str(e)}
    budget = commit_budget(args.tick_s)
    for fs in ("local", "juicefs"):
        if "commits_per_s" in out.get(fs, {}):
            budget[f"headroom_{fs}"] = round(out[fs]["commits_per_s"] / budget["needed_commits_per_s_batched"], 2)
    out["paper_scale_budget"] = budget
    print(json.dumps(out))


if __name__ == "__main__":
    main()
