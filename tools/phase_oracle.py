"""What an elastic split could gain at most over the best fixed one: the switching oracle, in hindsight and
across seeds.

    python tools/phase_oracle.py WORKLOAD.yaml CLUSTER.yaml [--cuts 50] [--cut-at-evals] [--seeds 0-2]
        [--steps 100] [--jobs N]

Runs every fixed CTB+RA2P partition of the `best-fixed` sweep (`tiderl sim --system best-fixed`) under
each seed and cuts each run into segments: at the `--cuts` steps and, with `--cut-at-evals`, before and
after every evaluation step (the step of version v with v a multiple of the workload's
`eval_every_steps`, 0 included: the publish of v+1 waits for the evaluation round of v), so that each
evaluation step is a segment of its own. A cut at step c ends a segment after step c-1; the cuts are the
same for every run, so segment i is the same steps in every run.

On a seed (the pick seed) the oracle takes the best fixed partition (the highest goodput) and, in every
segment, the partition with the highest rate there (tokens consumed in the segment over its time), and
switches between them at no cost. Scoring those choices on a seed (the score seed) uses that seed's runs
of the same partitions: the oracle's time is, summed over the segments, the tokens the chosen best fixed
partition consumed in the segment over the rate of the segment's pick there; its ratio is the chosen best
fixed partition's time over the oracle's (goodput: the best fixed partition's tokens over either time).

- Hindsight (pick seed = score seed): a bound on what ERS can gain over the best fixed split (within the
  sweep's partitions, without the cost of a move or of measuring). Part of it is noise: a segment's best
  partition is partly its luckiest one on that seed.
- Cross-seed (every ordered pair of distinct seeds): the picks and the best fixed split, both made on the
  pick seed, scored on the score seed, as a policy that learned the workload's phases on one run would do
  on another. The noise no longer helps: it is the gain the workload's phases allow (still switching at
  no cost, within the sweep). Each object also names the score seed's own best fixed partition and the
  oracle's goodput over that partition's (a harder comparison: that one is chosen with hindsight).

With `--system NAME` (a `tiderl sim` system, e.g. `tiderl`), that system runs under each seed too, cut
alike, and the summary says per score seed how its rate (its tokens over its time) compares with the
cross-seed oracle's there (the mean over the pick seeds), and, with `--cut-at-evals`, how its rate in the
evaluation steps compares with the best fixed partition's rate in them (the partition fastest over that
seed's evaluation steps, in hindsight).

Prints one JSON object per (pick seed, score seed), the hindsight one first for each pick seed (with its
segments' picks), then a summary: the mean hindsight ratio and the mean, lowest and highest cross-seed
ratio.
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


def eval_steps(eval_every_steps: int, eval_groups: int, steps: int) -> list[int]:
    """The steps (record versions) during which an evaluation round runs: the simulator's `_eval_due`."""
    if eval_every_steps <= 0 or eval_groups <= 0:
        return []
    return list(range(0, steps, eval_every_steps))


def cut_points(steps: int, cuts: list[int], evals: list[int]) -> list[int]:
    """The fixed cuts plus a cut before and after each evaluation step, within 1..steps-1, sorted."""
    points = set(cuts) | {c for v in evals for c in (v, v + 1)}
    return sorted(c for c in points if 0 < c < steps)


def segments(rows: list[dict], cuts: list[int], evals: list[int] = ()) -> list[dict]:
    """The step records `rows` (one per step, in order) cut at `cuts`: per segment its steps [lo, hi),
    the tokens consumed, its time and whether an evaluation step lies in it."""
    bounds = [0, *cuts, len(rows)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        start = rows[lo - 1]["end_s"] if lo > 0 else 0.0
        out.append({"steps": [lo, hi], "eval": any(lo <= v < hi for v in evals),
                    "tokens": sum(r["consumed_tokens"] for r in rows[lo:hi]),
                    "seconds": rows[hi - 1]["end_s"] - start})
    return out


def _run(args: tuple) -> dict:
    from tiderl.sim.simulator import Simulation
    from tiderl.sim.spec import load_cluster, load_workload

    workload, cluster, system, seed, steps, cuts, evals = args
    sim = Simulation(load_workload(workload), load_cluster(cluster), system, steps=steps, seed=seed)
    result = sim.run()
    rows = sim.step_rows()
    if [r["version"] for r in rows] != list(range(len(rows))):
        raise RuntimeError(f"phase_oracle: {system.label} seed {seed}: the step records are not versions "
                           f"0..{len(rows) - 1}, so the cuts cannot name steps")
    return {"system": system.label, "seed": seed, "goodput_tok_s": result["goodput_tok_s"],
            "segments": segments(rows, cuts, evals)}


def _rate(seg: dict) -> float:
    return seg["tokens"] / seg["seconds"]


def pick(runs: list[dict]) -> tuple[str, list[str]]:
    """On one seed's `runs`: the best fixed partition (highest goodput) and each segment's fastest one."""
    best = max(runs, key=lambda r: r["goodput_tok_s"])
    picks = [max(runs, key=lambda r: _rate(r["segments"][i]))["system"] for i in range(len(best["segments"]))]
    return best["system"], picks


def score(runs: list[dict], best_fixed: str, picks: list[str]) -> dict:
    """`best_fixed` and the segment `picks` scored on one seed's `runs`: the oracle's time for the best
    fixed partition's tokens, segment by segment at the picked partitions' rates, against that partition's."""
    by = {r["system"]: r for r in runs}
    fixed = by[best_fixed]["segments"]
    tokens = sum(s["tokens"] for s in fixed)
    fixed_s = sum(s["seconds"] for s in fixed)
    oracle_s = sum(seg["tokens"] / _rate(by[p]["segments"][i]) for i, (seg, p) in enumerate(zip(fixed, picks)))
    own = max(runs, key=lambda r: r["goodput_tok_s"])
    own_tok_s = sum(s["tokens"] for s in own["segments"]) / sum(s["seconds"] for s in own["segments"])
    return {"best_fixed": best_fixed, "best_fixed_tok_s": round(tokens / fixed_s),
            "oracle_tok_s": round(tokens / oracle_s), "oracle_over_best_fixed": round(fixed_s / oracle_s, 4),
            "score_seed_best_fixed": own["system"],
            "oracle_over_score_seed_best_fixed": round(tokens / oracle_s / own_tok_s, 4)}


def oracle(runs: list[dict]) -> dict:
    """The hindsight oracle on one seed's `runs`: picked and scored on the same seed, with each segment's pick."""
    best_fixed, picks = pick(runs)
    out = score(runs, best_fixed, picks)
    fixed = next(r for r in runs if r["system"] == best_fixed)["segments"]
    by = {r["system"]: r for r in runs}
    out["segments"] = [{"steps": seg["steps"], "eval": seg["eval"], "system": p,
                        "tok_s": round(_rate(by[p]["segments"][i])), "best_fixed_tok_s": round(_rate(seg))}
                       for i, (seg, p) in enumerate(zip(fixed, picks))]
    return out


def pairs(runs: list[dict], seeds: list[int]) -> list[dict]:
    """For every pick seed, its hindsight object, then its picks scored on every other seed."""
    by_seed = {s: [r for r in runs if r["seed"] == s] for s in seeds}
    out = []
    for s in seeds:
        best_fixed, picks = pick(by_seed[s])
        switches = sum(a != b for a, b in zip(picks, picks[1:]))
        out.append({"pick_seed": s, "score_seed": s, "hindsight": True, "switches": switches, **oracle(by_seed[s])})
        for t in seeds:
            if t != s:
                out.append({"pick_seed": s, "score_seed": t, "hindsight": False, "switches": switches,
                            **score(by_seed[t], best_fixed, picks)})
    return out


def summary(objects: list[dict]) -> dict:
    """The mean hindsight ratio and the mean, lowest and highest cross-seed ratio (None with one seed)."""
    same = [o["oracle_over_best_fixed"] for o in objects if o["hindsight"]]
    cross = [o["oracle_over_best_fixed"] for o in objects if not o["hindsight"]]
    cross_own = [o["oracle_over_score_seed_best_fixed"] for o in objects if not o["hindsight"]]
    mean = (lambda xs: round(statistics.mean(xs), 4) if xs else None)
    return {"hindsight_oracle_over_best_fixed_mean": mean(same),
            "cross_seed_oracle_over_best_fixed_mean": mean(cross),
            "cross_seed_oracle_over_best_fixed_min": min(cross, default=None),
            "cross_seed_oracle_over_best_fixed_max": max(cross, default=None),
            "cross_seed_oracle_over_score_seed_best_fixed_mean": mean(cross_own),
            "cross_seed_pairs": len(cross)}


def _total_rate(segs: list[dict], evals_only: bool = False) -> float | None:
    chosen = [g for g in segs if g["eval"] or not evals_only]
    seconds = sum(g["seconds"] for g in chosen)
    return sum(g["tokens"] for g in chosen) / seconds if seconds > 0 else None


def against(system_runs: list[dict], runs: list[dict], objects: list[dict]) -> dict:
    """A system's runs (one per seed) against the cross-seed oracle of `objects` (:func:`pairs`) and, in the
    evaluation steps, against the best fixed partition's rate there, per score seed (pure)."""
    per_seed = []
    for mine in system_runs:
        t = mine["seed"]
        cross = [o["oracle_tok_s"] for o in objects if not o["hindsight"] and o["score_seed"] == t]
        row = {"seed": t, "tok_s": round(_total_rate(mine["segments"]) or 0.0)}
        if cross:
            row["over_cross_seed_oracle"] = round(row["tok_s"] / statistics.mean(cross), 4)
        own = _total_rate(mine["segments"], evals_only=True)
        fixed = {r["system"]: _total_rate(r["segments"], evals_only=True) for r in runs if r["seed"] == t}
        fixed = {k: v for k, v in fixed.items() if v is not None}
        if own is not None and fixed:
            best = max(fixed, key=lambda k: fixed[k])
            row.update(eval_tok_s=round(own), eval_best_fixed=best, eval_best_fixed_tok_s=round(fixed[best]),
                       eval_over_best_fixed=round(own / fixed[best], 4))
        per_seed.append(row)
    out: dict = {"system": system_runs[0]["system"] if system_runs else None, "per_seed": per_seed}
    for key in ("over_cross_seed_oracle", "eval_over_best_fixed"):
        values = [r[key] for r in per_seed if key in r]
        if values:
            out[f"{key}_mean"] = round(statistics.mean(values), 4)
            out[f"{key}_min"] = min(values)
    return out


def main(argv: list[str] | None = None) -> None:
    from tiderl.sim.report import fixed_partitions
    from tiderl.sim.spec import load_cluster, load_workload
    from sim_seeds import parse_seeds

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("cluster")
    ap.add_argument("--cuts", default="50", help="steps at which the oracle may switch, e.g. 25,50,75 ('' for none)")
    ap.add_argument("--cut-at-evals", action="store_true",
                    help="also cut before and after every evaluation step (each its own segment)")
    ap.add_argument("--seeds", default="0-2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--system", default=None, help="a `tiderl sim` system to score against the oracle (e.g. tiderl)")
    args = ap.parse_args(argv)
    try:
        cuts = sorted({int(c) for c in args.cuts.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"phase_oracle: --cuts must be step numbers separated by commas, got {args.cuts!r}")
    if any(c < 1 or c >= args.steps for c in cuts):
        raise SystemExit(f"phase_oracle: every cut must lie in 1..{args.steps - 1}, got {args.cuts!r}")
    if args.jobs < 1:
        raise SystemExit("phase_oracle: --jobs must be >= 1")
    workload = load_workload(args.workload)
    evals = eval_steps(workload.eval_every_steps, workload.eval_groups, args.steps)
    if args.cut_at_evals and not evals:
        raise SystemExit(f"phase_oracle: --cut-at-evals: {args.workload} runs no evaluation (eval_every_steps "
                         f"{workload.eval_every_steps}, eval_groups {workload.eval_groups})")
    points = cut_points(args.steps, cuts, evals if args.cut_at_evals else [])
    seeds = parse_seeds(args.seeds)
    partitions = fixed_partitions(load_cluster(args.cluster))
    system = None
    if args.system:
        from tiderl.sim.report import at_default_fraction
        from tiderl.sim.systems import parse_system
        try:
            system = at_default_fraction(parse_system(args.system),
                                         load_cluster(args.cluster).training.default_rollout_fraction)
        except ValueError as e:
            raise SystemExit(f"phase_oracle: --system: {e}") from None
    work = [(args.workload, args.cluster, p, s, args.steps, points, evals) for s in seeds for p in partitions]
    work += [(args.workload, args.cluster, system, s, args.steps, points, evals) for s in seeds if system]
    with ProcessPoolExecutor(args.jobs) as pool:
        everything = list(pool.map(_run, work))
    runs, mine = everything[:len(seeds) * len(partitions)], everything[len(seeds) * len(partitions):]
    objects = pairs(runs, seeds)
    for o in objects:
        print(json.dumps(o))
    print(json.dumps({"workload": args.workload, "cluster": args.cluster, "steps": args.steps, "cuts": cuts,
                      "cut_at_evals": args.cut_at_evals, "eval_steps": evals, "segment_bounds": points,
                      "seeds": seeds, "partitions": len(partitions),
                      "cross_seed": "every ordered pair of distinct seeds", **summary(objects),
                      **({"against": against(mine, runs, objects)} if system else {})}))


if __name__ == "__main__":
    main()
