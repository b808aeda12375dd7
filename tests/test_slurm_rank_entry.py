"""A rank started by srun learns its rank from Slurm (through submitit); outside a step it says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiderl.run.rank import rank_from_slurm

ROOT = Path(__file__).resolve().parents[1]


def test_rank_is_the_task_rank_of_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"SLURM_JOB_ID": "12", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
                        "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "dev[1-2]",
                        "SUBMITIT_EXECUTOR": "slurm"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # srun's environment (cpus_per_task) is kept
    assert rank_from_slurm() == 3
    # vLLM's CPU worker of rank 3 pinned as the local launcher pins it.
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(3 % (os.cpu_count() or 1))
    assert os.environ["OMP_NUM_THREADS"] == "4"


def test_without_a_rank_outside_slurm_the_error_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "tiderl.run.rank", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "no RANK given and not a task of a Slurm step (SLURM_PROCID is unset)" in out.stderr
