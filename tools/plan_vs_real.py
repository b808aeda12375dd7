"""`tiderl plan` against the real job: does the setting it recommends run within 10% of the best one measured?

    python tools/plan_vs_real.py [--job jobs/bench-latency.yaml] [--groups 2,4] [--staleness 1,2]
        [--seeds 3] [--out DIR] [--reuse] [--jobs J]

The simulator's files for the job (`jobs/sim/JOBSTEM.workload.yaml` and `jobs/sim/cpu.cluster.yaml`, the
calibrated costs of this kind of host) take the job's own settings (ranks, slots, micro-batch, staleness,
batch, group size, `ers:`; `tiderl.sim.from_job.job_settings`, as the simulator's comparison with a run takes
them), and `tiderl plan` sweeps `--groups` x `--staleness` at the job's rank count (a shared host runs no
other count) for the job's `trainer.num_steps`, over `--seeds`. Then the real job runs once per setting
(`tools/bench_systems.py --systems tiderl` with `trainer.groups_ideal`, `trainer.groups_min` (half, at least 1)
and `rollout.max_staleness` set), each in DIR/gG-sS, and its steady goodput (start-up left out,
`bench_systems.steady_goodput`) is read.

Prints one JSON line: per setting the predicted goodput and the measured steady goodput, the
recommendation, `recommended_over_best_measured` (the target: >= 0.9), the setting measured best, and
whether the predicted order matches the measured one. The two goodputs count the same trained trajectories
in different tokens (the plan's, every token of a trajectory trained per second; the run's steady figure,
the generated ones): the settings are compared by their order and the recommendation's share, not by value. Runs take minutes each on a CPU host: this is a
benchmark, not a test. Exit 1 where a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from tiderl.sim.from_job import job_settings  # noqa: E402
from tiderl.sim.plan_cli import int_list  # noqa: E402

TARGET = 0.9


def sim_files(job: Path, out: Path) -> tuple[Path, Path, int, int]:
    """The workload and cluster files for `job` with its settings, written under `out`; its ranks and steps."""
    from tiderl.config import load_job
    from tiderl.config.schema import to_dict

    config = to_dict(load_job(job))
    workload = yaml.safe_load((ROOT / "jobs" / "sim" / f"{job.stem}.workload.yaml").read_text())
    cluster = yaml.safe_load((ROOT / "jobs" / "sim" / "cpu.cluster.yaml").read_text())
    cluster, workload, _, _ = job_settings(cluster, workload, config)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"{job.stem}.workload.yaml", out / f"{job.stem}.cluster.yaml"
    paths[0].write_text(yaml.safe_dump(workload, sort_keys=False))
    paths[1].write_text(yaml.safe_dump(cluster, sort_keys=False))
    return paths[0], paths[1], int(config["launch"]["num_ranks"]), int(config["trainer"]["num_steps"])


def key(groups: int, staleness: int) -> str:
    return f"g{groups}-s{staleness}"


def compare(plan: dict[str, Any], measured: dict[str, float | None]) -> dict[str, Any]:
    """The plan's rows beside the measured steady goodput of each setting (pure: `tiderl plan --json`'s
    object and {key: tok/s or None}), the recommendation's measured share of the best measured."""
    rows = []
    for row in plan["rows"]:
        k = key(row["groups"], row["staleness"])
        got = measured.get(k)
        rows.append({"setting": k, "predicted_tok_s": row["goodput_tok_s"], "measured_tok_s": got})
    done = [r for r in rows if r["measured_tok_s"]]
    rec = plan.get("recommendation")
    rec_key = key(rec["groups"], rec["staleness"]) if rec else None
    best = max(done, key=lambda r: r["measured_tok_s"]) if done else None
    share = None
    if best is not None and rec_key is not None and measured.get(rec_key):
        share = round(measured[rec_key] / best["measured_tok_s"], 4)  # type: ignore[operator]
    order = [r["setting"] for r in sorted(done, key=lambda r: -r["predicted_tok_s"])]
    return {"rows": rows, "recommended": rec_key, "best_measured": best["setting"] if best else None,
            "recommended_over_best_measured": share, "target": TARGET,
            "met": None if share is None else share >= TARGET,
            "same_order": order == [r["setting"] for r in sorted(done, key=lambda r: -r["measured_tok_s"])]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=ROOT / "jobs" / "bench-latency.yaml")
    parser.add_argument("--groups", type=int_list(1), default=[2, 4])
    parser.add_argument("--staleness", type=int_list(1), default=[1, 2])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="Read runs already in --out instead of running them.")
    parser.add_argument("--jobs", type=int, default=1, help="Simulations at once (the real runs go one by one).")
    args = parser.parse_args(argv)
    job = args.job.resolve()
    if not job.is_file():
        parser.error(f"no job file {args.job}")
    if not (ROOT / "jobs" / "sim" / f"{job.stem}.workload.yaml").is_file():
        parser.error(f"no simulator workload jobs/sim/{job.stem}.workload.yaml for {args.job}")
    out = (args.out or Path(tempfile.mkdtemp(prefix="tiderl-plan-vs-real-"))).resolve()
    workload, cluster, ranks, steps = sim_files(job, out / "sim")
    planned = subprocess.run([sys.executable, "-m", "tiderl", "plan", str(workload), str(cluster), "--gpus", str(ranks),
                              "--groups", ",".join(map(str, args.groups)),
                              "--staleness", ",".join(map(str, args.staleness)), "--seeds", str(args.seeds),
                              "--steps", str(steps), "--jobs", str(args.jobs), "--json"],
                             cwd=ROOT, capture_output=True, text=True)
    if planned.returncode != 0:
        print(planned.stderr, file=sys.stderr)
        return 1
    plan = json.loads(planned.stdout)
    from bench_systems import run_one

    measured: dict[str, float | None] = {}
    failed = []
    for g in args.groups:
        for s in args.staleness:
            sets = [f"trainer.groups_ideal={g}", f"trainer.groups_min={max(1, g // 2)}", f"rollout.max_staleness={s}"]
            result = run_one(job, "tiderl", sets, out / key(g, s), args.reuse)
            measured[key(g, s)] = result.get("steady_goodput_tok_s")
            if "error" in result:
                failed.append(key(g, s))
            print(f"{key(g, s)}: {json.dumps(result)}", file=sys.stderr, flush=True)
    print(json.dumps({"job": str(args.job), "ranks": ranks, "steps": steps, "seeds": args.seeds,
                      **compare(plan, measured), "failed": failed, "out": str(out),
                      "load_avg_1m": os.getloadavg()[0]}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
