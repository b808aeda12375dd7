"""The config loader's budget on YAML alias expansion: ordinary anchors work, an alias bomb is a config
error naming the file (exit 2), found in a moment and in little memory."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tiderl.cli import main
from tiderl.config import ConfigError, load_job
from tiderl.config.yamlio import MAX_ALIAS_EXPANSION, AliasBudgetError, load_yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from attack_store import BOMB_OPTIONS  # noqa: E402


def test_ordinary_anchors_and_merge_keys_still_work() -> None:
    data = load_yaml("base: &b {lr: 1e-4, steps: 3}\nrun: {<<: *b, steps: 5}\nlist: [*b, *b]\n", "f.yaml")
    assert data["run"] == {"lr": 1e-4, "steps": 5}
    assert data["list"] == [{"lr": 1e-4, "steps": 3}] * 2
    with pytest.raises(yaml.YAMLError, match="given twice"):  # duplicate keys are still refused
        load_yaml("base: &b {lr: 1}\nrun: {<<: *b, steps: 5, steps: 6}\n", "f.yaml")


def test_expansion_up_to_the_budget_is_allowed_and_past_it_refused() -> None:
    # One anchor of 99 values (100 nodes with its list), used n times: each use beyond the first adds 100.
    values = ", ".join("1" for _ in range(99))
    def doc(n: int) -> str:
        return f"a: &a [{values}]\nb: [{', '.join('*a' for _ in range(n))}]\n"
    assert len(load_yaml(doc(MAX_ALIAS_EXPANSION // 100), "ok.yaml")["b"]) == MAX_ALIAS_EXPANSION // 100
    with pytest.raises(AliasBudgetError, match=r"over the limit of 10000 added by aliases \(anchor &a") as e:
        load_yaml(doc(MAX_ALIAS_EXPANSION // 100 + 1), "big.yaml")
    assert 'in "big.yaml", line 1' in str(e.value)


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    with pytest.raises(AliasBudgetError, match=r"alias \*x refers to the node it is part of"):
        load_yaml("x: &x [1, *x]\n", "loop.yaml")


def test_a_bomb_in_env_options_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    job = tmp_path / "bomb.yaml"
    job.write_text("name: bomb\nenv:\n  name: hilo\n  options:\n" + BOMB_OPTIONS)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="aliases expand this document") as e:
        load_job(job)
    assert time.monotonic() - started < 2
    assert e.value.source == str(job) and f'in "{job}", line' in str(e.value)


def test_a_bomb_in_a_set_override_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    value = "{a: &a [x,x,x,x,x,x,x,x,x,x], b: [" + ",".join(["*a"] * 1200) + "]}"  # 1200 x 11 nodes
    with pytest.raises(ConfigError, match=r"--set env.options.x=.*aliases expand"):
        load_job(ROOT / "jobs" / "quickstart.yaml", ["env.options.x=" + value])
    assert main(["config", str(ROOT / "jobs" / "quickstart.yaml"), "--set", "env.options.x=" + value]) == 2
    assert "aliases expand" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["config", "run", "submit"])
def test_the_cli_exits_2_at_once_on_a_bomb_and_creates_nothing(tmp_path: Path, command: str) -> None:
    job = tmp_path / "bomb.yaml"
    job.write_text(f"name: bomb\nlaunch:\n  runs_dir: {tmp_path}/runs\nenv:\n  name: hilo\n  options:\n"
                   + BOMB_OPTIONS)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tiderl", command, str(job)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 20
    assert f"tiderl {command}: config error: {job}: not valid YAML: aliases expand" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
