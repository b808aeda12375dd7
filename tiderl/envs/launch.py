"""Starting env servers as processes and connecting to them, from the `env:` config.

The run launcher starts `num_servers` servers with `server_argv` (port 0: each
picks a free port and writes its URL to a port file), waits with `wait_for_url`,
and rollout ranks build their client with `make_pool`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tiderl.config.env import EnvConfig
from tiderl.envs.client import EnvPool


class EnvServerStartError(RuntimeError):
    """An env server process exited or did not write its URL in time."""


def server_argv(cfg: EnvConfig, port_file: Path, *, envs: str | None = None) -> list[str]:
    """The command line of one local env server for this config (the token file, if any,
    is passed by path: the token itself never appears on a command line)."""
    argv = [
        sys.executable, "-m", "tiderl", "env", "serve",
        "--env", envs or cfg.name,
        "--host", cfg.host,
        "--port", "0",
        "--port-file", str(port_file),
        "--max-sessions", str(cfg.max_sessions),
        "--idle-timeout-s", str(cfg.idle_timeout_s),
        "--latency", cfg.latency,
        "--max-workers", str(cfg.max_workers),
    ]
    if cfg.token_file:
        argv += ["--token-file", cfg.token_file]
    return argv


def wait_for_url(port_file: Path, proc: subprocess.Popen[bytes] | subprocess.Popen[str],
                 timeout_s: float = 120.0) -> str:
    """The URL a server wrote to `port_file`; raises if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists():
            return port_file.read_text().strip()
        code = proc.poll()
        if code is not None:
            raise EnvServerStartError(f"env server exited with code {code} before listening (port file {port_file})")
        time.sleep(0.05)
    raise EnvServerStartError(f"env server wrote no URL to {port_file} within {timeout_s} s")


def read_token(cfg: EnvConfig) -> str | None:
    if not cfg.token_file:
        return None
    token = Path(cfg.token_file).read_text().strip()
    if not token:
        raise ValueError(f"env.token_file {cfg.token_file} is empty")
    return token


def make_pool(cfg: EnvConfig, urls: list[str] | tuple[str, ...]) -> EnvPool:
    """The rollout side's client of these servers, with the config's timeouts and token."""
    return EnvPool(
        list(urls), token=read_token(cfg), timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries
    )
