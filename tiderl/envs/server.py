"""The env server: sessions of registered environments behind the HTTP protocol
of `tiderl.envs.protocol`, on aiohttp: the application, its middlewares and handlers.
Its options are `server_options.ServerOptions`; `serving.start_server` starts it on an
event loop.

One process serves many concurrent sessions from one event loop. Environments
marked `blocking` run their reset/step in a thread pool so a slow step never
stalls the other sessions; such calls wait for a thread in a bounded queue
(`workqueue.WorkQueue`), and one whose client has gone is dropped before it runs. A
background task reaps idle, unpaused sessions and expires sessions paused for
longer than `max_paused_s`.

Clients that misbehave, by mistake or on purpose, are bounded at every layer:
connections (`connguard.ConnectionGuard`: a cap with a 503 beyond it, a deadline for
request headers), requests (`httpio.read_body`: a body size limit, a body deadline,
`protocol.parse_body`'s JSON depth and text checks), sessions (a share per client,
`SessionTable`) and logs (`serverlog.RepeatFilter`: one record of a kind per
`LOG_REPEAT_WINDOW_S`, with a count of the repeats; a client's mistake or hang-up is
one quiet line, never a traceback).
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import deque
from typing import Any

from aiohttp import web

from tiderl.envs.base import Environment, EnvOptionError
from tiderl.envs.images import ImageEnvironment, ImageError
from tiderl.envs.connguard import ConnectionGuard, client_key, connection_cap
from tiderl.envs.httpio import (
    ClientGone,
    check_token,
    error_response,
    http_error_response,
    is_connected,
    json_response,
    read_body,
)
from tiderl.config.latency import LatencyProfile, parse_latency
from tiderl.envs.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    encode_images,
    parse_session_id,
    parse_start,
    parse_step,
)
from tiderl.envs.registry import env_class
from tiderl.envs.serverlog import conn_log, log
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.sessions import Session, SessionState, SessionTable
from tiderl.envs.workqueue import CallDropped, WorkQueue


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
        self.table = SessionTable(
            max_sessions=options.max_sessions,
            idle_timeout_s=options.idle_timeout_s,
            max_paused_s=options.max_paused_s,
            max_sessions_per_client=options.client_cap,
        )
        self.work = WorkQueue(num_workers=options.max_workers, max_waiting=options.max_queued_steps)
        max_connections = connection_cap(options.max_connections, options.max_workers)
        self.guard = ConnectionGuard(
            max_connections=max_connections,
            header_timeout_s=options.header_timeout_s,
            max_per_client=options.max_connections_per_client or max(8, max_connections // 4),
            max_half_open_per_client=options.max_half_open_per_client,
        )
        if self.guard.max_connections < options.max_connections:
            log.info("max_connections lowered from %d to %d to fit the open-file limit (ulimit -n %d)",
                     options.max_connections, self.guard.max_connections,
                     resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.image_limits = options.image_limits
        self.is_draining = False
        self.started_s = time.monotonic()
        self.num_steps = 0
        # Server-side time of recent steps (parse, env step, answer; no injected delay), seconds.
        self.step_times_s: deque[float] = deque(maxlen=10_000)
        self._reaper: asyncio.Task[None] | None = None
        self.app = web.Application(
            middlewares=[self.guard.middleware, self._error_middleware, self._auth_middleware],
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
            return error_response(e)
        except ClientGone as e:
            conn_log.info("%s %s from %s: %s", request.method, request.path, request.remote, e)
            return web.Response(status=499, reason="Client Closed Request")
        except web.HTTPException as e:
            return http_error_response(request, e)
        except Exception as e:  # a bug must answer 500, never take the server down
            log.exception("internal error on %s %s", request.method, request.path)
            return error_response(ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        check_token(request, self.options.token)
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
        self.work.shutdown()

    async def _reap_loop(self) -> None:
        options = self.options
        interval_s = min(1.0, options.idle_timeout_s / 4, options.max_paused_s / 4)
        expired = f"expired: paused for longer than max_paused_s={options.max_paused_s:g} s"
        while True:
            await asyncio.sleep(interval_s)
            # Remove first, then close: no request can end a session between the two lists and here.
            doomed = [(s, "reaped") for s in self.table.idle_sessions()]
            doomed += [(s, expired) for s in self.table.expired_sessions()]
            for session, reason in doomed:
                log.info("%s session %s (%s)", "reaping idle" if reason == "reaped" else "expiring paused",
                         session.session_id, session.env_name)
                self.table.remove(session, reason)
            for session, _ in doomed:
                await self._close_env(session)

    async def _call(self, env: Environment, fn: Any, *args: Any, request: web.Request | None = None) -> Any:
        """Run an env method: inline, or in a worker thread for a blocking env. With `request`,
        a call still waiting for a thread when that client disconnects is dropped."""
        if not env.blocking:
            return fn(*args)
        return await self.work.run(fn, *args, is_wanted=None if request is None else is_connected(request))

    def _check_room(self, env: Environment | type[Environment]) -> None:
        """429 now, before any state changes, if a blocking call could not even wait its turn."""
        if env.blocking and not self.work.has_room():
            raise ProtocolError(
                ErrorCode.QUEUE_FULL,
                f"{self.work.num_waiting} env calls are waiting for a worker thread "
                f"(max_queued_steps={self.work.max_waiting}, max_workers={self.work.num_workers}); retry later",
            )

    async def _close_env(self, session: Session) -> None:
        try:
            await self._call(session.env, session.env.close)
        except Exception:
            log.exception("closing session %s (%s) failed", session.session_id, session.env_name)

    async def _end_failed(self, session: Session, error: Exception, what: str) -> ProtocolError:
        """End a session whose environment failed; the error to answer with."""
        self.table.remove(session, f"failed: {type(error).__name__}: {error}")
        await self._close_env(session)
        return ProtocolError(ErrorCode.ENV_ERROR, f"session {session.session_id}: env {session.env_name} {what}")

    async def _close_quietly(self, env: Environment) -> None:
        """Close an env that never became a session."""
        try:
            await self._call(env, env.close)
        except Exception:
            log.exception("closing a %s env that failed to start failed", env.name)

    def _images_of(self, env: Environment) -> dict[str, Any]:
        """{"images": [...]} of an image environment's latest observation, checked and encoded;
        {} for a text environment. A bad image raises `ImageError`."""
        if not isinstance(env, ImageEnvironment):
            return {}
        return {"images": encode_images(env.observation_images(), self.image_limits)}

    # Reset or step and the images in one env call: a blocking env's screenshot is checked and
    # encoded in its worker thread, and no client can leave between the step and its images.
    def _reset_answer(self, env: Environment, seed: int,
                      options: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
        observation, info = env.reset(seed, options)
        return observation, info, self._images_of(env)

    def _step_answer(self, env: Environment, action: str) -> tuple[Any, dict[str, Any]]:
        result = env.step(action)
        return result, self._images_of(env)

    # handlers ----------------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        return await read_body(
            request, max_body_bytes=self.options.max_body_bytes, body_timeout_s=self.options.body_timeout_s
        )

    def _client_of(self, request: web.Request) -> str:
        """Whom a session belongs and counts against (`max_sessions_per_client`): with a token every
        holder of it is one client; without one, the peer address (every loopback address is one)."""
        if self.options.token is not None:
            return "token"
        return client_key(request.remote)

    async def _own_session(self, request: web.Request, endpoint: str) -> Session:
        """The session a /pause or /resume names, if this client started it (else 404)."""
        return self.table.get(parse_session_id(await self._body(request), endpoint), self._client_of(request))

    def _check_operator_options(self, cls: type[Environment], options: dict[str, Any]) -> None:
        """403 for an option value only the server's operator may choose (`Environment.operator_options`)."""
        for key, values in cls.operator_options.items():
            if options.get(key) in values and not self.options.allow_unsafe_sandbox:
                raise ProtocolError(
                    ErrorCode.FORBIDDEN,
                    f"{cls.name}: option {key}={options[key]!r} is the operator's choice: this server does not "
                    "allow it (its operator may, with `tiderl env serve --allow-unsafe-sandbox`)",
                )

    def _check_draining(self) -> None:
        if self.is_draining:
            raise ProtocolError(ErrorCode.DRAINING, "server is shutting down")

    def _check_free(self, session: Session) -> None:
        if session.is_busy:
            raise ProtocolError(
                ErrorCode.SESSION_BUSY, f"session {session.session_id}: another request is in progress"
            )

    async def handle_start(self, request: web.Request) -> web.Response:
        self._check_draining()
        req = parse_start(await self._body(request))
        cls = self.env_classes.get(req.env)
        if cls is None:
            served = ", ".join(self.options.envs)
            raise ProtocolError(ErrorCode.UNKNOWN_ENV, f"unknown env {req.env!r} (this server serves: {served})")
        self._check_operator_options(cls, req.options)
        self._check_room(cls)
        client = self._client_of(request)
        self.table.reserve(client)
        env: Environment | None = None
        try:
            env = cls()
            observation, info, images = await self._call(env, self._reset_answer, env, req.seed, req.options,
                                                         request=request)
        except CallDropped as e:
            self.table.release(client)
            raise ClientGone(f"start of {req.env} dropped: the client left while it waited for a worker") from e
        except EnvOptionError as e:
            self.table.release(client)
            raise ProtocolError(ErrorCode.BAD_OPTIONS, str(e)) from e
        except ImageError as e:
            self.table.release(client)
            log.error("env %s produced a bad first observation (seed %s): %s", req.env, req.seed, e)
            if env is not None:
                await self._close_quietly(env)
            raise ProtocolError(ErrorCode.ENV_ERROR, f"env {req.env} reset: produced a bad image: {e}") from e
        except Exception as e:
            self.table.release(client)
            log.exception("env %s failed to reset (seed %s)", req.env, req.seed)
            raise ProtocolError(ErrorCode.ENV_ERROR, f"env {req.env} reset failed: {type(e).__name__}: {e}") from e
        session = self.table.add(req.env, env, req.seed, client)
        return json_response(
            {"session_id": session.session_id, "observation": observation, "done": False, "info": info, **images}
        )

    async def handle_observation(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        delay_s = 0.0
        req = parse_step(await self._body(request))
        session = self.table.get(req.session_id, self._client_of(request))
        if session.state is SessionState.PAUSED:
            raise ProtocolError(ErrorCode.SESSION_PAUSED, f"session {req.session_id} is paused; /resume it first")
        if session.state is SessionState.DONE:
            raise ProtocolError(ErrorCode.EPISODE_DONE, f"session {req.session_id}: the episode is done; call /end")
        self._check_free(session)
        self._check_room(session.env)
        session.is_busy = True
        try:
            try:
                result, images = await self._call(session.env, self._step_answer, session.env, req.action,
                                                  request=request)
            except CallDropped as e:
                raise ClientGone(
                    f"step of session {session.session_id} dropped: the client left while it waited for a worker"
                ) from e
            except ImageError as e:  # the env's picture, not its step, is at fault: no traceback
                log.error("env %s produced a bad image in session %s: %s", session.env_name, session.session_id, e)
                raise await self._end_failed(session, e, f"produced a bad image: {e}") from e
            except Exception as e:
                log.exception("env %s step failed in session %s", session.env_name, session.session_id)
                raise await self._end_failed(session, e, f"step failed: {type(e).__name__}: {e}") from e
            # Keyed by the session's seed, its ordinal among that seed's sessions and the step: every run of
            # one task feed draws the same delays for the same task steps, so systems compare side by side.
            delay_s = self.latency.keyed_s(self.options.latency_seed, session.env_name, session.seed,
                                           session.seed_ordinal, session.num_steps)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
        finally:
            session.is_busy = False
            self.table.stepped(session)
        session.num_steps += 1
        self.num_steps += 1
        observation, reward, done, info = result
        if done:
            session.is_episode_done = True
            if session.state is SessionState.PAUSED:
                session.state_before_pause = SessionState.DONE
            else:
                session.state = SessionState.DONE
        response = json_response(
            {"observation": observation, "reward": float(reward), "done": bool(done), "info": info, **images}
        )
        self.step_times_s.append(time.perf_counter() - t0 - delay_s)
        return response

    async def handle_pause(self, request: web.Request) -> web.Response:
        session = await self._own_session(request, "/pause")
        # Pausing during a step is allowed (a task may be parked while its env works):
        # the step completes and the session stays paused.
        self.table.pause(session)
        return json_response({"session_id": session.session_id, "state": session.state.value})

    async def handle_resume(self, request: web.Request) -> web.Response:
        session = await self._own_session(request, "/resume")
        self.table.resume(session)
        return json_response({"session_id": session.session_id, "state": session.state.value})

    async def handle_end(self, request: web.Request) -> web.Response:
        session_id = parse_session_id(await self._body(request), "/end")
        client = self._client_of(request)
        replay = self.table.ended_result(session_id, client)
        if replay is not None:
            return json_response(replay)  # a repeated /end (e.g. a retry) gets the same answer
        session = self.table.get(session_id, client)
        self._check_free(session)
        self._check_room(session.env)
        session.is_busy = True
        try:
            reward = float(await self._call(session.env, session.env.final_reward, request=request))
        except CallDropped as e:
            session.is_busy = False
            raise ClientGone(f"/end of session {session_id} dropped: the client left while it waited") from e
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
        return json_response(result)

    async def handle_health(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "status": "draining" if self.is_draining else "ok",
                "protocol": PROTOCOL_VERSION,
                "envs": list(self.options.envs),
                **self.table.counts(),
                "max_sessions_per_client": self.table.max_sessions_per_client,
                "num_steps": self.num_steps,
                "idle_timeout_s": self.options.idle_timeout_s,
                "max_paused_s": self.options.max_paused_s,
                "queued_steps": self.work.num_waiting,
                "max_queued_steps": self.work.max_waiting,
                "num_dropped_steps": self.work.num_dropped,
                "connections": len(self.guard.connections),
                "max_connections": self.guard.max_connections,
                "max_connections_per_client": self.guard.max_per_client,
                "max_half_open_per_client": self.guard.max_half_open_per_client,
                "allow_unsafe_sandbox": self.options.allow_unsafe_sandbox,
                "num_refused_connections": self.guard.num_refused,
                "num_timed_out_connections": self.guard.num_timed_out,
                "latency": self.latency.spec,
                "image_limits": {"max_images_per_observation": self.image_limits.max_images,
                                 "max_image_bytes": self.image_limits.max_bytes,
                                 "max_image_pixels": self.image_limits.max_pixels},
                "step_p50_ms": _percentile_ms(self.step_times_s, 0.50),
                "step_p99_ms": _percentile_ms(self.step_times_s, 0.99),
                "uptime_s": time.monotonic() - self.started_s,
            }
        )
