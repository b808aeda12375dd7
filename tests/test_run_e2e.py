"""End-to-end: `tiderl run` of a short hilo job on real vLLM engines (and torch, HTTP, SQLite): the engine serves
exactly the weights each version published, received by transfer. The same on the files path (every engine reads
weights/vN) is the vision job's test (tests/test_rollout_vl_model.py), and the fault campaign's short form
(tests/test_chaos.py) kills a rollout rank of a real vLLM run.

What does not depend on the engine is run on the tests' scripted engine, faster (tests/test_run_without_vllm.py):
every system, data-parallel actors with a decoupled ref, ERS moving actors."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from run_checks import check_run, shared_memory_left_behind

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["trainer.num_steps=3", "trainer.groups_min=1", "trainer.groups_ideal=2", "rollout.group_size=4",
         "rollout.eval_every_steps=0", "rollout.max_concurrency=8", "launch.num_ranks=3",
         "launch.rollout_fraction=0.34", "trainer.checkpoint_every=2"]


def tiderl(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def run_job(run_dir: Path, sets: list[str]) -> None:
    """`tiderl run` of the quickstart job with these overrides; it must finish."""
    out = tiderl("run", "jobs/quickstart.yaml", *[a for s in sets for a in ("--set", s)], "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_bad_config_exits_2_and_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = tiderl("run", "jobs/quickstart.yaml", "--set", "trainer.num_steps=0", "--run-dir", str(run_dir))
    assert out.returncode == 2
    assert "trainer.num_steps" in out.stderr
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_a_short_run_on_vllm_serves_every_version_it_received(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_job(run_dir, SHORT + ["system=tiderl", "trainer.weight_sync=transfer"])
    status = json.loads(tiderl("status", str(run_dir), "--json").stdout)
    assert status["state"] == "finished" and status["version"] == 3
    assert {"rwt_s", "twt_s", "goodput_tok_s", "ranks", "steps"} <= set(status)
    assert status["goodput_tok_s"] > 0
    facts = check_run(run_dir, max_staleness=1)
    assert facts["versions"] == 3
    # The engine served exactly the weights each version published: tokens sampled and trained at the same
    # version score alike on both sides (fp32 on a CPU; the first step's tokens always are); stale tokens
    # are reported apart.
    db = sqlite3.connect(run_dir / "run.db")
    try:
        on_policy = [v for (v,) in db.execute("SELECT value FROM metrics WHERE name = 'logprob_mismatch_on_policy'")]
        paths = {name for (name,) in db.execute("SELECT DISTINCT name FROM metrics WHERE name LIKE 'weights_%_stall_s'")}
        fell_back = db.execute("SELECT count(*) FROM events WHERE kind = 'weights_transfer_failed'").fetchone()[0]
    finally:
        db.close()
    assert on_policy and max(on_policy) <= 1e-4, on_policy
    assert paths == {"weights_transfer_stall_s"} and not fell_back, paths
    assert not shared_memory_left_behind()  # the leader's weight server removed its buckets
