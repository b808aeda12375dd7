"""The fault campaign's short form (tools/chaos.py): one rollout rank SIGKILLed mid-run, nothing lost or doubled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chaos_faults import FAULTS
from chaos_trial import run_trial


@pytest.mark.slow
@pytest.mark.vllm
def test_a_killed_rollout_rank_loses_and_doubles_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("TIDERL_TEST_SEED", "0"))
    # 5 steps: the kill lands after version 1 or 2 and a delay of at most 2 s (at version 4 at the latest,
    # a version taking 1 s or more on this host), so mid-run; every group of the run, the killed rank's
    # retried tasks among them, must be trained for the run to finish.
    result = run_trial(FAULTS["rollout_kill"], seed=seed, steps=5, timeout_s=850, work_root=tmp_path)
    assert "SIGKILL rank" in result["note"] and "before the fault" not in result["note"], result  # it landed mid-run
    assert result["survived"], result
    assert result["trajectories_lost"] == 0, result
    assert result["consumed_twice"] == 0, result
    assert result["recovery_s"] is not None, result


def test_groups_dropped_as_too_stale_are_not_counted_lost(tmp_path: Path) -> None:
    """A group the control plane drops while open (a trajectory already older than the bound) fails its
    pending tasks; the campaign counts it dropped on purpose, and a group failed by a task's errors lost."""
    from chaos_facts import exactly_once

    from tiderl.config.store import StoreConfig
    from tiderl.store import FinishedTrajectory, NewGroup, RankReport, Role, RunStore, TaskFailure, TaskKind

    s = RunStore.for_run_dir(tmp_path, StoreConfig())
    s.create_schema()
    s.init_run(name="t", system="async", config_yaml="system: async\n")
    s.register_initial_version("weights/v0", "sum0")
    s.register_rank(0, Role.ROLLOUT)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.TRAIN, 2, 2)])
    claims = s.claim_tasks(0, 4)
    doomed, failing = sorted({c.group_id for c in claims})
    first = next(c for c in claims if c.group_id == doomed)
    s.report(RankReport(rank=0, finished=[FinishedTrajectory(
        task_id=first.task_id, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], token_versions=[-1, 0],
        num_turns=1, reward=1.0, success=True)], released=[c.task_id for c in claims if c.group_id == doomed
                                                          and c is not first]))
    assert s.drop_doomed_groups(1, "test") == [doomed]
    for c in claims:
        if c.group_id == failing:
            s.report(RankReport(rank=0, failed=[TaskFailure(c.task_id, "boom")]), max_attempts=1)
    result = exactly_once(tmp_path / "run.db")
    assert result["dropped_stale"] == 2 and result["lost"]["failed"] == 2, result
