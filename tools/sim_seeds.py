"""Systems side by side over several seeds of the simulator: one seed's comparison is one draw.

    python tools/sim_seeds.py WORKLOAD.yaml CLUSTER.yaml --systems tiderl,tiderl-noers@0.5+ref4 \\
        [--seeds 0-5] [--steps 100] [--jobs N]

Each system (the `--system` names of `tiderl sim`, one run each: a fixed-partition system needs its
@F) runs under every seed. Prints one JSON object: per system its goodput per seed, mean and
seed-to-seed standard deviation (as a share of the mean); and for the first system against each
other one, the ratio of the means and the lowest and highest per-seed ratio. A policy's decisions
depend on the path a seed's tasks take, so one changed decision moves a run by several percent;
`docs/RESULTS.md` ("Six seeds instead of three") shows why a difference below ~2% needs more than three
seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_seeds(text: str) -> list[int]:
    """'0-5' or '0,2,7' (or both: '0-2,9') -> the seeds, in order, each once."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                new = list(range(lo, hi + 1))
            else:
                new = [int(part)]
        except ValueError:
            raise SystemExit(f"sim_seeds: --seeds: {part!r} is not a seed or a range LO-HI") from None
        seeds += [s for s in new if s not in seeds]
    return seeds


def summarise(names: list[str], goodputs: list[list[float]], seeds: list[int]) -> dict:
    systems = {}
    for name, g in zip(names, goodputs):
        mean = statistics.fmean(g)
        sd = statistics.stdev(g) / mean if len(g) > 1 and mean > 0 else 0.0
        systems[name] = {"goodput_tok_s": g, "mean_tok_s": round(mean, 1), "sd_share": round(sd, 4)}
    first, base = names[0], goodputs[0]
    ratios = {}
    for name, g in zip(names[1:], goodputs[1:]):
        per_seed = [a / b for a, b in zip(base, g) if b > 0]
        mean = statistics.fmean(g)
        ratios[f"{first}/{name}"] = {
            "of_means": round(statistics.fmean(base) / mean, 4) if mean > 0 else None,
            "per_seed_min": round(min(per_seed), 4) if per_seed else None,
            "per_seed_max": round(max(per_seed), 4) if per_seed else None,
        }
    return {"seeds": seeds, "systems": systems, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    from tiderl.sim import report
    from tiderl.sim.spec import load_cluster, load_workload
    from tiderl.sim.systems import SimSystemError, parse_system

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("cluster")
    ap.add_argument("--systems", required=True, help="comma-separated `tiderl sim --system` names")
    ap.add_argument("--seeds", default="0-5", help="e.g. 0-5 or 0,3,7 (default 0-5)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise SystemExit("sim_seeds: --steps must be >= 1")
    seeds = parse_seeds(args.seeds)
    load_workload(args.workload)  # fail early, with the file and key, on a bad file
    cluster = load_cluster(args.cluster)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    if not names:
        raise SystemExit("sim_seeds: --systems names no system")
    systems = []
    for name in names:
        try:
            system = parse_system(name)
        except SimSystemError as e:
            raise SystemExit(f"sim_seeds: --systems: {e}") from None
        if system.sweep and system.rollout_fraction is None:
            raise SystemExit(f"sim_seeds: --systems: {name} sweeps rollout fractions; name one (NAME@F)")
        systems.append(report.at_default_fraction(system, cluster.training.default_rollout_fraction))
    runs = report.run_seeds(args.workload, args.cluster, systems, args.steps, seeds, args.jobs)
    goodputs = [[r["goodput_tok_s"] for r in per_system] for per_system in runs]
    out = summarise(names, goodputs, seeds)
    print(json.dumps({"workload": args.workload, "cluster": args.cluster, "steps": args.steps, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
