"""A step's figures of the trajectories it trained (tiderl.store.step_figures), and the run store keeping them."""

from __future__ import annotations

import pytest

from tiderl.store.step_figures import EnvFigures, TrainedTask, parse_env_figures, step_figures


def test_a_mixed_step_has_its_figures_and_each_environments() -> None:
    rows = [TrainedTask(reward=1.0, success=True, num_turns=2, env="hilo"),
            TrainedTask(reward=0.0, success=False, num_turns=6, env="hilo"),
            TrainedTask(reward=0.5, success=False, num_turns=1, env="hilo"),
            TrainedTask(reward=2.0, success=True, num_turns=3, env="pytool"),
            TrainedTask(reward=4.0, success=True, num_turns=3, env=None)]  # no environment recorded
    f = step_figures(rows)
    assert f.reward_mean == pytest.approx(7.5 / 5) and f.success_rate == pytest.approx(3 / 5)
    assert f.turns_mean == pytest.approx(15 / 5) and f.turns_max == 6
    # Each environment over its own trajectories; the unnamed one only in the step's figures.
    assert f.by_env == {"hilo": EnvFigures(num_trajectories=3, reward_mean=pytest.approx(0.5),
                                           success_rate=pytest.approx(1 / 3)),
                        "pytool": EnvFigures(num_trajectories=1, reward_mean=2.0, success_rate=1.0)}
    assert list(f.by_env) == ["hilo", "pytool"]
    assert parse_env_figures(f.env_json()) == {
        "hilo": {"num_trajectories": 3, "reward_mean": pytest.approx(0.5), "success_rate": pytest.approx(1 / 3)},
        "pytool": {"num_trajectories": 1, "reward_mean": 2.0, "success_rate": 1.0}}


def test_a_step_of_no_trajectory_or_no_environment_has_none() -> None:
    empty = step_figures([])
    assert (empty.reward_mean, empty.success_rate, empty.turns_mean, empty.turns_max) == (None, None, None, None)
    assert empty.by_env == {} and empty.env_json() is None and parse_env_figures(None) == {}
    old = step_figures([TrainedTask(reward=1.0, success=True, num_turns=2)])
    assert old.reward_mean == 1.0 and old.turns_max == 2 and old.env_json() is None
