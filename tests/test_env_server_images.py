"""Observations with images through a real env server on loopback: the round trip, pause and
resume, the server's image limits, and an environment or a server that produces a bad image."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tiderl.envs import StepResult, make_env, register_env
from tiderl.envs.client import EnvClient, EnvConflictError, EnvFailedError, EnvProtocolError, StepWithImages
from tiderl.envs.gridimage import GridImageEnv
from tiderl.envs.images import ImageEnvironment, encode_png
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.serving import RunningServer, start_server

RED_2X2 = encode_png(2, 2, bytes((255, 0, 0)) * 4)


class FaultyImageEnv(ImageEnvironment):
    """Produces the images its `fault` option asks for: at reset, or at the step `when` says."""

    name = "faultyimage"

    def __init__(self) -> None:
        self.fault = "none"
        self.at_step = False
        self.stepped = False

    def reset(self, seed: int, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        self.fault, self.at_step = options.get("fault", "none"), options.get("at_step", False)
        return "look", {}

    def step(self, action: str) -> StepResult:
        self.stepped = True
        return StepResult("looked", 0.0, False, {})

    def observation_images(self) -> list[bytes]:
        if self.at_step and not self.stepped:
            return [RED_2X2]
        return {
            "none": [RED_2X2],
            "garbage": [RED_2X2, b"GIF89a not a png"],
            "truncated": [RED_2X2[:-12]],
            "too_many": [RED_2X2] * 9,
            "huge": [encode_png(100, 50, bytes(100 * 50 * 3))],
            "text": ["a string"],  # type: ignore[list-item]
        }[self.fault]

    def final_reward(self) -> float:
        return 0.0


class BlockingGridEnv(GridImageEnv):
    """gridimage run in the server's worker threads, as a slow screenshotting env would be."""

    name = "blockinggrid"
    blocking = True


register_env("faultyimage", FaultyImageEnv)
register_env("blockinggrid", BlockingGridEnv)


@contextlib.asynccontextmanager
async def serving(**kwargs: Any) -> AsyncIterator[RunningServer]:
    envs = ("gridimage", "hilo", "faultyimage", "blockinggrid")
    running = await start_server(ServerOptions(envs=envs, **kwargs))
    try:
        yield running
    finally:
        await running.close()


async def post(url: str, endpoint: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(url + endpoint, json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("env_name", ["gridimage", "blockinggrid"])
def test_an_episode_carries_the_pictures_through_pause_and_resume(env_name: str) -> None:
    local = make_env("gridimage")
    assert isinstance(local, GridImageEnv)
    local.reset(seed=9, options={})

    async def main() -> None:
        async with serving() as srv, EnvClient(srv.url) as client:
            start = await client.start(env_name, seed=9)
            assert start.observation == "you are red, the goal is green: move up, down, left or right"
            assert [(i.width, i.height, i.data) for i in start.images] == [(56, 56, local.render_png())]
            sid = start.session_id
            for action in ["up", "left"]:
                step = await client.step(sid, action)
                assert isinstance(step, StepWithImages) and isinstance(step, StepResult)
                assert step[:3] == tuple(local.step(action)[:3])
                assert [i.data for i in step.images] == local.observation_images()
            assert await client.pause(sid) == "paused"
            with pytest.raises(EnvConflictError, match="paused"):
                await client.step(sid, "down")
            assert await client.resume(sid) == "active"
            step = await client.step(sid, "down")
            assert [i.data for i in step.images] == (local.step("down"), local.observation_images())[1]
            end = await client.end(sid)
            assert end.info["num_steps"] == 3 and end.reward == local.final_reward()

    asyncio.run(main())


def test_the_wire_format_is_base64_png_and_text_envs_send_no_images_field() -> None:
    async def main() -> None:
        async with serving() as srv:
            status, data = await post(srv.url, "/start", {"env": "gridimage", "seed": 1})
            assert status == 200 and set(data) == {"session_id", "observation", "done", "info", "images"}
            [image] = data["images"]
            assert set(image) == {"media_type", "data"} and image["media_type"] == "image/png"
            assert base64.b64decode(image["data"]).startswith(b"\x89PNG\r\n\x1a\n")
            status, data = await post(srv.url, "/observation", {"session_id": data["session_id"], "action": "up"})
            assert status == 200 and len(data["images"]) == 1
            status, data = await post(srv.url, "/start", {"env": "hilo", "seed": 1})
            assert status == 200 and "images" not in data
            status, data = await post(srv.url, "/observation", {"session_id": data["session_id"], "action": "3"})
            assert status == 200 and "images" not in data

    asyncio.run(main())


@pytest.mark.parametrize("fault, words", [
    ("garbage", r"images\[1\]: not a PNG file"),
    ("truncated", r"images\[0\]: cut short"),
    ("too_many", "9 images in one observation, more than max_images=8"),
    ("huge", r"images\[0\]: size 100x50 is 5000 pixels, more than max_pixels=4096"),
    ("text", r"images\[0\]: want the bytes of a PNG file, got str"),
])
@pytest.mark.parametrize("at_step", [False, True])
def test_a_bad_image_from_the_env_is_its_failure_named_and_never_sent(fault: str, words: str, at_step: bool) -> None:
    async def main() -> None:
        async with serving(max_image_pixels=64 * 64) as srv, EnvClient(srv.url, max_retries=0) as client:
            bystander = await client.start("gridimage", seed=2)
            options = {"fault": fault, "at_step": at_step}
            if not at_step:
                with pytest.raises(EnvFailedError, match="env faultyimage reset: produced a bad image: " + words) as e:
                    await client.start("faultyimage", seed=0, options=options)
                assert (e.value.status, e.value.code) == (500, "env_error")
            else:
                sid = (await client.start("faultyimage", seed=0, options=options)).session_id
                with pytest.raises(EnvFailedError, match="env faultyimage produced a bad image: " + words) as e:
                    await client.step(sid, "look")
                assert (e.value.status, e.value.code) == (500, "env_error")
                with pytest.raises(EnvConflictError, match="has ended"):
                    await client.step(sid, "look")
            health = await client.health()
            assert health["sessions"] == 1 and health["image_limits"]["max_image_pixels"] == 4096
            assert len((await client.step(bystander.session_id, "up")).images) == 1

    asyncio.run(main())


def test_the_server_refuses_to_send_images_past_its_limits() -> None:
    async def main() -> None:
        async with serving(max_image_pixels=1000) as srv, EnvClient(srv.url, max_retries=0) as client:
            with pytest.raises(EnvFailedError, match="size 56x56 is 3136 pixels, more than max_pixels=1000"):
                await client.start("gridimage", seed=0)
            assert (await client.health())["sessions"] == 0

    asyncio.run(main())


def test_server_options_check_the_image_limits() -> None:
    with pytest.raises(ValueError, match="max_image_bytes"):
        ServerOptions(envs=("gridimage",), max_image_bytes=0)


@contextlib.asynccontextmanager
async def answering(images: Any) -> AsyncIterator[str]:
    """A server that is not TideRL's: it answers every request with `images` in the answer."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"session_id": "s1", "observation": "x", "reward": 0.0, "done": False,
                                  "info": {}, "images": images})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("images, words", [
    ("iVBORw0", "want a list of images, got str"),
    ([{"media_type": "image/png", "data": "@@@"}], r"images\[0\]: data is not base64"),
    ([{"media_type": "image/png", "data": base64.b64encode(b"GIF89a").decode()}], r"images\[0\]: not a PNG file"),
    ([{"media_type": "image/png", "data": base64.b64encode(encode_png(60, 60, bytes(60 * 60 * 3))).decode()}],
     r"images\[0\]: size 60x60 is 3600 pixels, more than max_pixels=3136"),
])
def test_the_client_names_a_bad_image_in_an_answer(images: Any, words: str) -> None:
    from tiderl.envs.images import ImageLimits

    async def main() -> None:
        async with answering(images) as url, EnvClient(url, max_retries=0,
                                                       image_limits=ImageLimits(max_pixels=56 * 56)) as client:
            for call in (client.start("x", 0), client.step("s1", "up")):
                with pytest.raises(EnvProtocolError, match="answer field 'images': " + words) as e:
                    await call
                assert e.value.code == "bad_answer"

    asyncio.run(main())
