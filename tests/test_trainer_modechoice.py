"""Mode choice from trainer.ra2p_mode and measured stage times."""

import dataclasses

import pytest

from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.modechoice import StageTimeTracker, choose_step_mode
from tiderl.trainer.step import StepStats

ZERO = StepStats(**{f.name: 0 for f in dataclasses.fields(StepStats)})


def _stats(**times: float) -> StepStats:
    return dataclasses.replace(ZERO, **times)


def test_fixed_modes_pass_through():
    tracker = StageTimeTracker()
    assert choose_step_mode("vanilla_stream_offload", [0.0], tracker, 2, 1) is Ra2pMode.VANILLA_STREAM_OFFLOAD
    with pytest.raises(ValueError, match="unknown RA2P mode"):
        choose_step_mode("turbo", [0.0], tracker, 2, 1)


def test_auto_is_colocated_until_every_stage_is_measured_or_without_ref_rank():
    tracker = StageTimeTracker()
    assert choose_step_mode("auto", [0.0] * 8, tracker, 2, 1) is Ra2pMode.COLOCATED
    tracker.observe(_stats(t_ref_s=0.1, t_act_f_s=0.1, t_act_b_s=0.2, t_swap_s=1.0))
    assert choose_step_mode("auto", [0.0] * 8, tracker, 2, 0) is Ra2pMode.COLOCATED


def test_auto_follows_the_cost_model_regimes():
    tracker = StageTimeTracker()
    tracker.observe(_stats(t_ref_s=0.1, t_act_f_s=0.1, t_act_b_s=0.2, t_swap_s=1.0))
    # large RAS: the swap costs more than the pipeline fill -> decoupled
    assert choose_step_mode("auto", [0.0] * 8, tracker, 2, 1) is Ra2pMode.DECOUPLED
    # cheap swaps, nothing at the start, one micro-batch every 10 s: the swaps hide in the gaps while
    # four actors would wait on one ref rank to fill the pipeline -> colocated
    cheap = StageTimeTracker()
    cheap.observe(_stats(t_ref_s=0.1, t_act_f_s=0.1, t_act_b_s=0.2, t_swap_s=0.05))
    assert choose_step_mode("auto", [10.0 * (i + 1) for i in range(4)], cheap, 4, 1) is Ra2pMode.COLOCATED


def test_tracker_ignores_stages_a_mode_did_not_run():
    tracker = StageTimeTracker(alpha=0.5)
    tracker.observe(_stats(t_ref_s=0.2, t_act_f_s=0.1, t_act_b_s=0.2, t_swap_s=0.4))
    tracker.observe(_stats(t_ref_s=0.4, t_act_f_s=0.1, t_act_b_s=0.2, t_swap_s=0.0))
    times = tracker.stage_times()
    assert times.t_swap_s == pytest.approx(0.4) and times.t_ref_s == pytest.approx(0.3)
