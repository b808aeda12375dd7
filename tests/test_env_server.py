"""Protocol conformance of the env server, through a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest

from tiderl.envs import Environment, StepResult, register_env
from tiderl.envs.client import EnvClient, EnvConflictError, EnvConnectionError, EnvNotFoundError
from tiderl.envs.pool import EnvPool
from tiderl.envs.hilo import HiloEnv
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.serving import RunningServer, start_server


class ExplodingEnv(Environment):
    """Raises on the action `boom`, to check that env failures stay in their session."""

    name = "exploding"

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        if options.get("fail_reset"):
            raise RuntimeError("reset exploded")
        return "ready", {}

    def step(self, action: str) -> StepResult:
        if action == "boom":
            raise RuntimeError("step exploded")
        return StepResult("ok", 0.0, False, {})

    def final_reward(self) -> float:
        return 0.5


register_env("exploding", ExplodingEnv)


@contextlib.asynccontextmanager
async def serving(envs: tuple[str, ...] = ("hilo",), **kwargs: Any) -> AsyncIterator[RunningServer]:
    running = await start_server(ServerOptions(envs=envs, **kwargs))
    try:
        yield running
    finally:
        await running.close()


async def post(url: str, endpoint: str, body: Any = None, *, raw: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        data = raw if raw is not None else aiohttp.payload.JsonPayload(body)
        async with http.post(url + endpoint, data=data, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


async def get(url: str, endpoint: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + endpoint, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


def test_full_episode_through_every_endpoint() -> None:
    async def main() -> None:
        async with serving() as srv, EnvClient(srv.url) as client:
            health = await client.health()
            assert health["status"] == "ok" and health["envs"] == ["hilo"] and health["active"] == 0
            start = await client.start("hilo", seed=5)
            assert start.observation == "guess a number 1-16" and start.done is False
            low, high = 1, 16
            for _ in range(6):
                guess = (low + high) // 2
                step = await client.step(start.session_id, str(guess))
                if step.observation == "higher":
                    low = guess + 1
                elif step.observation == "lower":
                    high = guess - 1
                if step.done:
                    break
            assert step.observation == "correct" and step.reward == 1.0 and step.done
            assert (await client.pause(start.session_id)) == "paused"
            assert (await client.health())["paused"] == 1
            assert (await client.resume(start.session_id)) == "done"
            end = await client.end(start.session_id)
            assert end.reward == 1.0 and end.info["episode_done"] is True and end.info["num_steps"] >= 1
            health = await client.health()
            assert health["sessions"] == 0 and health["num_ended"] == 1 and health["num_steps"] >= 1

    asyncio.run(main())


BAD_REQUESTS: list[tuple[str, Any, bytes | None, int, str]] = [
    ("/start", None, b"{not json", 400, "bad_request"),
    ("/start", None, b"\xff\xfe", 400, "bad_request"),
    ("/start", [1, 2], None, 400, "bad_request"),
    ("/start", {"seed": 1}, None, 400, "bad_request"),
    ("/start", {"env": "hilo", "seed": "1"}, None, 400, "bad_request"),
    ("/start", {"env": "hilo", "seed": True}, None, 400, "bad_request"),
    ("/start", {"env": "hilo", "seed": 1, "options": [1]}, None, 400, "bad_request"),
    ("/start", {"env": "hilo", "seed": 1, "extra": 1}, None, 400, "bad_request"),
    ("/start", {"env": "hilo", "seed": 1, "options": {"high": "x"}}, None, 400, "bad_options"),
    ("/start", {"env": "nope", "seed": 1}, None, 404, "unknown_env"),
    ("/observation", {"session_id": "x"}, None, 400, "bad_request"),
    ("/observation", {"session_id": 3, "action": "1"}, None, 400, "bad_request"),
    ("/observation", {"session_id": "nope", "action": "1"}, None, 404, "unknown_session"),
    ("/pause", {}, None, 400, "bad_request"),
    ("/pause", {"session_id": "nope"}, None, 404, "unknown_session"),
    ("/resume", {"session_id": "nope"}, None, 404, "unknown_session"),
    ("/end", {"session_id": "nope"}, None, 404, "unknown_session"),
    ("/end", None, b"", 400, "bad_request"),
    ("/nowhere", {}, None, 404, "not_found"),
    ("/health", {}, None, 405, "method_not_allowed"),
]


def test_bad_requests_get_json_errors_and_do_not_disturb_other_sessions() -> None:
    async def main() -> None:
        async with serving(max_body_bytes=1 << 16) as srv, EnvClient(srv.url) as client:
            bystander = await client.start("hilo", seed=1)
            await client.step(bystander.session_id, "1")
            for endpoint, body, raw, status, code in BAD_REQUESTS:
                got_status, data = await post(srv.url, endpoint, body, raw=raw)
                assert (got_status, data.get("code")) == (status, code), (endpoint, body, raw, data)
                assert isinstance(data["error"], str) and data["error"]
            status, data = await post(srv.url, "/start", raw=b'{"env": "' + b"x" * (1 << 17) + b'"}')
            assert status == 413 and data["code"] == "too_large"
            step = await client.step(bystander.session_id, "16")
            assert step.info["turn"] == 2
            assert (await client.health())["sessions"] == 1

    asyncio.run(main())


def test_step_on_paused_ended_or_done_session_is_409() -> None:
    async def main() -> None:
        async with serving() as srv, EnvClient(srv.url) as client:
            sid = (await client.start("hilo", seed=2, options={"max_turns": 1})).session_id
            assert await client.pause(sid) == "paused"
            assert await client.pause(sid) == "paused"  # pausing twice is harmless
            status, data = await post(srv.url, "/observation", {"session_id": sid, "action": "3"})
            assert (status, data["code"]) == (409, "session_paused")
            assert await client.resume(sid) == "active"
            assert (await client.step(sid, "x")).done  # max_turns=1: the episode is over
            status, data = await post(srv.url, "/observation", {"session_id": sid, "action": "3"})
            assert (status, data["code"]) == (409, "episode_done")
            first = await client.end(sid)
            assert first.reward == 0.0
            assert (await client.end(sid)) == first  # /end replays its answer, so retrying it is safe
            for endpoint, body in [("/observation", {"session_id": sid, "action": "3"}),
                                   ("/pause", {"session_id": sid}), ("/resume", {"session_id": sid})]:
                status, data = await post(srv.url, endpoint, body)
                assert (status, data["code"]) == (409, "session_ended"), endpoint
                assert "ended" in data["error"]

    asyncio.run(main())


def test_concurrent_step_on_one_session_is_409_busy_but_pause_is_allowed() -> None:
    async def main() -> None:
        async with serving(latency="fixed:0.4") as srv, EnvClient(srv.url) as client:
            sid = (await client.start("hilo", seed=2)).session_id
            first = asyncio.create_task(client.step(sid, "1"))
            await asyncio.sleep(0.1)
            status, data = await post(srv.url, "/observation", {"session_id": sid, "action": "2"})
            assert (status, data["code"]) == (409, "session_busy")
            assert (await first).info["turn"] == 1

            # Pausing while a step runs is allowed: the step completes, the session stays paused.
            game = HiloEnv()
            game.reset(2, {})
            secret = game.secret
            first = asyncio.create_task(client.step(sid, "16" if secret != 16 else "15"))
            await asyncio.sleep(0.1)
            assert await client.pause(sid) == "paused"
            assert (await first).info["turn"] == 2
            assert (await client.health())["paused"] == 1
            assert await client.resume(sid) == "active"

    asyncio.run(main())


def test_capacity_429_and_draining_503() -> None:
    async def main() -> None:
        async with serving(max_sessions=2) as srv, EnvClient(srv.url, max_retries=0) as client:
            a = await client.start("hilo", seed=1)
            await client.start("hilo", seed=2)
            status, data = await post(srv.url, "/start", {"env": "hilo", "seed": 3})
            assert (status, data["code"]) == (429, "at_capacity")
            health = await client.health()
            assert health["capacity_left"] == 0 and health["max_sessions"] == 2
            await client.end(a.session_id)
            await client.start("hilo", seed=3)  # a freed slot is reusable
            srv.server.is_draining = True
            status, data = await post(srv.url, "/start", {"env": "hilo", "seed": 4})
            assert (status, data["code"]) == (503, "draining")

    asyncio.run(main())


def test_token_required_when_configured() -> None:
    async def main() -> None:
        async with serving(token="s3cret") as srv:
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                status, data = await get(srv.url, "/health", headers=headers)
                assert (status, data["code"]) == (401, "unauthorized")
                status, data = await post(srv.url, "/start", {"env": "hilo", "seed": 1}, headers=headers)
                assert status == 401
            status, _ = await get(srv.url, "/health", headers={"Authorization": "Bearer s3cret"})
            assert status == 200
            async with EnvClient(srv.url, token="s3cret") as client:
                sid = (await client.start("hilo", seed=1)).session_id
                await client.step(sid, "4")

    asyncio.run(main())


def test_pause_stops_idle_timeout_and_unpaused_sessions_are_reaped() -> None:
    async def main() -> None:
        async with serving(idle_timeout_s=0.3) as srv, EnvClient(srv.url) as client:
            kept = (await client.start("hilo", seed=9)).session_id
            reaped = (await client.start("hilo", seed=9)).session_id
            await client.step(kept, "1")
            await client.pause(kept)
            await asyncio.sleep(1.2)  # four idle timeouts
            health = await client.health()
            assert health["num_reaped"] == 1 and health["paused"] == 1 and health["active"] == 0
            with pytest.raises(EnvConflictError, match=f"{reaped}.*reaped"):
                await client.step(reaped, "1")
            assert await client.resume(kept) == "active"
            step = await client.step(kept, "2")
            assert step.info["turn"] == 2  # the episode kept its state
            # Resumed, the session is idle-reaped again like any other.
            await asyncio.sleep(1.0)
            with pytest.raises(EnvConflictError, match="reaped"):
                await client.step(kept, "3")

    asyncio.run(main())


def test_env_failure_ends_only_that_session() -> None:
    async def main() -> None:
        async with serving(envs=("exploding", "hilo")) as srv, EnvClient(srv.url) as client:
            other = (await client.start("hilo", seed=1)).session_id
            status, data = await post(srv.url, "/start", {"env": "exploding", "seed": 1, "options": {"fail_reset": 1}})
            assert (status, data["code"]) == (500, "env_error") and "reset exploded" in data["error"]
            sid = (await client.start("exploding", seed=1)).session_id
            assert (await client.step(sid, "fine")).observation == "ok"
            status, data = await post(srv.url, "/observation", {"session_id": sid, "action": "boom"})
            assert (status, data["code"]) == (500, "env_error") and "step exploded" in data["error"]
            status, data = await post(srv.url, "/observation", {"session_id": sid, "action": "fine"})
            assert (status, data["code"]) == (409, "session_ended")
            assert (await client.step(other, "8")).info["turn"] == 1
            health = await client.health()
            assert health["num_failed"] == 1 and health["sessions"] == 1 and health["capacity_left"] == 511

    asyncio.run(main())


def test_client_errors_name_server_and_session() -> None:
    async def main() -> None:
        async with serving() as srv, EnvClient(srv.url) as client:
            with pytest.raises(EnvNotFoundError) as info:
                await client.step("abc123", "1")
            assert srv.url in str(info.value) and "abc123" in str(info.value)
            assert info.value.status == 404 and info.value.code == "unknown_session"
        # The server is gone: connection refused, retried (safe: nothing was sent), then named.
        async with EnvClient(srv.url, max_retries=2, retry_backoff_s=0.01) as client:
            with pytest.raises(EnvConnectionError, match=srv.url.replace(".", r"\.")):
                await client.health()

    asyncio.run(main())


def test_observation_is_never_retried_after_a_timeout() -> None:
    async def main() -> None:
        async with serving(latency="fixed:0.6") as srv:
            async with EnvClient(srv.url, timeout_s=0.2, max_retries=3, retry_backoff_s=0.01) as client:
                sid = (await client.start("hilo", seed=1)).session_id
                with pytest.raises(EnvConnectionError, match="no answer") as info:
                    await client.step(sid, "1")
                assert info.value.session_id == sid
            await asyncio.sleep(0.8)
            async with EnvClient(srv.url) as client:
                assert (await client.health())["num_steps"] == 1  # one step, not four
                assert (await client.step(sid, "2")).info["turn"] == 2

    asyncio.run(main())


def test_pool_spreads_sessions_over_servers_and_routes_by_session() -> None:
    async def main() -> None:
        async with serving() as a, serving() as b, EnvPool([a.url, b.url]) as pool:
            starts = [await pool.start("hilo", seed=i) for i in range(4)]
            assert [h["sessions"] for h in await pool.health()] == [2, 2]
            for s in starts:
                assert (await pool.step(s.session_id, "x")).info["turn"] == 1
                assert await pool.pause(s.session_id) == "paused"
                assert await pool.resume(s.session_id) == "active"
            await pool.end(starts[0].session_id)
            await pool.end(starts[1].session_id)
            assert [h["sessions"] for h in await pool.health()] == [1, 1]
            with pytest.raises(KeyError, match="not started through this pool"):
                await pool.step(starts[0].session_id, "8")

    asyncio.run(main())


def test_pool_takes_a_dead_server_out_of_rotation_and_brings_it_back() -> None:
    async def main() -> None:
        async with serving() as a:
            b = await start_server(ServerOptions(envs=("hilo",)))
            pool = EnvPool([a.url, b.url], down_s=0.5, max_retries=0, retry_backoff_s=0.01)
            try:
                on_b = [s for s in [await pool.start("hilo", seed=i) for i in range(2)]
                        if pool.server_of(s.session_id) == b.url]
                assert len(on_b) == 1
                await b.close()  # b dies with a session on it
                with pytest.raises(EnvConnectionError, match=b.url):
                    await pool.step(on_b[0].session_id, "x")
                assert not pool.is_up(pool.clients[1])
                # Its session fails at once, without waiting on the dead server, and is forgotten.
                with pytest.raises(EnvConnectionError, match="out of rotation"):
                    await pool.end(on_b[0].session_id)
                with pytest.raises(KeyError):
                    pool.client_of(on_b[0].session_id)
                # New sessions go to the live server only.
                fresh = [await pool.start("hilo", seed=10 + i) for i in range(3)]
                assert {pool.server_of(s.session_id) for s in fresh} == {a.url}
                await asyncio.sleep(0.6)  # back in rotation: a start there fails over to a
                again = await pool.start("hilo", seed=20)
                assert pool.server_of(again.session_id) == a.url and pool.num_failovers == 1
            finally:
                await pool.close()

    asyncio.run(main())


def test_a_single_server_that_comes_back_is_back_in_rotation_at_once() -> None:
    # One env server, killed and restarted on its port (the launcher does that): the sessions started
    # on the new server must work at once, not fail "out of rotation" for the rest of down_s.
    async def main() -> None:
        first = await start_server(ServerOptions(envs=("hilo",)))
        port = int(first.url.rsplit(":", 1)[1])
        pool = EnvPool([first.url], down_s=60.0, max_retries=0, retry_backoff_s=0.01)
        try:
            s = await pool.start("hilo", seed=1)
            await first.close()
            with pytest.raises(EnvConnectionError):
                await pool.step(s.session_id, "8")
            assert not pool.is_up(pool.clients[0])
            second = await start_server(ServerOptions(envs=("hilo",), port=port))
            try:
                again = await pool.start("hilo", seed=2)  # every server out: the pool tries it anyway
                assert pool.is_up(pool.clients[0])
                assert (await pool.step(again.session_id, "8")).info["turn"] == 1
                await pool.end(again.session_id)
            finally:
                await second.close()
        finally:
            await pool.close()

    asyncio.run(main())


def test_pool_with_every_server_dead_says_so() -> None:
    async def main() -> None:
        b = await start_server(ServerOptions(envs=("hilo",)))
        url = b.url
        await b.close()
        async with EnvPool([url], max_retries=0) as pool:
            with pytest.raises(EnvConnectionError, match="no env server answers"):
                await pool.start("hilo", seed=0)

    asyncio.run(main())


def test_a_server_on_every_interface_advertises_the_hostname() -> None:
    import socket

    from tiderl.envs.serving import advertised_host

    assert advertised_host("0.0.0.0") == socket.gethostname() == advertised_host("::")
    assert advertised_host("10.1.2.3") == "10.1.2.3" and advertised_host("::1") == "[::1]"

    async def main() -> None:
        async with serving(host="0.0.0.0") as s:
            assert s.url.startswith(f"http://{socket.gethostname()}:")
            async with EnvClient(s.url.replace(socket.gethostname(), "127.0.0.1")) as client:
                assert (await client.health())["status"] == "ok"

    asyncio.run(main())


def test_injected_delays_are_keyed_by_seed_ordinal_and_step_not_by_request_order(monkeypatch) -> None:
    # Two runs of one task feed on servers of one latency seed: the tasks of a group share their env seed
    # and start in a different order in each; every task step draws the same delay in both. (The draws
    # are recorded and not slept.)
    from tiderl.config.latency import LatencyProfile

    drawn: list[tuple[tuple[object, ...], float]] = []
    keyed = LatencyProfile.keyed_s

    def record(self: LatencyProfile, *key: object) -> float:
        drawn.append((key, keyed(self, *key)))
        return 0.0

    monkeypatch.setattr(LatencyProfile, "keyed_s", record)

    async def play(seeds: list[int], latency_seed: int) -> dict[tuple[int, int, int], float]:
        drawn.clear()
        async with serving(latency="lognormal:0.5:4", latency_seed=latency_seed) as srv, \
                EnvClient(srv.url) as client:
            sessions = [(await client.start("hilo", seed=s)).session_id for s in seeds]
            for _ in range(2):
                for sid in sessions:
                    await client.step(sid, "1")
        return {(seed, ordinal, step): d for (_, _, seed, ordinal, step), d in drawn}

    one = asyncio.run(play([1, 1, 2], latency_seed=7))
    other = asyncio.run(play([2, 1, 1], latency_seed=7))
    assert sorted(one) == [(1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1), (2, 0, 0), (2, 0, 1)]
    assert one == other
    assert one[(1, 0, 0)] != one[(1, 1, 0)] and one[(1, 0, 0)] != one[(1, 0, 1)]  # the group's tasks apart
    assert asyncio.run(play([1, 1, 2], latency_seed=8)) != one  # another run seed or server: other delays
