"""Starting an env server on the running event loop (`start_server`), the handle that stops it
(`RunningServer`), and the URL other machines reach it at (`advertised_host`)."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from tiderl.envs.connguard import LINGER_S, GuardedSite
from tiderl.envs.server import EnvServer
from tiderl.envs.server_options import ServerOptions
from tiderl.envs.serverlog import http_log, log_loop_error


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
        if self._owns_loop_handler and loop.get_exception_handler() is log_loop_error:
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
        loop.set_exception_handler(log_loop_error)
    return RunningServer(server, runner, f"http://{advertised_host(options.host)}:{site.port}",
                         owns_loop_handler=owns_loop_handler)


def advertised_host(listen_host: str) -> str:
    """The host other machines reach a server listening on `listen_host` at: the machine's
    hostname for a wildcard address (ranks on other nodes read the URL), else the address."""
    if listen_host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return listen_host if ":" not in listen_host else f"[{listen_host}]"
