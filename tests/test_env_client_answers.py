"""The env client against answers outside the protocol: each is an EnvServiceError naming the server,
the endpoint and what was wrong, never a bare UnicodeDecodeError, KeyError or ValueError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from tiderl.envs.client import EnvClient, EnvFailedError, EnvProtocolError, EnvServiceError


@asynccontextmanager
async def serving(handler: Callable[[web.Request], Awaitable[web.Response]]) -> AsyncIterator[str]:
    """An HTTP server answering every path with `handler`; its URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def answering(status: int, body: bytes) -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    async with serving(handler) as url:
        yield url


def call(status: int, body: bytes, what: str) -> EnvServiceError:
    async def go() -> EnvServiceError:
        async with answering(status, body) as url:
            client = EnvClient(url, max_retries=0)
            try:
                with pytest.raises(EnvServiceError) as info:
                    if what == "start":
                        await client.start("hilo", 0)
                    elif what == "step":
                        await client.step("s1", "5")
                    else:
                        await client.end("s1")
                return info.value
            finally:
                await client.close()

    return asyncio.run(go())


@pytest.mark.parametrize("body, words", [
    (b"\xff\xfe{\"observation\": 1}", "not UTF-8"),
    (b"<html>proxy error</html>", "not a JSON object"),
    (b"[1, 2]", "not a JSON object"),
])
def test_a_200_answer_that_is_not_a_json_object_is_a_protocol_error(body, words):
    e = call(200, body, "step")
    assert isinstance(e, EnvProtocolError) and words in str(e)
    assert "/observation" in str(e) and "session s1" in str(e)


@pytest.mark.parametrize("what, body, field", [
    ("start", b'{"session_id": "a", "done": false}', "observation"),
    ("start", b'{"session_id": 7, "observation": "x", "done": false}', "session_id"),
    ("step", b'{"observation": "x", "reward": "high", "done": false}', "reward"),
    ("step", b'{"observation": "x", "reward": NaN, "done": false}', "reward"),
    ("step", b'{"observation": "x", "reward": 1.0, "done": false, "info": [1]}', "info"),
    ("end", b'{"info": {}}', "reward"),
])
def test_a_missing_or_mistyped_field_is_named(what, body, field):
    e = call(200, body, what)
    assert isinstance(e, EnvProtocolError) and repr(field) in str(e)


def test_an_error_answer_that_is_not_utf8_keeps_its_status():
    e = call(500, b"\xff\xfe internal", "step")
    assert isinstance(e, EnvFailedError) and e.status == 500 and "internal" in str(e)


@asynccontextmanager
async def flaky_server(garbled: dict[str, bool]) -> AsyncIterator[str]:
    """An env server stand-in whose every answer is garbled JSON while garbled["on"] (as a broken proxy or
    a server in a bad state gives), and well-formed otherwise."""
    async def handler(request: web.Request) -> web.Response:
        if garbled["on"]:
            return web.Response(status=200, body=b'{"session_id": "s-1", "observation": [1, 2,',
                                content_type="application/json")
        if request.path == "/health":
            return web.json_response({"sessions": 0})
        if request.path == "/start" and garbled.get("bad_start"):
            return web.json_response({"session_id": "s-1", "done": False})  # no observation
        return web.json_response({"session_id": "s-1", "observation": "guess", "done": False, "info": {}})

    async with serving(handler) as url:
        yield url


def test_a_start_holds_while_the_only_server_answers_garbage_and_goes_on_when_it_recovers():
    from tiderl.envs.pool import EnvPool

    async def go() -> None:
        garbled = {"on": True}
        async with flaky_server(garbled) as url:
            async with EnvPool([url], hold_s=10.0, max_retries=0) as pool:
                loop = asyncio.get_running_loop()
                loop.call_later(0.8, garbled.update, {"on": False})
                t0 = loop.time()
                started = await pool.start("hilo", 0)
                assert started.observation == "guess" and loop.time() - t0 >= 0.7
                assert pool.is_up(pool.clients[0])

    asyncio.run(go())


def test_a_start_held_longer_than_hold_s_fails_naming_the_server():
    from tiderl.envs.client import EnvConnectionError
    from tiderl.envs.pool import EnvPool

    async def go() -> None:
        async with flaky_server({"on": True}) as url:
            async with EnvPool([url], hold_s=0.6, max_retries=0) as pool:
                with pytest.raises(EnvConnectionError, match="no env server answers within 0.6 s") as info:
                    await pool.start("hilo", 0)
                assert url in str(info.value) and "not a JSON object" in str(info.value)
                assert not pool.is_up(pool.clients[0])

    asyncio.run(go())


def test_a_bad_start_answer_from_a_healthy_server_fails_at_once_and_keeps_it_in_rotation():
    from tiderl.envs.pool import EnvPool

    async def go() -> None:
        async with flaky_server({"on": False, "bad_start": True}) as url:
            async with EnvPool([url], hold_s=30.0, max_retries=0) as pool:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                with pytest.raises(EnvProtocolError, match="'observation'"):
                    await pool.start("hilo", 0)
                assert loop.time() - t0 < 5.0 and pool.is_up(pool.clients[0])

    asyncio.run(go())
