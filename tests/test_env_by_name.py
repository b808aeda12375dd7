"""Environments of one's own, by import path (`module:Class`) and by entry point (group `tiderl.envs`):
resolved by the registry, served by `tiderl env serve` as a real process, their options checked like the
built-ins', and unknown names refused with what was tried (exit 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tiderl.config import ConfigError, load_job
from tiderl.envs.base import EnvOptionError
from tiderl.envs.registry import EnvUnavailableError, UnknownEnvError, env_class, env_names

ROOT = Path(__file__).resolve().parents[1]

COUNTDOWN = '''
from tiderl.envs.base import Environment, StepResult, read_options


class CountdownEnv(Environment):
    """Say the numbers from `start` down to 1, one a turn."""

    name = "countdown"
    option_defaults = {"start": 3}

    def reset(self, seed, options):
        self.options = read_options(self.name, options, self.option_defaults)
        self.next = self.options["start"]
        self.said = 0
        return f"count down from {self.next}", {}

    def step(self, action):
        ok = action.strip() == str(self.next)
        self.said += ok
        self.next -= 1
        return StepResult("ok" if ok else "wrong", float(ok), self.next == 0, {})

    def final_reward(self):
        return self.said / self.options["start"]


NOT_AN_ENV = 3
'''


@pytest.fixture
def mypkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A package `mypkg` with `mypkg.envs:CountdownEnv`, installed (a dist-info with an entry point
    `countdown` in group `tiderl.envs`) on this process's path and on its children's."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(COUNTDOWN)
    dist = tmp_path / "mypkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tiderl.envs]\ncountdown = mypkg.envs:CountdownEnv\n"
                                          "broken = mypkg.missing:Nothing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_import_path_and_entry_point_resolve_to_the_class(mypkg: Path) -> None:
    by_path = env_class("mypkg.envs:CountdownEnv")
    assert by_path.__name__ == "CountdownEnv"
    assert env_class("countdown") is by_path
    assert "countdown" in env_names() and "hilo" in env_names()
    env = by_path()
    assert env.reset(0, {"start": 2})[0] == "count down from 2"
    assert env.step("2").reward == 1.0 and env.step("1").done


def test_own_environment_options_are_checked_like_the_builtins(mypkg: Path) -> None:
    for name in ("mypkg.envs:CountdownEnv", "countdown"):
        env_class(name).check_options({"start": 5})
        with pytest.raises(EnvOptionError, match=r"unknown option 'stop' \(known options: start\)"):
            env_class(name).check_options({"stop": 5})
        with pytest.raises(EnvOptionError, match="start"):
            env_class(name).check_options({"start": "five"})


def test_names_that_do_not_load_say_what_was_tried(mypkg: Path) -> None:
    with pytest.raises(UnknownEnvError) as e:
        env_class("countdwn")
    message = str(e.value)
    assert "'countdwn'" in message and "entry point of group 'tiderl.envs'" in message
    assert "import path `module:Class`" in message and "countdown" in message  # the known names
    with pytest.raises(EnvUnavailableError, match="cannot import module 'mypkg.nope'"):
        env_class("mypkg.nope:CountdownEnv")
    with pytest.raises(EnvUnavailableError, match="module 'mypkg.envs' has no 'Countdown'"):
        env_class("mypkg.envs:Countdown")
    with pytest.raises(EnvUnavailableError, match="not a subclass of tiderl.envs.Environment"):
        env_class("mypkg.envs:NOT_AN_ENV")
    with pytest.raises(EnvUnavailableError, match="entry point of group 'tiderl.envs'.*mypkg.missing"):
        env_class("broken")


def test_job_env_name_takes_an_import_path_and_refuses_a_malformed_one(mypkg: Path) -> None:
    job = load_job(ROOT / "jobs/quickstart.yaml", ["env.name=mypkg.envs:CountdownEnv", "env.options={start: 4}"])
    assert job.env.name == "mypkg.envs:CountdownEnv"
    env_class(job.env.name).check_options(job.env.options)
    for bad in ("mypkg.envs:", "my pkg:Env", "hilo,pytool", "mypkg-envs:Env"):
        with pytest.raises(ConfigError, match="env.name"):
            load_job(ROOT / "jobs/quickstart.yaml", [f"env.name={bad}"])


def _tiderl(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], capture_output=True, text=True, timeout=120, **kw)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_serve_own_environment_by_import_path_and_entry_point(mypkg: Path) -> None:
    port_file = mypkg / "url"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiderl", "env", "serve", "--env", "mypkg.envs:CountdownEnv,countdown",
         "--port", "0", "--port-file", str(port_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server wrote no URL"
            time.sleep(0.05)
        url = port_file.read_text().strip()
        for name in ("mypkg.envs:CountdownEnv", "countdown"):
            status, started = _post(url + "/start", {"env": name, "seed": 1, "options": {"start": 2}})
            assert status == 200, started
            assert "count down from 2" in json.dumps(started)
            status, refused = _post(url + "/start", {"env": name, "seed": 1, "options": {"stop": 2}})
            assert status == 400 and "unknown option 'stop'" in json.dumps(refused)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "serving mypkg.envs:CountdownEnv,countdown at" in out


def test_serve_unknown_environment_exits_2_naming_what_was_tried(mypkg: Path) -> None:
    done = _tiderl("env", "serve", "--env", "countdwn", cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "unknown environment 'countdwn'" in done.stderr and "tiderl.envs" in done.stderr
    assert "Traceback" not in done.stderr
    done = _tiderl("env", "serve", "--env", "mypkg.envs:Countdown", cwd=ROOT)
    assert done.returncode == 2 and "module 'mypkg.envs' has no 'Countdown'" in done.stderr, done.stderr
