"""The fault campaign's faults (tools/chaos.py): what each one sets up before its run and injects into
it, with the helpers two of them put in the run's way (a proxy answering garbage, a listener that never
answers)."""

from __future__ import annotations

import errno
import http.client
import http.server
import json
import os
import secrets
import signal
import socket
import sqlite3
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_facts import POLL_S, _query, rank_pid
from chaos_procs import ChaosError, _signal_group, child_of, stop_process
from chaos_trial import ROOT, Trial

STOP_HOLD_S = 15.0  # SIGSTOP lasts this long: past the 10 s heartbeat timeout of that trial
LOCK_HOLD_S = 20.0
DISK_FULL_S = 10.0
GARBAGE_S = 5.0
HOLE_S = 20.0
TMPFS_SIZE = "96m"


# ---- a proxy that answers garbage ------------------------------------------------------------

class GarbageProxy:
    """HTTP proxy in front of one env server; while `garbage` is set, every answer (the request
    still reaches the server) is replaced by a 200 with malformed JSON."""

    def __init__(self, upstream: str) -> None:
        self.garbage = threading.Event()
        self.num_garbled = 0
        target = urllib.parse.urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=150)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    status, data, ctype = resp.status, resp.read(), resp.getheader("Content-Type", "application/json")
                except (OSError, http.client.HTTPException) as e:
                    status, data, ctype = 502, json.dumps({"error": f"proxy: {e}"}).encode(), "application/json"
                finally:
                    conn.close()
                if proxy.garbage.is_set():
                    proxy.num_garbled += 1
                    status, data = 200, b'{"session_id": "s-1", "observation": [1, 2,'
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up (its timeout): nothing to answer

            do_GET = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="chaos-proxy", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- the faults ----------------------------------------------------------------------------

Inject = Callable[[Trial], str]  # injects the fault; returns what it did


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Inject
    sets: tuple[str, ...] = ()
    setup: Callable[[Trial], None] | None = None
    what: str = ""
    min_steps: int = 0  # a run at least this long: what the fault leaves behind needs time to show


def _kill_rank(role: str) -> Inject:
    def inject(trial: Trial) -> str:
        rank, pid = rank_pid(trial.db, role)
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL rank {rank} ({role}, pid {pid})"
    return inject


def _kill_engine(trial: Trial) -> str:
    """SIGKILL the vLLM engine-core process of a rollout rank whose engine is up: the rank's engine dies under
    it (as it does when vLLM fails on a request), the rank process lives on."""
    rank, pid = rank_pid(trial.db, "rollout")
    core = child_of(pid, "EngineCore")
    os.kill(core, signal.SIGKILL)
    return f"SIGKILL the engine core (pid {core}) of rank {rank} (rollout, pid {pid})"


def _kill_child(needle: str, what: str) -> Inject:
    def inject(trial: Trial) -> str:
        assert trial.launcher is not None
        pid = child_of(trial.launcher.pid, needle)
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL {what} (pid {pid})"
    return inject


def _kill_launcher(trial: Trial) -> str:
    assert trial.launcher is not None
    first = trial.launcher
    os.kill(first.pid, signal.SIGKILL)
    try:
        first.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise ChaosError("the SIGKILLed launcher did not exit within 30 s") from None
    trial.sleep(2.0)  # its children die by PDEATHSIG; what they leave, the resume reaps
    trial.launch("--resume", str(trial.run_dir))
    return f"SIGKILL launcher (pid {first.pid}), then one `tiderl run --resume`"


def _stop_rollout(trial: Trial) -> str:
    rank, pid = rank_pid(trial.db, "rollout")
    trial.stack.callback(_signal_group, pid, signal.SIGCONT)
    _signal_group(pid, signal.SIGSTOP)
    trial.sleep(STOP_HOLD_S)
    _signal_group(pid, signal.SIGCONT)
    state = _query(trial.db, "SELECT state FROM ranks WHERE rank = ?", (rank,))[0][0]
    trial.extra["stopped_rank"] = rank
    return f"SIGSTOP rank {rank} (rollout, pid {pid}, its process group) for {STOP_HOLD_S:.0f} s, then SIGCONT " \
           f"(rank state then: {state})"


def _truncate_weights(trial: Trial) -> str:
    assert trial.watcher is not None
    weights = trial.run_dir / "weights"
    written = [int(p.name[1:]) for p in weights.glob("v*") if p.name[1:].isdigit()]
    target = weights / f"v{max(written + [trial.watcher.version]) + 1}"
    while not (target / "SHA256SUMS").exists():
        if trial.left_s() <= 0 or (trial.launcher is not None and trial.launcher.poll() is not None):
            raise ChaosError(f"{target} never appeared")
        time.sleep(0.02)
    files = sorted(target.glob("*.safetensors"))
    for f in files:
        os.truncate(f, f.stat().st_size // 2)
    published = trial.watcher.version >= int(target.name[1:])
    return f"truncated {', '.join(f.name for f in files)} of {target.name} to half" + \
           (" (already published when truncated)" if published else " before its publish")


def _lock_store(trial: Trial) -> str:
    conn = sqlite3.connect(trial.db, timeout=60.0, isolation_level=None)
    trial.stack.callback(conn.close)
    t0 = time.monotonic()
    conn.execute("BEGIN EXCLUSIVE")
    waited = time.monotonic() - t0
    trial.extra["fault_at"] = time.time()
    trial.sleep(LOCK_HOLD_S)
    conn.execute("ROLLBACK")
    conn.close()
    return f"BEGIN EXCLUSIVE from an outside sqlite3 connection (after {waited:.1f} s), held {LOCK_HOLD_S:.0f} s"


def _mount_tmpfs(trial: Trial) -> None:
    mnt = trial.work_dir / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ChaosError(f"mount -t tmpfs failed: {done.stderr.strip()}")
    trial.stack.callback(_unmount, mnt)
    trial.run_dir = mnt / "run"


def _unmount(mnt: Path) -> None:
    if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill_disk(trial: Trial) -> str:
    filler = trial.run_dir.parent / "filler"
    trial.stack.callback(filler.unlink, missing_ok=True)
    chunk = b"\0" * (1 << 20)
    written = 0
    with open(filler, "wb", buffering=0) as f:
        try:
            while time.monotonic() < trial.deadline:
                written += f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    trial.extra["fault_at"] = time.time()
    trial.sleep(DISK_FULL_S)
    filler.unlink()
    return f"filled the run directory's {TMPFS_SIZE} tmpfs ({written >> 20} MiB filler) for {DISK_FULL_S:.0f} s"


def _garbage_setup(trial: Trial) -> None:
    from tiderl.config import load_job
    from tiderl.envs.launch import EnvServerStartError, server_argv, wait_for_url

    token = trial.work_dir / "env.token"
    token.write_text(secrets.token_hex(16))
    token.chmod(0o600)
    cfg = load_job(ROOT / "jobs" / "quickstart.yaml", ["env.latency=fixed:0.3"]).env
    port_file = trial.work_dir / "env.port"
    with open(trial.work_dir / "env.log", "ab") as log:
        server = subprocess.Popen(server_argv(cfg, port_file, token_file=token), cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    trial.stack.callback(stop_process, server, signal.SIGTERM, 10.0)
    try:
        upstream = wait_for_url(port_file, server, timeout_s=min(120.0, trial.left_s()))
    except EnvServerStartError as e:
        raise ChaosError(str(e)) from e
    proxy = GarbageProxy(upstream)
    trial.stack.callback(proxy.close)
    trial.extra["proxy"] = proxy
    trial.token_file = token
    trial.env_urls = lambda: [upstream]  # counted at the server itself, not through the proxy
    trial.sets += [f"env.servers=[{proxy.url}]", f"env.token_file={token}"]


def _garbage(trial: Trial) -> str:
    proxy: GarbageProxy = trial.extra["proxy"]
    proxy.garbage.set()
    trial.sleep(GARBAGE_S)
    proxy.garbage.clear()
    return f"env server answered malformed JSON for {GARBAGE_S:.0f} s ({proxy.num_garbled} answers garbled)"


class BlackHole:
    """A TCP listener that accepts every connection and never answers: a weight server that hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, name="black-hole", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def _hang_weight_server(trial: Trial) -> str:
    """Point the rollout ranks at a weight server that accepts and never answers, then give the real one back."""
    named = trial.run_dir / "rendezvous" / "weight-server.json"
    while not named.exists():
        if trial.left_s() <= 0 or (trial.launcher is not None and trial.launcher.poll() is not None):
            raise ChaosError(f"{named} never appeared (is trainer.weight_sync transfer?)")
        time.sleep(POLL_S)
    original = named.read_text()
    hole = BlackHole()
    trial.stack.callback(hole.close)
    tmp = named.with_suffix(".chaos")
    tmp.write_text(json.dumps({"address": f"127.0.0.1:{hole.port}", "rank": -1, "pid": os.getpid()}))
    os.replace(tmp, named)
    trial.extra["fault_at"] = time.time()
    trial.sleep(HOLE_S)
    tmp.write_text(original)
    os.replace(tmp, named)
    return f"the weight server's address pointed at a listener that never answers for {HOLE_S:.0f} s " \
           f"({len(hole.held)} connections held)"


def _remove_shared_weights(trial: Trial) -> str:
    """Unlink the weight server's shared-memory buckets as they appear, for HOLE_S seconds: the engines on its
    host cannot map a version and must have it sent over their connections instead."""
    from tiderl.weightsync.shm import PREFIX, SHM_DIR

    named = trial.run_dir / "rendezvous" / "weight-server.json"
    while not named.exists():
        if trial.left_s() <= 0 or (trial.launcher is not None and trial.launcher.poll() is not None):
            raise ChaosError(f"{named} never appeared (is trainer.weight_sync transfer?)")
        time.sleep(POLL_S)
    pid = json.loads(named.read_text())["pid"]
    trial.extra["fault_at"] = time.time()
    end, removed = time.monotonic() + HOLE_S, 0
    while time.monotonic() < end and trial.left_s() > 0:
        for p in SHM_DIR.glob(f"{PREFIX}*-{pid}-*"):
            p.unlink(missing_ok=True)
            removed += 1
        time.sleep(0.05)
    return f"the leader's (pid {pid}) shared-memory weight files unlinked as they appeared for {HOLE_S:.0f} s " \
           f"({removed} removed)"


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("rollout_kill", _kill_rank("rollout"), what="SIGKILL of a rollout rank"),
    Fault("engine_kill", _kill_engine, what="SIGKILL of a rollout rank's vLLM engine core (the rank lives on)"),
    Fault("actor_kill", _kill_rank("actor"), what="SIGKILL of the actor rank"),
    Fault("ref_kill", _kill_rank("ref"), what="SIGKILL of the ref rank"),
    Fault("control_kill", _kill_child("tiderl.run.control", "the control plane"), what="SIGKILL of the control plane"),
    Fault("env_kill", _kill_child("tiderl env serve", "the env server"), what="SIGKILL of the env server"),
    Fault("launcher_kill", _kill_launcher, what="SIGKILL of the launcher, then one --resume"),
    Fault("rollout_stop", _stop_rollout, sets=("launch.heartbeat_timeout_s=10",), min_steps=30,
          what=f"SIGSTOP of a rollout rank for {STOP_HOLD_S:.0f} s (heartbeat timeout 10 s), then SIGCONT"),
    Fault("weights_truncate", _truncate_weights, sets=("trainer.weight_sync=files",),
          what="the newest weights file truncated as it appears (engines reading files)"),
    Fault("weights_server_hang", _hang_weight_server, sets=("trainer.weight_sync=transfer",), min_steps=15,
          what=f"the weight server unreachable (a listener that never answers) for {HOLE_S:.0f} s"),
    Fault("weights_shm_gone", _remove_shared_weights, sets=("trainer.weight_sync=transfer",), min_steps=15,
          what=f"the weight server's shared-memory buckets unlinked as they appear for {HOLE_S:.0f} s"),
    Fault("store_lock", _lock_store, what=f"store write lock held {LOCK_HOLD_S:.0f} s by an outside connection"),
    Fault("disk_full", _fill_disk, setup=_mount_tmpfs, what=f"run directory's tmpfs full for {DISK_FULL_S:.0f} s"),
    Fault("env_garbage", _garbage, setup=_garbage_setup, what=f"env server answering malformed JSON for {GARBAGE_S:.0f} s"),
)}
