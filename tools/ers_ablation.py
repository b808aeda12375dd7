"""Which of ERS's rules earn their keep: each rule switched off in turn (`tiderl sim --system tiderl~RULE`), over
several seeds, on every shipped workload x cluster pair.

    python tools/ers_ablation.py [--pairs W:C,...] [--rules regime,walk,...] [--starts F,...] [--seeds 0-5]
        [--steps 100] [--jobs N]

For each pair (and each `--starts` rollout fraction, by default the cluster's own start), `tiderl` and
`tiderl~RULE` for every rule run under the same seeds (`tools/sim_seeds.py`'s runs,
`tiderl.sim.report.run_seeds`). Per rule and pair: the per-seed ratio tiderl / tiderl~RULE (above 1: the rule
pays), their mean and its standard error across seeds, and a verdict: `pays` where the mean ratio exceeds 1 by
more than twice its standard error, `costs` where it falls short of 1 by as much, `within spread` otherwise.
Per rule overall: `earns_keep` where it pays on some pair and costs on none. A line on stderr per finished pair.
Prints one JSON object. A benchmark of the simulator (minutes per pair), not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from sim_seeds import parse_seeds  # noqa: E402

PAIRS = ("text-agentic:h100x8", "text-agentic:h100x32", "phase-change:h100x8", "mix-shift:h100x8",
         "length-growth:h100x8", "osworld:h100x32-vl4b", "hilo-bench:cpu", "bench-latency:cpu",
         "text-agentic-b128:h100x32", "osworld-b64:h100x32-vl4b")


def verdict(base: list[float], ablated: list[float]) -> dict:
    """The per-seed ratios base / ablated (the same seeds, in order), their mean, its standard error and the
    verdict (pure)."""
    ratios = [b / a for b, a in zip(base, ablated, strict=True) if a > 0]
    if not ratios:
        return {"ratios": [], "mean_ratio": None, "se": None, "verdict": "no goodput"}
    mean = statistics.fmean(ratios)
    se = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.inf
    if mean - 1 > 2 * se:
        call = "pays"
    elif 1 - mean > 2 * se:
        call = "costs"
    else:
        call = "within spread"
    return {"ratios": [round(r, 4) for r in ratios], "mean_ratio": round(mean, 4),
            "se": round(se, 4) if math.isfinite(se) else None, "verdict": call}


def overall(per_pair: dict[str, dict[str, dict]], rules: list[str]) -> dict[str, dict]:
    """Per rule: the pairs where it pays and where it costs, and whether it earns its keep (pure)."""
    out = {}
    for rule in rules:
        pays = [p for p, r in per_pair.items() if r[rule]["verdict"] == "pays"]
        costs = [p for p, r in per_pair.items() if r[rule]["verdict"] == "costs"]
        out[rule] = {"pays_on": pays, "costs_on": costs, "earns_keep": bool(pays) and not costs}
    return out


def pair_files(pair: str) -> tuple[Path, Path]:
    workload, sep, cluster = pair.partition(":")
    if not sep:
        raise SystemExit(f"ers_ablation: --pairs: {pair!r} is not WORKLOAD:CLUSTER")
    w = ROOT / "jobs" / "sim" / f"{workload}.workload.yaml"
    c = ROOT / "jobs" / "sim" / f"{cluster}.cluster.yaml"
    for f in (w, c):
        if not f.is_file():
            raise SystemExit(f"ers_ablation: --pairs {pair}: no file {f.relative_to(ROOT)}")
    return w, c


def main(argv: list[str] | None = None) -> int:
    from tiderl.policy.ers.inputs import ABLATIONS
    from tiderl.sim import report
    from tiderl.sim.spec import load_cluster
    from tiderl.sim.systems import ABLATION_SWITCHES, parse_system

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default=",".join(PAIRS), help="WORKLOAD:CLUSTER names of jobs/sim/, comma-separated")
    # The rate planner's rules and its evaluation rule (adaptive_retention is the paper planner's: `tiderl` never reads it).
    ap.add_argument("--rules", default=",".join([*ABLATIONS, "evaluation_actors"]),
                    help=f"rules to switch off one at a time (known: {', '.join([*ABLATIONS, *ABLATION_SWITCHES])})")
    ap.add_argument("--starts", default="",
                    help="rollout fractions to start from, comma-separated (default: each cluster's own start)")
    ap.add_argument("--seeds", default="0-5")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    files = [pair_files(p) for p in pairs]
    names = ["tiderl"] + [f"tiderl~{r}" for r in rules]
    try:
        parsed = [parse_system(n) for n in names]
    except ValueError as e:
        raise SystemExit(f"ers_ablation: --rules: {e}") from None
    per_pair: dict[str, dict[str, dict]] = {}
    means: dict[str, dict[str, float]] = {}
    t0 = time.monotonic()
    try:
        starts = [float(x) for x in args.starts.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"ers_ablation: --starts: numbers in (0, 1), got {args.starts!r}") from None
    if any(not 0 < f < 1 for f in starts):
        raise SystemExit(f"ers_ablation: --starts: numbers in (0, 1), got {args.starts!r}")
    for pair, (w, c) in zip(pairs, files):
        cluster = load_cluster(c)
        for start in starts or [cluster.training.default_rollout_fraction]:
            key = pair if not starts else f"{pair}@{start:g}"
            systems = [replace(s, rollout_fraction=start) for s in parsed]
            runs = report.run_seeds(str(w), str(c), systems, args.steps, seeds, args.jobs)
            goodputs = [[r["goodput_tok_s"] for r in per_system] for per_system in runs]
            per_pair[key] = {rule: verdict(goodputs[0], g) for rule, g in zip(rules, goodputs[1:])}
            means[key] = {n: round(statistics.fmean(g), 1) for n, g in zip(names, goodputs)}
            print(f"ers_ablation: {key} done ({time.monotonic() - t0:.0f} s): "
                  + ", ".join(f"{r} {v['mean_ratio']} ({v['verdict']})" for r, v in per_pair[key].items()),
                  file=sys.stderr, flush=True)
    print(json.dumps({"seeds": seeds, "steps": args.steps, "rules": rules, "mean_tok_s": means,
                      "per_pair": per_pair, "overall": overall(per_pair, rules)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
