"""TextWorld games: generated from a seed offline, cached, played to a win."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tiderl.envs import EnvOptionError, make_env
from tiderl.envs.client import EnvClient
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.serving import start_server
from tiderl.envs.textworld_env import CACHE_ENV_VAR, clean_feedback, game_command

pytest.importorskip("textworld")


def test_clean_feedback_drops_prompt_and_status_line() -> None:
    raw = "\nYou pick up the key.\n\n\n\n>      -= Attic =-0/3"
    assert clean_feedback(raw) == "You pick up the key."
    assert clean_feedback("a\n\n\n\n   b  ") == "a\n\nb"


@pytest.mark.slow
def test_generated_game_is_cached_and_walkthrough_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    env = make_env("textworld")
    observation, info = env.reset(seed=11, options={"quest_length": 2, "nb_rooms": 2})
    assert info["turn"] == 0 and "\n\n-= " in observation and ">" not in observation
    games = list(tmp_path.rglob("*.z8"))
    assert len(games) == 1 and games[0].with_suffix(".json").exists()
    built_at = games[0].stat().st_mtime_ns
    total = 0.0
    while not env.done:
        result = env.step(env.expert_action())
        total += result.reward
    assert result.info["won"] is True and env.final_reward() == 1.0 and total == pytest.approx(1.0)
    env.close()

    again = make_env("textworld")
    t0 = time.monotonic()
    assert again.reset(seed=11, options={"quest_length": 2, "nb_rooms": 2})[0] == observation
    assert time.monotonic() - t0 < 5.0 and games[0].stat().st_mtime_ns == built_at  # from the cache
    result = again.step("dance wildly")
    assert result.observation and result.reward == 0.0 and not result.done
    # A NUL byte in a model's action crashed (segfault) or hung the game interpreter, and with it the
    # server: control characters are spaces to the parser.
    result = again.step("go\x00north\x07")
    assert result.observation and not result.done
    again.close()


def test_game_commands_are_one_line_without_control_characters() -> None:
    assert game_command("go\x00north") == "go north"
    assert game_command("  take\n the\tkey\x7f ") == "take the key"
    assert game_command("\x00") == ""
    assert game_command("0\\Dxg caf\u00e9") == "0 Dxg caf"


@pytest.mark.slow
def test_textworld_through_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))

    async def main() -> None:
        running = await start_server(ServerOptions(envs=("textworld",)))
        try:
            async with EnvClient(running.url) as client:
                start = await client.start("textworld", seed=5, options={"max_turns": 2, "show_commands": True})
                assert "commands: " in start.observation
                await client.step(start.session_id, "look")
                step = await client.step(start.session_id, "inventory")
                assert step.done and step.info["out_of_turns"] is True
                assert (await client.end(start.session_id)).reward == 0.0
        finally:
            await running.close()

    asyncio.run(main())


def test_bad_knobs_are_refused() -> None:
    env = make_env("textworld")
    with pytest.raises(EnvOptionError, match="nb_rooms"):
        env.reset(seed=1, options={"nb_rooms": 0})
    with pytest.raises(EnvOptionError, match="unknown option"):
        env.reset(seed=1, options={"rooms": 2})


@pytest.mark.slow
def test_random_model_output_never_stops_the_game(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a weak byte-level model emits (any byte, backslashes, control characters, broken UTF-8) is
    just an action the game does not understand: every step answers, none blocks or crashes."""
    import random
    import signal

    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    env = make_env("textworld")
    env.reset(seed=11, options={"quest_length": 2, "nb_rooms": 2, "max_turns": 10_000})
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 128)] + ["\\", "\ufffd", "\u00e9", "\\D", "\\help", "\x00"]

    def blocked(*_: object) -> None:
        raise TimeoutError("a game step blocked for 5 s")

    previous = signal.signal(signal.SIGALRM, blocked)
    try:
        for _ in range(300):
            action = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
            signal.alarm(5)
            assert env.step(action).observation
            signal.alarm(0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        env.close()


@pytest.mark.slow
def test_the_interpreters_own_commands_are_not_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`save` and `script` wrote files where the env server runs, `restore`/`undo`/`restart` reload or
    rewind the game, `quit` ends it: a model's action must not reach them."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    env = make_env("textworld")
    env.reset(seed=11, options={"quest_length": 2, "nb_rooms": 2, "max_turns": 20})
    for action in ("save", "evil", "script", "Transcript on", "restore", "undo", "quit", "restart"):
        result = env.step(action)
        assert result.observation.startswith("That command is not available") or action == "evil"
        assert not result.done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    env.close()
