"""The env server: sessions of registered environments behind the HTTP protocol
of `tiderl.envs.protocol`, on aiohttp.

One process serves many concurrent sessions from one event loop. Environments
marked `blocking` run their reset/step in a thread pool so a slow step never
stalls the other sessions. A background task reaps idle, unpaused sessions.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tiderl.envs.base import Environment, EnvOptionError
from tiderl.envs.latency import LatencyProfile, parse_latency
from tiderl.envs.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    parse_session_id,
    parse_start,
    parse_step,
)
from tiderl.envs.registry import env_class
from tiderl.envs.sessions import Session, SessionState, SessionTable

log = logging.getLogger("tiderl.envs.server")


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    envs: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    max_sessions: int = 512
    idle_timeout_s: float = 300.0
    latency: str = "none"
    token: str | None = None
    max_workers: int = 32  # threads for blocking environments
    max_body_bytes: int = 4 << 20
    latency_seed: int = 0


def _json(data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=json.dumps(data, default=str), status=status, content_type="application/json", headers=headers
    )


def _error(err: ProtocolError) -> web.Response:
    headers = {"Retry-After": "1"} if err.code.status in (429, 503) else None
    if err.code is ErrorCode.UNAUTHORIZED:
        headers = {"WWW-Authenticate": "Bearer"}
    return _json(err.to_json(), status=err.code.status, headers=headers)


_HTTP_CODES = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.TOO_LARGE,
    400: ErrorCode.BAD_REQUEST,
}


def _percentile_ms(values: deque[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class EnvServer:
    """The aiohttp application and the sessions it serves."""

    def __init__(self, options: ServerOptions) -> None:
        if not options.envs:
            raise ValueError("an env server needs at least one environment (--env)")
        self.options = options
        # Resolve every env class now: an unknown or unloadable name fails at startup.
        self.env_classes: dict[str, type[Environment]] = {name: env_class(name) for name in options.envs}
        self.latency: LatencyProfile = parse_latency(options.latency)
        self.rng = random.Random(options.latency_seed)
        self.table = SessionTable(max_sessions=options.max_sessions, idle_timeout_s=options.idle_timeout_s)
        self.executor = ThreadPoolExecutor(max_workers=options.max_workers, thread_name_prefix="env")
        self.is_draining = False
        self.started_s = time.monotonic()
        self.num_steps = 0
        # Server-side time of recent steps (parse, env step, answer; no injected delay), seconds.
        self.step_times_s: deque[float] = deque(maxlen=10_000)
        self._reaper: asyncio.Task[None] | None = None
        self.app = web.Application(
            middlewares=[self._error_middleware, self._auth_middleware],
            client_max_size=options.max_body_bytes,
        )
        self.app.router.add_post("/start", self.handle_start)
        self.app.router.add_post("/observation", self.handle_observation)
        self.app.router.add_post("/pause", self.handle_pause)
        self.app.router.add_post("/resume", self.handle_resume)
        self.app.router.add_post("/end", self.handle_end)
        self.app.router.add_get("/health", self.handle_health)
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)

    # middlewares -------------------------------------------------------------------

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProtocolError as e:
            return _error(e)
        except web.HTTPException as e:
            code = _HTTP_CODES.get(e.status, ErrorCode.INTERNAL if e.status >= 500 else ErrorCode.BAD_REQUEST)
            return _json({"error": f"{request.method} {request.path}: {e.reason}", "code": code.code}, e.status)
        except Exception as e:  # a bug must answer 500, never take the server down
            log.exception("internal error on %s %s", request.method, request.path)
            return _error(ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        token = self.options.token
        if token is not None:
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme != "Bearer" or not hmac.compare_digest(value.encode(), token.encode()):
                raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong token (Authorization: Bearer TOKEN)")
        return await handler(request)

    # lifecycle ---------------------------------------------------------------------

    async def _on_startup(self, app: web.Application) -> None:
        self._reaper = asyncio.create_task(self._reap_loop())

    async def _on_shutdown(self, app: web.Application) -> None:
        self.is_draining = True
        if self._reaper is not None:
            self._reaper.cancel()
        for session in list(self.table.sessions.values()):
            self.table.remove(session, "ended")
            await self._close_env(session)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _reap_loop(self) -> None:
        interval_s = min(1.0, self.options.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            for session in self.table.idle_sessions():
                log.info("reaping idle session %s (%s)", session.session_id, session.env_name)
                self.table.remove(session, "reaped")
                await self._close_env(session)

    async def _call(self, env: Environment, fn: Any, *args: Any) -> Any:
        if env.blocking:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        return fn(*args)

    async def _close_env(self, session: Session) -> None:
        try:
            await self._call(session.env, session.env.close)
        except Exception:
            log.exception("closing session %s (%s) failed", session.session_id, session.env_name)

    # handlers ----------------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{request.path}: body is not valid JSON: {e}") from e

    def _check_draining(self) -> None:
        if self.is_draining:
            raise ProtocolError(ErrorCode.DRAINING, "server is shutting down")

    def _claim(self, session: Session) -> None:
        if session.is_busy:
            raise ProtocolError(
                ErrorCode.SESSION_BUSY, f"session {session.session_id}: another request is in progress"
            )
        session.is_busy = True

    async def handle_start(self, request: web.Request) -> web.Response:
        self._check_draining()
        req = parse_start(await self._body(request))
        cls = self.env_classes.get(req.env)
        if cls is None:
            served = ", ".join(self.options.envs)
            raise ProtocolError(ErrorCode.UNKNOWN_ENV, f"unknown env {req.env!r} (this server serves: {served})")
        self.table.reserve()
        env: Environment | None = None
        try:
            env = cls()
            observation, info = await self._call(env, env.reset, req.seed, req.options)
        except EnvOptionError as e:
            self.table.release()
            raise ProtocolError(ErrorCode.BAD_OPTIONS, str(e)) from e
        except Exception as e:
            self.table.release()
            log.exception("env %s failed to reset (seed %s)", req.env, req.seed)
            raise ProtocolError(ErrorCode.ENV_ERROR, f"env {req.env} reset failed: {type(e).__name__}: {e}") from e
        session = self.table.add(req.env, env, req.seed)
        return _json({"session_id": session.session_id, "observation": observation, "done": False, "info": info})

    async def handle_observation(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        delay_s = 0.0
        req = parse_step(await self._body(request))
        session = self.table.get(req.session_id)
        if session.state is SessionState.PAUSED:
            raise ProtocolError(ErrorCode.SESSION_PAUSED, f"session {req.session_id} is paused; /resume it first")
        if session.state is SessionState.DONE:
            raise ProtocolError(ErrorCode.EPISODE_DONE, f"session {req.session_id}: the episode is done; call /end")
        self._claim(session)
        try:
            try:
                result = await self._call(session.env, session.env.step, req.action)
            except Exception as e:
                log.exception("env %s step failed in session %s", session.env_name, session.session_id)
                self.table.remove(session, f"failed: {type(e).__name__}: {e}")
                await self._close_env(session)
                raise ProtocolError(
                    ErrorCode.ENV_ERROR,
                    f"session {session.session_id}: env {session.env_name} step failed: {type(e).__name__}: {e}",
                ) from e
            delay_s = self.latency.sample_s(self.rng)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
        finally:
            session.is_busy = False
            self.table.touch(session)
        session.num_steps += 1
        self.num_steps += 1
        observation, reward, done, info = result
        if done:
            session.is_episode_done = True
            if session.state is SessionState.PAUSED:
                session.state_before_pause = SessionState.DONE
            else:
                session.state = SessionState.DONE
        response = _json({"observation": observation, "reward": float(reward), "done": bool(done), "info": info})
        self.step_times_s.append(time.perf_counter() - t0 - delay_s)
        return response

    async def handle_pause(self, request: web.Request) -> web.Response:
        session = self.table.get(parse_session_id(await self._body(request), "/pause"))
        # Pausing during a step is allowed (a task may be parked while its env works):
        # the step completes and the session stays paused.
        self.table.pause(session)
        return _json({"session_id": session.session_id, "state": session.state.value})

    async def handle_resume(self, request: web.Request) -> web.Response:
        session = self.table.get(parse_session_id(await self._body(request), "/resume"))
        self.table.resume(session)
        return _json({"session_id": session.session_id, "state": session.state.value})

    async def handle_end(self, request: web.Request) -> web.Response:
        session_id = parse_session_id(await self._body(request), "/end")
        ended = self.table.ended.get(session_id)
        if ended is not None and ended.end_result is not None:
            return _json(ended.end_result)  # a repeated /end (e.g. a retry) gets the same answer
        session = self.table.get(session_id)
        self._claim(session)
        try:
            reward = float(await self._call(session.env, session.env.final_reward))
        except Exception as e:
            session.is_busy = False
            self.table.remove(session, f"failed: {type(e).__name__}: {e}")
            await self._close_env(session)
            raise ProtocolError(
                ErrorCode.ENV_ERROR, f"session {session_id}: env {session.env_name} final_reward failed: {e}"
            ) from e
        result = {
            "reward": reward,
            "info": {
                "env": session.env_name,
                "seed": session.seed,
                "num_steps": session.num_steps,
                "episode_done": session.is_episode_done,
                "duration_s": time.monotonic() - session.created_s,
            },
        }
        self.table.remove(session, "ended", result)
        session.is_busy = False
        await self._close_env(session)
        return _json(result)

    async def handle_health(self, request: web.Request) -> web.Response:
        return _json(
            {
                "status": "draining" if self.is_draining else "ok",
                "protocol": PROTOCOL_VERSION,
                "envs": list(self.options.envs),
                **self.table.counts(),
                "num_steps": self.num_steps,
                "idle_timeout_s": self.options.idle_timeout_s,
                "latency": self.latency.spec,
                "step_p50_ms": _percentile_ms(self.step_times_s, 0.50),
                "step_p99_ms": _percentile_ms(self.step_times_s, 0.99),
                "uptime_s": time.monotonic() - self.started_s,
            }
        )


class RunningServer:
    """A started server: `url` is where it listens (the real port when port 0 was asked)."""

    def __init__(self, server: EnvServer, runner: web.AppRunner, url: str) -> None:
        self.server = server
        self.runner = runner
        self.url = url

    async def close(self) -> None:
        await self.runner.cleanup()

    async def __aenter__(self) -> RunningServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_server(options: ServerOptions) -> RunningServer:
    """Start serving on the running event loop; returns once the socket is bound."""
    server = EnvServer(options)
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port, backlog=1024)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # noqa: SLF001
    port = sockets[0].getsockname()[1] if sockets else options.port
    host = advertised_host(options.host)
    return RunningServer(server, runner, f"http://{host}:{port}")


def advertised_host(listen_host: str) -> str:
    """The host other machines reach a server listening on `listen_host` at: the machine's
    hostname for a wildcard address (ranks on other nodes read the URL), else the address."""
    if listen_host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return listen_host if ":" not in listen_host else f"[{listen_host}]"
