"""Clients of several env servers behind one interface (`EnvPool`): sessions placed on the
least-loaded server that answers, calls routed to the session's server, failover and a hold
while every server is out (the class docstring). Each server's calls go through its
`tiderl.envs.client.EnvClient`, with that client's retry rules and error mapping."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tiderl.envs.client import (EndResult, EnvClient, EnvConflictError, EnvConnectionError, EnvNotFoundError,
                                EnvProtocolError, EnvServiceError, StartResult, StepWithImages)

log = logging.getLogger("tiderl.envs.client")


class EnvPool:
    """Clients of several env servers behind one interface: `start` places a session on
    the server with the fewest sessions this pool holds there; later calls on that
    session go to the same server.

    Failover: a server that does not answer (connection refused or dropped, timeout,
    after the client's retries) is taken out of rotation for `down_s` seconds. New
    sessions go to the servers still answering (a `start` that finds its server dead
    moves on to the next); calls on sessions of the dead server raise, so their tasks
    fail and are retried elsewhere by the run store. After `down_s` the server gets new
    sessions again; if it still does not answer it is out for another `down_s`. A server
    that answers (a `start` placed on it when every server was out, a restarted server)
    is back in rotation at once: its sessions must not fail for the rest of `down_s`.

    A server whose `/start` answers outside the protocol (garbled JSON, a missing field)
    is out of rotation too when its `/health` is broken as well: the server, not one
    answer, is at fault. With every server out of rotation, a `start` holds for up to
    `hold_s` seconds, probing `/health` (0.25 s, doubling, at most 5 s apart), and
    places the session as soon as one answers: a task does not spend its attempts on an
    outage shorter than that. `hold_s` 0 fails at once."""

    def __init__(self, urls: list[str] | tuple[str, ...], *, down_s: float = 30.0, hold_s: float = 0.0,
                 **client_kwargs: Any) -> None:
        if not urls:
            raise ValueError("EnvPool needs at least one env server URL")
        if hold_s < 0:
            raise ValueError(f"hold_s: must be >= 0, got {hold_s}")
        self.clients = [EnvClient(url, **client_kwargs) for url in urls]
        self.down_s = down_s
        self.hold_s = hold_s
        self._owner: dict[str, EnvClient] = {}
        self._load = {id(c): 0 for c in self.clients}
        self._down_until = {id(c): 0.0 for c in self.clients}
        self.num_failovers = 0  # sessions started elsewhere because their first server did not answer

    def is_up(self, client: EnvClient) -> bool:
        return time.monotonic() >= self._down_until[id(client)]

    def _mark_down(self, client: EnvClient, error: EnvServiceError) -> None:
        if self.is_up(client):
            log.warning("env server %s out of rotation for %.0f s: %s", client.url, self.down_s, error)
        self._down_until[id(client)] = time.monotonic() + self.down_s

    def _mark_up(self, client: EnvClient) -> None:
        if not self.is_up(client):
            log.info("env server %s answers again: back in rotation", client.url)
        self._down_until[id(client)] = 0.0

    async def _on(self, client: EnvClient, endpoint: str, session_id: str, call: Any) -> Any:
        """Run `call(session_id)` on `client`; a server out of rotation fails at once."""
        if not self.is_up(client):
            raise EnvConnectionError(client.url, endpoint, "the server stopped answering and is out of rotation",
                                     session_id=session_id, code="server_down")
        try:
            result = await call(session_id)
        except EnvConnectionError as e:
            self._mark_down(client, e)
            raise
        self._mark_up(client)
        return result

    async def __aenter__(self) -> EnvPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    async def health(self) -> list[dict[str, Any]]:
        """Every server's /health, in the order of the URLs."""
        return list(await asyncio.gather(*(client.health() for client in self.clients)))

    def client_of(self, session_id: str) -> EnvClient:
        client = self._owner.get(session_id)
        if client is None:
            raise KeyError(f"session {session_id} was not started through this pool (or has ended)")
        return client

    def server_of(self, session_id: str) -> str:
        """The URL of the server holding `session_id`."""
        return self.client_of(session_id).url

    def adopt(self, session_id: str, url: str) -> None:
        """Route `session_id`, started by another pool (another rank), to the server at `url`."""
        if session_id in self._owner:
            return
        for client in self.clients:
            if client.url == url:
                self._owner[session_id] = client
                self._load[id(client)] += 1
                return
        raise KeyError(f"session {session_id}: its env server {url} is not one of this pool's "
                       f"({', '.join(c.url for c in self.clients)})")

    async def start(self, env: str, seed: int, options: dict[str, Any] | None = None) -> StartResult:
        tried: list[EnvServiceError] = []
        deadline: float | None = None
        while True:
            up = [c for c in self.clients if self.is_up(c)]
            if not up and not tried:
                # Every server is out of rotation: try the one that went out first.
                up = [min(self.clients, key=lambda c: self._down_until[id(c)])]
            elif not up:
                if deadline is None:
                    deadline = time.monotonic() + self.hold_s
                    if self.hold_s > 0:
                        log.warning("no env server in rotation: holding a new session up to %.0f s", self.hold_s)
                up = await self._answering(deadline)
                if not up:
                    held = f" within {self.hold_s:g} s" if self.hold_s > 0 else ""
                    raise EnvConnectionError(tried[-1].url, "/start", f"no env server answers{held}: " + "; ".join(
                        str(e) for e in tried[-len(self.clients):]))
            client = min(up, key=lambda c: self._load[id(c)])
            self._load[id(client)] += 1
            try:
                result = await client.start(env, seed, options)
            except EnvConnectionError as e:
                self._load[id(client)] -= 1
                self._mark_down(client, e)
                tried.append(e)
                continue
            except EnvProtocolError as e:
                self._load[id(client)] -= 1
                if await self._is_healthy(client):
                    raise  # the server answers its health check: this answer, not the server, is at fault
                tried.append(e)
                continue
            except BaseException:
                self._load[id(client)] -= 1
                raise
            if tried:
                self.num_failovers += 1
            self._mark_up(client)
            self._owner[result.session_id] = client
            return result

    async def _is_healthy(self, client: EnvClient) -> bool:
        """Probe `client`'s /health: in rotation if it answers in protocol, out of it if not."""
        try:
            await client.health()
        except (EnvConnectionError, EnvProtocolError) as e:
            self._mark_down(client, e)
            return False
        self._mark_up(client)
        return True

    async def _answering(self, deadline: float) -> list[EnvClient]:
        """The servers whose /health answers in protocol, probing every server until one does or until
        `deadline` (monotonic) would pass before the next probe ([] then)."""
        delay = 0.25
        while True:
            answering = [c for c, ok in zip(self.clients, await asyncio.gather(
                *(self._is_healthy(c) for c in self.clients))) if ok]
            if answering or time.monotonic() + delay > deadline:
                return answering
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)

    async def step(self, session_id: str, action: str) -> StepWithImages:
        client = self.client_of(session_id)
        return await self._on(client, "/observation", session_id, lambda s: client.step(s, action))

    async def pause(self, session_id: str) -> str:
        client = self.client_of(session_id)
        return await self._on(client, "/pause", session_id, client.pause)

    async def resume(self, session_id: str) -> str:
        client = self.client_of(session_id)
        return await self._on(client, "/resume", session_id, client.resume)

    async def end(self, session_id: str) -> EndResult:
        client = self.client_of(session_id)
        try:
            result = await self._on(client, "/end", session_id, client.end)
        except (EnvNotFoundError, EnvConflictError, EnvConnectionError):
            self._forget(session_id, client)  # the server no longer holds it (reaped, or the server is gone)
            raise
        self._forget(session_id, client)
        return result

    def _forget(self, session_id: str, client: EnvClient) -> None:
        del self._owner[session_id]
        self._load[id(client)] -= 1
