"""The tool-use environment: code runs, exact verifier reward, and hostile code that
never takes the env server down."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tiderl.envs import EnvOptionError, make_env, sandbox
from tiderl.envs.client import EnvBadRequestError, EnvClient
from tiderl.envs.pytool import HINT, format_run
from tiderl.envs.sandbox import SandboxResult, SandboxUnavailableError, check_bwrap
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.serving import start_server

pytest.importorskip("reasoning_gym")


def _bwrap_missing() -> str | None:
    try:
        check_bwrap()
    except SandboxUnavailableError as e:
        return str(e)
    return None


BWRAP_MISSING = _bwrap_missing()
SANDBOXES = [pytest.param("bwrap", marks=pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"bwrap cannot run "
                                                            f"here: {BWRAP_MISSING}")), "unsafe"]


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_code_run_then_exact_answer(sandbox_name: str) -> None:
    env = make_env("pytool")
    observation, info = env.reset(seed=3, options={"dataset": "basic_arithmetic", "sandbox": sandbox_name})
    assert observation.endswith("\n" + HINT) and info["dataset"] == "basic_arithmetic"
    expected = env.entry["answer"]
    question = env.entry["question"]
    code = f"print(eval({question.removeprefix('Calculate ').rstrip('.')!r}))"
    result = env.step(f"let me compute\n```python\n{code}\n```")
    assert result.observation == f"exit 0\n{expected}" and not result.done and result.info["code_runs"] == 1
    assert env.step("thinking...").observation == HINT
    result = env.step(f"answer: {expected}")
    assert result == ("correct", 1.0, True, result.info) and result.info["correct"] is True
    assert env.final_reward() == 1.0


@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_wrong_answer_and_turn_limit_score_zero(sandbox_name: str) -> None:
    env = make_env("pytool")
    env.reset(seed=1, options={"dataset": "gcd", "sandbox": sandbox_name})
    assert env.step("Answer: -12345").observation == "wrong"
    assert env.final_reward() == 0.0
    env.reset(seed=1, options={"max_turns": 2, "sandbox": sandbox_name})
    env.step("```python\nraise SystemExit(3)\n```")
    result = env.step("```\nprint('hi')\n```")
    assert result.done and result.info["out_of_turns"] and result.reward == 0.0
    assert result.observation == "exit 0\nhi"


def test_bad_options_are_clear() -> None:
    env = make_env("pytool")
    with pytest.raises(EnvOptionError, match="no_such_dataset"):
        env.reset(seed=0, options={"dataset": "no_such_dataset"})
    with pytest.raises(EnvOptionError, match="unknown option"):
        env.reset(seed=0, options={"limit": 3})
    with pytest.raises(EnvOptionError, match="'sandbox' must be 'bwrap' or 'unsafe'"):
        env.reset(seed=0, options={"sandbox": "docker"})


def test_without_bwrap_code_runs_are_refused_unless_the_job_says_unsafe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_bwrap_checked", False)
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    env = make_env("pytool")
    with pytest.raises(EnvOptionError, match=r"bubblewrap \(`bwrap`\) is not installed.*sandbox: unsafe"):
        env.reset(seed=0, options={})
    env.reset(seed=0, options={"sandbox": "unsafe"})
    assert env.step("```python\nprint(6 * 7)\n```").observation == "exit 0\n42"

    async def main() -> None:  # the server answers the refusal as bad options, naming tool and option
        running = await start_server(ServerOptions(envs=("pytool",), allow_unsafe_sandbox=True))
        try:
            async with EnvClient(running.url) as client:
                with pytest.raises(EnvBadRequestError, match="bubblewrap.*sandbox: unsafe"):
                    await client.start("pytool", seed=0)
                assert (await client.start("pytool", seed=0, options={"sandbox": "unsafe"})).session_id
        finally:
            await running.close()

    asyncio.run(main())


def test_a_run_killed_by_the_memory_limit_says_so() -> None:
    killed = SandboxResult(stdout="", stderr="", exit_code=-9, timed_out=False, output_truncated=False, wall_s=1.0,
                           memory_exceeded=True)
    assert format_run(killed) == "memory limit"
    survived = SandboxResult(stdout="ok\n", stderr="", exit_code=0, timed_out=False, output_truncated=False,
                             wall_s=1.0, memory_exceeded=True)
    assert format_run(survived) == "exit 0\nok"


@pytest.mark.slow
@pytest.mark.parametrize("sandbox_name", SANDBOXES)
def test_hostile_code_never_takes_the_server_down(sandbox_name: str) -> None:
    hostile = [
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "while True:\n    pass\n",
        "while True:\n    print('x' * 10000)\n",
        "a = []\nwhile True:\n    a.append(bytearray(64 << 20))\n",
    ]
    if sandbox_name == "bwrap" or os.geteuid() == 0:  # own PID namespace, or as root an own uid
        hostile.append("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n")

    async def main() -> None:
        running = await start_server(ServerOptions(envs=("pytool", "hilo"), max_workers=8, allow_unsafe_sandbox=True))
        try:
            async with EnvClient(running.url) as client:
                sessions = [
                    (await client.start("pytool", seed=i, options={"max_turns": 2, "sandbox": sandbox_name})).session_id
                    for i in range(len(hostile))
                ]
                hilo = (await client.start("hilo", seed=0)).session_id
                runs = [asyncio.create_task(client.step(sid, f"```python\n{code}```"))
                        for sid, code in zip(sessions, hostile)]
                # While the hostile runs go on, the server keeps serving other sessions quickly.
                worst_s = 0.0
                while not all(r.done() for r in runs):
                    t0 = time.perf_counter()
                    await client.health()
                    worst_s = max(worst_s, time.perf_counter() - t0)
                    await asyncio.sleep(0.1)
                assert worst_s < 2.0
                results = [r.result() for r in runs]
                assert results[1].observation.split("\n")[0] in ("timed out", "exit -24")
                assert results[2].observation.startswith("output limit")
                assert "MemoryError" in results[3].observation
                assert (await client.step(hilo, "8")).info["turn"] == 1
                health = await client.health()
                assert health["status"] == "ok" and health["sessions"] == len(hostile) + 1
                for sid in sessions:
                    assert (await client.step(sid, "answer: 0")).done
        finally:
            await running.close()

    asyncio.run(main())
