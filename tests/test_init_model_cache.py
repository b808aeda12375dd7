"""`tiderl init-model` writes where runs look: the model a job's `model.path: null` resolves to is the one it
built (same hashed directory), found in the cache instead of built again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.config import load_job
from tiderl.models import for_job
from tiderl.models.tiny_model import MANIFEST, TinyModelSpec, spec_model_dir

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "jobs" / "quickstart.yaml"


def _init_model(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", "init-model", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env={**os.environ, "TIDERL_CACHE": str(cache)})


@pytest.mark.slow
def test_init_model_for_a_job_builds_what_its_run_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    sets = ["--set", "model.init_train_steps=0"]  # the quickstart's model, without its minute of warm start
    done = _init_model(cache, "--job", str(QUICKSTART), *sets)
    assert done.returncode == 0, done.stderr
    built = json.loads(done.stdout)
    assert built["cached"] is False
    path = Path(built["path"])
    assert path.parent == cache / "models" and path.name == f"tiny-hilo-{built['hash']}"

    monkeypatch.setenv("TIDERL_CACHE", str(cache))
    job = load_job(QUICKSTART, ["model.init_train_steps=0"])
    manifest = (path / MANIFEST).stat().st_mtime_ns
    assert for_job.model_dir(job) == path  # what the run loads
    assert (path / MANIFEST).stat().st_mtime_ns == manifest  # found, not built again

    again = _init_model(cache, "--job", str(QUICKSTART), *sets)
    assert again.returncode == 0 and json.loads(again.stdout)["cached"] is True


def test_default_output_is_the_spec_directory_runs_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDERL_CACHE", str(tmp_path))
    quickstart = for_job.tiny_spec(load_job(QUICKSTART))
    assert quickstart.env_options and quickstart.demo_noise == 0.05  # the job's own task and noise
    assert for_job.spec_dir(quickstart).name.startswith("tiny-hilo-")
    assert for_job.spec_dir(TinyModelSpec(env="hilo")) == tmp_path / "models" / "tiny-hilo"
    noisy = TinyModelSpec(env="hilo", demo_noise=0.1)
    assert for_job.spec_dir(noisy) == spec_model_dir(noisy) != tmp_path / "models" / "tiny-hilo"


def test_init_model_refuses_mixed_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init-model", "--job", str(QUICKSTART), "--env", "hilo"]) == 2
    assert "not with --env" in capsys.readouterr().err
    assert main(["init-model", "--set", "model.init_train_steps=0"]) == 2
    assert "--set needs --job" in capsys.readouterr().err
    assert main(["init-model", "--job", str(QUICKSTART), "--set", "model.path=/m"]) == 2
    assert "model.path is /m" in capsys.readouterr().err


def test_help_says_the_default_output_is_where_runs_look() -> None:
    done = subprocess.run([sys.executable, "-m", "tiderl", "init-model", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    text = " ".join(done.stdout.split())
    assert "where runs with `model.path: null` look for this model" in text
    assert "tiny-ENV-HASH" in text and "--job" in text


def _counted_build(out_dir: Path, spec: TinyModelSpec, digest: str) -> Path:
    """A build that takes a while and leaves a mark of each time it ran."""
    import time

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / "builds", "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    out_dir.mkdir()
    (out_dir / MANIFEST).write_text(json.dumps({"hash": digest}))
    return out_dir


def test_processes_that_want_one_model_at_once_build_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three processes ask for the same uncached model together (the ranks of a node, two runs): one builds it,
    the others wait for it and find it built."""
    import multiprocessing

    from tiderl.models import tiny_model

    monkeypatch.setattr(tiny_model, "_build", _counted_build)
    out = tmp_path / "models" / "tiny-hilo"
    procs = [multiprocessing.get_context("fork").Process(target=tiny_model.init_model, args=(out, TinyModelSpec()))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]  # a second build would find the directory there and fail
    assert len((tmp_path / "models" / "builds").read_text().split()) == 1
