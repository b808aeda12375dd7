"""`pytool`: reasoning tasks where the agent may run Python code before answering.

Tasks come from `reasoning-gym` (procedural generators with exact verifiers), one
task per seed: `reasoning_gym.create_dataset(dataset, seed=seed, size=1, **dataset_config)[0]`.
It is made in a process of its own under a time limit (`task_timeout_s`, 10 s) and a memory limit
(`tiderl.envs.taskgen`): a config that asks for too much is a 400 `bad_options`, never a
server thread held.
Each turn the agent either runs code or answers:

- first observation: the task's question, then the line
  `run code with a ```python block, or reply answer: YOUR ANSWER`
- action with a fenced block (```python ... ``` or ``` ... ```): the code runs in the
  sandbox (`tiderl.envs.sandbox`: own namespaces, CPU/memory/output/wall limits, private
  /tmp, no network, empty environment); the observation is `exit CODE` (or `timed out`,
  `output limit`, `memory limit`) on the first line, then stdout and stderr, cut to 1500
  characters
- action `answer: TEXT` (case-insensitive): the episode ends; reward 1.0 if the
  dataset's verifier scores TEXT as exactly right, else 0.0 (option `graded: true`
  gives the verifier's score in [0, 1] instead); observation `correct` or `wrong`
- anything else: `run code with a ```python block, or reply answer: YOUR ANSWER`
- after `max_turns` actions without an answer the episode ends with reward 0.

Options: `dataset` (default `basic_arithmetic`), `dataset_config` (keyword arguments
of the reasoning-gym dataset config), `max_turns` (default 4), `graded` (false), `sandbox`
(`bwrap`, the default: `reset` refuses with `EnvOptionError` where bubblewrap is missing or
cannot work; `unsafe`: rlimits only, see `tiderl.envs.sandbox`; a job sets it in `env.options`).
Code runs take real, uneven time: the class is `blocking`, so the server runs its
steps in worker threads.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping
from typing import Any

from tiderl.envs.base import EnvActionError, Environment, EnvOptionError, StepResult, read_options
from tiderl.envs.taskgen import GEN_TIMEOUT_S, TaskGenError, make_task
from tiderl.envs.sandbox import (
    Isolation,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    check_bwrap,
    run_python,
)

HINT = "run code with a ```python block, or reply answer: YOUR ANSWER"
MAX_OBSERVATION_CHARS = 1500
DEFAULTS: dict[str, Any] = {
    "dataset": "basic_arithmetic", "dataset_config": {}, "max_turns": 4, "graded": False, "sandbox": "bwrap",
}

MAX_TURNS = 64
MAX_CONFIG_CHARS = 4096  # option dataset_config, as JSON
_DATASET_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_ANSWER = re.compile(r"\s*answer\s*:\s*(.*)", re.DOTALL | re.IGNORECASE)
_import_lock = threading.Lock()
_warned_unsafe = False
log = logging.getLogger("tiderl.envs.pytool")


def _reasoning_gym() -> Any:
    with _import_lock:  # the first import is slow and not safe from several threads at once
        import reasoning_gym

    return reasoning_gym


def _isolation(name: str, limits: SandboxLimits) -> Isolation:
    """The sandbox a job asked for, refused where bwrap cannot work: never a silent fallback."""
    global _warned_unsafe
    try:
        isolation = Isolation(name)
    except ValueError:
        raise EnvOptionError(f"pytool: option 'sandbox' must be 'bwrap' or 'unsafe', got {name!r}") from None
    if isolation is Isolation.BWRAP:
        try:
            check_bwrap(limits)
        except SandboxUnavailableError as e:
            raise EnvOptionError(
                f"pytool: refusing to run model code without isolation: {e}. To run it with rlimits only, "
                "set the option sandbox: unsafe (env.options.sandbox in the job config)"
            ) from e
    elif not _warned_unsafe:
        _warned_unsafe = True
        log.warning("pytool: sandbox: unsafe: model code runs without namespaces (see tiderl/envs/sandbox.py)")
    return isolation


def format_run(result: SandboxResult) -> str:
    if result.timed_out:
        head = "timed out"
    elif result.output_truncated:
        head = "output limit"
    elif result.memory_exceeded and (result.exit_code or 0) < 0:
        head = "memory limit"
    else:
        head = f"exit {result.exit_code}"
    text = f"{head}\n{result.stdout}{result.stderr}".rstrip("\n")
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[: MAX_OBSERVATION_CHARS - 12] + "\n[truncated]"
    return text


class PyToolEnv(Environment):
    name = "pytool"
    option_defaults = DEFAULTS
    blocking = True
    operator_options = {"sandbox": ("unsafe",)}
    task_timeout_s = GEN_TIMEOUT_S  # making one task (reasoning-gym, in a process of its own)
    limits = SandboxLimits(cpu_s=5, wall_s=10.0, memory_mb=512, output_bytes=16 * 1024, max_processes=8)

    def __init__(self) -> None:
        self.entry: dict[str, Any] = {}
        self.dataset: Any = None
        self.max_turns = 4
        self.graded = False
        self.isolation = Isolation.BWRAP
        self.turn = 0
        self.num_code_runs = 0
        self.score = 0.0
        self.done = False
        self.is_reset = False

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        opts = read_options(self.name, options, DEFAULTS)
        if not 1 <= opts["max_turns"] <= MAX_TURNS:
            raise EnvOptionError(f"pytool: option 'max_turns' must be in [1, {MAX_TURNS}], got {opts['max_turns']!r:.80}")
        if not _DATASET_NAME.fullmatch(opts["dataset"]):
            raise EnvOptionError(f"pytool: option 'dataset' must be a reasoning-gym dataset name, got {opts['dataset']!r:.80}")
        config_chars = len(json.dumps(opts["dataset_config"], default=str))
        if config_chars > MAX_CONFIG_CHARS:
            raise EnvOptionError(f"pytool: option 'dataset_config' is {config_chars} characters of JSON, "
                                 f"more than {MAX_CONFIG_CHARS}")
        self.isolation = _isolation(opts["sandbox"], self.limits)
        _reasoning_gym()  # imported here too, once: the task comes back pickled
        try:
            self.dataset, self.entry = make_task(opts["dataset"], seed, opts["dataset_config"],
                                                 timeout_s=self.task_timeout_s)
        except TaskGenError as e:
            raise EnvOptionError(f"pytool: dataset {opts['dataset']!r} with config "
                                 f"{json.dumps(opts['dataset_config'], default=str)[:200]}: {e}") from e
        self.max_turns, self.graded = opts["max_turns"], opts["graded"]
        self.turn = self.num_code_runs = 0
        self.score = 0.0
        self.done = False
        self.is_reset = True
        return f"{self.entry['question']}\n{HINT}", self._info(opts["dataset"])

    def step(self, action: str) -> StepResult:
        if not self.is_reset or self.done:
            raise EnvActionError("pytool: step before reset or after the episode is done")
        self.turn += 1
        answer = _ANSWER.match(action)
        code = _CODE_BLOCK.search(action)
        info: dict[str, Any]
        if answer is not None and code is None:
            text = answer.group(1).strip()
            score = float(self.dataset.score_answer(text, self.entry) or 0.0)
            self.score = score if self.graded else float(score >= 1.0)
            self.done = True
            info = self._info()
            info.update(correct=score >= 1.0, expected=str(self.entry["answer"]))
            return StepResult("correct" if score >= 1.0 else "wrong", self.score, True, info)
        if code is not None:
            result = run_python(code.group(1), self.limits, self.isolation)
            self.num_code_runs += 1
            observation = format_run(result)
            info = self._info()
            info.update(exit_code=result.exit_code, run_wall_s=round(result.wall_s, 3))
        else:
            observation = HINT
            info = self._info()
        if self.turn >= self.max_turns:
            self.done = True
            info.update(out_of_turns=True, correct=False, expected=str(self.entry["answer"]))
        return StepResult(observation, 0.0, self.done, info)

    def final_reward(self) -> float:
        return self.score

    def _info(self, dataset: str | None = None) -> dict[str, Any]:
        info: dict[str, Any] = {"turn": self.turn, "max_turns": self.max_turns, "code_runs": self.num_code_runs}
        if dataset is not None:
            info["dataset"] = dataset
        return info
