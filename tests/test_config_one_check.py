"""One validation path (issue 49, item 7): `tiderl config`, `tiderl submit --dry-run` and `tiderl run` accept and
refuse the same configs (`tiderl.rundir.validate_job`), and values read as YAML 1.2: `yes`, `no`, `on`, `off` are
strings, so a bool option given one is a config error that says to write true or false."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiderl.config import ConfigError, load_job
from tiderl.config.yamlio import load_yaml

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "quickstart.yaml"
COMMANDS = [["config"], ["submit", "--dry-run"], ["run"]]


def tiderl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("override,expected", [
    ("env.options.hihg=3", "env.options: hilo: unknown option 'hihg'"),
    ("ers.enabled=yes", "ers.enabled: expected true or false, got 'yes' (config values read as YAML 1.2"),
    ("rollout.enforce_eager=off", "rollout.enforce_eager: expected true or false or null, got 'off'"),
    ("env.name=nosuchpkg.envs:Foo", "env.name: environment 'nosuchpkg.envs:Foo': cannot import module"),
])
def test_config_submit_and_run_refuse_the_same_config_alike(tmp_path: Path, override: str, expected: str) -> None:
    for command in COMMANDS:
        run_dir = tmp_path / f"run-{command[0]}"
        extra = ["--run-dir", str(run_dir)] if command[0] != "config" else []
        out = tiderl(tmp_path, *command, str(JOB), "--set", override, *extra)
        assert out.returncode == 2, (command, out.stdout[-2000:], out.stderr[-2000:])
        assert expected in out.stderr, (command, out.stderr)
        assert not run_dir.exists() and not (tmp_path / "runs").exists(), command  # nothing created


def test_a_config_all_three_accept(tmp_path: Path) -> None:
    """The same overrides, valid: `config` and `submit --dry-run` accept them (a `run` would start the run)."""
    sets = ["--set", "env.options.high=8", "--set", "ers.enabled=false"]
    for command in COMMANDS[:2]:
        out = tiderl(tmp_path, *command, str(JOB), *sets)
        assert out.returncode == 0, (command, out.stderr[-2000:])


def test_yaml_1_2_booleans() -> None:
    data = load_yaml("a: yes\nb: No\nc: ON\nd: off\ne: true\nf: False\ng: TRUE\nh: null\ni: 1e-4\n", "t.yaml")
    assert data == {"a": "yes", "b": "No", "c": "ON", "d": "off", "e": True, "f": False, "g": True, "h": None,
                    "i": 1e-4}
    import yaml

    assert yaml.safe_load("a: yes") == {"a": True}  # PyYAML's own loaders are left as they are


def test_a_job_file_with_yes_for_a_bool_option_names_the_file_and_key(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.read_text() + "\nmonitor:\n  tensorboard: on\n")
    with pytest.raises(ConfigError) as e:
        load_job(job)
    assert e.value.source == str(job) and e.value.key == "monitor.tensorboard"
    assert "'on' is a string, not a boolean: write true or false" in e.value.message
    # A string option takes the word as the string it is.
    assert load_job(JOB, ["name=yes"]).name == "yes"
