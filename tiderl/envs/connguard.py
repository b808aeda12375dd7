"""The open connections of an env server, bounded below aiohttp (`ConnectionGuard`).

A cap on connections, with a 503 `too_many_connections` beyond it, lowered to fit the
process's open-file limit (`connection_cap`); a cap per client (`client_key`: its address,
every loopback address being one client) on its connections and on those still awaiting
their request's headers (half-open), so that one client flooding the server leaves room for
the others; and a deadline for each request's headers, with a 408 when it passes. `GuardedSite` is the aiohttp site whose
connections pass through the guard; the guard's request `middleware` tells it when a
request's headers have arrived and when its answer is done.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import resource
from http import HTTPStatus
from typing import Any

from aiohttp import web

from tiderl.envs.protocol import ErrorCode
from tiderl.envs.serverlog import conn_log

LINGER_S = 1.0  # how long a connection is kept to read the rest of a body its answer did not need
FILES_RESERVED = 64  # open files kept for the process itself, beyond connections and workers
FILES_PER_WORKER = 13  # open files an environment call may hold at its peak (a sandbox run starting: pipes, bwrap's fds)
MAX_REFUSED_OPEN = 64  # refused connections kept open until their 503 is out; beyond: reset


def connection_cap(max_connections: int, max_workers: int) -> int:
    """`max_connections`, lowered so that the connections, the environments' files and the
    process's own fit under its open-file limit (a server out of files cannot even answer
    /health, and asyncio logs every failed accept())."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(8, min(max_connections, soft - FILES_RESERVED - FILES_PER_WORKER * max_workers))


def _raw_response(code: ErrorCode, message: str) -> bytes:
    """A complete HTTP answer that closes the connection, for use below aiohttp."""
    body = json.dumps({"error": message, "code": code.code}).encode()
    retry = "Retry-After: 1\r\n" if code.status in (429, 503) else ""
    head = (f"HTTP/1.1 {code.status} {HTTPStatus(code.status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{retry}Connection: close\r\n\r\n")
    return head.encode() + body


def client_key(address: str | None) -> str:
    """Who a peer address is, as a client: the address, except that every loopback address
    (127.0.0.0/8, ::1, ::ffff:127.x) is the one client "loopback" (127.0.0.2 is no one else)."""
    if not address:
        return "?"
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return "loopback" if ip.is_loopback else str(ip)


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

    def __init__(self, *, max_connections: int, header_timeout_s: float, max_per_client: int | None = None,
                 max_half_open_per_client: int | None = None) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.max_per_client = max_per_client or max_connections
        self.max_half_open_per_client = max_half_open_per_client or max_connections
        self.connections: dict[asyncio.BaseTransport, GuardedConnection] = {}
        self.num_by_client: dict[str, int] = {}  # open connections per client
        self.half_open_by_client: dict[str, int] = {}  # of them, awaiting a request's headers
        self.refused: set[asyncio.Transport] = set()  # answered 503, closing
        self.num_refused = 0
        self.num_timed_out = 0

    def why_not_admit(self, client: str) -> str | None:
        """Why a new connection of `client` is refused now; None: it is admitted."""
        if len(self.connections) >= self.max_connections:
            return f"server has {len(self.connections)} connections open, max_connections={self.max_connections}"
        held = self.num_by_client.get(client, 0)
        if held >= self.max_per_client:
            return f"client {client} has {held} connections open, max_connections_per_client={self.max_per_client}"
        half_open = self.half_open_by_client.get(client, 0)
        if half_open >= self.max_half_open_per_client:
            return (f"client {client} has {half_open} connections awaiting request headers, "
                    f"max_half_open_per_client={self.max_half_open_per_client}")
        return None

    @staticmethod
    def _count(counts: dict[str, int], client: str, delta: int) -> None:
        left = counts.get(client, 0) + delta
        if left > 0:
            counts[client] = left
        else:
            counts.pop(client, None)

    def refuse(self, transport: asyncio.Transport, reason: str) -> None:
        self.num_refused += 1
        conn_log.warning("refusing a connection from %s: %s", _peer(transport), reason)
        if len(self.refused) >= MAX_REFUSED_OPEN:
            transport.abort()
            return
        transport.write(_raw_response(ErrorCode.TOO_MANY_CONNECTIONS, f"{reason}; retry later"))
        if transport.can_write_eof():
            transport.write_eof()
        self.refused.add(transport)
        asyncio.get_running_loop().call_later(LINGER_S, self._drop_refused, transport)

    def _drop_refused(self, transport: asyncio.Transport) -> None:
        if transport in self.refused:
            self.refused.discard(transport)
            transport.abort()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The app's first middleware: tells the guard when a request's headers are in and
        when its answer is done."""
        transport = request.transport
        if transport is not None:
            self.request_started(transport)  # the headers are in: their deadline is met
        try:
            return await handler(request)
        finally:
            if transport is not None:
                self.request_finished(transport)

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
        self.client = "?"
        self.is_refused = False
        self.is_awaiting_headers = True
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peername = transport.get_extra_info("peername")
        self.client = client_key(str(peername[0]) if isinstance(peername, tuple) and peername else None)
        reason = self.guard.why_not_admit(self.client)
        if reason is not None:
            self.is_refused = True
            self.guard.refuse(transport, reason)
            return
        self.guard.connections[transport] = self
        self.guard._count(self.guard.num_by_client, self.client, 1)
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
        if self.guard.connections.pop(self.transport, None) is not None:  # type: ignore[arg-type]
            self.guard._count(self.guard.num_by_client, self.client, -1)
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
        """Start the header deadline: the connection is half-open until it is met."""
        self._deadline = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, self._headers_late)
        self.guard._count(self.guard.half_open_by_client, self.client, 1)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
            self.guard._count(self.guard.half_open_by_client, self.client, -1)

    def _headers_late(self) -> None:
        self._deadline = None
        self.guard._count(self.guard.half_open_by_client, self.client, -1)
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
