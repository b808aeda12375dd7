"""The rollout rank's per-tick decisions (tiderl.run.rollout_tick), tested directly; the loop that acts
on them is driven in tests/test_run_eval_pinning.py."""

from __future__ import annotations

from tiderl.run.rollout_tick import TickMetric, Versions, WeightsStep, claim_kinds, tick_metric
from tiderl.store.types import TaskKind


def test_1_reloads_toward_the_plan_only_when_behind_and_not_holding_an_evaluation() -> None:
    assert Versions(held=3, planned=3).weights_step(False)[0] is WeightsStep.HOLD
    assert Versions(held=4, planned=3).weights_step(False)[0] is WeightsStep.HOLD  # newer: the plan's were pruned
    step, v = Versions(held=3, planned=4).weights_step(False)
    assert step is WeightsStep.RELOAD and v == Versions(held=3, planned=4)
    assert v.reloaded(4) == Versions(held=4, planned=4)
    assert v.reloaded(5).held == 5  # 4 pruned meanwhile: it loaded newer
    assert Versions(held=3, planned=4).weights_step(True)[0] is WeightsStep.KEEP


def test_1_a_rejected_version_is_not_retried_but_the_next_one_is() -> None:
    v = Versions(held=3, planned=4).reloaded(None)
    assert v.rejected == {4} and v.held == 3
    assert v.weights_step(False)[0] is WeightsStep.HOLD
    step, v = v.at_boundary(5).weights_step(False)
    assert step is WeightsStep.RELOAD and v.planned == 5
    assert v.at_boundary(4).planned == 5  # a boundary never goes back


def test_2_keeping_for_an_evaluation_is_announced_once_per_planned_version() -> None:
    step, v = Versions(held=3, planned=4).weights_step(True)
    assert step is WeightsStep.KEEP and v.kept_for == 4
    assert v.weights_step(True)[0] is WeightsStep.HOLD
    step, v = v.at_boundary(5).weights_step(True)
    assert step is WeightsStep.KEEP and v.kept_for == 5
    step, v = v.weights_step(False)  # the evaluation finished
    assert step is WeightsStep.RELOAD


def test_3_behind_the_plan_the_rank_claims_only_evaluation_tasks() -> None:
    assert claim_kinds(Versions(held=3, planned=3)) == tuple(TaskKind)
    assert claim_kinds(Versions(held=3, planned=4)) == (TaskKind.EVAL,)
    assert claim_kinds(Versions(held=3, planned=4, rejected=frozenset({4}))) == tuple(TaskKind)
    assert claim_kinds(Versions(held=5, planned=4)) == tuple(TaskKind)


def test_4_how_a_tick_counts() -> None:
    assert tick_metric(unfinished=0, generating=0) is TickMetric.IDLE
    assert tick_metric(unfinished=3, generating=1) is TickMetric.BUSY
    assert tick_metric(unfinished=3, generating=0) is None  # every task waits on its environment
    assert Versions(held=3, planned=6).stale_bound(max_staleness=2) == 4
