"""The same job under `sync`, `async`, `stream` and `tiderl`, one after the other, same seed and ranks.

    python tools/bench_systems.py [--job jobs/quickstart.yaml] [--set KEY=VALUE ...] [--out DIR]
        [--systems sync,async,stream,tiderl] [--reuse]
    python tools/bench_systems.py --job jobs/bench-latency.yaml --out DIR > bench.json   # heavy-tailed env latency

Without --job it runs jobs/quickstart.yaml (with whatever --set makes of it, see docs/RESULTS.md).
Every run is the job with `system` set, plus the --set overrides, in DIR/SYSTEM.
Prints one JSON line: {"sync": {...}, "async": {...}, "stream": {...}, "tiderl": {...}}, each with the
run's goodput_tok_s (trained generated tokens per second of the run), rwt_s and twt_s (summed over
ranks), success_rate (trained trajectories of the last half of the steps), the last evaluation success
rate, the mean step time, the wall time of the run including start-up, the job file, and the load
average (1, 5 and 15 minutes) before and after the run (`load_avg`; `load_avg_1m`: the 1-minute
figures alone). `task_s_mean` is the mean time from a trained task's last claim to its trajectory's
end, `turns_mean` its mean number of turns (environment steps): with an injected environment delay,
how much of a task's life is the environment's.

`steady_goodput_tok_s` leaves the start-up out: the tokens trained by the versions after
`steady_from_version`, per second between its publication and the last one's. `steady_from_version` is
the first version published once every rank that starts an engine had it up (the run store's last
`engine_up` event), and at least version 1: engine start-up dominates short runs on a CPU, and a
system that publishes its first version from one rank's engine while others still start (streaming
with a small first fetch; ERS's idle rank building its engine) would otherwise count their start-up
as steady. `goodput_from_v1_tok_s` is the same from version 1, the definition before 2026-12-05.
With --reuse, a system whose run dir already holds a finished run is summarised, not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SYSTEMS = ("sync", "async", "stream", "tiderl")


def steady_goodput(run_dir: Path, from_version: int | None = None) -> tuple[float | None, int]:
    """(trained tokens of the versions after `from_version` per second between its publication and
    the last one's, that version); `from_version` None: `steady_from_version` of the run
    (tiderl.store.step_figures.steady_goodput, as `tiderl status` reports it)."""
    from tiderl.observe import steady_of
    from tiderl.store import RunStore

    store = RunStore.for_run_dir(run_dir)
    try:
        steady = steady_of(store, from_version)
    finally:
        store.close()
    return steady.tok_s, steady.from_version


def task_times(run_dir: Path) -> tuple[float | None, float | None]:
    """(mean seconds from a trained task's last claim to its trajectory's end, mean turns)."""
    from sqlalchemy import select

    from tiderl.store import RunStore
    from tiderl.store.schema import tasks, trajectories

    store = RunStore.for_run_dir(run_dir)
    t, j = tasks.c, trajectories.c
    try:
        rows = store.tx.read(lambda c: c.execute(
            select(j.finished_at, t.claimed_at, j.num_turns).join(tasks, tasks.c.id == j.task_id)
            .where(j.kind == "train", j.consumed_version.is_not(None))).all())
    finally:
        store.close()
    timed = [r.finished_at - r.claimed_at for r in rows if r.claimed_at is not None]
    return (sum(timed) / len(timed) if timed else None,
            sum(r.num_turns for r in rows) / len(rows) if rows else None)


def run_one(job: Path, system: str, overrides: list[str], run_dir: Path, reuse: bool = False) -> dict:
    sets = [a for s in [*overrides, f"system={system}"] for a in ("--set", s)]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    code, log = 0, ""
    if not (reuse and (run_dir / "run.db").exists()):
        proc = subprocess.run([sys.executable, "-m", "tiderl", "run", str(job), *sets, "--run-dir", str(run_dir)],
                              cwd=ROOT, capture_output=True, text=True)
        code, log = proc.returncode, proc.stdout + proc.stderr
    wall_s = time.monotonic() - t0
    status = subprocess.run([sys.executable, "-m", "tiderl", "status", str(run_dir), "--json"], cwd=ROOT,
                            capture_output=True, text=True)
    if code != 0 or status.returncode != 0 or json.loads(status.stdout)["state"] != "finished":
        return {"error": f"exit {code}", "log_tail": (log + status.stderr)[-1500:]}
    doc = json.loads(status.stdout)
    steps = doc["steps"]
    late = steps[len(steps) // 2:]
    n = sum(1 for _ in late)
    evals = [e for e in doc["eval"] if e["success_rate"] is not None]
    durations = [s["duration_s"] for s in steps if s["duration_s"]]
    load_after = os.getloadavg()
    task_s, turns = task_times(run_dir)
    steady, steady_from = steady_goodput(run_dir)
    return {
        "goodput_tok_s": round(doc["goodput_tok_s"], 2),
        "steady_goodput_tok_s": round(steady, 2) if steady is not None else None,
        "steady_from_version": steady_from,
        "goodput_from_v1_tok_s": round(g, 2) if (g := steady_goodput(run_dir, 1)[0]) is not None else None,
        "rwt_s": round(doc["rwt_s"], 1),
        "rollout_idle_s": round(idle_seconds(run_dir), 1),
        "twt_s": round(doc["twt_s"], 1),
        "success_rate": round(sum(s["success_rate"] or 0 for s in late) / n, 3) if n else None,
        "eval_success_rate": evals[-1]["success_rate"] if evals else None,
        "consumed_tokens": doc["consumed_tokens"],
        "task_s_mean": round(task_s, 2) if task_s is not None else None,
        "turns_mean": round(turns, 2) if turns is not None else None,
        "steps": len(steps),
        "mean_step_s": round(sum(durations) / len(durations), 2) if durations else None,
        "run_s": round(doc["elapsed_s"], 1),
        "wall_s": round(wall_s, 1) if code == 0 and log else None,
        "run_dir": str(run_dir),
        "job": str(job),
        "load_avg_1m": [round(load_before[0], 2), round(load_after[0], 2)],  # before and after: results swing with load
        "load_avg": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
    }


def idle_seconds(run_dir: Path) -> float:
    """Rollout-rank seconds with no task to play at all (`rollout_idle_s`), the paper's RWT; `rwt_s`
    also counts ticks where a rank had free slots while it played other tasks."""
    from tiderl.store import RunStore

    store = RunStore.for_run_dir(run_dir)
    try:
        return sum(float(r["value"]) for r in store.reader.metric_sums(["rollout_idle_s"]))
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=ROOT / "jobs" / "quickstart.yaml",
                        help="The job every system runs (default: jobs/quickstart.yaml).")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None, help="Where the four run dirs go (default: a temp dir).")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="Comma-separated subset, in order.")
    parser.add_argument("--reuse", action="store_true", help="Summarise runs already in --out instead of rerunning.")
    args = parser.parse_args(argv)
    # The runs start in ROOT: paths given relative to where this was started are resolved first.
    job = args.job.resolve()
    if not job.is_file():
        parser.error(f"no job file {args.job}")
    out = (args.out or Path(tempfile.mkdtemp(prefix="tiderl-bench-"))).resolve()
    results = {}
    for system in args.systems.split(","):
        results[system] = run_one(job, system, args.overrides, out / system, args.reuse)
        print(f"{system}: {json.dumps(results[system])}", file=sys.stderr, flush=True)
    print(json.dumps(results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
