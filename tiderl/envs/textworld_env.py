"""`textworld`: procedurally generated text adventures (the `textworld` package).

Games are generated offline from the seed and the difficulty knobs, compiled once
and cached as files (`$TIDERL_TEXTWORLD_CACHE`, default `~/.cache/tiderl/textworld`):
the first start of a (knobs, seed) pair takes seconds, later ones milliseconds.
Several servers may share a cache directory: a file lock makes one of them build
each game, and files appear atomically.

Options (difficulty knobs): `nb_rooms` (default 3), `nb_objects` (5),
`quest_length` (3: the walkthrough length), `max_turns` (30), `graded` (false),
`show_commands` (false: when true each observation ends with the admissible
commands). Larger quests and worlds give 5 to 50+ turns and growing context.

Texts: the first observation is the game's objective, a blank line and the room
description; later observations are the game's feedback with the status line and
prompt removed. Actions are game commands (`go east`, `take key`, ...). Step
rewards are score increases divided by the maximum score (they sum to 1.0 for a
won game); the final reward is 1.0 for a won game, else 0 (`graded`: the fraction
of the maximum score reached). `expert_action()` gives the next walkthrough command.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiderl.envs.base import EnvActionError, Environment, EnvOptionError, StepResult, read_options

DEFAULTS: dict[str, Any] = {
    "nb_rooms": 3,
    "nb_objects": 5,
    "quest_length": 3,
    "max_turns": 30,
    "graded": False,
    "show_commands": False,
}
CACHE_ENV_VAR = "TIDERL_TEXTWORLD_CACHE"
# textworld's generator and z-machine wrappers keep module-level state; one at a time.
_lock = threading.Lock()


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "tiderl" / "textworld")


def clean_feedback(text: str) -> str:
    """The game's text without the prompt and status line, blank runs collapsed."""
    text = text.split("\n>", 1)[0]
    text = "\n".join(line.strip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def game_path(nb_rooms: int, nb_objects: int, quest_length: int, seed: int) -> Path:
    """The cached game file of these knobs and seed, built if missing."""
    import textworld
    from textworld.generator import GameOptions, compile_game, make_game

    key = f"r{nb_rooms}-o{nb_objects}-q{quest_length}-s{seed}"
    tag = hashlib.sha1(f"{textworld.__version__}".encode()).hexdigest()[:8]
    root = cache_dir() / tag
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{key}.z8"
    if path.exists():
        return path
    with open(root / f"{key}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if path.exists():
            return path
        build = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=root))
        try:
            opts = GameOptions()
            opts.seeds = seed
            opts.nb_rooms, opts.nb_objects, opts.quest_length = nb_rooms, nb_objects, quest_length
            opts.path = str(build / f"{key}.z8")
            opts.force_recompile = True
            with _lock:
                game = make_game(opts)
                built = Path(compile_game(game, opts))
            # The .json (game metadata) first: the .z8 appearing marks the pair complete.
            os.replace(built.with_suffix(".json"), path.with_suffix(".json"))
            os.replace(built, path)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return path


class TextWorldEnv(Environment):
    name = "textworld"
    option_defaults = DEFAULTS
    blocking = True

    def __init__(self) -> None:
        self.game: Any = None
        self.state: Any = None
        self.max_turns = 30
        self.graded = False
        self.show_commands = False
        self.turn = 0
        self.score = 0
        self.max_score = 1
        self.won = False
        self.done = False
        self.walkthrough: list[str] = []

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        import textworld

        opts = read_options(self.name, options, DEFAULTS)
        for knob in ("nb_rooms", "nb_objects", "quest_length", "max_turns"):
            if opts[knob] < 1:
                raise EnvOptionError(f"textworld: {knob} must be >= 1, got {opts[knob]}")
        if not 0 <= seed < 2**32:
            raise EnvOptionError(f"textworld: seed must be in [0, 2**32), got {seed}")
        path = game_path(opts["nb_rooms"], opts["nb_objects"], opts["quest_length"], seed)
        self.close()
        infos = textworld.EnvInfos(
            admissible_commands=True, objective=True, description=True, max_score=True,
            score=True, won=True, lost=True, policy_commands=True,
        )
        with _lock, warnings.catch_warnings():
            # jericho warns that it cannot track score itself; textworld's wrapper does.
            warnings.filterwarnings("ignore", message=".*is not fully supported.*")
            self.game = textworld.start(str(path), request_infos=infos)
            state = self.game.reset()
        self.max_turns, self.graded, self.show_commands = opts["max_turns"], opts["graded"], opts["show_commands"]
        self.turn = self.score = 0
        self.max_score = max(1, int(state["max_score"] or 1))
        self.won = self.done = False
        self.walkthrough = list(state["policy_commands"] or [])
        self.state = state
        text = f"{state['objective'].strip()}\n\n{clean_feedback(state['description'])}"
        return self._with_commands(text, state), self._info()

    def step(self, action: str) -> StepResult:
        if self.game is None or self.done:
            raise EnvActionError("textworld: step before reset or after the episode is done")
        self.turn += 1
        command = game_command(action)
        if command.split(" ", 1)[0].lower() in META_VERBS:
            # The interpreter's own commands write files where the server runs (save, script), reload or
            # rewind the game (restore, undo, restart) or end it (quit): not moves of the game.
            self.done = self.turn >= self.max_turns
            info = self._info()
            if self.done:
                info.update(won=False, lost=False, out_of_turns=True)
            return StepResult(self._with_commands(NOT_AVAILABLE, self.state), 0.0, self.done, info)
        with _lock:
            state, score, game_over = self.game.step(command)
        self.state = state
        gained = max(0, int(score) - self.score)
        self.score = int(score)
        self.won = bool(state["won"])
        self.walkthrough = list(state["policy_commands"] or [])
        self.done = bool(game_over) or self.won or bool(state["lost"]) or self.turn >= self.max_turns
        info = self._info()
        if self.done:
            info.update(won=self.won, lost=bool(state["lost"]), out_of_turns=not game_over and not self.won)
        text = clean_feedback(state.feedback) or "nothing happens"
        return StepResult(self._with_commands(text, state), gained / self.max_score, self.done, info)

    def final_reward(self) -> float:
        if self.won:
            return 1.0
        return self.score / self.max_score if self.graded else 0.0

    def expert_action(self) -> str:
        """The next command of the walkthrough from the current state (for demonstrations)."""
        return self.walkthrough[0] if self.walkthrough else "look"

    def close(self) -> None:
        if self.game is not None:
            with _lock:
                self.game.close()
            self.game = None

    def _with_commands(self, text: str, state: Any) -> str:
        if not self.show_commands:
            return text
        return f"{text}\n\ncommands: {', '.join(state['admissible_commands'] or [])}"

    def _info(self) -> dict[str, Any]:
        return {"turn": self.turn, "max_turns": self.max_turns, "score": self.score, "max_score": self.max_score}


META_VERBS = frozenset({"save", "restore", "restart", "quit", "q", "script", "unscript", "noscript", "transcript",
                        "notranscript", "recording", "replay", "playback", "undo", "verify", "version"})
NOT_AVAILABLE = "That command is not available in this game."
_NOT_COMMAND = re.compile(r"[^\x20-\x5b\x5d-\x7e]+")  # all but printable ASCII without the backslash


def game_command(action: str) -> str:
    """The action as the game's parser takes it: one line of printable ASCII, anything else as a space.
    The interpreter reads a C string, and a backslash starts one of its own commands: a NUL byte in a
    model's action crashed the whole env server, and `\\D` left it waiting on its console."""
    return " ".join(_NOT_COMMAND.sub(" ", action).split())
