"""Starting env servers as processes and connecting to them, from the `env:` config.

The run launcher starts `num_servers` servers with `server_argv` (port 0: each
picks a free port and writes its URL to a port file), waits with `wait_for_url`,
and rollout ranks build their client with `make_pool`. Servers, clients and
`tiderl status` take the token from one place (`read_token`); a run whose job
names no `env.token_file` gets a random one of its own (`ensure_run_token`).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from tiderl.config.env import EnvConfig
from tiderl.envs.pool import EnvPool
from tiderl.envs.protocol import TOKEN_ENV_VAR
from tiderl.paths import RunPaths, atomic_write_text



class EnvServerStartError(RuntimeError):
    """An env server process exited or did not write its URL in time."""


def server_argv(cfg: EnvConfig, port_file: Path, *, envs: str | None = None,
                token_file: Path | None = None, port: int = 0, latency_seed: int = 0) -> list[str]:
    """The command line of one local env server for this config (the token file, `token_file` or
    `env.token_file`, is passed by path: the token itself never appears on a command line).
    `latency_seed`: the seed of its injected delays (the run's seed and the server's index)."""
    argv = [
        sys.executable, "-m", "tiderl", "env", "serve",
        "--env", envs or cfg.name,
        "--host", cfg.host,
        "--port", str(port),
        "--port-file", str(port_file),
        "--max-sessions", str(cfg.max_sessions),
        "--idle-timeout-s", str(cfg.idle_timeout_s),
        "--latency", cfg.latency,
        "--latency-seed", str(latency_seed),
        "--max-workers", str(cfg.max_workers),
        "--max-paused-s", str(cfg.max_paused_s),
    ]
    if cfg.max_sessions_per_client is not None:
        argv += ["--max-sessions-per-client", str(cfg.max_sessions_per_client)]
    for key, values in _operator_options(envs or cfg.name).items():
        if cfg.options.get(key) in values:  # the job's own server: its author is its operator
            argv += ["--allow-unsafe-sandbox"]
            break
    token_file = token_file or (Path(cfg.token_file) if cfg.token_file else None)
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    return argv


def _operator_options(envs: str) -> dict[str, tuple[object, ...]]:
    """The operator-only option values of the environments named (comma-separated), merged."""
    from tiderl.envs.registry import env_class

    merged: dict[str, tuple[object, ...]] = {}
    for name in (n.strip() for n in envs.split(",") if n.strip()):
        try:
            cls = env_class(name)
        except Exception:
            continue  # the server itself names an unknown or unloadable environment
        for key, values in cls.operator_options.items():
            merged[key] = merged.get(key, ()) + tuple(values)
    return merged


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


class TokenError(ValueError):
    """A token file that cannot be read or is empty; the message names it."""


def token_file_of(cfg: EnvConfig, run_dir: Path | None = None) -> Path | None:
    """The token file of a run's env servers: `env.token_file`, else the run's own `RUN_DIR/env.token`
    where the launcher made one (`ensure_run_token`)."""
    if cfg.token_file:
        return Path(cfg.token_file)
    if run_dir is not None and RunPaths(Path(run_dir)).env_token.is_file():
        return RunPaths(Path(run_dir)).env_token
    return None


def read_token(cfg: EnvConfig, run_dir: Path | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The one token source the servers, their clients and `tiderl status` share: the token file
    (`token_file_of`), else $TIDERL_ENV_TOKEN, else None (no token)."""
    path = token_file_of(cfg, run_dir)
    if path is None:
        return environ.get(TOKEN_ENV_VAR) or None
    return read_token_file(path)


def read_token_file(path: Path) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise TokenError(f"cannot read the env token file {path}: {e.strerror or e}") from e
    if not token:
        raise TokenError(f"the env token file {path} is empty")
    return token


def ensure_run_token(run_dir: Path) -> Path:
    """`RUN_DIR/env.token`: a random token only its owner can read, made once per run (a resume keeps it)."""
    path = RunPaths(Path(run_dir)).env_token
    if not path.is_file():
        atomic_write_text(path, secrets.token_urlsafe(32) + "\n", mode=0o600)
    return path


def make_pool(cfg: EnvConfig, urls: list[str] | tuple[str, ...], run_dir: Path | None = None) -> EnvPool:
    """The rollout side's client of these servers, with the config's timeouts and the run's token."""
    return EnvPool(
        list(urls), token=read_token(cfg, run_dir), timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries,
        hold_s=cfg.hold_s,
    )
