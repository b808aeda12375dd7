"""The env server: sessions of registered environments behind the HTTP protocol
of `tiderl.envs.protocol`, on aiohttp.

One process serves many concurrent sessions from one event loop. Environments
marked `blocking` run their reset/step in a thread pool so a slow step never
stalls the other sessions; such calls wait for a thread in a bounded queue
(`WorkQueue`), and one whose client has gone is dropped before it runs. A
background task reaps idle, unpaused sessions and expires sessions paused for
longer than `max_paused_s`.

Clients that misbehave, by mistake or on purpose, are bounded at every layer:
connections (`ConnectionGuard`: a cap with a 503 beyond it, a deadline for request
headers), requests (a body size limit, a body deadline, `protocol.parse_body`'s
JSON depth and text checks), sessions (a share per client, `SessionTable`) and logs
(`RepeatFilter`: one record of a kind per `LOG_REPEAT_WINDOW_S`, with a count of
the repeats; a client's mistake or hang-up is one quiet line, never a traceback).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import resource
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tiderl.envs.base import Environment, EnvOptionError
from tiderl.envs.latency import LatencyProfile, parse_latency
from tiderl.envs.protocol import (
    PROTOCOL_VERSION,
    TOKEN_HEADER,
    ErrorCode,
    ProtocolError,
    describe_non_ascii,
    parse_body,
    parse_session_id,
    parse_start,
    parse_step,
)
from tiderl.envs.registry import env_class
from tiderl.envs.sessions import Session, SessionState, SessionTable

log = logging.getLogger("tiderl.envs.server")
conn_log = logging.getLogger("tiderl.envs.server.conn")  # refusals, timeouts, clients that hang up
http_log = logging.getLogger("tiderl.envs.server.http")  # aiohttp's own request handling
loop_log = logging.getLogger("tiderl.envs.server.loop")  # event loop errors, e.g. accept() out of files

LOG_REPEAT_WINDOW_S = 10.0
LINGER_S = 1.0  # how long a connection is kept to read the rest of a body its answer did not need
FILES_RESERVED = 64  # open files kept for the process itself, beyond connections and workers
FILES_PER_WORKER = 4  # open files an environment call may hold (a sandbox run's pipes)
MAX_REFUSED_OPEN = 64  # refused connections kept open until their 503 is out; beyond: reset


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    envs: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    max_sessions: int = 512
    idle_timeout_s: float = 300.0
    max_paused_s: float = 3600.0  # a session paused longer than this expires
    max_sessions_per_client: int | None = None  # None: see `client_cap`
    latency: str = "none"
    token: str | None = None
    max_workers: int = 32  # threads for blocking environments
    max_queued_steps: int = 256  # blocking env calls that may wait for a thread; more get 429
    max_body_bytes: int = 4 << 20
    max_connections: int = 1024  # lowered to fit the open-file limit (`connection_cap`)
    header_timeout_s: float = 10.0  # a request's headers must arrive within this
    body_timeout_s: float = 30.0  # a request's body must arrive within this once its headers have
    keepalive_timeout_s: float = 30.0  # an idle keep-alive connection is closed after this
    latency_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_workers", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "max_paused_s", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_queued_steps < 0:
            raise ValueError(f"max_queued_steps must be >= 0, got {self.max_queued_steps}")
        if self.max_sessions_per_client is not None and self.max_sessions_per_client < 1:
            raise ValueError(f"max_sessions_per_client must be >= 1, got {self.max_sessions_per_client}")

    @property
    def client_cap(self) -> int:
        """Sessions one client may hold: `max_sessions_per_client` if set; else, with a token,
        all of `max_sessions` (every holder of the token is one client, the run itself), and
        without one, all but a quarter, so that no one address can take every slot."""
        if self.max_sessions_per_client is not None:
            return self.max_sessions_per_client
        if self.token is not None:
            return self.max_sessions
        return max(1, self.max_sessions - self.max_sessions // 4)


def connection_cap(max_connections: int, max_workers: int) -> int:
    """`max_connections`, lowered so that the connections, the environments' files and the
    process's own fit under its open-file limit (a server out of files cannot even answer
    /health, and asyncio logs every failed accept())."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(8, min(max_connections, soft - FILES_RESERVED - FILES_PER_WORKER * max_workers))


# logs ------------------------------------------------------------------------------


class RepeatFilter(logging.Filter):
    """Passes one record of a kind per `window_s` and counts the others; the next record of
    that kind to pass says how many were suppressed. A kind is the logger, the level, the
    message template and the exception type, so a flood of one error costs a line per window.
    Records below `min_level` always pass."""

    def __init__(self, window_s: float = LOG_REPEAT_WINDOW_S, min_level: int = logging.DEBUG,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.min_level = min_level
        self.clock = clock
        self._passed: dict[tuple[str, int, str, str], tuple[float, int]] = {}  # kind -> (passed at, suppressed)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return True
        exc_type = record.exc_info[0] if record.exc_info else None
        kind = (record.name, record.levelno, str(record.msg), exc_type.__name__ if exc_type else "")
        now = self.clock()
        with self._lock:
            last = self._passed.get(kind)
            if last is not None and now - last[0] < self.window_s:
                self._passed[kind] = (last[0], last[1] + 1)
                return False
            self._passed[kind] = (now, 0)
            if len(self._passed) > 4096:  # forget kinds that are quiet and have nothing to report
                self._passed = {k: v for k, v in self._passed.items() if v[1] or now - v[0] < self.window_s}
        if last is not None and last[1]:
            record.msg = f"{record.msg} ({last[1]} similar suppressed in the last {now - last[0]:.0f} s)"
        return True


class QuietClientErrors(logging.Filter):
    """aiohttp logs an unparseable request, and a client that hangs up mid-answer, as an error
    with a traceback; both are the client's doing: one INFO line, or a DEBUG one."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, ConnectionError)):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            if isinstance(exc, HttpProcessingError):
                record.msg, record.levelno, what = "bad HTTP request from %s: %s", logging.INFO, exc.message
            else:
                record.msg, record.levelno, what = "client %s hung up: %s", logging.DEBUG, str(exc)
            record.args = (peer, " ".join(what.split()) or type(exc).__name__)
            record.levelname = logging.getLevelName(record.levelno)
            record.exc_info = record.exc_text = None
        return True


log.addFilter(RepeatFilter(min_level=logging.WARNING))
http_log.addFilter(QuietClientErrors())
for _logger in (conn_log, http_log, loop_log):
    _logger.addFilter(RepeatFilter(min_level=logging.INFO))


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's exception handler while a server runs: through `loop_log`, so repeats
    are counted rather than written; an OSError (EMFILE on accept) needs no traceback."""
    exc = context.get("exception")
    message = str(context.get("message") or "event loop error").replace("%", "%%")
    if exc is None:
        loop_log.error(message)
    else:
        loop_log.error(message + ": %s: %s", type(exc).__name__, exc,
                       exc_info=None if isinstance(exc, OSError) else exc)


# connections ---------------------------------------------------------------------------


def _raw_response(code: ErrorCode, message: str) -> bytes:
    """A complete HTTP answer that closes the connection, for use below aiohttp."""
    body = json.dumps({"error": message, "code": code.code}).encode()
    retry = "Retry-After: 1\r\n" if code.status in (429, 503) else ""
    head = (f"HTTP/1.1 {code.status} {HTTPStatus(code.status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n")
    return head.encode() + body


def _peer(transport: asyncio.BaseTransport) -> str:
    peername = transport.get_extra_info("peername")
    return str(peername[0]) if isinstance(peername, tuple) and peername else "?"


class ConnectionGuard:
    """The open connections of one server.

    - At most `max_connections` are admitted. One beyond them gets a 503
      `too_many_connections` at once and is closed (reset, when many such are open).
    - An admitted connection must deliver the complete headers of its first request within
      `header_timeout_s` of opening, and those of each later one within `header_timeout_s`
      of its first byte; else it gets a 408 and is closed. (Idle keep-alive connections are
      closed by aiohttp after `keepalive_timeout_s`; bodies have their own deadline.)
    """

    def __init__(self, *, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.connections: dict[asyncio.BaseTransport, GuardedConnection] = {}
        self.refused: set[asyncio.Transport] = set()  # answered 503, closing
        self.num_refused = 0
        self.num_timed_out = 0

    def can_admit(self) -> bool:
        return len(self.connections) < self.max_connections

    def refuse(self, transport: asyncio.Transport) -> None:
        self.num_refused += 1
        conn_log.warning("refusing a connection from %s: %d connections open, max_connections=%d",
                         _peer(transport), len(self.connections), self.max_connections)
        if len(self.refused) >= MAX_REFUSED_OPEN:
            transport.abort()
            return
        transport.write(_raw_response(
            ErrorCode.TOO_MANY_CONNECTIONS,
            f"server has {len(self.connections)} connections open, max_connections={self.max_connections}; "
            "retry later",
        ))
        if transport.can_write_eof():
            transport.write_eof()
        self.refused.add(transport)
        asyncio.get_running_loop().call_later(LINGER_S, self._drop_refused, transport)

    def _drop_refused(self, transport: asyncio.Transport) -> None:
        if transport in self.refused:
            self.refused.discard(transport)
            transport.abort()

    def request_started(self, transport: asyncio.BaseTransport) -> None:
        connection = self.connections.get(transport)
        if connection is not None:
            connection.headers_arrived()

    def request_finished(self, transport: asyncio.BaseTransport) -> None:
        connection = self.connections.get(transport)
        if connection is not None:
            connection.is_awaiting_headers = True

    def close_refused(self) -> None:
        for transport in list(self.refused):
            transport.abort()
        self.refused.clear()


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol of one connection, wrapped: admission and the header deadline of
    `ConnectionGuard` (the request middleware reports when headers have arrived)."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.is_refused = False
        self.is_awaiting_headers = True
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.guard.can_admit():
            self.is_refused = True
            self.guard.refuse(transport)
            return
        self.guard.connections[transport] = self
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.is_refused:
            return
        if self.is_awaiting_headers and self._deadline is None:
            self._arm()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.is_refused else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.is_refused:
            self.guard.refused.discard(self.transport)  # type: ignore[arg-type]
            return
        self._disarm()
        self.guard.connections.pop(self.transport, None)  # type: ignore[arg-type]
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.is_refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.is_refused:
            self.inner.resume_writing()

    def headers_arrived(self) -> None:
        self.is_awaiting_headers = False
        self._disarm()

    def _arm(self) -> None:
        self._deadline = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        transport = self.transport
        if not self.is_awaiting_headers or transport is None or transport.is_closing():
            return
        self.guard.num_timed_out += 1
        timeout_s = self.guard.header_timeout_s
        conn_log.info("closing a connection from %s: no complete request headers within %g s",
                      _peer(transport), timeout_s)
        message = f"request headers not received within {timeout_s:g} s"
        transport.write(_raw_response(ErrorCode.REQUEST_TIMEOUT, message))
        transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections pass through a `ConnectionGuard`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard, *,
                 backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self.host = host
        self.port = port  # the bound port once started
        self.guard = guard

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        guard = self.guard
        self._server = await asyncio.get_running_loop().create_server(
            lambda: GuardedConnection(server(), guard), self.host, self.port, backlog=self._backlog
        )
        if self._server.sockets:
            self.port = self._server.sockets[0].getsockname()[1]


# blocking environment calls -----------------------------------------------------------------


class CallDropped(Exception):
    """A queued environment call whose client left before a worker thread was free."""


class WorkQueue:
    """Blocking environment calls on `num_workers` threads, with at most `max_waiting` calls
    waiting for one.

    Calls wait here, on the event loop, not in the executor's own unbounded queue, so that
    - a call beyond `max_waiting` is refused up front (`has_room`), and
    - a waiting call whose client has gone (`is_wanted()` false) is dropped (`CallDropped`)
      instead of running for nobody: when a thread comes free for it, and whenever
      `has_room` counts the queue (so abandoned calls do not keep others out)."""

    def __init__(self, *, num_workers: int, max_waiting: int) -> None:
        self.num_workers = num_workers
        self.max_waiting = max_waiting
        self.executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="env")
        self.num_running = 0  # threads given to calls (a thread passes from call to call in `_hand_on`)
        self._waiting: deque[tuple[asyncio.Future[None], Callable[[], bool] | None]] = deque()
        self.num_dropped = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_room(self) -> bool:
        if self.num_running < self.num_workers:
            return True
        self._drop_unwanted()
        return len(self._waiting) < self.max_waiting

    async def run(self, fn: Callable[..., Any], *args: Any, is_wanted: Callable[[], bool] | None = None) -> Any:
        if self.num_running < self.num_workers:
            self.num_running += 1
        else:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (turn, is_wanted)
            self._waiting.append(entry)
            try:
                await turn  # CallDropped if dropped
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled() and turn.exception() is None:
                    self._hand_on()  # it was given a thread: pass it on
                elif entry in self._waiting:
                    self._waiting.remove(entry)
                raise
        loop = asyncio.get_running_loop()

        def done(_: Future[Any]) -> None:  # in the worker thread: only now is the thread free
            try:
                loop.call_soon_threadsafe(self._hand_on)
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass

        try:
            future = self.executor.submit(fn, *args)
        except BaseException:
            self._hand_on()
            raise
        future.add_done_callback(done)
        return await asyncio.wrap_future(future)

    def _hand_on(self) -> None:
        """A thread is free: give it to the next waiting call still wanted, else put it back."""
        while self._waiting:
            turn, is_wanted = self._waiting.popleft()
            if turn.done():  # its request was cancelled
                continue
            if is_wanted is not None and not is_wanted():
                self._drop(turn)
                continue
            turn.set_result(None)
            return
        self.num_running -= 1

    def _drop_unwanted(self) -> None:
        if all(is_wanted is None or is_wanted() for _, is_wanted in self._waiting):
            return
        keep: deque[tuple[asyncio.Future[None], Callable[[], bool] | None]] = deque()
        for turn, is_wanted in self._waiting:
            if is_wanted is None or is_wanted():
                keep.append((turn, is_wanted))
            elif not turn.done():
                self._drop(turn)
        self._waiting = keep

    def _drop(self, turn: asyncio.Future[None]) -> None:
        self.num_dropped += 1
        turn.set_exception(CallDropped("its client disconnected while it waited for a worker thread"))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# the server ---------------------------------------------------------------------------------


def _json(data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=json.dumps(data, default=str), status=status, content_type="application/json", headers=headers
    )


def _error(err: ProtocolError) -> web.Response:
    headers = {"Retry-After": "1"} if err.code.status in (429, 503) else None
    if err.code is ErrorCode.UNAUTHORIZED:
        headers = {"WWW-Authenticate": "Bearer"}
    response = _json(err.to_json(), status=err.code.status, headers=headers)
    if err.code is ErrorCode.REQUEST_TIMEOUT:
        response.force_close()  # the rest of the body may still be on its way
    return response


class _ClientGone(Exception):
    """The client disconnected before its request was done; nobody reads the answer."""


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


def _is_connected(request: web.Request) -> Callable[[], bool]:
    return lambda: request.transport is not None and not request.transport.is_closing()


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
        self.table = SessionTable(
            max_sessions=options.max_sessions,
            idle_timeout_s=options.idle_timeout_s,
            max_paused_s=options.max_paused_s,
            max_sessions_per_client=options.client_cap,
        )
        self.work = WorkQueue(num_workers=options.max_workers, max_waiting=options.max_queued_steps)
        self.guard = ConnectionGuard(
            max_connections=connection_cap(options.max_connections, options.max_workers),
            header_timeout_s=options.header_timeout_s,
        )
        if self.guard.max_connections < options.max_connections:
            log.info("max_connections lowered from %d to %d to fit the open-file limit (ulimit -n %d)",
                     options.max_connections, self.guard.max_connections,
                     resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self.is_draining = False
        self.started_s = time.monotonic()
        self.num_steps = 0
        # Server-side time of recent steps (parse, env step, answer; no injected delay), seconds.
        self.step_times_s: deque[float] = deque(maxlen=10_000)
        self._reaper: asyncio.Task[None] | None = None
        self.app = web.Application(
            middlewares=[self._connection_middleware, self._error_middleware, self._auth_middleware],
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
    async def _connection_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        transport = request.transport
        if transport is not None:
            self.guard.request_started(transport)  # the headers are in: their deadline is met
        try:
            return await handler(request)
        finally:
            if transport is not None:
                self.guard.request_finished(transport)

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProtocolError as e:
            return _error(e)
        except _ClientGone as e:
            conn_log.info("%s %s from %s: %s", request.method, request.path, request.remote, e)
            return web.Response(status=499, reason="Client Closed Request")
        except web.HTTPException as e:
            code = _HTTP_CODES.get(e.status, ErrorCode.INTERNAL if e.status >= 500 else ErrorCode.BAD_REQUEST)
            return _json({"error": f"{request.method} {request.path}: {e.reason}", "code": code.code}, e.status)
        except Exception as e:  # a bug must answer 500, never take the server down
            log.exception("internal error on %s %s", request.method, request.path)
            return _error(ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get(TOKEN_HEADER)
        problem = None if given is None else describe_non_ascii(TOKEN_HEADER, given)
        if problem is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, problem)
        token = self.options.token
        if token is not None:
            scheme, _, value = (given or "").partition(" ")
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
        return await self.work.run(fn, *args, is_wanted=None if request is None else _is_connected(request))

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

    # handlers ----------------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        endpoint = request.path
        limit = self.options.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ProtocolError(
                ErrorCode.TOO_LARGE, f"{endpoint}: body of {request.content_length} bytes is over the limit of {limit}"
            )
        try:
            async with asyncio.timeout(self.options.body_timeout_s):
                raw = await request.read()
        except TimeoutError as e:
            raise ProtocolError(
                ErrorCode.REQUEST_TIMEOUT, f"{endpoint}: body not received within {self.options.body_timeout_s:g} s"
            ) from e
        except web.HTTPRequestEntityTooLarge as e:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{endpoint}: body is over the limit of {limit} bytes") from e
        except ConnectionError as e:
            raise _ClientGone(f"client disconnected mid-body ({type(e).__name__}: {e})") from e
        except web.RequestPayloadError as e:  # e.g. a broken chunked encoding
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{endpoint}: body could not be read: {e}") from e
        return parse_body(raw, endpoint)

    def _client_of(self, request: web.Request) -> str:
        """Whom a session counts against (`max_sessions_per_client`): with a token every holder
        of it is one client; without one, the peer address."""
        if self.options.token is not None:
            return "token"
        return request.remote or "?"

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
        self._check_room(cls)
        client = self._client_of(request)
        self.table.reserve(client)
        env: Environment | None = None
        try:
            env = cls()
            observation, info = await self._call(env, env.reset, req.seed, req.options, request=request)
        except CallDropped as e:
            self.table.release(client)
            raise _ClientGone(f"start of {req.env} dropped: the client left while it waited for a worker") from e
        except EnvOptionError as e:
            self.table.release(client)
            raise ProtocolError(ErrorCode.BAD_OPTIONS, str(e)) from e
        except Exception as e:
            self.table.release(client)
            log.exception("env %s failed to reset (seed %s)", req.env, req.seed)
            raise ProtocolError(ErrorCode.ENV_ERROR, f"env {req.env} reset failed: {type(e).__name__}: {e}") from e
        session = self.table.add(req.env, env, req.seed, client)
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
        self._check_free(session)
        self._check_room(session.env)
        session.is_busy = True
        try:
            try:
                result = await self._call(session.env, session.env.step, req.action, request=request)
            except CallDropped as e:
                raise _ClientGone(
                    f"step of session {session.session_id} dropped: the client left while it waited for a worker"
                ) from e
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
        self._check_free(session)
        self._check_room(session.env)
        session.is_busy = True
        try:
            reward = float(await self._call(session.env, session.env.final_reward, request=request))
        except CallDropped as e:
            session.is_busy = False
            raise _ClientGone(f"/end of session {session_id} dropped: the client left while it waited") from e
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
                "max_sessions_per_client": self.table.max_sessions_per_client,
                "num_steps": self.num_steps,
                "idle_timeout_s": self.options.idle_timeout_s,
                "max_paused_s": self.options.max_paused_s,
                "queued_steps": self.work.num_waiting,
                "max_queued_steps": self.work.max_waiting,
                "num_dropped_steps": self.work.num_dropped,
                "connections": len(self.guard.connections),
                "max_connections": self.guard.max_connections,
                "num_refused_connections": self.guard.num_refused,
                "num_timed_out_connections": self.guard.num_timed_out,
                "latency": self.latency.spec,
                "step_p50_ms": _percentile_ms(self.step_times_s, 0.50),
                "step_p99_ms": _percentile_ms(self.step_times_s, 0.99),
                "uptime_s": time.monotonic() - self.started_s,
            }
        )


class RunningServer:
    """A started server: `url` is where it listens (the real port when port 0 was asked)."""

    def __init__(self, server: EnvServer, runner: web.AppRunner, url: str, *, owns_loop_handler: bool = False) -> None:
        self.server = server
        self.runner = runner
        self.url = url
        self._owns_loop_handler = owns_loop_handler

    async def close(self) -> None:
        await self.runner.cleanup()
        self.server.guard.close_refused()
        loop = asyncio.get_running_loop()
        if self._owns_loop_handler and loop.get_exception_handler() is _log_loop_error:
            loop.set_exception_handler(None)

    async def __aenter__(self) -> RunningServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_server(options: ServerOptions) -> RunningServer:
    """Start serving on the running event loop; returns once the socket is bound."""
    server = EnvServer(options)
    runner = web.AppRunner(
        server.app, access_log=None, handle_signals=False, logger=http_log,
        keepalive_timeout=options.keepalive_timeout_s, lingering_time=LINGER_S,
    )
    await runner.setup()
    site = GuardedSite(runner, options.host, options.port, server.guard)
    await site.start()
    loop = asyncio.get_running_loop()
    owns_loop_handler = loop.get_exception_handler() is None
    if owns_loop_handler:
        loop.set_exception_handler(_log_loop_error)
    return RunningServer(server, runner, f"http://{advertised_host(options.host)}:{site.port}",
                         owns_loop_handler=owns_loop_handler)


def advertised_host(listen_host: str) -> str:
    """The host other machines reach a server listening on `listen_host` at: the machine's
    hostname for a wildcard address (ranks on other nodes read the URL), else the address."""
    if listen_host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return listen_host if ":" not in listen_host else f"[{listen_host}]"
