"""`gridimage`: walk to the goal on a small grid that only a picture shows.

The multi-modal counterpart of `hilo`: every observation carries a PNG of the grid, and
where the agent and the goal are is in the picture only; the texts never say.

Picture (defaults size=4, cell_px=14): a 56x56 RGB image, 4x4 cells of 14x14 pixels on a
light grey ground with darker cell borders; the agent is a red square, the goal a green
one. With Qwen2-VL's 14-pixel patches merged 2x2 a cell is one patch and the picture
is 4 image tokens.

Texts:
- first observation: `you are red, the goal is green: move up, down, left or right`
- action: `up`, `down`, `left` or `right` (case and surrounding whitespace are ignored;
  anything else is a bad action)
- observation after a move: `moved up` (etc.); after a move into the edge: `blocked`
  (the agent stays); after a bad action: `not a move, say up, down, left or right`; all
  three cost a turn; reaching the goal: `goal reached` (the episode ends)
- the episode also ends after `max_turns` actions, with info `out_of_turns: true`.

Rewards: the step that reaches the goal has reward 1.0, every other step 0.0; the final
reward is 1.0 if the goal was reached, else 0.0. With `shaped: true` a goal reached in t
turns scores `1 - (t - d) / (2 * max_turns)`, d the shortest path (always >= 0.5).

Info: `turn`, `max_turns`; when done also `reached`, `agent` and `goal` ([row, col]).

Start positions: the seed picks one of the n^2 (n^2 - 1) (agent, goal) placements by
`(seed * stride) % count`, `stride` as in hilo (`secret_stride`): consecutive seeds are
distinct games spread over the grid. `expert_action()` gives a shortest-path move (the
longer axis first): use it for demonstrations.

Option `demo_column_fraction` (default 0) changes only the demonstrator, never the game, as
hilo's `demo_scan_fraction` does: that share of the games, drawn per game from the seed, is
demonstrated by a player who reads only the goal's column in the picture: it walks left or
right to that column and, once there, carries on the way it was going (it never moves up or
down, so it finds only goals on its own row); `expert_action()` returns its move in those
games. Both players read the picture. A model warm-started on such a mixture plays the
column-reader greedily where the two differ (it is the majority) and has the expert's
vertical moves in its sampled play, for RL to select.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from tiderl.envs.base import EnvActionError, EnvOptionError, StepResult, read_options
from tiderl.envs.hilo import secret_stride
from tiderl.envs.images import ImageEnvironment, encode_png

DEFAULTS: dict[str, Any] = {"size": 4, "cell_px": 14, "max_turns": 8, "shaped": False, "demo_column_fraction": 0.0}
MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
PROMPT = "you are red, the goal is green: move up, down, left or right"
BAD_ACTION = "not a move, say up, down, left or right"

GROUND = (232, 232, 232)
BORDER = (170, 170, 170)
AGENT = (220, 40, 40)
GOAL = (40, 170, 60)
MAX_IMAGE_SIDE_PX = 448


class GridImageEnv(ImageEnvironment):
    name = "gridimage"
    option_defaults = DEFAULTS
    action_words: tuple[str, ...] = tuple(MOVES)

    def __init__(self) -> None:
        self.size = DEFAULTS["size"]
        self.cell_px = DEFAULTS["cell_px"]
        self.max_turns = DEFAULTS["max_turns"]
        self.shaped = False
        self.agent = (0, 0)
        self.goal = (0, 0)
        self.shortest = 0
        self.turn = 0
        self.reached = False
        self.done = False
        self.is_reset = False
        # The column-reader of option demo_column_fraction: whether it plays this game, and its last
        # horizontal move.
        self.demo_columns = False
        self.last_horizontal = "right"

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        opts = read_options(self.name, options, DEFAULTS)
        if not 2 <= opts["size"] <= 16:
            raise EnvOptionError(f"gridimage: size must be in 2-16, got {opts['size']}")
        if not 4 <= opts["cell_px"] or opts["size"] * opts["cell_px"] > MAX_IMAGE_SIDE_PX:
            raise EnvOptionError(f"gridimage: cell_px must be >= 4 and size * cell_px <= {MAX_IMAGE_SIDE_PX}, "
                                 f"got cell_px={opts['cell_px']} with size={opts['size']}")
        if opts["max_turns"] < 1:
            raise EnvOptionError(f"gridimage: max_turns must be >= 1, got {opts['max_turns']}")
        if not 0.0 <= opts["demo_column_fraction"] <= 1.0:
            raise EnvOptionError(f"gridimage: demo_column_fraction must be in [0, 1], got {opts['demo_column_fraction']}")
        self.size, self.cell_px = opts["size"], opts["cell_px"]
        self.max_turns, self.shaped = opts["max_turns"], opts["shaped"]
        cells = self.size * self.size
        count = cells * (cells - 1)
        index = (seed * secret_stride(count)) % count
        agent, goal = divmod(index, cells - 1)
        goal += goal >= agent  # the goal is any cell but the agent's
        self.agent, self.goal = divmod(agent, self.size), divmod(goal, self.size)
        self.shortest = self._distance()
        self.demo_columns = random.Random(f"gridimage-demo-{seed}").random() < opts["demo_column_fraction"]
        self.last_horizontal = "right"
        self.turn = 0
        self.reached = False
        self.done = False
        self.is_reset = True
        return PROMPT, self._info()

    def step(self, action: str) -> StepResult:
        if not self.is_reset:
            raise EnvActionError("gridimage: step before reset")
        if self.done:
            raise EnvActionError("gridimage: step after the episode is done")
        self.turn += 1
        word = action.strip().lower()
        move = MOVES.get(word)
        if word in ("left", "right"):
            self.last_horizontal = word
        if move is None:
            observation = BAD_ACTION
        else:
            row, col = self.agent[0] + move[0], self.agent[1] + move[1]
            if 0 <= row < self.size and 0 <= col < self.size:
                self.agent = (row, col)
                observation = f"moved {word}"
            else:
                observation = "blocked"
            if self.agent == self.goal:
                self.reached = True
                observation = "goal reached"
        self.done = self.reached or self.turn >= self.max_turns
        info = self._info()
        if self.done and not self.reached:
            info["out_of_turns"] = True
        return StepResult(observation, self.final_reward() if self.reached else 0.0, self.done, info)

    def final_reward(self) -> float:
        if not self.reached:
            return 0.0
        if self.shaped:
            return 1.0 - (self.turn - self.shortest) / (2 * self.max_turns)
        return 1.0

    def observation_images(self) -> list[bytes]:
        if not self.is_reset:
            return []
        return [self.render_png()]

    def render_png(self) -> bytes:
        """The grid as it stands, as an 8-bit RGB PNG of (size * cell_px) pixels a side."""
        side = self.size * self.cell_px
        row_px = bytearray()
        for x in range(side):
            row_px += bytes(BORDER if x % self.cell_px in (0, self.cell_px - 1) else GROUND)
        pixels = bytearray()
        for y in range(side):
            pixels += bytes(BORDER) * side if y % self.cell_px in (0, self.cell_px - 1) else row_px
        margin = max(1, self.cell_px // 7)
        for (row, col), colour in ((self.goal, GOAL), (self.agent, AGENT)):
            for y in range(row * self.cell_px + margin, (row + 1) * self.cell_px - margin):
                start = (y * side + col * self.cell_px + margin) * 3
                width = self.cell_px - 2 * margin
                pixels[start:start + width * 3] = bytes(colour) * width
        return encode_png(side, side, bytes(pixels))

    def expert_action(self) -> str:
        """A move along a shortest path: the axis with the longer way to go first; in a game that
        option `demo_column_fraction` gives to the column-reader, its move."""
        if self.demo_columns:
            if self.agent[1] != self.goal[1]:
                return "right" if self.goal[1] > self.agent[1] else "left"
            return self.last_horizontal
        d_row, d_col = self.goal[0] - self.agent[0], self.goal[1] - self.agent[1]
        if abs(d_row) >= abs(d_col) and d_row:
            return "down" if d_row > 0 else "up"
        return "right" if d_col > 0 else "left"

    def _distance(self) -> int:
        return abs(self.goal[0] - self.agent[0]) + abs(self.goal[1] - self.agent[1])

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"turn": self.turn, "max_turns": self.max_turns}
        if self.done:
            info["reached"] = self.reached
            info["agent"] = list(self.agent)
            info["goal"] = list(self.goal)
        return info
