"""The fault campaign's short form (tools/chaos.py): one rollout rank SIGKILLed mid-run, nothing lost or doubled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chaos import FAULTS, run_trial


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_rollout_rank_loses_and_doubles_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("TIDERL_TEST_SEED", "0"))
    result = run_trial(FAULTS["rollout_kill"], seed=seed, steps=8, timeout_s=850, work_root=tmp_path)
    assert "SIGKILL rank" in result["note"] and "before the fault" not in result["note"], result  # it landed mid-run
    assert result["survived"], result
    assert result["trajectories_lost"] == 0, result
    assert result["consumed_twice"] == 0, result
    assert result["recovery_s"] is not None, result
