"""Does the quickstart learn? The same job for several seeds, one after the other.

    python tools/bench_learning.py [--job jobs/quickstart.yaml] [--seeds 0,1,2] [--set KEY=VALUE ...] [--out DIR]
    python tools/bench_learning.py --set trainer.off_policy=decoupled --set rollout.max_staleness=2

Every seed runs `tiderl run JOB --set seed=N [--set ...] --run-dir DIR/seed-N` with the model cache
DIR/model-cache, empty at the start: the first seed's wall time includes building the tiny model, as
a first `make demo` does (`model_build_s`), the others find it. The evaluations are read from the run
store (`tiderl status --json`). `--model-cache DIR` uses DIR instead (a model built there before is
found, and no seed's wall time includes a build).
Prints one JSON line: `eval_v0` and `eval_last` (greedy evaluation success rate at the first and
the last evaluated version, one per seed), `eval_gain_min` (the smallest last - first across seeds),
`wall_s_max`, the job and overrides, and `seeds`: per seed its run dir, wall time, model build time,
every evaluation (version, success rate, tasks), the gain, whether it is beyond noise (95%, as the
end-of-run summary says) and the load average before and after. Exit status 1 if a run failed.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_seed(job: Path, seed: int, overrides: list[str], out: Path, cache: Path) -> dict[str, Any]:
    from tiderl.evalstats import compare
    from tiderl.models.tiny_model import MANIFEST

    run_dir = out / f"seed-{seed}"
    built_before = {m: m.stat().st_mtime for m in cache.glob(f"models/*/{MANIFEST}")}
    sets = [a for s in [f"seed={seed}", *overrides] for a in ("--set", s)]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tiderl", "run", str(job), *sets, "--run-dir", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, env=os.environ | {"TIDERL_CACHE": str(cache)})
    wall_s = time.monotonic() - t0
    status = subprocess.run([sys.executable, "-m", "tiderl", "status", str(run_dir), "--json"], cwd=ROOT,
                            capture_output=True, text=True)
    doc = json.loads(status.stdout) if status.returncode == 0 else {}
    evals = [e for e in doc.get("eval", []) if e["success_rate"] is not None and e["num_tasks"]]
    if proc.returncode != 0 or doc.get("state") != "finished" or len(evals) < 2:
        return {"seed": seed, "run_dir": str(run_dir), "error": f"exit {proc.returncode}",
                "log_tail": (proc.stdout + proc.stderr + status.stderr)[-1500:]}
    first, last = evals[0], evals[-1]
    change = compare(round(first["success_rate"] * first["num_tasks"]), first["num_tasks"],
                     round(last["success_rate"] * last["num_tasks"]), last["num_tasks"])
    builds = [json.loads(m.read_text())["build_s"] for m in cache.glob(f"models/*/{MANIFEST}")
              if built_before.get(m) != m.stat().st_mtime]
    return {
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_s": round(wall_s, 1),
        "model_build_s": max(builds) if builds else None,  # None: the model was in the cache
        "evals": [[e["eval_version"], round(e["success_rate"], 4), e["num_tasks"]] for e in evals],
        "eval_v0": round(first["success_rate"], 4),
        "eval_last": round(last["success_rate"], 4),
        "gain": round(change.change, 4),
        "z": round(change.z, 2),
        "beyond_noise": change.beyond_noise,
        "load_avg": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
    }


def job_and_seeds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Path, list[int]]:
    """`--job` resolved (the runs start in ROOT) and `--seeds` parsed; a parser error names the one at fault."""
    job = args.job.resolve()
    if not job.is_file():
        parser.error(f"no job file {args.job}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    return job, seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=ROOT / "jobs" / "quickstart.yaml",
                        help="The job every seed runs (default: jobs/quickstart.yaml).")
    parser.add_argument("--seeds", default="0,1,2", help="Comma-separated job seeds, run in this order.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override passed to every run (repeatable), as `tiderl run --set`.")
    parser.add_argument("--out", type=Path, default=None, help="Where the run dirs go (default: a temp dir).")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="Model cache of the runs (default: OUT/model-cache, which must not exist yet).")
    args = parser.parse_args(argv)
    job, seeds = job_and_seeds(parser, args)
    out = (args.out or Path(tempfile.mkdtemp(prefix="tiderl-learning-"))).resolve()
    cache = (args.model_cache or out / "model-cache").resolve()
    if args.model_cache is None and cache.exists():
        parser.error(f"{cache} exists: give an --out without a model cache (the first seed builds the model), "
                     "or name it with --model-cache")
    results = []
    for seed in seeds:
        results.append(run_seed(job, seed, args.overrides, out, cache))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    done = [r for r in results if "error" not in r]
    print(json.dumps({
        "eval_v0": [r["eval_v0"] for r in done],
        "eval_last": [r["eval_last"] for r in done],
        "eval_gain_min": min(r["gain"] for r in done) if done else None,
        "wall_s_max": max(r["wall_s"] for r in done) if done else None,
        "job": str(job.relative_to(ROOT) if job.is_relative_to(ROOT) else job),
        "overrides": args.overrides,
        "seeds": results,
    }))
    return 0 if len(done) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
