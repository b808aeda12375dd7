"""Run directory layout, and `tiderl status` on a store with a known story."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.config import load_job
from tiderl.paths import RunPaths, atomic_write_text
from tiderl.rundir import RunDirError, create_run, open_run
from tiderl.store import (FinishedTrajectory, MetricPoint, NewGroup, NoRunError, RankReport, Role, RunState, RunStore,
                          TaskKind, VersionRecord)

ROOT = Path(__file__).resolve().parents[1]


def test_create_run_lays_out_the_directory(tmp_path: Path) -> None:
    cfg = load_job(ROOT / "jobs" / "quickstart.yaml", ["trainer.num_steps=3"])
    paths, store = create_run(cfg, tmp_path / "r")
    for p in (paths.db, paths.config, paths.weights, paths.ckpt, paths.logs):
        assert p.exists(), p
    assert load_job(paths.config) == cfg
    assert store.run_info().state is RunState.STARTING
    with pytest.raises(RunDirError, match="already holds a run"):
        create_run(cfg, tmp_path / "r")


def test_run_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    # A shared node: a run's config, store and summary are its user's alone (0600), even under umask 027.
    old = os.umask(0o027)
    try:
        paths, _ = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "r")
        atomic_write_text(paths.root / "summary.md", "# run\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(paths.config.stat().st_mode) == 0o600
    assert stat.S_IMODE((paths.root / "summary.md").stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.root.stat().st_mode) == 0o700
    atomic_write_text(tmp_path / "secret", "token\n", mode=0o600)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600


def test_weight_versions_ignore_half_written_dirs(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).create()
    for name in ("v0", "v2", "v10", "v3.tmp", "x"):
        (paths.weights / name).mkdir()
    assert paths.weight_versions() == [0, 2, 10]


def test_open_run_without_store(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="no run store"):
        open_run(tmp_path)


def test_a_run_being_created_reads_as_no_run_yet_not_as_an_sql_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Between the store's file appearing and its tables (then its run row) being written, a look at the run
    # (`tiderl status`, a script polling it) gets NoRunError, which names the run store, not "no such table".
    store = RunStore.for_run_dir(tmp_path)
    store.tx.read(lambda c: c.exec_driver_sql("SELECT 1").scalar())  # the file exists, no tables yet
    assert (tmp_path / "run.db").exists()
    for look in (store.run_info, store.position, store.trainer_generation):
        with pytest.raises(NoRunError, match="no run recorded yet"):
            look()
    assert main(["status", str(tmp_path)]) == 2
    assert "no run recorded yet" in capsys.readouterr().err
    store.create_schema()
    with pytest.raises(NoRunError, match="no run recorded$"):
        store.run_info()
    store.close()


def _story(run_dir: Path) -> None:
    cfg = load_job(ROOT / "jobs" / "quickstart.yaml")
    _, s = create_run(cfg, run_dir)
    s.register_initial_version("weights/v0", "c0")
    s.register_rank(0, Role.ROLLOUT)
    s.register_rank(1, Role.ACTOR)
    s.plan_roles(0, {0: Role.ROLLOUT, 1: Role.ACTOR})
    s.set_run_state(RunState.RUNNING)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.TRAIN, 2, 2)])
    claims = s.claim_tasks(0, 2)
    s.report(RankReport(rank=0, finished=[
        FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1],
                           logprobs=[0, -1, -1, -1], token_versions=[-1, 0, 0, 0], num_turns=1 + 2 * i,
                           reward=float(i), success=bool(i), env=("hilo", "pytool")[i]) for i, c in enumerate(claims)],
        metrics=[MetricPoint("rwt_s", 1.5), MetricPoint("twt_s", 0.25)]))
    got = s.claim_ready_groups(1, 4)
    s.publish_version(VersionRecord(version=1, path="weights/v1", checksum="c1", trajectory_ids=[t.id for t in got],
                                    step_started_at=0.0, duration_s=3.0, ras=1, tprm_s=0.5, ra2p_mode="colocated"),
                      owner=1)
    s.report(RankReport(rank=1, metrics=[MetricPoint("clip_frac", 0.125, 0, "actor"),
                                         MetricPoint("logprob_mismatch_on_policy", 0.0625, 0, "actor"),
                                         MetricPoint("entropy", 0.75, 0, "actor")]))
    s.report(RankReport(rank=0, metrics=[MetricPoint(n, v, 1, "rollout") for n, v in (
        ("ctb_admitted", 2), ("ctb_pauses", 1), ("ctb_resumes", 1), ("ctb_prefix_kept", 3), ("ctb_prefix_evicted", 1),
        ("prefix_cache_queries", 100), ("prefix_cache_hits", 40), ("kv_usage", 0.5), ("ctb_budget_tokens", 1500))]))
    s.report(RankReport(rank=0, metrics=[MetricPoint("ctb_admitted", 1, 1, "rollout"),
                                         MetricPoint("prefix_cache_queries", 100, 1, "rollout")]))


def test_status_json_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _story(tmp_path / "r")
    assert main(["status", str(tmp_path / "r"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "running" and doc["version"] == 1
    assert doc["consumed_tokens"] == 6 and doc["goodput_tok_s"] > 0
    assert doc["rwt_s"] == 1.5 and doc["twt_s"] == 0.25
    assert [(r["rank"], r["role"]) for r in doc["ranks"]] == [(0, "rollout"), (1, "actor")]
    (step,) = doc["steps"]
    assert step == {"version": 1, "success_rate": 0.5, "reward_mean": 0.5, "turns_mean": 2.0, "turns_max": 3,
                    "consumed_tokens": 6, "duration_s": 3.0, "goodput_tok_s": 2.0, "ras": 1, "tprm_s": 0.5,
                    "ra2p_mode": "colocated", "max_staleness": 0, "eval": False,
                    "env_figures": {"hilo": {"num_trajectories": 1, "reward_mean": 0.0, "success_rate": 0.0},
                                    "pytool": {"num_trajectories": 1, "reward_mean": 1.0, "success_rate": 1.0}}}
    assert doc["buffer"]["tasks_pending"] == 2 and doc["buffer"]["traj_consumed"] == 2
    assert doc["trainer"] == {"clip_frac": 0.125, "logprob_mismatch_on_policy": 0.0625, "entropy": 0.75}
    assert doc["rollout"] == {"ctb_admitted": 3, "ctb_pauses": 1, "ctb_resumes": 1, "ctb_prefix_kept": 3,
                              "ctb_prefix_evicted": 1, "prefix_cache_queries": 200, "prefix_cache_hits": 40,
                              "kv_usage": 0.5, "kv_usage_peak": 0.5, "ctb_budget_tokens": 1500.0}
    assert doc["steady_from_version"] == 1 and doc["startup_s"] is not None and doc["steady_goodput_tok_s"] is None


def test_status_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _story(tmp_path / "r")
    assert main(["status", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "run quickstart (tiderl): running" in out
    assert "colocated" in out and "rollout" in out and "tasks pending 2" in out
    assert "trainer (last step): entropy 0.75, clip_frac 0.125, logprob_mismatch_on_policy 0.0625" in out
    assert "version  success  reward  turns  tokens" in out and "      1     0.50    0.50    2.0       6" in out
    assert ("per environment (last step): hilo reward 0.00 success 0.00 (1 trajectories); "
            "pytool reward 1.00 success 1.00 (1 trajectories)") in out
    assert ("rollout (run so far): admitted 3, paused 1, resumed 1; turns whose context the prefix cache kept 3, "
            "evicted 1; prefix-cache hit rate 0.20; KV usage 0.50 (peak 0.50); CTB budget 1500 tokens") in out


def test_status_of_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(tmp_path)]) == 2
    assert "no run store" in capsys.readouterr().err


def _finished_run(run_dir: Path) -> None:
    _, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), run_dir)
    store.register_initial_version("model", "0")
    store.set_run_state(RunState.FINISHED)
    store.close()


def test_status_opens_the_store_read_only_and_works_on_a_read_only_run_dir(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "r"
    _finished_run(run_dir)
    before = (run_dir / "run.db").read_bytes()
    assert main(["status", str(run_dir), "--json", "--no-probe"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "finished"
    assert (run_dir / "run.db").read_bytes() == before  # nothing written
    run_dir.chmod(0o555)
    (run_dir / "run.db").chmod(0o444)
    try:
        # As root the permission bits do not stop writes: what is checked is that nothing needs them.
        assert main(["status", str(run_dir), "--no-probe"]) == 0
        assert "finished" in capsys.readouterr().out
    finally:
        run_dir.chmod(0o755)
        (run_dir / "run.db").chmod(0o644)
    _, store = open_run(run_dir, read_only=True)
    with pytest.raises(Exception, match="readonly|read-only"):
        store.set_run_state(RunState.RUNNING)
    store.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_run_db_is_named_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                damage: str) -> None:
    run_dir = tmp_path / "r"
    _finished_run(run_dir)
    db = run_dir / "run.db"
    data = db.read_bytes()
    db.write_bytes(b"this is not sqlite" * 100 if damage == "garbage" else data[: len(data) // 3])
    for command in (["status", str(run_dir)], ["status", str(run_dir), "--check"], ["report", str(run_dir)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"{db} is corrupt" in err and "Traceback" not in err
