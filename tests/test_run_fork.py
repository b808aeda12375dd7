"""Forking a run (issue 49, its optional item): `tiderl run --resume RUN_DIR --fork NEW_DIR [--set k=v ...]` makes a
new run in NEW_DIR from RUN_DIR's newest complete checkpoint (weights, optimizer state, version), RUN_DIR only
read; bad input is refused (exit 2) before NEW_DIR is made."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fake_engine import SCRIPTED_ENGINE, scripted_run_env
from run_checks import check_run
from tiderl.cli import main
from tiderl.config import load_job
from tiderl.models.for_job import model_dir
from tiderl.policy.ra2p import Ra2pMode
from tiderl.run.control import ControlPlane, train_seed
from tiderl.rundir import create_run, model_checksum
from tiderl.store import NewGroup, RunState, TaskKind
from tiderl.trainer.modes import TrainerComm
from tiderl.trainer.publish import verify
from tiderl.trainer.rank import ActorRank, StepInput, find_resume_point
from tiderl.trainer.synthetic import random_samples

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "quickstart.yaml"
SETS = [f"rollout.engine={SCRIPTED_ENGINE}", "trainer.num_steps=3", "trainer.checkpoint_every=2",
        "trainer.keep_versions=5", "launch.num_ranks=2"]
SOURCE_GROUPS = 5  # training groups the synthetic source drew


def snapshot(run_dir: Path) -> dict[str, tuple[str, int]]:
    """Every file of a run directory: its content's digest and its modification time."""
    return {str(p.relative_to(run_dir)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


SQLITE_SIDE_FILES = {"run.db-wal", "run.db-shm"}


def assert_unchanged(before: dict[str, tuple[str, int]], run_dir: Path) -> None:
    """Nothing of the source changed: no file added, removed or written, its store's included. SQLite's
    read-only opening of a WAL store leaves an empty -wal and its shared-memory index (-shm) beside it, as
    `tiderl status` does: no data."""
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k not in SQLITE_SIDE_FILES} == \
        {k: v for k, v in before.items() if k not in SQLITE_SIDE_FILES}
    assert not (run_dir / "run.db-wal").exists() or (run_dir / "run.db-wal").stat().st_size == 0


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, quickstart_model: Path) -> Path:
    """A finished run as its processes leave it, made without them: its store (version 3, finished, 5 training
    groups drawn), weights v1-v3 and the checkpoint of step 2, trained by the actor on synthetic groups."""
    run_dir = tmp_path_factory.mktemp("fork") / "source"
    config = load_job(JOB, SETS)
    assert model_dir(config) == quickstart_model
    _, store = create_run(config, run_dir)
    try:
        store.register_initial_version(str(quickstart_model), model_checksum(quickstart_model))
        store.add_groups([NewGroup(TaskKind.TRAIN, train_seed(config.seed, i), 4) for i in range(SOURCE_GROUPS)])
        store.set_run_state(RunState.FINISHED, "3 steps done")
    finally:
        store.close()
    db = sqlite3.connect(run_dir / "run.db")
    with db:
        db.execute("UPDATE runs SET version = 3")
    db.close()  # the last connection: SQLite takes its -wal and -shm files away, as a finished run leaves it
    actor = ActorRank(config.trainer, TrainerComm(rank=0, actor_ranks=(0,)), base_model=quickstart_model,
                      weights_root=run_dir / "weights", ckpt_root=run_dir / "ckpt", with_ref=True)
    for v in range(3):
        actor.train_step(StepInput(v, tuple(random_samples(2, 4, vocab_size=200, version=v, seed=v)),
                                   Ra2pMode.COLOCATED))
    assert [p.name for p in (run_dir / "ckpt").iterdir()] == ["step2"]
    return run_dir


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list:
    """The launches `tiderl run` would start: the processes are left out (the slow test below runs them)."""
    out: list = []
    monkeypatch.setattr("tiderl.run.launcher.run_launch", lambda launch, *a, **k: out.append(launch) or 0)
    return out


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for p in sorted(directory.glob("*.safetensors")) for k, v in load_file(p).items()}


def test_a_fork_starts_from_the_sources_checkpoint_and_leaves_the_source_as_it_was(
        source: Path, tmp_path: Path, launched: list, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(source)
    fork = tmp_path / "fork"
    assert main(["run", "--resume", str(source), "--fork", str(fork), "--set", "trainer.num_steps=6",
                 "--set", "rollout.group_size=2"]) == 0
    err = capsys.readouterr().err
    assert "forked" in err and "step 2" in err and "trainer.num_steps: 3 -> 6" in err
    [launch] = launched
    assert not launch.resumed and launch.paths.root == fork and launch.config.trainer.num_steps == 6
    assert_unchanged(before, source)

    # Its first weights are the checkpoint's (the source published the same at version 2), not the base model's.
    weights = tensors(fork / "weights" / "v2")
    assert all(torch.equal(t, tensors(source / "weights" / "v2")[k]) for k, t in weights.items())
    base = tensors(model_dir(launch.config))
    assert any(not torch.equal(t, base[k]) for k, t in weights.items())
    verify(fork / "ckpt" / "step2")
    point = find_resume_point(model_dir(launch.config), fork / "weights", fork / "ckpt")
    assert point.version == 2 and point.is_exact  # the trainer resumes from it: weights v2, the optimizer of step 2
    assert sorted(p.name for p in (fork / "weights").iterdir()) == ["v2"]

    store = launch.store
    try:
        origin = store.fork_origin()
        assert (origin.run_dir, origin.step, origin.version, origin.source_train_groups) == (
            str(source.resolve()), 2, 2, SOURCE_GROUPS)
        assert store.position() == (RunState.STARTING, 2)
        [event] = store.recent_events(10, kinds=["forked"])
        assert str(source.resolve()) in event["message"] and "rollout.group_size: 8 -> 2" in event["message"]
        assert load_job(fork / "config.yaml").rollout.group_size == 2
        # The control plane plans the initial split at version 2 and draws prompts after the source's.
        plane = ControlPlane(launch.config, store)
        assert plane.tick()
        assert store.plan_at(2) is not None and len(store.plan_at(2).roles) == 2
        with store.engine.connect() as c:
            seeds = [s for (s,) in c.exec_driver_sql("SELECT prompt_seed FROM task_groups WHERE kind = 'train'")]
        assert seeds and min(seeds) == train_seed(launch.config.seed, SOURCE_GROUPS)
    finally:
        store.close()


def refused_at(source: Path, fork: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> str:
    """What `tiderl run --resume SOURCE --fork FORK --set ...` says on refusing (exit 2, FORK not made)."""
    assert main(["run", "--resume", str(source), "--fork", str(fork), *[a for s in sets for a in ("--set", s)]]) == 2
    assert not fork.exists()
    return capsys.readouterr().err


def test_bad_input_is_refused_before_the_fork_is_made(source: Path, tmp_path: Path, launched: list,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(source)
    fork = tmp_path / "fork"
    assert "write true or false" in refused_at(source, fork, capsys, "monitor.tensorboard=yes")
    err = refused_at(source, fork, capsys, "trainer.lr=1e-4", "model.max_context_tokens=333")
    assert "--set model.max_context_tokens=333: model.max_context_tokens: cannot change on a fork" in err
    assert "the fork starts at version 2" in refused_at(source, fork, capsys, "trainer.num_steps=2")
    assert "inside" in refused_at(source, source / "fork", capsys)
    fork.mkdir()
    (fork / "notes.txt").write_text("mine")
    assert main(["run", "--resume", str(source), "--fork", str(fork)]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in fork.iterdir()] == ["notes.txt"]
    assert main(["run", "--fork", str(tmp_path / "other")]) == 2 and not (tmp_path / "other").exists()
    assert not launched
    assert_unchanged(before, source)


def test_a_source_without_a_complete_checkpoint_is_refused(tmp_path: Path, launched: list,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    _, store = create_run(load_job(JOB, SETS), run_dir)
    store.close()
    (run_dir / "ckpt" / ".step4.tmp-dcp").mkdir()  # a checkpoint whose save never committed
    damaged = run_dir / "ckpt" / "step2"  # and one whose files do not match their checksums
    damaged.mkdir()
    (damaged / "trainer_state.json").write_text('{"step": 2, "version": 2, "extra": {}}')
    (damaged / "SHA256SUMS").write_text(f"{'0' * 64}  trainer_state.json\n")
    err = refused_at(run_dir, tmp_path / "fork", capsys)
    assert "no complete checkpoint" in err
    assert "no run store" in refused_at(tmp_path / "nothing", tmp_path / "fork", capsys)
    assert not launched


def test_a_fork_from_another_base_model_is_refused(source: Path, tmp_path: Path, launched: list,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint was trained from the base model the source recorded at its first launch: a job whose
    model is another (here: the record says so) cannot start from it."""
    other = tmp_path / "other"
    shutil.copytree(source, other)
    db = sqlite3.connect(other / "run.db")
    with db:
        db.execute("UPDATE versions SET checksum = ? WHERE version = 0", ("0" * 64,))
    db.close()
    assert "its weights are not the ones" in refused_at(other, tmp_path / "fork", capsys)
    assert not launched


def fail_full(*args: object) -> None:
    """In place of the fork's export of its weights: the disk is full."""
    raise OSError(28, "No space left on device")


def test_a_fork_that_fails_while_it_is_made_leaves_nothing(source: Path, tmp_path: Path, launched: list,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("tiderl.run.fork._export_weights", fail_full)
    fork = tmp_path / "fork"
    fork.mkdir()  # an empty directory may be given: it is left empty
    assert main(["run", "--resume", str(source), "--fork", str(fork)]) == 2
    assert "the fork could not be made" in capsys.readouterr().err
    assert fork.is_dir() and not any(fork.iterdir()) and not launched


def test_status_shows_where_a_fork_started(source: Path, tmp_path: Path, launched: list,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fork = tmp_path / "fork"
    assert main(["run", "--resume", str(source), "--fork", str(fork)]) == 0
    launched[0].store.close()
    capsys.readouterr()
    assert main(["status", str(fork), "--json", "--no-probe"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["forked_from"] == {"run_dir": str(source.resolve()), "step": 2, "version": 2,
                                  "source_train_groups": SOURCE_GROUPS}
    assert main(["status", str(fork), "--no-probe"]) == 0
    assert f"forked from {source.resolve()} at its checkpoint of step 2 (version 2)" in capsys.readouterr().out
    # A run of its own says nothing of the kind.
    assert main(["status", str(source), "--json", "--no-probe"]) == 0
    assert "forked_from" not in json.loads(capsys.readouterr().out)
    assert main(["status", str(source), "--no-probe"]) == 0
    assert "forked from" not in capsys.readouterr().out


def test_a_fork_resumes_as_a_run_and_a_requeued_job_resumes_the_fork_not_its_source(
        source: Path, tmp_path: Path, launched: list, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A Slurm job whose step is `tiderl run --resume SOURCE --fork NEW_DIR`: its first attempt makes the fork; a
    requeue runs the same command line again (SLURM_RESTART_COUNT > 0), which resumes NEW_DIR; by hand,
    `tiderl run --resume NEW_DIR` resumes it, and the fork's command again is refused, naming the resume."""
    before = snapshot(source)
    fork = tmp_path / "fork"
    in_job: list = []
    monkeypatch.setattr("tiderl.run_cli._run_in_slurm_job", lambda launch, job_id: in_job.append(launch) or 0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    command = ["run", "--resume", str(source), "--fork", str(fork), "--set", "trainer.num_steps=6"]

    def attempt(restarts: int) -> object:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
        assert main(command) == 0
        launch = in_job.pop()
        launch.store.close()
        return launch

    first = attempt(0)
    assert not first.resumed and first.paths.root == fork
    capsys.readouterr()
    for restarts in (1, 2):
        again = attempt(restarts)
        assert again.resumed and again.paths.root == fork and again.config.trainer.num_steps == 6
        assert not again.changes
        err = capsys.readouterr().err
        assert f"requeued ({restarts})" in err and f"resuming {fork} at version 2 of 6" in err
    assert_unchanged(before, source)

    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert main(["run", "--resume", str(fork)]) == 0
    [resumed] = launched
    try:
        assert resumed.resumed and resumed.paths.root == fork and resumed.store.position()[1] == 2
        assert resumed.store.fork_origin().run_dir == str(source.resolve())
        assert ControlPlane(resumed.config, resumed.store)._first_seed_index() == SOURCE_GROUPS
        point = find_resume_point(model_dir(resumed.config), fork / "weights", fork / "ckpt")
        assert point.version == 2 and point.is_exact
    finally:
        resumed.store.close()
    assert main(command) == 2
    assert f"it holds this fork already: `tiderl run --resume {fork}` resumes it" in capsys.readouterr().err
    assert len(launched) == 1 and not in_job
    assert_unchanged(before, source)


def test_a_fork_whose_store_is_elsewhere_leaves_no_store_where_it_fails(
        source: Path, tmp_path: Path, launched: list, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A `store.url` outside NEW_DIR (SQLite here; PostgreSQL's schema below): the file the failed fork made goes."""
    monkeypatch.setattr("tiderl.run.fork._export_weights", fail_full)
    db = tmp_path / "stores" / "fork.db"
    db.parent.mkdir()
    assert main(["run", "--resume", str(source), "--fork", str(tmp_path / "fork"), "--set",
                 f"store.url=sqlite:///{db}"]) == 2
    assert "nothing of it was kept" in capsys.readouterr().err
    assert not any(db.parent.iterdir()) and not (tmp_path / "fork").exists() and not launched


def pg_schemas(url: str) -> dict[str, set[str]]:
    """The schemas on the server that a run could have made or a user made, each with its tables."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as c:
            rows = c.execute(text("SELECT n.nspname, c.relname FROM pg_namespace n LEFT JOIN pg_class c ON "
                                  "c.relnamespace = n.oid AND c.relkind IN ('r', 'v') WHERE n.nspname LIKE 'run_%' "
                                  "OR n.nspname = 'mine'")).all()
    finally:
        engine.dispose()
    out: dict[str, set[str]] = {}
    for schema, table in rows:
        out.setdefault(schema, set()).update([table] if table else [])
    return out


@pytest.mark.postgres
def test_a_fork_that_fails_on_postgresql_drops_what_it_made_of_its_store(
        pg_server, source: Path, tmp_path: Path, launched: list, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from sqlalchemy import create_engine, text

    from tiderl.store.location import run_schema

    url = pg_server.url
    fork = tmp_path / "fork"
    assert main(["run", "--resume", str(source), "--fork", str(fork), "--set", f"store.url={url}"]) == 0
    [made] = launched
    made.store.close()
    assert "runs" in pg_schemas(url)[run_schema(fork)]  # a fork made whole keeps its schema
    monkeypatch.setattr("tiderl.run.fork._export_weights", fail_full)
    failed = tmp_path / "failed"
    assert main(["run", "--resume", str(source), "--fork", str(failed), "--set", f"store.url={url}"]) == 2
    assert "nothing of it was kept" in capsys.readouterr().err
    assert run_schema(failed) not in pg_schemas(url) and not failed.exists()

    # A schema of the user's own, named in the URL: the store's tables and views go, the schema and the rest stay.
    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("CREATE SCHEMA mine"))
        c.execute(text("CREATE TABLE mine.notes (line text)"))
    try:
        assert main(["run", "--resume", str(source), "--fork", str(failed), "--set",
                     f"store.url={url}?options=-csearch_path%3Dmine"]) == 2
        assert pg_schemas(url)["mine"] == {"notes"} and len(launched) == 1
    finally:
        with engine.begin() as c:
            c.execute(text("DROP SCHEMA mine CASCADE"))
        engine.dispose()


@pytest.mark.slow
def test_a_fork_of_a_finished_run_trains_on_from_its_checkpoint(tmp_path: Path) -> None:
    """Real short local runs (the scripted engine, tests/fake_engine.py): a run to 3 steps, then a fork of it to 5
    from its checkpoint of step 2: the fork's ranks start on the checkpoint's weights and train versions 3 to 5
    exactly once, the source stays as it was."""
    cache, source, fork = tmp_path / "cache", tmp_path / "source", tmp_path / "fork"

    def tiderl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, env=scripted_run_env(cache))

    sets = SETS + ["model.init_train_steps=5", "trainer.groups_min=1", "trainer.groups_ideal=2",
                   "rollout.group_size=4", "rollout.max_concurrency=8", "rollout.eval_every_steps=0", "system=async"]
    out = tiderl("run", str(JOB), *[a for s in sets for a in ("--set", s)], "--run-dir", str(source))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert check_run(source, max_staleness=1)["versions"] == 3
    before = snapshot(source)
    out = tiderl("run", "--resume", str(source), "--fork", str(fork), "--set", "trainer.num_steps=5")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_unchanged(before, source)
    status = json.loads(tiderl("status", str(fork), "--json").stdout)
    assert status["state"] == "finished" and status["version"] == 5
    assert (status["forked_from"]["run_dir"], status["forked_from"]["step"]) == (str(source.resolve()), 2)
    assert check_run(fork, max_staleness=1)["versions"] == 3  # versions 3, 4 and 5, each trained once
    first, published = tensors(fork / "weights" / "v2"), tensors(source / "weights" / "v2")
    assert all(torch.equal(t, published[k]) for k, t in first.items())
    db = sqlite3.connect(f"file:{fork / 'run.db'}?mode=ro", uri=True)
    try:
        assert db.execute("SELECT min(min_version) FROM trajectories").fetchone() == (2,)  # rolled out on v2 first
    finally:
        db.close()
