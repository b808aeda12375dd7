"""Load benchmark of the env service: many concurrent sessions through full episodes.

Starts `tiderl env serve` in its own process (or uses --url), then drives
`--sessions` concurrent session loops through the async client; each loop plays
`--episodes` full episodes (start, steps until done, end). Prints one JSON object:
steps/s and p50/p99 latency of /observation as the client sees it (with 256
sessions in flight this is mostly queueing at the server), the server's own time
per step (`server_step_*`, from its /health: parse, env step, answer), plus /start
and /end latencies. Run with the default `--latency none` to measure the service
itself.

    python tools/bench_env.py --sessions 256 --episodes 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiderl.envs.client import EnvClient


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def session_loop(client: EnvClient, env: str, worker: int, episodes: int, rng: random.Random,
                       step_s: list[float], start_s: list[float], end_s: list[float]) -> int:
    num_steps = 0
    for episode in range(episodes):
        t0 = time.perf_counter()
        start = await client.start(env, seed=worker * 100_003 + episode)
        start_s.append(time.perf_counter() - t0)
        low, high = 1, 16
        done = False
        while not done:
            # A noisy binary search: realistic episode lengths (2-6 steps) for hilo.
            guess = rng.randint(low, high) if rng.random() < 0.5 else (low + high) // 2
            t0 = time.perf_counter()
            step = await client.step(start.session_id, str(guess))
            step_s.append(time.perf_counter() - t0)
            num_steps += 1
            done = step.done
            if step.observation == "higher":
                low = guess + 1
            elif step.observation == "lower":
                high = guess - 1
        t0 = time.perf_counter()
        await client.end(start.session_id)
        end_s.append(time.perf_counter() - t0)
    return num_steps


async def drive(url: str, args: argparse.Namespace) -> dict[str, object]:
    step_s: list[float] = []
    start_s: list[float] = []
    end_s: list[float] = []
    async with EnvClient(url, max_connections=args.sessions) as client:
        await client.health()
        t0 = time.perf_counter()
        counts = await asyncio.gather(
            *(session_loop(client, args.env, w, args.episodes, random.Random(w), step_s, start_s, end_s)
              for w in range(args.sessions))
        )
        wall_s = time.perf_counter() - t0
        health = await client.health()
    num_steps = sum(counts)
    return {
        "env": args.env,
        "latency": args.latency,
        "concurrent_sessions": args.sessions,
        "episodes": args.sessions * args.episodes,
        "steps": num_steps,
        "wall_s": round(wall_s, 3),
        "steps_per_s": round(num_steps / wall_s, 1),
        "episodes_per_s": round(args.sessions * args.episodes / wall_s, 1),
        "step_p50_ms": round(1000 * percentile(step_s, 0.50), 2),
        "step_p99_ms": round(1000 * percentile(step_s, 0.99), 2),
        "start_p50_ms": round(1000 * percentile(start_s, 0.50), 2),
        "start_p99_ms": round(1000 * percentile(start_s, 0.99), 2),
        "end_p50_ms": round(1000 * percentile(end_s, 0.50), 2),
        "server_step_p50_ms": round(health["step_p50_ms"], 3),
        "server_step_p99_ms": round(health["step_p99_ms"], 3),
        "server_steps": health["num_steps"],
        "server_sessions_left": health["sessions"],
        "cpu_count": os.cpu_count(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=256, help="Concurrent sessions (default 256).")
    parser.add_argument("--episodes", type=int, default=8, help="Full episodes per session loop (default 8).")
    parser.add_argument("--env", default="hilo")
    parser.add_argument("--latency", default="none", help="Latency profile of the server it starts.")
    parser.add_argument("--url", help="Benchmark this running server instead of starting one.")
    args = parser.parse_args()

    if args.url:
        print(json.dumps(asyncio.run(drive(args.url, args))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "url"
        server = subprocess.Popen(
            [sys.executable, "-m", "tiderl", "env", "serve", "--env", args.env, "--port", "0",
             "--port-file", str(port_file), "--latency", args.latency,
             "--max-sessions", str(max(512, 2 * args.sessions))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != "TIDERL_ENV_TOKEN"},
        )
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("bench_env: the env server did not start")
                time.sleep(0.05)
            result = asyncio.run(drive(port_file.read_text().strip(), args))
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
