"""The env server against hostile or broken clients, each through a real server on a free
port: slow and unfinished requests, connection floods, malformed input, clients that
leave, a full step queue, and sessions held as a resource. Pure rules (the log repeat
filter, body parsing, the per-client and paused-session rules of the table) are tested
directly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tiderl.envs import Environment, StepResult, register_env
from tiderl.envs.client import EnvClient, EnvConnectionError
from tiderl.envs.hilo import HiloEnv
from tiderl.envs.protocol import ErrorCode, ProtocolError, parse_body
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.serverlog import RepeatFilter
from tiderl.envs.serving import RunningServer, start_server
from tiderl.envs.sessions import SessionTable


class GatedEnv(Environment):
    """A blocking env whose steps wait for `gate`; counts the steps it really ran."""

    name = "gated"
    blocking = True
    gate = threading.Event()

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        self.num_steps_run = 0
        return "ready", {}

    def step(self, action: str) -> StepResult:
        assert GatedEnv.gate.wait(10), "the test never opened the gate"
        self.num_steps_run += 1
        return StepResult("ok", 0.0, False, {"turn": self.num_steps_run})

    def final_reward(self) -> float:
        return 0.0


class Utf8Env(Environment):
    """Encodes its action as UTF-8, as anything that writes it to a file or a process does."""

    name = "utf8"

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        return "write code", {}

    def step(self, action: str) -> StepResult:
        return StepResult(f"{len(action.encode('utf-8'))} bytes", 0.0, False, {})

    def final_reward(self) -> float:
        return 0.0


register_env("gated", GatedEnv)
register_env("utf8", Utf8Env)


@contextlib.asynccontextmanager
async def serving(envs: tuple[str, ...] = ("hilo",), **kwargs: Any) -> AsyncIterator[RunningServer]:
    running = await start_server(ServerOptions(envs=envs, **kwargs))
    try:
        yield running
    finally:
        await running.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def exchange(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes on a new connection; everything the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def request(method: str, path: str, body: bytes = b"", headers: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n".encode()
            + headers + b"\r\n" + body)


def answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def post(url: str, endpoint: str, body: Any, **kwargs: Any) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + endpoint, json=body, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


def loud(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records a client's doing must never produce: errors, warnings with a traceback."""
    return [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# 1. slow-loris and connection floods ----------------------------------------------------------


def test_unfinished_headers_and_bodies_are_cut_off_and_connections_beyond_the_cap_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with serving(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=8) as srv, \
                aiohttp.ClientSession() as http:
            port = port_of(srv.url)
            async with http.get(srv.url + "/health") as resp:  # a client within the cap, kept alive
                assert resp.status == 200
            loris = []
            for _ in range(7):  # with the client above, the cap is reached
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /start HTTP/1.1\r\nHost: x\r\nContent-Le")
                loris.append((reader, writer))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            refused = await asyncio.gather(*(exchange(port, request("GET", "/health")) for _ in range(20)))
            assert time.monotonic() - t0 < 2.0  # answered at once, not left hanging
            for raw in refused:
                status, data = answer(raw)
                assert (status, data["code"]) == (503, "too_many_connections") and b"Retry-After: 1" in raw
            async with http.get(srv.url + "/health") as resp:  # the client within the cap is still served
                assert resp.status == 200 and (await resp.json())["num_refused_connections"] == 20
            # The half-sent requests get a 408 and are closed once the header deadline passes.
            for reader, writer in loris:
                raw = await asyncio.wait_for(reader.read(), 2.0)
                assert answer(raw)[1]["code"] == "request_timeout"
                writer.close()
            # A body that stops coming: 408 too, and the connection is closed.
            raw = await exchange(port, b"POST /start HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"env\"")
            status, data = answer(raw)
            assert (status, data["code"]) == (408, "request_timeout") and "body" in data["error"]
            async with EnvClient(srv.url) as client:
                health = await client.health()
            assert health["num_timed_out_connections"] == 7
            assert health["connections"] == 2  # the kept client's and the asking one's

    asyncio.run(main())
    assert loud(caplog) == []
    refusals = [r for r in caplog.records if "refusing a connection" in r.getMessage()]
    assert len(refusals) == 1  # 20 refusals, one line: the repeats are counted, not written


def test_a_flood_under_a_low_open_file_limit_keeps_health_answering_and_the_log_small(tmp_path: Path) -> None:
    # The attack that was seen: 300 unfinished requests against a server allowed 256 open files.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    log_path = tmp_path / "server.log"
    port_file = tmp_path / "url"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiderl", "env", "serve", "--env", "hilo", "--port", "0",
             "--port-file", str(port_file)],
            stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "TIDERL_ENV_TOKEN": ""},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
        )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        url = port_file.read_text().strip()

        async def main() -> None:
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/health") as resp:
                    assert resp.status == 200
                flood = []
                for _ in range(300):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
                    writer.write(b"POST /start HTTP/1.1\r\nHost: x\r\nContent-Le")
                    flood.append((reader, writer))
                await asyncio.sleep(0.5)
                for _ in range(3):
                    async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=3)) as resp:
                        health = await resp.json()
                        assert resp.status == 200
                assert health["max_connections"] < 256 and health["num_refused_connections"] > 0
                # Connections beyond the cap were closed promptly, not held open.
                closed = 0
                for reader, _ in flood:
                    with contextlib.suppress(asyncio.TimeoutError):
                        with contextlib.suppress(ConnectionError):  # reset: closed too
                            await asyncio.wait_for(reader.read(), 0.01)
                        closed += 1
                assert closed >= 300 - health["max_connections"]
                for _, writer in flood:
                    writer.close()

        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert len(text) < 20_000 and "Traceback" not in text and "Too many open files" not in text, text[-3000:]


# 2. malformed input ---------------------------------------------------------------------------


def test_malformed_input_gets_400_naming_the_problem_and_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        for token in (None, "s3cret"):
            auth = b"Authorization: Bearer s3cret\r\n" if token else b""
            async with serving(envs=("hilo", "utf8"), token=token) as srv:
                port = port_of(srv.url)
                cases = [
                    (b"[" * 100_000, "nested deeper than 64"),
                    (b'{"a":' * 50_000, "nested deeper than 64"),
                    (b"[" * 70 + b"]" * 70, "nested deeper than 64"),
                    (b'{"env": "hilo", "seed": ' + b"1" * 5000 + b"}", "not valid JSON"),
                    (b'{"env": "hilo", "seed": NaN}', "not valid JSON"),
                    (b'{"env": "hilo", "seed": 1, "options": {"x": "\\udc80"}}', "lone surrogate"),
                    (b'{"env": "\xff", "seed": 1}', "not UTF-8"),
                ]
                for body, what in cases:
                    status, data = answer(await exchange(port, request("POST", "/start", body, auth)))
                    assert (status, data["code"]) == (400, "bad_request") and what in data["error"], (body[:40], data)
                for header in (b"Authorization: Bearer \xff\xfe\r\n", b"Authorization: \xc3(\r\n"):
                    status, data = answer(await exchange(port, request("GET", "/health", headers=header)))
                    assert (status, data["code"]) == (400, "bad_request") and "Authorization" in data["error"]
                headers = {"Authorization": f"Bearer {token}"} if token else None
                status, data, _ = await post(srv.url, "/start", {"env": "utf8", "seed": 1}, headers=headers)
                sid = data["session_id"]
                code = "```python\nprint('\ud800')\n```"
                body = json.dumps({"session_id": sid, "action": code}).encode()  # ascii: "\ud800" escaped
                status, data = answer(await exchange(port, request("POST", "/observation", body, auth)))
                assert (status, data["code"]) == (400, "bad_request"), data
                assert "field 'action'" in data["error"] and "\\ud800" in data["error"]
                status, data, _ = await post(srv.url, "/observation", {"session_id": sid, "action": "x"},
                                             headers=headers)
                assert status == 200  # the session goes on
                too_big = request("POST", "/start", b"{}", auth)
                too_big = too_big.replace(b"Content-Length: 2", b"Content-Length: 99999999")
                status, data = answer(await exchange(port, too_big))
                assert (status, data["code"]) == (413, "too_large") and "99999999" in data["error"]

    asyncio.run(main())
    assert loud(caplog) == []


def test_a_bad_http_request_is_one_quiet_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with serving() as srv:
            raw = await exchange(port_of(srv.url), b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
            assert raw.split(b"\r\n")[0].endswith(b" 400 Bad Request") and b"Invalid header" in raw

    asyncio.run(main())
    assert loud(caplog) == []
    assert any("bad HTTP request from 127.0.0.1" in r.getMessage() for r in caplog.records)


def test_a_body_that_is_not_the_gzip_it_says_is_a_400_and_one_quiet_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with serving() as srv:
            body = b"not gzip at all"
            raw = await exchange(port_of(srv.url), b"POST /start HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                 b"\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert raw.split(b"\r\n")[0].endswith(b" 400 Bad Request") and b"content-encoding: gzip" in raw
            for _ in range(200):  # aiohttp drains the body again after the answer, and logs that
                if any("Can not decode" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert loud(caplog) == []  # no ERROR, no traceback
    # One INFO line at most (the server's repeat filter passes one bad request's line per window).
    lines = [r for r in caplog.records if "Can not decode" in r.getMessage()]
    assert len(lines) <= 1 and all(r.levelno == logging.INFO and r.exc_info is None for r in lines), lines


def test_body_parsing_names_where_the_problem_is() -> None:
    assert parse_body(b'{"a": [1, {"b": "ok"}]}', "/x") == {"a": [1, {"b": "ok"}]}
    surrogate = r"/x: field 'a'\[1\]\['b'\] holds a lone surrogate \(\\udfff at character 2\)"
    with pytest.raises(ProtocolError, match=surrogate):
        parse_body(b'{"a": [1, {"b": "ok\\udfff"}]}', "/x")
    with pytest.raises(ProtocolError, match="a key of body holds a lone surrogate"):
        parse_body(b'{"\\ud800": 1}', "/x")
    with pytest.raises(ProtocolError, match="nested deeper than 3 levels"):
        parse_body(b"[[[[]]]]", "/x", max_depth=3)
    assert parse_body(b"[[[]]]", "/x", max_depth=3) == [[[]]]
    with pytest.raises(ProtocolError, match=r"not UTF-8 \(byte 0xfe at position 2\)"):
        parse_body(b'"a\xfe"', "/x")


# 3. clients that leave ------------------------------------------------------------------------


def test_a_client_dropping_mid_body_is_one_quiet_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with serving() as srv:
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port_of(srv.url))
                writer.write(b"POST /start HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"env\": ")
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.close()
            await asyncio.sleep(0.3)
            async with EnvClient(srv.url) as client:
                assert (await client.health())["sessions"] == 0

    asyncio.run(main())
    assert loud(caplog) == []
    gone = [r for r in caplog.records if "disconnected mid-body" in r.getMessage()]
    assert gone and all(r.levelno <= logging.INFO for r in gone)


# 4. the step queue ----------------------------------------------------------------------------


def test_a_full_step_queue_answers_429_and_a_step_whose_client_left_is_dropped() -> None:
    async def main() -> None:
        GatedEnv.gate.set()
        async with serving(envs=("gated",), max_workers=1, max_queued_steps=1) as srv, \
                EnvClient(srv.url, max_retries=0) as client:
            sids = [(await client.start("gated", seed=i)).session_id for i in range(4)]
            GatedEnv.gate.clear()
            running = asyncio.create_task(client.step(sids[0], "a"))  # holds the one thread
            await asyncio.sleep(0.2)
            async with EnvClient(srv.url, timeout_s=0.3, max_retries=0) as impatient:
                with pytest.raises(EnvConnectionError, match="no answer"):
                    await impatient.step(sids[1], "b")  # waits in the queue, then its client gives up
            queued = asyncio.create_task(client.step(sids[2], "c"))  # fills the queue
            await asyncio.sleep(0.2)
            status, data, headers = await post(srv.url, "/observation", {"session_id": sids[3], "action": "d"})
            assert (status, data["code"]) == (429, "queue_full") and headers["Retry-After"] == "1"
            assert "max_queued_steps=1" in data["error"]
            GatedEnv.gate.set()
            assert (await running).info["turn"] == 1 and (await queued).info["turn"] == 1
            health = await client.health()
            assert health["num_dropped_steps"] == 1 and health["queued_steps"] == 0
            # The dropped step never ran: the session's next step is its first.
            assert srv.server.table.get(sids[1]).env.num_steps_run == 0
            assert (await client.step(sids[1], "b")).info["turn"] == 1
            assert (await client.step(sids[3], "d")).info["turn"] == 1  # the refused one may simply retry

    asyncio.run(main())


# 5. sessions as a resource --------------------------------------------------------------------


def test_paused_sessions_expire_after_max_paused_s() -> None:
    async def main() -> None:
        async with serving(max_paused_s=0.4, idle_timeout_s=60) as srv, EnvClient(srv.url) as client:
            parked = (await client.start("hilo", seed=1)).session_id
            await client.pause(parked)
            await asyncio.sleep(0.3)
            await client.pause(parked)  # pausing again does not extend it
            await asyncio.sleep(0.6)
            status, data, _ = await post(srv.url, "/resume", {"session_id": parked})
            assert (status, data["code"]) == (409, "session_ended") and "max_paused_s=0.4" in data["error"]
            health = await client.health()
            assert health["num_expired"] == 1 and health["sessions"] == 0 and health["max_paused_s"] == 0.4

    asyncio.run(main())


def test_one_address_cannot_take_every_slot() -> None:
    async def main() -> None:
        async with serving(max_sessions=4) as srv:
            async with EnvClient(srv.url, max_retries=0) as client:
                held = [await client.start("hilo", seed=i) for i in range(3)]  # three quarters of 4
                for s in held:
                    await client.pause(s.session_id)
                status, data, _ = await post(srv.url, "/start", {"env": "hilo", "seed": 9})
                assert (status, data["code"]) == (429, "client_limit") and "client loopback" in data["error"]
                assert (await client.health())["max_sessions_per_client"] == 3
            # Another loopback address is the same client (no way round the cap from 127.0.0.2).
            other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=other) as http:
                async with http.post(srv.url + "/start", json={"env": "hilo", "seed": 9}) as resp:
                    assert resp.status == 429 and (await resp.json())["code"] == "client_limit"
            async with EnvClient(srv.url, max_retries=0) as client:
                await client.end(held[0].session_id)
                await client.start("hilo", seed=10)  # an ended session frees the client's share

    asyncio.run(main())


def test_with_a_token_the_cap_counts_per_token() -> None:
    async def main() -> None:
        async with serving(max_sessions=4, token="t") as srv, EnvClient(srv.url, token="t", max_retries=0) as client:
            for i in range(4):  # one token is one client, the run itself: by default it may use every slot
                await client.start("hilo", seed=i)
        async with serving(max_sessions=4, token="t", max_sessions_per_client=2) as srv:
            async with EnvClient(srv.url, token="t", max_retries=0) as client:
                for i in range(2):
                    await client.start("hilo", seed=i)
            other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=other) as http:  # another address, the same token
                async with http.post(srv.url + "/start", json={"env": "hilo", "seed": 9},
                                     headers={"Authorization": "Bearer t"}) as resp:
                    data = await resp.json()
                    assert (resp.status, data["code"]) == (429, "client_limit")

    asyncio.run(main())


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_table_counts_each_clients_live_and_starting_sessions() -> None:
    table = SessionTable(max_sessions=10, idle_timeout_s=10, max_sessions_per_client=2)
    table.reserve("a")
    table.add("hilo", HiloEnv(), 0, "a")
    table.reserve("a")  # a start in progress counts
    with pytest.raises(ProtocolError) as info:
        table.reserve("a")
    assert info.value.code is ErrorCode.CLIENT_LIMIT
    table.reserve("b")  # another client is not affected
    table.release("a")
    table.reserve("a")
    session = table.add("hilo", HiloEnv(), 0, "a")
    table.remove(session, "ended")
    table.reserve("a")
    assert table.num_by_client == {"a": 2, "b": 1}


def test_table_expires_sessions_paused_too_long_but_not_busy_ones() -> None:
    clock = FakeClock()
    table = SessionTable(max_sessions=4, idle_timeout_s=10, max_paused_s=100, clock=clock)
    sessions = []
    for _ in range(2):
        table.reserve()
        sessions.append(table.add("hilo", HiloEnv(), 0))
    for s in sessions:
        table.pause(s)
    clock.now_s = 60
    table.pause(sessions[0])  # pausing again does not restart its clock
    sessions[1].is_busy = True
    clock.now_s = 101
    assert table.expired_sessions() == [sessions[0]] and table.idle_sessions() == []
    table.resume(sessions[0])
    assert table.expired_sessions() == []
    table.remove(sessions[1], "expired: paused for longer than max_paused_s=100 s")
    assert table.counts()["num_expired"] == 1


def test_repeat_filter_passes_one_record_per_window_and_counts_the_rest() -> None:
    clock = FakeClock()
    repeats = RepeatFilter(window_s=10, min_level=logging.WARNING, clock=clock)

    def record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("tiderl.envs.server", level, __file__, 1, msg, ("x",), None)

    assert repeats.filter(record("accept failed: %s"))
    assert not any(repeats.filter(record("accept failed: %s")) for _ in range(99))
    assert repeats.filter(record("another error: %s"))  # another kind passes
    assert repeats.filter(record("below the level: %s", logging.INFO))
    clock.now_s = 10.5
    passed = record("accept failed: %s")
    assert repeats.filter(passed)
    assert passed.getMessage() == "accept failed: x (99 similar suppressed in the last 10 s)"
