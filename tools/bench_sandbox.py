"""Per-run cost of the pytool sandbox: `bwrap` (namespaces) against `unsafe` (rlimits only), side by side.

    .venv/bin/python tools/bench_sandbox.py [--runs 20] [--code 'print(1)']

Interleaves the two isolations run by run (so load hits both alike) and prints one JSON line:
the median and minimum wall seconds of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tiderl.envs.sandbox import Isolation, SandboxLimits, run_python


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="Runs of each isolation (default 20).")
    parser.add_argument("--code", default="print(1)", help="The script each run executes.")
    args = parser.parse_args()
    limits = SandboxLimits()
    arms = {iso.value: iso for iso in (Isolation.BWRAP, Isolation.UNSAFE)}
    for iso in arms.values():  # warm: page cache, the bwrap probe
        run_python(args.code, limits, iso)
    wall: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.runs):
        for name, iso in arms.items():
            t0 = time.perf_counter()
            result = run_python(args.code, limits, iso)
            wall[name].append(time.perf_counter() - t0)
            if result.exit_code != 0:
                raise SystemExit(f"bench_sandbox: the {name} run failed: {result.stderr[-500:]}")
    out = {name: {"median_s": round(statistics.median(v), 4), "min_s": round(min(v), 4)} for name, v in wall.items()}
    out["bwrap_over_unsafe"] = round(out["bwrap"]["median_s"] / out["unsafe"]["median_s"], 3)
    out["runs"] = args.runs
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
