"""vLLM on a CPU, eager or compiled: what an engine start costs and how fast it then decodes.

    python tools/bench_engine_start.py [--model DIR] [--rounds 1] [--requests 32] [--tokens 64]

For each mode (``eager``, ``compiled``; ``rollout.enforce_eager`` chooses), in fresh processes: a copy of
the model in a new directory and an empty vLLM cache (``VLLM_CACHE_ROOT``), as a run's first engine on a
fresh machine meets them; then, for ``compiled``, a second start that finds the compile cache (a later
engine of the same model and settings). Each start is timed from ``VllmEngine(...)`` until it serves,
then ``--requests`` concurrent requests of ``--tokens`` tokens are decoded twice (the second timed). The
modes alternate for ``--rounds`` rounds. Default model: the quickstart's tiny model (built if missing).
Prints one JSON line: per mode the start and decode seconds of each round, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _one(model: str, eager: bool, requests: int, tokens: int) -> dict[str, float]:
    """In this process: start an engine, decode, close."""
    from tiderl.rollout.engine import SamplingSpec
    from tiderl.rollout.vllm_engine import VllmEngine

    t0 = time.perf_counter()
    engine = VllmEngine(model, num_kv_blocks=256, block_size=32, max_model_len=1024, max_num_seqs=requests,
                        enforce_eager=eager)
    start_s = time.perf_counter() - t0

    async def decode() -> float:
        spec = SamplingSpec(max_new_tokens=tokens, temperature=1.0)
        t = time.perf_counter()
        await asyncio.gather(*(engine.generate([1, 2, 3, 4 + i % 50], spec) for i in range(requests)))
        return time.perf_counter() - t

    try:
        asyncio.run(decode())
        decode_s = asyncio.run(decode())
    finally:
        engine.close()
    return {"start_s": start_s, "decode_s": decode_s}


def _in_process(model: Path, eager: bool, cache: Path, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache))
    out = subprocess.run([sys.executable, __file__, "--one", str(model), "--eager", str(int(eager)),
                          "--requests", str(args.requests), "--tokens", str(args.tokens)],
                         env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"bench_engine_start: an engine start failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the quickstart's tiny model)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--eager", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_one(args.one, bool(args.eager), args.requests, args.tokens)), flush=True)
        os._exit(0)  # vLLM's engine threads: nothing left to wait for
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT))
        from tiderl.config.job import load_job
        from tiderl.models import for_job

        model = for_job.model_dir(load_job(ROOT / "jobs" / "quickstart.yaml"))
    runs: dict[str, list[dict[str, float]]] = {"eager": [], "compiled_cold": [], "compiled_cached": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for mode in ("eager", "compiled"):
            with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
                copy = Path(shutil.copytree(model, Path(tmp) / "model"))
                cache = Path(tmp) / "vllm-cache"
                if mode == "eager":
                    runs["eager"].append(_in_process(copy, True, cache, args))
                else:
                    runs["compiled_cold"].append(_in_process(copy, False, cache, args))
                    runs["compiled_cached"].append(_in_process(copy, False, cache, args))
    load.append(os.getloadavg()[0])

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    print(json.dumps({
        "model": str(model), "requests": args.requests, "tokens": args.tokens, "rounds": args.rounds, "runs": runs,
        "ratios": {"start_compiled_cold/eager": med("compiled_cold", "start_s") / med("eager", "start_s"),
                   "start_compiled_cached/eager": med("compiled_cached", "start_s") / med("eager", "start_s"),
                   "decode_compiled/eager": med("compiled_cached", "decode_s") / med("eager", "decode_s")},
        "load_avg_1m": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
