"""`hilo`: guess a secret integer in a range from higher/lower feedback.

The quickstart's task: small enough that a tiny model with a tokenizer trained on
the spot learns it within minutes. Every text is short and regular.

Texts (with the default options low=1, high=16, max_turns=6):
- first observation: `guess a number 1-16`
- action: a decimal integer, e.g. `8` (surrounding whitespace is ignored; nothing else
  is accepted: `8.`, `eight` or `I guess 8` are bad actions)
- observation after a guess: `higher` (the secret is greater than the guess),
  `lower` (the secret is smaller) or `correct` (found: the episode ends)
- observation after a bad action: `not a number, guess 1-16` (it costs a turn)
- the episode also ends after `max_turns` actions; the last observation is then the
  usual feedback word (`higher`/`lower`/`not a number, guess 1-16`) with done=true
  and info `out_of_turns: true`.

Rewards: the step that finds the secret has reward 1.0, every other step 0.0; the
final reward is 1.0 if the secret was found, else 0.0. With option `shaped: true`
a find after t turns scores `1 - (t - 1) / (2 * max_turns)` (faster is better;
always >= 0.5) and a miss still scores 0.

Info: `turn` (actions taken), `max_turns`; when done also `found`, `secret`.

The secret is `low + (seed * stride) % n` with n = high - low + 1 and `stride` the integer nearest
to n / golden ratio that is coprime with n (:func:`secret_stride`): any n consecutive seeds play
every secret once, and a few consecutive seeds spread over the range (a training step's groups are
not all low or all high secrets). An evaluation of N consecutive seeds with N <= n is then N
distinct games (greedy play of one game twice is the same trajectory, which would make a success
rate look surer than it is). `expert_action()` gives the
binary-search guess (midpoint of the interval the feedback so far allows), which
finds any secret in 1-16 within 5 turns: use it for demonstrations.

Option `demo_scan_fraction` (default 0) changes only the demonstrator, never the game: that
fraction of the episodes (chosen by the seed, the same for every turn of one episode) is
demonstrated by a naive player who scans upwards, guessing the lowest secret the feedback still
allows (`expert_action()` returns that guess in those episodes). A model warm-started on such a
mixture plays the scan greedily (it is the majority) while bisection is in its sampled play: the
situation where reinforcement learning has something to select (docs/RESULTS.md, issue 14).
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Mapping
from typing import Any

from tiderl.envs.base import EnvActionError, Environment, EnvOptionError, StepResult, read_options

_INTEGER = re.compile(r"[+-]?\d{1,12}")

MAX_BOUND = 10**12 - 1  # low and high: what a guess (12 digits) can name
MAX_TURNS = 10_000


def _short(value: Any) -> str:
    """An option's value for a message, cut short (an int may have thousands of digits)."""
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)[:80]


DEFAULTS: dict[str, Any] = {"low": 1, "high": 16, "max_turns": 6, "shaped": False, "demo_scan_fraction": 0.0}


def secret_stride(n: int) -> int:
    """The integer nearest to n / golden ratio that is coprime with n: coprime makes seed -> secret
    one-to-one on n consecutive seeds, the golden ratio spreads consecutive seeds' secrets apart."""
    nearest = max(1, round(n * (math.sqrt(5) - 1) / 2))
    # Outwards from the nearest: ends within a few steps (coprimes are dense), at worst at 1.
    return next(k for distance in itertools.count() for k in (nearest - distance, nearest + distance)
                if 1 <= k <= n and math.gcd(k, n) == 1)


class HiloEnv(Environment):
    name = "hilo"
    option_defaults = DEFAULTS

    def __init__(self) -> None:
        self.low = 1
        self.high = 16
        self.max_turns = 6
        self.shaped = False
        self.secret = 0
        self.turn = 0
        self.found = False
        self.done = False
        self.is_reset = False
        # The interval of secrets still consistent with the feedback so far.
        self.lo_known = 1
        self.hi_known = 16
        # This episode's demonstrator scans upwards instead of bisecting (option demo_scan_fraction).
        self.demo_scans = False

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        opts = read_options(self.name, options, DEFAULTS)
        for key in ("low", "high"):  # a guess has at most 12 digits: so has the range
            if not -MAX_BOUND <= opts[key] <= MAX_BOUND:
                raise EnvOptionError(f"hilo: option {key!r} must be within +-{MAX_BOUND}, got {_short(opts[key])}")
        if not 1 <= opts["max_turns"] <= MAX_TURNS:
            raise EnvOptionError(f"hilo: option 'max_turns' must be in [1, {MAX_TURNS}], got {_short(opts['max_turns'])}")
        if opts["low"] > opts["high"]:
            raise EnvOptionError(f"hilo: low ({opts['low']}) must be <= high ({opts['high']})")
        if opts["max_turns"] < 1:
            raise EnvOptionError(f"hilo: max_turns must be >= 1, got {opts['max_turns']}")
        if not 0.0 <= opts["demo_scan_fraction"] <= 1.0:
            raise EnvOptionError(f"hilo: demo_scan_fraction must be in [0, 1], got {opts['demo_scan_fraction']}")
        self.low, self.high = opts["low"], opts["high"]
        self.max_turns, self.shaped = opts["max_turns"], opts["shaped"]
        n = self.high - self.low + 1
        self.secret = self.low + (seed * secret_stride(n)) % n
        self.turn = 0
        self.found = False
        self.done = False
        self.is_reset = True
        self.lo_known, self.hi_known = self.low, self.high
        # A draw of its own (string seeds hash the same in every process), independent of the secret.
        self.demo_scans = random.Random(f"hilo-demo-{seed}").random() < opts["demo_scan_fraction"]
        return self.prompt(), self._info()

    def prompt(self) -> str:
        return f"guess a number {self.low}-{self.high}"

    def step(self, action: str) -> StepResult:
        if not self.is_reset:
            raise EnvActionError("hilo: step before reset")
        if self.done:
            raise EnvActionError("hilo: step after the episode is done")
        self.turn += 1
        text = action.strip()
        if not _INTEGER.fullmatch(text):
            observation = f"not a number, guess {self.low}-{self.high}"
        else:
            guess = int(text)
            if guess == self.secret:
                observation = "correct"
                self.found = True
            elif guess < self.secret:
                observation = "higher"
                self.lo_known = max(self.lo_known, guess + 1)
            else:
                observation = "lower"
                self.hi_known = min(self.hi_known, guess - 1)
        self.done = self.found or self.turn >= self.max_turns
        info = self._info()
        if self.done and not self.found:
            info["out_of_turns"] = True
        reward = self.final_reward() if self.found else 0.0
        return StepResult(observation, reward, self.done, info)

    def final_reward(self) -> float:
        if not self.found:
            return 0.0
        if self.shaped:
            return 1.0 - (self.turn - 1) / (2 * self.max_turns)
        return 1.0

    def expert_action(self) -> str:
        """The demonstrator's guess for the current state: the binary-search guess, or, in an episode
        that option `demo_scan_fraction` gives to the naive player, the lowest secret still possible."""
        if self.demo_scans:
            return str(self.lo_known)
        return str((self.lo_known + self.hi_known) // 2)

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"turn": self.turn, "max_turns": self.max_turns}
        if self.done:
            info["found"] = self.found
            info["secret"] = self.secret
        return info
