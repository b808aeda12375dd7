"""`env:` section: the environment the agents play and the servers that host it."""

from __future__ import annotations

import re
from typing import Any

from tiderl.config.latency import LatencySpecError, parse_latency
from tiderl.config.schema import option, section


# An environment given by import path: `package.module:Class` (the class may be nested: `Outer.Inner`).
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def check_env_name(name: str) -> None:
    """A name the env servers can be asked for: one word (no comma, no space: `tiderl env serve --env` takes a
    comma-separated list), and in the form `module:Class` when it has a colon. ValueError otherwise."""
    if not name or any(c.isspace() or c == "," for c in name):
        raise ValueError(f"{name!r} is not an environment name (one name: no spaces, no commas)")
    if ":" in name and not IMPORT_PATH.match(name):
        raise ValueError(f"{name!r} is not an import path of the form `package.module:Class`")


@section
class EnvConfig:
    name: str = option(
        "hilo",
        help="Environment served by the env servers: a built-in name (`hilo`, `pytool`, `gridimage`, "
        "`textworld`), the name of an entry point in group `tiderl.envs`, or an import path "
        "`package.module:Class` (an `Environment` subclass, importable where the servers run).",
    )
    servers: tuple[str, ...] = option(
        (),
        help="URLs of environment servers that already run elsewhere. Empty: the run starts "
        "`num_servers` local servers on loopback.",
    )
    num_servers: int = option(1, ge=1, help="Local environment servers the run starts when `servers` is empty.")
    max_sessions: int = option(512, ge=1, help="Concurrent sessions one environment server accepts.")
    idle_timeout_s: float = option(
        300.0, gt=0, help="An unpaused session idle this long is reaped by its server, in seconds."
    )
    max_paused_s: float = option(
        3600.0,
        gt=0,
        help="A session paused this long is ended by its server, in seconds (a task handed over at a "
        "sync boundary that resumes later starts again from the beginning).",
    )
    max_sessions_per_client: int | None = option(
        None,
        ge=1,
        help="Sessions one client may hold on one env server; a client is the token when servers have "
        "one, else the peer address. null: all of `max_sessions` with a token, three quarters without.",
    )
    latency: str = option(
        "none",
        help="Injected environment delay per step: `none`, `fixed:SECONDS`, "
        "`lognormal:MEAN_S:P99_S`, or `file:PATH` (a list of recorded delays). Each is drawn for its task "
        "step (the run's seed, the session's seed and ordinal, the step): runs of one job and seed see the "
        "same delays.",
    )
    token_file: str | None = option(
        None, help="File holding the shared token the env servers require (never put the token itself here)."
    )
    max_turns: int = option(8, ge=1, help="Turn limit of one task (one environment episode).")
    options: dict[str, Any] = option(
        default_factory=dict, help="Environment-specific options passed to `/start` (e.g. hilo's range)."
    )
    host: str = option(
        "127.0.0.1",
        help="Address local env servers listen on. Loopback by default; `0.0.0.0` for ranks on other "
        "nodes (the server then advertises the node's hostname); on a shared cluster listen wider only "
        "with `token_file` set.",
    )
    request_timeout_s: float = option(
        120.0, gt=0, help="Client timeout of one env request (a step includes the environment's delay), seconds."
    )
    max_retries: int = option(
        3, ge=0, help="Client retries of a request, only where a retry is safe (never a step that may have run)."
    )
    hold_s: float = option(
        60.0, ge=0, help="With every env server out of rotation (not answering, or answering outside the "
        "protocol), how long a new session waits for one to answer its health check again before its task "
        "fails, seconds (0: fail at once).",
    )
    max_workers: int = option(
        32, ge=1, help="Threads per env server for environments with blocking steps (code runs, game engines)."
    )

    def __post_init__(self) -> None:
        try:
            check_env_name(self.name)
        except ValueError as e:
            raise ValueError(f"name: {e}") from e
        try:
            parse_latency(self.latency)
        except LatencySpecError as e:
            raise ValueError(f"latency: {e}") from e
