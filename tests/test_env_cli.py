"""`tiderl env serve` as a real process: port 0 + --port-file, token from the environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tiderl.cli import build_parser


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {timeout_s} s")


def _get(url: str, token: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_on_port_zero_with_token_from_environment(tmp_path: Path) -> None:
    port_file = tmp_path / "url"
    env = {**os.environ, "TIDERL_ENV_TOKEN": "tok-123"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiderl", "env", "serve", "--env", "hilo", "--port", "0",
         "--port-file", str(port_file), "--max-sessions", "7"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = _wait_for(port_file, proc)
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        assert _get(url + "/health")[0] == 401
        status, health = _get(url + "/health", token="tok-123")
        assert status == 200 and health["max_sessions"] == 7 and health["envs"] == ["hilo"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"serving hilo at {url}" in out
    assert "tok-123" not in out


def test_serve_refuses_unknown_env_and_token_on_command_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tiderl", "env", "serve", "--env", "nope"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "unknown environment 'nope'" in result.stderr
    parser = build_parser()
    args = parser.parse_args(["env", "serve", "--env", "hilo", "--token-file", str(tmp_path / "t")])
    assert args.token_file == tmp_path / "t"
    with pytest.raises(SystemExit):  # there is no --token: a token on the command line is visible to all
        parser.parse_args(["env", "serve", "--env", "hilo", "--token", "x"])


def test_launch_helpers_start_a_server_from_the_env_config(tmp_path: Path) -> None:
    import asyncio

    from tiderl.config.env import EnvConfig
    from tiderl.config.schema import ConfigError, build
    from tiderl.envs.launch import make_pool, server_argv, wait_for_url

    token_file = tmp_path / "token"
    token_file.write_text("t0k\n")
    cfg = build(EnvConfig, {"max_sessions": 3, "latency": "fixed:0.001", "token_file": str(token_file)}, "job.yaml")
    argv = server_argv(cfg, tmp_path / "url0")
    assert "t0k" not in " ".join(argv)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for_url(tmp_path / "url0", proc)

        async def main() -> None:
            async with make_pool(cfg, [url]) as pool:
                start = await pool.start("hilo", seed=1)
                await pool.step(start.session_id, "8")
                assert (await pool.end(start.session_id)).info["num_steps"] == 1
                health = await pool.clients[0].health()
                assert health["max_sessions"] == 3 and health["latency"] == "fixed:0.001"

        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with pytest.raises(ConfigError, match="env.latency"):
        build(EnvConfig, {"latency": "sometimes"}, "job.yaml", "env")


def test_one_token_source_for_servers_clients_and_status(tmp_path: Path) -> None:
    from tiderl.config.env import EnvConfig
    from tiderl.config.schema import build
    from tiderl.envs.launch import TokenError, ensure_run_token, make_pool, read_token

    plain = build(EnvConfig, {}, "job.yaml")
    assert read_token(plain, environ={}) is None
    # $TIDERL_ENV_TOKEN, which the server honours, reaches the client too.
    assert read_token(plain, environ={"TIDERL_ENV_TOKEN": "from-env"}) == "from-env"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    token = ensure_run_token(run_dir).read_text().strip()
    assert len(token) >= 32 and ensure_run_token(run_dir).read_text().strip() == token  # made once
    assert read_token(plain, run_dir, environ={"TIDERL_ENV_TOKEN": "from-env"}) == token
    assert make_pool(plain, ["http://127.0.0.1:1"], run_dir).clients[0].token == token
    job_file = tmp_path / "job.token"
    job_file.write_text("\n")
    with_file = build(EnvConfig, {"token_file": str(job_file)}, "job.yaml")
    with pytest.raises(TokenError, match=f"the env token file {job_file} is empty"):
        read_token(with_file, run_dir)


def test_the_session_limits_of_the_job_reach_the_server(tmp_path: Path) -> None:
    import asyncio

    from tiderl.config.env import EnvConfig
    from tiderl.config.schema import build
    from tiderl.envs.launch import make_pool, server_argv, wait_for_url

    cfg = build(EnvConfig, {"max_sessions": 4, "max_paused_s": 120, "max_sessions_per_client": 2}, "job.yaml")
    argv = server_argv(cfg, tmp_path / "url0")
    assert argv[argv.index("--max-paused-s") + 1] == "120.0"
    assert argv[argv.index("--max-sessions-per-client") + 1] == "2"
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for_url(tmp_path / "url0", proc)

        async def main() -> None:
            async with make_pool(cfg, [url]) as pool:
                await pool.start("hilo", seed=1)
                await pool.start("hilo", seed=2)
                with pytest.raises(Exception, match="client_limit|429"):
                    await pool.start("hilo", seed=3)

        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(30)
