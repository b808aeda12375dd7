"""hilo as a plain Python environment (no HTTP)."""

from __future__ import annotations

import pytest

from tiderl.envs import EnvActionError, EnvOptionError, UnknownEnvError, make_env
from tiderl.envs.hilo import HiloEnv


def test_first_observation_and_feedback_texts() -> None:
    env = make_env("hilo")
    observation, info = env.reset(seed=7, options={})
    assert observation == "guess a number 1-16"
    assert info == {"turn": 0, "max_turns": 6}
    secret = env.secret
    assert 1 <= secret <= 16
    if secret > 1:
        assert env.step(str(secret - 1)).observation == "higher"
    if secret < 16:
        assert env.step(str(secret + 1)).observation == "lower"
    result = env.step(f" {secret}\n")
    assert result == (result.observation, 1.0, True, result.info)
    assert result.observation == "correct"
    assert result.info["found"] is True and result.info["secret"] == secret
    assert env.final_reward() == 1.0


def test_secret_is_deterministic_in_seed_and_covers_range() -> None:
    secrets = set()
    for seed in range(200):
        a, b = HiloEnv(), HiloEnv()
        a.reset(seed, {})
        b.reset(seed, {})
        assert a.secret == b.secret
        secrets.add(a.secret)
    assert secrets == set(range(1, 17))


def test_consecutive_seeds_play_distinct_secrets() -> None:
    # Evaluations use consecutive seeds: up to the range's size, every one must be a different game.
    env = HiloEnv()
    for low, high, first in ((1, 16, 0), (1, 64, 1_000_000_000), (5, 54, 123)):
        secrets = []
        for seed in range(first, first + high - low + 1):
            env.reset(seed, {"low": low, "high": high})
            secrets.append(env.secret)
        assert sorted(secrets) == list(range(low, high + 1))


@pytest.mark.parametrize("action", ["eight", "8.", "I guess 8", "", "  ", "8 9", "1e3"])
def test_bad_action_gets_clear_observation_and_costs_a_turn(action: str) -> None:
    env = make_env("hilo")
    env.reset(seed=1, options={})
    observation, reward, done, info = env.step(action)
    assert observation == "not a number, guess 1-16"
    assert reward == 0.0 and not done and info["turn"] == 1


def test_turn_limit_ends_episode_with_zero_reward() -> None:
    env = make_env("hilo")
    env.reset(seed=3, options={"max_turns": 2})
    wrong = "1" if env.secret != 1 else "2"
    assert not env.step(wrong).done
    result = env.step(wrong)
    assert result.done and result.reward == 0.0
    assert result.info["out_of_turns"] is True and result.info["found"] is False
    assert env.final_reward() == 0.0
    with pytest.raises(EnvActionError):
        env.step("5")


def test_expert_finds_every_secret_within_five_turns() -> None:
    for seed in range(100):
        env = HiloEnv()
        env.reset(seed, {})
        while not env.done:
            env.step(env.expert_action())
        assert env.found and env.turn <= 5


def test_shaped_reward_prefers_fast_finds() -> None:
    env = HiloEnv()
    env.reset(0, {"shaped": True, "max_turns": 4})
    for guess in range(1, 17):
        if env.step(str(guess)).done:
            break
    if env.found:
        assert env.final_reward() == pytest.approx(1 - (env.turn - 1) / 8)
    else:
        assert env.final_reward() == 0.0


def test_options_are_checked() -> None:
    env = HiloEnv()
    assert env.reset(0, {"low": 10, "high": 20})[0] == "guess a number 10-20"
    with pytest.raises(EnvOptionError, match="unknown option 'hi'"):
        env.reset(0, {"hi": 3})
    with pytest.raises(EnvOptionError, match="'high' expects int"):
        env.reset(0, {"high": "16"})
    with pytest.raises(EnvOptionError, match="low"):
        env.reset(0, {"low": 5, "high": 4})
    with pytest.raises(EnvActionError):
        HiloEnv().step("3")


def test_unknown_env_name_lists_known_names() -> None:
    with pytest.raises(UnknownEnvError, match="unknown environment 'nope'.*hilo"):
        make_env("nope")
