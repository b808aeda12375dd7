"""`tiderl logs`: which files, which prefixes (pure), and the command on a run directory with real log files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiderl.config import load_job
from tiderl.logs import LogFile, classify, select, split_lines
from tiderl.roles import Role
from tiderl.rundir import create_run, open_run
from tiderl.store.types import RunState

ROOT = Path(__file__).resolve().parents[1]


def test_classify_orders_and_ignores_other_files() -> None:
    names = ["rank10.log", "slurm-7.err", "rank2.log", "env0.log", "control.log", "notes.txt", "ranks-srun.log",
             "slurm-7.out", "rank2.log.tmp"]
    assert [f.name for f in classify(names)] == [
        "control.log", "env0.log", "rank2.log", "rank10.log", "ranks-srun.log", "slurm-7.err", "slurm-7.out"]
    assert classify(["rank3.log"]) == [LogFile("rank3.log", "rank", 3)]


def test_prefixes_name_rank_and_role() -> None:
    roles = {1: "rollout"}
    assert LogFile("rank1.log", "rank", 1).prefix(roles) == "rank1 rollout"
    assert LogFile("rank2.log", "rank", 2).prefix(roles) == "rank2"
    assert LogFile("env0.log", "env", 0).prefix(roles) == "env0"
    assert LogFile("control.log", "control").prefix(roles) == "control"
    assert LogFile("slurm-7.err", "slurm", 7).prefix(roles) == "slurm 7 err"
    assert LogFile("slurm-7.out", "slurm", 7).prefix(roles) == "slurm 7"


def test_select_by_rank_role_control() -> None:
    files = classify(["control.log", "env0.log", "rank0.log", "rank1.log", "rank2.log"])
    roles = {0: "actor", 1: "rollout", 2: "rollout"}
    assert [f.name for f in select(files, rank=1)] == ["rank1.log"]
    assert [f.name for f in select(files, role="rollout", roles=roles)] == ["rank1.log", "rank2.log"]
    assert [f.name for f in select(files, control=True)] == ["control.log"]
    assert select(files) == files
    assert select(files, rank=9) == []


def test_split_lines_keeps_a_line_still_being_written() -> None:
    assert split_lines("a\nb\nc") == (["a", "b"], "c")
    assert split_lines("a\n") == (["a"], "")
    assert split_lines("") == ([], "")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    paths, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=2"]), tmp_path / "run")
    store.register_rank(0, Role.ACTOR)
    store.register_rank(1, Role.ROLLOUT)
    store.close()
    (paths.logs / "control.log").write_text("planned v1\nplanned v2\n")
    (paths.logs / "rank0.log").write_text("step 1\n")
    (paths.logs / "rank1.log").write_text("".join(f"line {i}\n" for i in range(30)) + "partial")
    (paths.logs / "slurm-12.out").write_text("submitit INFO starting\n")
    return paths.root


def tiderl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_logs_of_one_rank_are_prefixed_with_its_role(run_dir: Path) -> None:
    out = tiderl("logs", str(run_dir), "--rank", "1", "-n", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[rank1 rollout] line 28\n[rank1 rollout] line 29\n[rank1 rollout] partial\n"


def test_logs_by_role_and_control_and_all(run_dir: Path) -> None:
    assert tiderl("logs", str(run_dir), "--role", "actor").stdout == "[rank0 actor] step 1\n"
    assert tiderl("logs", str(run_dir), "--control", "-n", "1").stdout == "[control] planned v2\n"
    everything = tiderl("logs", str(run_dir), "-n", "1").stdout.splitlines()
    assert everything == ["[control] planned v2", "[rank0 actor] step 1", "[rank1 rollout] partial",
                          "[slurm 12] submitit INFO starting"]


def test_follow_prints_what_is_written_until_the_run_ends(run_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "logs", str(run_dir), "--control", "-n", "1", "-f"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Its first line says it has read what was there: what is written now is new to it.
        assert proc.stdout is not None and proc.stdout.readline() == "[control] planned v2\n"
        with open(run_dir / "logs" / "control.log", "a") as log:
            log.write("planned v3\nhalf a li")
        # A rank log that appears while following, under --control, is not shown.
        (run_dir / "logs" / "rank2.log").write_text("not shown\n")
        with open(run_dir / "logs" / "control.log", "a") as log:
            log.write("ne\n")
        _, store = open_run(run_dir)
        store.set_run_state(RunState.FINISHED, "done")
        store.close()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out == "[control] planned v3\n[control] half a line\n"


def test_logs_of_a_directory_without_a_run(tmp_path: Path) -> None:
    out = tiderl("logs", str(tmp_path))
    assert out.returncode == 2 and "no run store" in out.stderr
