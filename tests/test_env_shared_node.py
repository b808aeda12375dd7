"""An env server on a shared node (issue 48): the operator decides the sandbox mode, the uid locks
are private, work outside the sandbox is bounded, one client cannot starve another, sessions
belong to their client, and the sandbox's scratch directory is its own."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tiderl.envs.bwrap import bwrap_argv, scratch_dir
from tiderl.envs.connguard import client_key
from tiderl.envs.seccomp import filter_program
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.serving import start_server
from tiderl.envs.sessions import SessionTable
from tiderl.envs.uids import lock_dir
from tiderl.envs.sandbox_errors import SandboxError

ROOT = Path(__file__).resolve().parents[1]


async def _post(url: str, endpoint: str, body: Any, local_addr: str | None = None) -> tuple[int, dict[str, Any]]:
    connector = aiohttp.TCPConnector(local_addr=(local_addr, 0) if local_addr else None)
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.post(url + endpoint, json=body) as resp:
            return resp.status, await resp.json()


def test_unsafe_sandbox_is_the_operators_choice() -> None:
    async def main() -> tuple[Any, ...]:
        body = {"env": "pytool", "seed": 1, "options": {"sandbox": "unsafe"}}
        async with await start_server(ServerOptions(envs=("pytool",))) as srv:
            refused = await _post(srv.url, "/start", body)
        async with await start_server(ServerOptions(envs=("pytool",), allow_unsafe_sandbox=True)) as srv:
            allowed = await _post(srv.url, "/start", body)
        return refused, allowed

    (status, answer), (ok_status, ok_answer) = asyncio.run(main())
    assert status == 403 and answer["code"] == "forbidden"
    assert "sandbox='unsafe'" in answer["error"] and "--allow-unsafe-sandbox" in answer["error"]
    assert ok_status == 200 and "session_id" in ok_answer, ok_answer


def test_huge_option_values_are_400_bad_options_naming_the_option() -> None:
    async def main() -> list[tuple[int, dict[str, Any]]]:
        async with await start_server(ServerOptions(envs=("hilo",))) as srv:
            return [await _post(srv.url, "/start", {"env": "hilo", "seed": 1, "options": options})
                    for options in ({"high": 10**4000}, {"low": -(10**13)}, {"max_turns": 10**9})]

    for (status, answer), name in zip(asyncio.run(main()), ("'high'", "'low'", "'max_turns'")):
        assert status == 400 and answer["code"] == "bad_options" and name in answer["error"], answer


def test_a_slow_dataset_config_is_stopped_at_the_time_limit() -> None:
    from tiderl.envs.base import EnvOptionError
    from tiderl.envs.taskgen import TaskGenError, make_task

    make_task("basic_arithmetic", 1, {})  # warm the helper (imports reasoning_gym once)
    started = time.monotonic()
    with pytest.raises(TaskGenError, match="longer than 1 s"):
        make_task("basic_arithmetic", 1, {"min_terms": 20000, "max_terms": 20000, "min_digits": 500,
                                          "max_digits": 500}, timeout_s=1.0)
    assert time.monotonic() - started < 3.0
    with pytest.raises(TaskGenError, match="unexpected keyword argument 'bogus'"):
        make_task("basic_arithmetic", 1, {"bogus": 1})
    dataset, entry = make_task("basic_arithmetic", 2, {})
    assert dataset.score_answer(str(entry["answer"]), entry) == 1.0
    assert issubclass(TaskGenError, ValueError) and issubclass(EnvOptionError, ValueError)


def test_the_task_helper_outlives_the_thread_that_started_it_and_comes_back_if_killed() -> None:
    """A server's worker thread starts the helper; the helper must not end with that thread (the
    hostile-code test's second server once found it gone), and one killed from outside is replaced."""
    import os
    import signal
    import threading

    from tiderl.envs import taskgen

    if taskgen._helper.proc is not None:
        taskgen._helper.proc.kill()
        taskgen._helper.proc.wait()
    thread = threading.Thread(target=taskgen.make_task, args=("basic_arithmetic", 1, {}))
    thread.start()
    thread.join()
    first = taskgen._helper.proc
    assert first is not None
    time.sleep(0.5)
    assert first.poll() is None  # still there after its starting thread ended
    dataset, entry = taskgen.make_task("basic_arithmetic", 3, {})
    assert taskgen._helper.proc is first and dataset.score_answer(str(entry["answer"]), entry) == 1.0
    os.kill(first.pid, signal.SIGKILL)
    time.sleep(0.2)
    dataset, entry = taskgen.make_task("basic_arithmetic", 4, {})
    assert taskgen._helper.proc is not first and dataset.score_answer(str(entry["answer"]), entry) == 1.0


def test_loopback_addresses_are_one_client() -> None:
    assert client_key("127.0.0.1") == client_key("127.0.0.2") == client_key("::1") == "loopback"
    assert client_key("::ffff:127.0.0.5") == "loopback"
    assert client_key("10.1.2.3") == "10.1.2.3" and client_key(None) == "?"


def test_a_pause_lease_counts_from_its_first_pause_until_a_step() -> None:
    now = [0.0]
    table = SessionTable(max_sessions=4, idle_timeout_s=1000, max_paused_s=100, clock=lambda: now[0])
    table.reserve("a")
    session = table.add("hilo", object(), 1, "a")  # type: ignore[arg-type]
    for _ in range(12):  # resume + pause every 10 s
        table.pause(session)
        now[0] += 10
        table.resume(session)
        table.pause(session)
    assert table.expired_sessions() == [session]
    table.resume(session)
    table.stepped(session)  # a step ends the lease
    table.pause(session)
    assert table.expired_sessions() == []


def test_sessions_are_bound_to_the_client_that_started_them() -> None:
    address = _other_local_address()
    if address is None:
        pytest.skip("no non-loopback address on this machine to be a second client")

    async def main() -> list[tuple[int, dict[str, Any]]]:
        async with await start_server(ServerOptions(envs=("hilo",), host="0.0.0.0")) as srv:
            url = srv.url.replace(srv.url.split("//")[1].split(":")[0], "127.0.0.1")
            _, started = await _post(url, "/start", {"env": "hilo", "seed": 1})
            sid = {"session_id": started["session_id"]}
            other_url = url.replace("127.0.0.1", address)
            answers = [await _post(other_url, ep, {**sid, "action": "1"} if ep == "/observation" else sid,
                                   local_addr=address) for ep in ("/observation", "/pause", "/resume", "/end")]
            answers.append(await _post(url.replace("127.0.0.1", "127.0.0.2"), "/pause", sid))  # loopback: the owner
            return answers

    answers = asyncio.run(main())
    for status, answer in answers[:4]:
        assert status == 404 and answer["code"] == "unknown_session", answer
    assert answers[4][0] == 200


def _other_local_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_health_answers_while_another_client_holds_many_half_open_connections() -> None:
    address = _other_local_address()
    if address is None:
        pytest.skip("no non-loopback address on this machine to be a second client")

    async def main() -> tuple[int, float, dict[str, Any]]:
        async with await start_server(ServerOptions(envs=("hilo",), host="0.0.0.0", token="t")) as srv:
            port = int(srv.url.rsplit(":", 1)[1])
            flood = []
            for _ in range(300):  # half-open: a request line, never the end of the headers
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    flood.append(writer)
                except OSError:
                    pass
            ok, worst = 0, 0.0
            connector = aiohttp.TCPConnector(local_addr=(address, 0), force_close=True)
            async with aiohttp.ClientSession(connector=connector) as http:
                for _ in range(20):
                    t0 = time.monotonic()
                    async with http.get(f"http://{address}:{port}/health",
                                        headers={"Authorization": "Bearer t"}) as resp:
                        ok += resp.status == 200
                        health = await resp.json()
                    worst = max(worst, time.monotonic() - t0)
            for writer in flood:
                writer.close()
            return ok, worst, health

    ok, worst, health = asyncio.run(main())
    assert ok == 20 and worst < 1.0, (ok, worst)
    assert health["num_refused_connections"] >= 300 - health["max_half_open_per_client"]


def test_lock_directory_must_be_private(tmp_path: Path) -> None:
    good = lock_dir(tmp_path / "locks")
    assert (os.stat(good).st_mode & 0o777) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(SandboxError, match="mode 0755"):
        lock_dir(loose)
    (tmp_path / "link").symlink_to(good)
    with pytest.raises(SandboxError, match="is a symlink"):
        lock_dir(tmp_path / "link")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(SandboxError, match="owned by uid 65534"):
            lock_dir(theirs)


def test_scratch_directory_never_overlaps_a_python_tree_under_tmp() -> None:
    assert scratch_dir(["/opt/venv"]) == "/tmp"
    assert scratch_dir(["/tmp/fresh/.venv", "/opt/py"]) == "/sandbox"
    argv = bwrap_argv("bwrap", system_mounts=[], python_dirs=["/tmp/fresh/.venv"], tmpfs_mb=1, code_fd=3,
                      info_fd=4, sync_fd=5, as_root=False, seccomp_fd=6)
    assert argv[argv.index("--chdir") + 1] == "/sandbox" and "/sandbox/main.py" in argv
    assert argv[argv.index("--seccomp") + 1] == "6"
    assert filter_program("x86_64") is not None and len(filter_program("x86_64")) % 8 == 0


@pytest.mark.slow
def test_a_venv_under_tmp_leaves_the_scratch_directory_empty(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tiderl.envs.bwrap import find_bwrap

    if find_bwrap() is None:
        pytest.skip("bwrap is not installed")
    base = Path("/tmp") / f"tiderl-fresh-{os.getpid()}"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / ".venv")], check=True)
        code = ("import json, sys\nfrom tiderl.envs.sandbox import run_python, SandboxLimits\n"
                "r = run_python(\"import os\\nprint(os.getcwd(), os.listdir('.'))\", "
                "SandboxLimits(wall_s=5, uid_base=1_900_300_000, uid_slots=2))\nprint(json.dumps(r.stdout))\n")
        proc = subprocess.run([str(base / ".venv/bin/python"), "-c", code], env={"PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
    if "SandboxUnavailableError" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    cwd, listing = json.loads(proc.stdout.splitlines()[-1]).split(" ", 1)
    assert listing.strip() == "['main.py']" and cwd == "/sandbox"


def test_serve_without_a_token_refuses_a_wider_address_and_warns_on_loopback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TIDERL_ENV_TOKEN"}
    wide = subprocess.run([sys.executable, "-m", "tiderl", "env", "serve", "--env", "hilo", "--host", "0.0.0.0"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert wide.returncode == 2 and "refusing to listen on 0.0.0.0 without a token" in wide.stderr
    port_file = tmp_path / "url"
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "env", "serve", "--env", "hilo", "--port-file",
                             str(port_file)], env=env, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert port_file.exists()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "without a token: every local user can use this server" in stderr
