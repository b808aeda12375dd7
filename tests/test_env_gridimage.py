"""`gridimage`: the positions are in the picture only, moves follow the rules, episodes are
deterministic in the seed and consecutive seeds are distinct games."""

from __future__ import annotations

import io
import re

import pytest
from PIL import Image

from tiderl.envs import EnvActionError, EnvOptionError, make_env
from tiderl.envs.gridimage import AGENT, GOAL, PROMPT, GridImageEnv
from tiderl.envs.images import ImageEnvironment, check_png


def reset(seed: int, **options: object) -> GridImageEnv:
    env = make_env("gridimage")
    assert isinstance(env, GridImageEnv)
    env.reset(seed=seed, options=options)
    return env


def cells_of(png: bytes, size: int, cell_px: int) -> dict[tuple[int, int, int], tuple[int, int]]:
    """Colour at the centre of each cell -> (row, col), read from the PNG alone."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (size * cell_px, size * cell_px)
    found = {}
    for row in range(size):
        for col in range(size):
            colour = image.getpixel((col * cell_px + cell_px // 2, row * cell_px + cell_px // 2))
            if colour in (AGENT, GOAL):
                found[colour] = (row, col)
    return found


def test_it_is_registered_and_is_an_image_environment() -> None:
    assert isinstance(make_env("gridimage"), ImageEnvironment)


@pytest.mark.parametrize("size, cell_px", [(4, 14), (3, 28), (6, 14)])
def test_the_picture_shows_agent_and_goal_where_they_are(size: int, cell_px: int) -> None:
    for seed in range(20):
        env = reset(seed, size=size, cell_px=cell_px)
        [png] = env.observation_images()
        assert check_png(png).width == size * cell_px
        assert cells_of(png, size, cell_px) == {AGENT: env.agent, GOAL: env.goal}


def test_the_texts_never_say_where_agent_or_goal_are() -> None:
    env = reset(7)
    texts = [PROMPT]
    for action in ["up", "left", "down", "right", "jump"] * 2:
        if env.done:
            break
        texts.append(env.step(action).observation)
    assert not any(re.search(r"\d", text) for text in texts), texts


def test_moves_blocked_moves_and_bad_actions_each_cost_a_turn() -> None:
    env = reset(0)
    env.agent, env.goal = (0, 0), (3, 3)
    assert env.step("up") == ("blocked", 0.0, False, {"turn": 1, "max_turns": 8})
    assert env.agent == (0, 0)
    assert env.step("  Down ").observation == "moved down" and env.agent == (1, 0)
    assert env.step("right").observation == "moved right" and env.agent == (1, 1)
    assert env.step("go north").observation == "not a move, say up, down, left or right"
    assert env.agent == (1, 1) and env.turn == 4
    assert cells_of(env.observation_images()[0], 4, 14)[AGENT] == (1, 1)


def test_reaching_the_goal_ends_the_episode_with_reward_one() -> None:
    env = reset(0)
    env.agent, env.goal = (2, 2), (2, 3)
    observation, reward, done, info = env.step("right")
    assert (observation, reward, done) == ("goal reached", 1.0, True)
    assert info == {"turn": 1, "max_turns": 8, "reached": True, "agent": [2, 3], "goal": [2, 3]}
    assert env.final_reward() == 1.0
    with pytest.raises(EnvActionError, match="after the episode is done"):
        env.step("left")


def test_running_out_of_turns_ends_the_episode_unrewarded() -> None:
    env = reset(0, max_turns=2)
    env.agent, env.goal = (0, 0), (3, 3)
    env.step("up")
    observation, reward, done, info = env.step("left")
    assert (observation, reward, done, info["out_of_turns"], info["reached"]) == ("blocked", 0.0, True, True, False)
    assert env.final_reward() == 0.0


def test_the_expert_walks_a_shortest_path_and_shaped_rewards_favour_it() -> None:
    for seed in range(60):
        env = reset(seed, shaped=True)
        shortest = env.shortest
        while not env.done:
            env.step(env.expert_action())
        assert env.reached and env.turn == shortest and env.final_reward() == 1.0
    slow = reset(3, shaped=True, max_turns=20)
    slow.step("bogus")
    while not slow.done:
        slow.step(slow.expert_action())
    assert slow.final_reward() == pytest.approx(1 - 1 / 40)


def test_a_seed_always_plays_the_same_game_down_to_the_bytes() -> None:
    first, again = reset(11), reset(11)
    assert (first.agent, first.goal) == (again.agent, again.goal)
    assert first.observation_images() == again.observation_images()
    for action in ["up", "left", "down"]:
        assert first.step(action) == again.step(action)
        assert first.observation_images() == again.observation_images()


def test_consecutive_seeds_are_distinct_games_spread_over_the_grid() -> None:
    placements = [(reset(seed).agent, reset(seed).goal) for seed in range(240)]
    assert len(set(placements)) == 240  # 16 cells * 15 goals: every placement once
    first_ten = placements[:10]
    assert len({agent for agent, _ in first_ten}) >= 6


def test_bad_options_and_early_steps_are_named() -> None:
    env = make_env("gridimage")
    with pytest.raises(EnvActionError, match="before reset"):
        env.step("up")
    assert env.observation_images() == []  # type: ignore[attr-defined]
    for options, words in [({"size": 1}, "size must be in 2-16"), ({"cell_px": 2}, "cell_px"),
                           ({"size": 16, "cell_px": 40}, "size \\* cell_px <= 448"),
                           ({"max_turns": 0}, "max_turns"), ({"colour": "red"}, "unknown option 'colour'"),
                           ({"size": "4"}, "expects int")]:
        with pytest.raises(EnvOptionError, match=words):
            env.reset(seed=0, options=options)
