"""The code sandbox contains what untrusted code does: loops, fork bombs, output,
memory, files, and it sees none of the server's environment or private files."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tiderl.envs.sandbox import SandboxLimits, _processes_of_uid, run_python

is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="own-uid containment needs root")
UID_BASE = 1_900_100_000
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2, uid_base=UID_BASE, uid_slots=4)


def test_runs_code_and_captures_output_and_errors() -> None:
    result = run_python("import math\nprint(math.gcd(12, 18))\nraise ValueError('bad')\n", LIMITS)
    assert result.stdout == "6\n"
    assert result.exit_code == 1 and not result.timed_out and not result.ok
    assert 'File "main.py", line 3' in result.stderr and "ValueError: bad" in result.stderr
    assert run_python("print('hi')", LIMITS).ok


def test_empty_environment_and_scratch_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDERL_ENV_TOKEN", "server-secret")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(os.listdir('.'))", LIMITS)
    env_keys, cwd, listing = result.stdout.splitlines()
    assert "TIDERL_ENV_TOKEN" not in env_keys and "PATH" not in env_keys
    assert "tiderl-sandbox-" in cwd and listing == "['main.py']"
    assert not Path(cwd).exists()  # the scratch directory is deleted afterwards


def test_infinite_loop_is_stopped_by_cpu_or_wall_limit() -> None:
    result = run_python("while True:\n    pass\n", SandboxLimits(cpu_s=1, wall_s=3.0, uid_base=UID_BASE, uid_slots=4))
    assert result.exit_code is not None and result.exit_code < 0
    assert result.wall_s < 5.0


def test_sleeping_code_is_stopped_by_wall_limit() -> None:
    result = run_python("import time\ntime.sleep(60)\n", SandboxLimits(wall_s=1.0, uid_base=UID_BASE, uid_slots=4))
    assert result.timed_out and result.exit_code == -signal.SIGKILL and result.wall_s < 3.0


def test_huge_output_is_capped() -> None:
    limits = SandboxLimits(output_bytes=10_000, wall_s=5.0, uid_base=UID_BASE, uid_slots=4)
    result = run_python("while True:\n    print('x' * 1000)\n", limits)
    assert result.output_truncated and len(result.stdout) + len(result.stderr) <= 10_000
    assert result.wall_s < 4.0


def test_memory_hog_gets_memory_error() -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    result = run_python(code, SandboxLimits(memory_mb=256, uid_base=UID_BASE, uid_slots=4))
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_big_file_is_refused() -> None:
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (8 << 20))\nprint('wrote')\n"
    result = run_python(code, SandboxLimits(file_mb=1, uid_base=UID_BASE, uid_slots=4))
    assert "wrote" not in result.stdout and result.exit_code != 0


@needs_root
def test_fork_bomb_is_capped_and_every_process_is_killed() -> None:
    code = (
        "import os, time\n"
        "for _ in range(10000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"  # escape the process group: the uid sweep must still get it
        "            time.sleep(600)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('forks refused')\n"
        "time.sleep(600)\n"
    )
    limits = SandboxLimits(wall_s=3.0, max_processes=8, uid_base=UID_BASE, uid_slots=1)
    result = run_python(code, limits)
    assert result.timed_out and "forks refused" in result.stdout
    assert _processes_of_uid(UID_BASE) == {}  # no process left, not even a zombie


@needs_root
def test_server_private_files_are_unreadable(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("server-secret")
    secret.chmod(0o600)
    result = run_python(f"print(open({str(secret)!r}).read())", LIMITS)
    assert "server-secret" not in result.stdout and "PermissionError" in result.stderr
    assert run_python("import os\nprint(os.getuid())", LIMITS).stdout.strip().startswith("19001000")
