"""End-to-end: `tiderl run` of a short hilo job under each `system:` value (real vLLM, torch, HTTP, SQLite)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from run_checks import check_run

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
@pytest.mark.parametrize("system", ["sync", "async", "stream", "tiderl"])
def test_short_run_per_system(tmp_path: Path, system: str) -> None:
    run_dir = tmp_path / "run"
    # tiderl's run takes its weights by transfer (trainer.weight_sync), the others read the files.
    transfer = system == "tiderl"
    run_job(run_dir, SHORT + [f"system={system}"] + (["trainer.weight_sync=transfer"] if transfer else []))
    status = json.loads(tiderl("status", str(run_dir), "--json").stdout)
    assert status["state"] == "finished" and status["version"] == 3
    assert {"rwt_s", "twt_s", "goodput_tok_s", "ranks", "steps"} <= set(status)
    assert status["goodput_tok_s"] > 0
    bound = 0 if system == "sync" else 1
    facts = check_run(run_dir, max_staleness=bound)
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
    assert paths == {"weights_transfer_stall_s" if transfer else "weights_files_stall_s"} and not fell_back, paths


@pytest.mark.slow
@pytest.mark.vllm
def test_data_parallel_actors_with_a_decoupled_ref(tmp_path: Path) -> None:
    """Two actor ranks train each step together (the leader publishes), a ref rank serves them."""
    run_dir = tmp_path / "run"
    sets = SHORT + ["system=async", "trainer.ra2p_mode=decoupled", "launch.num_ranks=4", "trainer.actor_ranks=2",
                    "launch.rollout_fraction=0.25", "monitor.metrics_port=0"]
    run_job(run_dir, sets)
    facts = check_run(run_dir, max_staleness=1)
    assert facts["versions"] == 3
    db = sqlite3.connect(run_dir / "run.db")
    roles = dict(db.execute("select rank, role from control where version = 0").fetchall())
    assert roles == {0: "actor", 1: "actor", 2: "rollout", 3: "ref"}
    trained = db.execute("select rank, count(*) from metrics where name = 'train_s' group by rank").fetchall()
    assert dict(trained) == {0: 3, 1: 3}, "both actors train every step"
    modes = {m for (m,) in db.execute("select ra2p_mode from versions where version > 0")}
    assert modes == {"decoupled"}
    # The follower actor and the ref record their waits for the leader's data as TWT, every step.
    waited = dict(db.execute("select rank, count(distinct version) from metrics where name = 'twt_s' "
                             "and rank in (1, 3) group by rank").fetchall())
    assert waited == {1: 3, 3: 3}
    # Every process served its Prometheus registry (the control plane's run metrics, each rank's own).
    urls = sorted(p.name for p in (run_dir / "metrics").glob("*.url"))
    assert urls == ["control.url", "rank0.url", "rank1.url", "rank2.url", "rank3.url"]


@pytest.mark.slow
@pytest.mark.vllm
def test_elastic_actors_join_and_leave_with_the_groups_state(tmp_path: Path) -> None:
    """`ers.elastic_actors`: ERS moves data-parallel actor ranks to and from rollout at boundaries
    (a tiny HoL tau makes any waiting micro-batch a consumption deficit, an empty buffer a generation
    deficit); an actor that joins takes the group's weights and optimizer state, nothing is lost."""
    run_dir = tmp_path / "run"
    sets = SHORT + ["system=tiderl", "trainer.num_steps=6", "launch.num_ranks=4", "trainer.actor_ranks=2",
                    "launch.rollout_fraction=0.5", "ers.elastic_actors=true", "ers.max_ref_ranks=0",
                    "ers.policy=paper", "ers.hol_tau=0.001", "trainer.checkpoint_every=100"]
    run_job(run_dir, sets)
    facts = check_run(run_dir, max_staleness=1)
    assert facts["versions"] == 6
    db = sqlite3.connect(run_dir / "run.db")
    actors: dict[int, set[int]] = {}
    for version, rank in db.execute("select version, rank from control where role = 'actor'"):
        actors.setdefault(version, set()).add(rank)
    joined = {v: actors[v] - actors[v - 1] for v in range(1, 6) if actors[v] - actors[v - 1]}
    assert joined, f"no actor rank joined in 6 steps: {actors}"
    took = "".join((run_dir / "logs" / f"rank{r}.log").read_text() for r in range(4)).count("from the group, held")
    assert took >= len(joined), (joined, took)
    # every actor of a step trained it (the joiners too)
    trained = db.execute("select version, count(*) from metrics where name = 'train_s' group by version").fetchall()
    assert all(n == len(actors[v]) for v, n in trained), (trained, actors)
