"""The job's workload, measured by tools/calibrate_cpu.py ``--workload-from``: the environment's ``/start``
and ``/observation`` latencies through the HTTP client, and turns, tokens and generated tokens per
trajectory from a finished run's store."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---- environment and run store ------------------------------------------------------------------
async def _env_latencies(url: str, env: str, sessions: int, episodes: int) -> tuple[list[float], list[float]]:
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_env import session_loop

    from tiderl.envs.client import EnvClient

    step_s: list[float] = []
    start_s: list[float] = []
    end_s: list[float] = []
    async with EnvClient(url) as client:
        await asyncio.gather(*(session_loop(client, env, i, episodes, random.Random(i), step_s, start_s, end_s)
                               for i in range(sessions)))
    return start_s, step_s


def measure_env(env: str, sessions: int, episodes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "url"
        server = subprocess.Popen(
            [sys.executable, "-m", "tiderl", "env", "serve", "--env", env, "--port", "0",
             "--port-file", str(port_file), "--latency", "none"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != "TIDERL_ENV_TOKEN"})
        try:
            deadline = time.monotonic() + 120
            while not port_file.exists() or not port_file.read_text().strip():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("calibrate_cpu: the env server did not start")
                time.sleep(0.1)
            start, step = asyncio.run(_env_latencies(port_file.read_text().strip(), env, sessions, episodes))
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {"env_sessions": sessions, "env_start_s": latency_stats(start), "env_step_s": latency_stats(step)}


def latency_stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(ordered), "mean_s": sum(ordered) / len(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def trajectory_stats(run_dir: Path) -> dict:
    """Per training trajectory: turns, tokens, generated and prompt tokens, by half of the run (by version)."""
    from sqlalchemy import select

    from tiderl.sim.workload import intraclass_correlation
    from tiderl.store import RunStore
    from tiderl.store.codec import unpack_mask
    from tiderl.store.schema import trajectories

    store = RunStore.for_run_dir(run_dir)
    t = trajectories.c
    try:
        rows = store.tx.read(lambda c: c.execute(
            select(t.num_turns, t.num_tokens, t.num_generated, t.loss_mask, t.consumed_version, t.finish)
            .where(t.kind == "train", t.consumed_version.is_not(None))).all())
        # Every finished training trajectory, trained or dropped as stale: the trained ones alone are the
        # groups that finished in time, the shorter ones where a group's tasks share their length.
        played = store.tx.read(lambda c: c.execute(
            select(t.group_id, t.num_turns).where(t.kind == "train", t.finished_at.is_not(None))).all())
    finally:
        store.close()
    if not rows:
        raise SystemExit(f"calibrate_cpu: {run_dir} has no consumed training trajectory")
    last = max(r.consumed_version for r in rows)

    def summary(part: list) -> dict:
        prompt = [unpack_mask(r.loss_mask).index(1) if 1 in unpack_mask(r.loss_mask) else r.num_tokens
                  for r in part]
        return {
            "n": len(part),
            "turns_mean": statistics.fmean(r.num_turns for r in part),
            "tokens_mean": statistics.fmean(r.num_tokens for r in part),
            "gen_tokens_per_turn": statistics.fmean(r.num_generated / max(r.num_turns, 1) for r in part),
            "prompt_tokens": statistics.fmean(prompt),
        }

    first = [r for r in rows if r.consumed_version <= last / 2]
    second = [r for r in rows if r.consumed_version > last / 2] or first
    return {
        "versions": last,
        "turns_min": min(r.num_turns for r in rows),
        "turns_max": max(r.num_turns for r in rows),
        # Trajectories the agent loop cut at env.max_turns: none, and the environment ended every
        # episode itself (hilo's own limit of 6 turns under a job's env.max_turns of 8).
        "agent_capped": sum(1 for r in rows if r.finish == "max_turns"),
        "turns_group_icc": intraclass_correlation(_by_group(played)),
        "start": summary(first or second),
        "end": summary(second),
    }


def _by_group(rows) -> list[list[float]]:  # type: ignore[no-untyped-def]
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r.group_id, []).append(float(r.num_turns))
    return list(groups.values())
