"""What an elastic split could gain at most over the best fixed one: the switching oracle.

    python tools/phase_oracle.py WORKLOAD.yaml CLUSTER.yaml [--cuts 50] [--seeds 0-2] [--steps 100] [--jobs N]

Runs every fixed CTB+RA2P partition of the `best-fixed` sweep (`tiderl sim --system best-fixed`) under
each seed and cuts each run at the `--cuts` steps into segments. The oracle takes, in every segment, the
partition with the highest rate there (tokens consumed in the segment over its time) and switches between
them at no cost; its goodput is the best fixed partition's tokens over the time the oracle would take for
them. That is a bound on what ERS can gain over the best fixed split on the workload (within the sweep's
partitions, with hindsight, without the cost of a move or of measuring): a target above it is out of
reach for a reason the numbers show. Prints one JSON object per seed and the mean ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _run(args: tuple) -> dict:
    from tiderl.sim.simulator import Simulation
    from tiderl.sim.spec import load_cluster, load_workload

    workload, cluster, system, seed, steps, cuts = args
    sim = Simulation(load_workload(workload), load_cluster(cluster), system, steps=steps, seed=seed)
    result = sim.run()
    rows = sim.step_rows()
    bounds = [0, *cuts, len(rows)]
    segments = []
    for lo, hi in zip(bounds, bounds[1:]):
        start = rows[lo - 1]["end_s"] if lo > 0 else 0.0
        segments.append({"tokens": sum(r["consumed_tokens"] for r in rows[lo:hi]),
                         "seconds": rows[hi - 1]["end_s"] - start})
    return {"system": system.label, "seed": seed, "goodput_tok_s": result["goodput_tok_s"], "segments": segments}


def oracle(runs: list[dict]) -> dict:
    """The best fixed partition among `runs` (one seed) and the switching oracle over their segments."""
    best = max(runs, key=lambda r: r["goodput_tok_s"])
    picks, seconds = [], 0.0
    for i, seg in enumerate(best["segments"]):
        top = max(runs, key=lambda r: r["segments"][i]["tokens"] / r["segments"][i]["seconds"])
        rate = top["segments"][i]["tokens"] / top["segments"][i]["seconds"]
        picks.append({"system": top["system"], "tok_s": round(rate),
                      "best_fixed_tok_s": round(seg["tokens"] / seg["seconds"])})
        seconds += seg["tokens"] / rate
    tokens = sum(s["tokens"] for s in best["segments"])
    fixed_s = sum(s["seconds"] for s in best["segments"])
    return {"best_fixed": best["system"], "best_fixed_tok_s": round(tokens / fixed_s),
            "oracle_tok_s": round(tokens / seconds), "oracle_over_best_fixed": round(fixed_s / seconds, 4),
            "segments": picks}


def main(argv: list[str] | None = None) -> None:
    from tiderl.sim.report import fixed_partitions
    from tiderl.sim.spec import load_cluster
    from sim_seeds import parse_seeds

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("cluster")
    ap.add_argument("--cuts", default="50", help="steps at which the oracle may switch, e.g. 25,50,75")
    ap.add_argument("--seeds", default="0-2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        cuts = sorted({int(c) for c in args.cuts.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"phase_oracle: --cuts must be step numbers separated by commas, got {args.cuts!r}")
    if any(c < 1 or c >= args.steps for c in cuts):
        raise SystemExit(f"phase_oracle: every cut must lie in 1..{args.steps - 1}, got {args.cuts!r}")
    if args.jobs < 1:
        raise SystemExit("phase_oracle: --jobs must be >= 1")
    seeds = parse_seeds(args.seeds)
    partitions = fixed_partitions(load_cluster(args.cluster))
    work = [(args.workload, args.cluster, p, s, args.steps, cuts) for s in seeds for p in partitions]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, work))
    out = []
    for seed in seeds:
        found = oracle([r for r in runs if r["seed"] == seed])
        out.append({"seed": seed, **found})
        print(json.dumps(out[-1]))
    print(json.dumps({"workload": args.workload, "cluster": args.cluster, "cuts": cuts, "seeds": seeds,
                      "oracle_over_best_fixed_mean": round(statistics.mean(o["oracle_over_best_fixed"]
                                                                             for o in out), 4)}))


if __name__ == "__main__":
    main()
