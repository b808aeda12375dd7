"""`tiderl env serve`: run an env server.

The shared token comes from `--token-file` or the TIDERL_ENV_TOKEN environment
variable, never from the command line (other users can read command lines).
Without a token the server listens only on a loopback address (it refuses to start on
any other, exit 2, and warns on loopback: every local user can reach it). What a client may
not choose is the operator's: `--allow-unsafe-sandbox` lets clients ask for pytool's
`sandbox: unsafe` (else 403).
With `--port 0` the server picks a free port; `--port-file` receives the bound URL
(written atomically) so a launcher can find it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from tiderl.envs.protocol import TOKEN_ENV_VAR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="env_command", metavar="ENV_COMMAND", required=True)
    serve = sub.add_parser(
        "serve", help="Run an env server (HTTP) for one or more environments.", allow_abbrev=False
    )
    serve.add_argument("--env", required=True,
                       help="Comma-separated environments: built-in names (`hilo,pytool`), entry points of group "
                            "`tiderl.envs`, or import paths `package.module:Class` (e.g. `mypkg.envs:CountdownEnv`).")
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: loopback only).")
    serve.add_argument("--port", type=int, default=0, help="Port; 0 picks a free one (default 0).")
    serve.add_argument("--port-file", type=Path, help="Write the bound URL to this file once listening.")
    serve.add_argument("--max-sessions", type=int, default=512, help="Concurrent sessions accepted (default 512).")
    serve.add_argument("--idle-timeout-s", type=float, default=300.0,
                       help="Reap unpaused sessions idle this long, seconds (default 300).")
    serve.add_argument("--latency", default="none",
                       help="Injected delay per step: none, fixed:S, lognormal:MEAN_S:P99_S, file:PATH.")
    serve.add_argument("--latency-seed", type=int, default=0,
                       help="Seed of the injected delays: under one seed, the n-th session of an env seed draws "
                            "the same delay at each step in every run (default 0).")
    serve.add_argument("--token-file", type=Path,
                       help=f"File holding the shared token (else ${TOKEN_ENV_VAR}; neither: no token).")
    serve.add_argument("--max-workers", type=int, default=32,
                       help="Threads for environments with blocking steps (default 32).")
    serve.add_argument("--max-paused-s", type=float, default=3600.0,
                       help="A session paused longer than this expires, seconds (default 3600).")
    serve.add_argument("--max-sessions-per-client", type=int, default=None,
                       help="Sessions one client (its token, else its address) may hold (default: all of "
                            "--max-sessions with a token, three quarters without).")
    serve.add_argument("--allow-unsafe-sandbox", action="store_true",
                       help="Let clients ask for pytool's `sandbox: unsafe` (model code without namespaces); "
                            "without this flag such a /start is refused (403).")


def read_token(token_file: Path | None) -> str | None:
    """The shared token from the file, else from $TIDERL_ENV_TOKEN, else None (what clients read too)."""
    from tiderl.envs.launch import TokenError, read_token_file

    if token_file is None:
        return os.environ.get(TOKEN_ENV_VAR) or None
    try:
        return read_token_file(token_file)
    except TokenError as e:
        raise SystemExit(f"tiderl env serve: --token-file: {e}") from e


class NoTokenError(ValueError):
    """A server without a token asked to listen beyond loopback."""


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`): only the local machine reaches it."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> int:
    from tiderl.envs.server_options import ServerOptions
    from tiderl.envs.serving import start_server

    options = ServerOptions(
        envs=tuple(name.strip() for name in args.env.split(",") if name.strip()),
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        idle_timeout_s=args.idle_timeout_s,
        latency=args.latency,
        latency_seed=args.latency_seed,
        token=read_token(args.token_file),
        max_workers=args.max_workers,
        max_paused_s=args.max_paused_s,
        max_sessions_per_client=args.max_sessions_per_client,
        allow_unsafe_sandbox=args.allow_unsafe_sandbox,
    )
    if options.token is None:
        if not is_loopback(options.host):
            raise NoTokenError(
                f"refusing to listen on {options.host} without a token: anyone who can reach it could run "
                f"code there and end others' sessions; set --token-file or ${TOKEN_ENV_VAR}, or listen on "
                "127.0.0.1")
        logging.getLogger("tiderl.envs.server").warning(
            "listening on %s without a token: every local user can use this server "
            "(set --token-file or $%s to keep them out)", options.host, TOKEN_ENV_VAR,
        )
    if options.allow_unsafe_sandbox:
        logging.getLogger("tiderl.envs.server").warning(
            "--allow-unsafe-sandbox: clients may run model code without namespaces (pytool sandbox: unsafe)")
    running = await start_server(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.port_file is not None:
        write_atomic(args.port_file, running.url + "\n")
    print(f"tiderl env server: serving {','.join(options.envs)} at {running.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await running.close()
    return 0


def run(args: argparse.Namespace) -> int:
    if args.env_command != "serve":
        raise SystemExit(f"tiderl env: unknown command {args.env_command!r}")
    from tiderl.config.latency import LatencySpecError
    from tiderl.envs.registry import EnvUnavailableError, UnknownEnvError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name, value in (("--max-sessions", args.max_sessions), ("--max-workers", args.max_workers)):
        if value < 1:
            print(f"tiderl env serve: {name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.idle_timeout_s <= 0:
        print(f"tiderl env serve: --idle-timeout-s must be > 0, got {args.idle_timeout_s}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(args))
    except (UnknownEnvError, EnvUnavailableError, LatencySpecError, ValueError) as e:
        print(f"tiderl env serve: {e}", file=sys.stderr)
        return 2
