"""A run's files on a node shared with other users: files 0600 and directories 0700 whatever the umask,
run names that cannot leave `launch.runs_dir`, a base model that cannot change under a run."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from tiderl.config import ConfigError, load_job
from tiderl.paths import atomic_write_text, private_dir
from tiderl.rundir import RunDirError, check_base_model, check_run_name, create_run, model_checksum, open_run
from tiderl.store.types import RunState

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from attack_store import (LATER_WRITES, file_modes_umask_002, make_run, python, run_name_traversal,  # noqa: E402
                          tampered_base_model, tiderl)


@pytest.fixture
def umask_002():
    old = os.umask(0o002)
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, tuple[bool, int]]:
    return {str(p.relative_to(root)): (p.is_dir(), stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


def test_a_run_made_under_umask_002_is_private_and_so_is_what_its_processes_write(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    python(LATER_WRITES, str(run_dir), umask=0o002)
    modes = _modes(run_dir)
    for name in (".", "run.db", "config.yaml", "weights", "weights/v1", "logs", "logs/rank0.log", "ckpt",
                 "ckpt/child.txt", "summary.md"):
        assert name in modes, sorted(modes)
    assert {p: oct(m) for p, (d, m) in modes.items() if m != (0o700 if d else 0o600)} == {}


def test_create_run_narrows_an_existing_run_dir_and_atomic_writes_default_to_0600(tmp_path: Path,
                                                                                  umask_002: None) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir(mode=0o775)
    run_dir.chmod(0o775)
    paths, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), run_dir)
    store.close()
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(paths.db.stat().st_mode) == 0o600 and stat.S_IMODE(paths.config.stat().st_mode) == 0o600
    os.umask(0o002)
    atomic_write_text(tmp_path / "f", "x")
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o600
    assert stat.S_IMODE(private_dir(tmp_path / "d" / "e").stat().st_mode) == 0o700


def test_a_resumed_run_made_with_wider_modes_is_narrowed(tmp_path: Path, umask_002: None) -> None:
    run_dir = tmp_path / "run"
    make_run(run_dir)
    for p in (run_dir, run_dir / "logs"):
        p.chmod(0o755)
    (run_dir / "run.db").chmod(0o644)
    _, store = open_run(run_dir)
    store.close()
    assert {p: oct(m) for p, (_, m) in _modes(run_dir).items()
            if p in (".", "logs", "run.db")} == {".": "0o700", "logs": "0o700", "run.db": "0o600"}


@pytest.mark.parametrize("name,problem", [("../../../tmp/x", "path separator"), ("..", "'..'"), ("a/b", "separator"),
                                          ("a\\b", "separator"), ("", "empty"), ("  ", "empty"), ("x\n", "control"),
                                          (".hidden", "starts with '.'"), ("a..b", "'..'")])
def test_run_names_that_are_not_one_plain_component_are_refused(name: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        check_run_name(name)


def test_ordinary_run_names_pass() -> None:
    for name in ("quickstart", "qwen2.5-7b", "hilo64", "my_run-2"):
        check_run_name(name)


def test_a_traversing_name_exits_2_before_anything_is_created(tmp_path: Path) -> None:
    runs = tmp_path / "a" / "runs"
    code, _, err, _ = tiderl("run", str(ROOT / "jobs" / "quickstart.yaml"), "--set", "name=../../escaped",
                             "--set", f"launch.runs_dir={runs}")
    assert code == 2 and "Traceback" not in err
    assert "name: '../../escaped' holds a path separator" in err
    assert list(tmp_path.iterdir()) == []


def test_a_traversing_name_is_a_config_error_of_the_job_itself(tmp_path: Path) -> None:
    # `tiderl config` and `submit --dry-run` refuse it as `run` does: the job does not load.
    with pytest.raises(ConfigError, match=r"--set name=\.\./x: name: '\.\./x' holds a path separator"):
        load_job(ROOT / "jobs" / "quickstart.yaml", ["name=../x"])
    code, _, err, _ = tiderl("config", str(ROOT / "jobs" / "quickstart.yaml"), "--set", "name=../x")
    assert code == 2 and "holds a path separator" in err and "Traceback" not in err


def _run_with_model(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "a.safetensors").write_bytes(b"a" * 1000)
    (model / "b.safetensors").write_bytes(b"b" * 1000)
    run_dir = tmp_path / "run"
    make_run(run_dir, "cancelled", model)
    return model, run_dir


def test_the_base_model_is_checked_before_a_resume(tmp_path: Path) -> None:
    import hashlib

    model, run_dir = _run_with_model(tmp_path)
    # The checksum the first launch records for version 0 (tiderl.run.launcher calls the same function).
    assert model_checksum(model) == hashlib.sha256(b"a" * 1000 + b"b" * 1000).hexdigest()
    paths, store = open_run(run_dir)
    check_base_model(paths, store)  # untouched: passes
    (model / "b.safetensors").write_bytes(b"b" * 999 + b"c")
    with pytest.raises(RunDirError, match=rf"base model {model} .*tampered base model is refused"):
        check_base_model(paths, store)
    assert store.run_info().state is RunState.CANCELLED  # nothing changed by the refusal
    store.close()


def test_a_resume_with_a_tampered_base_model_exits_2(tmp_path: Path) -> None:
    model, run_dir = _run_with_model(tmp_path)
    (model / "a.safetensors").write_bytes(b"A" + b"a" * 999)
    code, _, err, _ = tiderl("run", "--resume", str(run_dir))
    assert code == 2 and "Traceback" not in err
    assert f"tiderl run: base model {model} (version 0 of {run_dir})" in err


@pytest.mark.parametrize("case", [run_name_traversal, file_modes_umask_002, tampered_base_model])
def test_the_run_file_attack_cases_are_blocked(case) -> None:
    result = case()
    assert result["blocked"], result["evidence"]
