"""Each simulated run's goodput and a digest of its per-step record, for systems on workload x cluster pairs:
what a change to a policy must keep (a refactor: every digest the same) or what it moved.

    python tools/sim_fingerprint.py --systems tiderl,tiderl~valley [--pairs W:C,...] [--starts F,...]
        [--seeds 0-5] [--steps 100] [--jobs N] [--tree DIR]

`--tree` runs the tiderl package of another checkout (default: this one), so that two commits compare in one
sitting. Prints one JSON object: per "PAIR[@START]|SYSTEM" the per-seed [goodput, digest]. A line on stderr per
finished pair. A benchmark of the simulator (minutes per pair), not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def digest(per_step: object) -> str:
    """A short digest of a run's per-step record (equal records, equal digests)."""
    return hashlib.sha1(json.dumps(per_step, sort_keys=True, default=str).encode()).hexdigest()[:12]


def pin_tree(tree: Path) -> Path:
    """Import the tiderl package of `tree` before anything else imports one (tools/ers_ablation.py puts this
    checkout first on the path): later imports reuse it. Returns its directory; exits where this interpreter
    already holds another checkout's package."""
    sys.path.insert(0, str(tree))
    import tiderl

    where = Path(tiderl.__file__).resolve().parent
    if where != (tree / "tiderl").resolve():
        raise SystemExit(f"sim_fingerprint: --tree {tree}: this interpreter already runs the tiderl of {where.parent}; "
                         "run the tool in a fresh one")
    return where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", required=True)
    ap.add_argument("--pairs", default="")
    ap.add_argument("--starts", default="")
    ap.add_argument("--seeds", default="0-5")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tree", default=str(ROOT))
    args = ap.parse_args(argv)
    pin_tree(Path(args.tree))
    sys.path.insert(0, str(ROOT / "tools"))
    from ers_ablation import PAIRS
    from sim_seeds import parse_seeds
    from tiderl.sim import report
    from tiderl.sim.systems import parse_system

    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()] or list(PAIRS)
    starts = [float(x) for x in args.starts.split(",") if x.strip()] or [None]
    seeds = parse_seeds(args.seeds)
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    try:
        systems = [parse_system(n) for n in names]
    except ValueError as e:
        raise SystemExit(f"sim_fingerprint: --systems: {e}") from None
    out: dict[str, list] = {}
    t0 = time.monotonic()
    for pair in pairs:
        workload, _, cluster = pair.partition(":")
        files = [Path(args.tree) / "jobs" / "sim" / f"{workload}.workload.yaml",
                 Path(args.tree) / "jobs" / "sim" / f"{cluster}.cluster.yaml"]
        if not all(f.is_file() for f in files):
            raise SystemExit(f"sim_fingerprint: --pairs {pair}: no such workload or cluster file under {args.tree}")
        for start in starts:
            chosen = systems if start is None else [replace(s, rollout_fraction=start) for s in systems]
            runs = report.run_seeds(str(files[0]), str(files[1]), chosen, args.steps, seeds, args.jobs)
            key = pair if start is None else f"{pair}@{start:g}"
            for name, per_seed in zip(names, runs):
                out[f"{key}|{name}"] = [[r["goodput_tok_s"], digest(r.get("per_step"))] for r in per_seed]
            print(f"sim_fingerprint: {key} done ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(json.dumps({"seeds": seeds, "steps": args.steps, "runs": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
