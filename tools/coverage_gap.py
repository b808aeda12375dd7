"""Which lines a real `tiderl run` executes that the fast tests never reach (issue 17's coverage target).

Runs a short quickstart for real (vLLM engines, every process) under coverage.py, then compares the lines it
executed in `tiderl/` with the lines the fast tests reached (the data `tools/coverage.sh` left). Prints, per
file, the lines only the real run executed, and one JSON line: `{"run_lines": N, "gap_lines": M,
"gap_outside_vllm_engine": K, ...}`. The target is K = 0: every line the run executes outside the vLLM
engine's own module is reached by a test without vLLM.

    TIDERL_COVERAGE_DIR=D bash tools/coverage.sh      # the fast tests' lines, first
    python tools/coverage_gap.py --fast D [--steps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_MODULES = ("tiderl/rollout/vllm_engine.py",)  # what only a real engine runs


def lines_of(data_dir: Path) -> dict[str, set[int]]:
    """Executed lines per file (relative to the repository) of the combined coverage data in `data_dir`."""
    from coverage import CoverageData

    combined = data_dir / "cov"
    if not combined.exists():
        raise SystemExit(f"{combined}: no combined coverage data (run tools/coverage.sh with TIDERL_COVERAGE_DIR)")
    data = CoverageData(basename=str(combined))
    data.read()
    out: dict[str, set[int]] = {}
    for path in data.measured_files():
        rel = _relative(path)
        if rel is not None:
            out.setdefault(rel, set()).update(data.lines(path) or ())
    return out


def _relative(path: str) -> str | None:
    parts = Path(path).parts
    if "tiderl" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("tiderl")  # the package directory, wherever the checkout lies
    return str(Path(*parts[i:]))


def run_quickstart(data_dir: Path, steps: int, run_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "COVERAGE_FILE": str(data_dir / "cov")}
    cmd = [sys.executable, "-m", "coverage", "run", "-m", "tiderl", "run", "jobs/quickstart.yaml",
           "--set", f"trainer.num_steps={steps}", "--set", "rollout.eval_every_steps=2", "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    subprocess.run([sys.executable, "-m", "coverage", "combine", "-q", str(data_dir)], cwd=ROOT, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", type=Path, required=True, help="The fast tests' coverage data directory.")
    parser.add_argument("--steps", type=int, default=3, help="Versions the real run trains.")
    parser.add_argument("--out", type=Path, default=None, help="Where the run and its coverage data go.")
    args = parser.parse_args(argv)
    fast = lines_of(args.fast)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        run_quickstart(out / "coverage", args.steps, out / "run")
        real = lines_of(out / "coverage")
    gap = {f: sorted(lines - fast.get(f, set())) for f, lines in real.items()}
    gap = {f: lines for f, lines in sorted(gap.items()) if lines}
    for f, lines in gap.items():
        print(f"{f}: {len(lines)} lines: {_ranges(lines)}")
    outside = sum(len(v) for f, v in gap.items() if f not in ENGINE_MODULES)
    print(json.dumps({"run_lines": sum(len(v) for v in real.values()), "gap_lines": sum(len(v) for v in gap.values()),
                      "gap_outside_vllm_engine": outside, "gap_files": len(gap)}))
    return 0


def _ranges(lines: list[int]) -> str:
    out, start, prev = [], lines[0], lines[0]
    for n in lines[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
        if n is not None:
            start = prev = n
    return ", ".join(out)


if __name__ == "__main__":
    sys.exit(main())
