"""Fault campaign: short real runs of the quickstart job, ONE injected fault each, checked from the store.

    .venv/bin/python tools/chaos.py --all --seed 0
    .venv/bin/python tools/chaos.py --fault rollout_kill --fault store_lock --seed 3 --keep

Each trial runs `python -m tiderl run jobs/quickstart.yaml --run-dir DIR --set ...`: `--steps` steps
of 2 groups x 4 tasks, 4 ranks (rank 0 actor, ranks 1-2 rollout, rank 3 ref: `system=async` with a
fixed decoupled RA2P mode, so every role exists for the whole run), environment steps of 0.3 s
(`rollout_stop` runs 30 steps: the rank it stops must have time to come back). Once version 1 or 2
is published and a seeded random delay has passed, the trial injects its fault, then
waits for the launcher to end (the launcher fault only: after one `tiderl run --resume`; no other
fault gets any help). It prints one JSON line per fault:

    fault, seed, survived (finished at the last version, exit code 0, nobody stepping in),
    trajectories_lost, consumed_twice, recovery_s (fault -> the next new version), exit_code, run_dir, note

Lost and twice come from the store (`exactly_once`); the note adds the env servers' own session
counters (GET /health with the run's token, polled every 2 s while the run lives) next to the
store's. Every process and mount a trial starts is ended when it ends, on Ctrl-C too, and every wait
has a timeout (`--timeout-s` per trial).

`--model-path DIR` gives every trial an already built model (`model.path`): a job whose warm start
changed would otherwise build its model (minutes, under load tens of minutes) inside the first
trial's timeout, and inside every later one that starts while it is still building.
"""

from __future__ import annotations

import argparse
import errno
import http.client
import http.server
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.25
HEALTH_S = 2.0
STOP_S = 30.0  # a launcher stopping its children (SIGINT) gets this long before SIGKILL
STOP_HOLD_S = 15.0  # SIGSTOP lasts this long: past the 10 s heartbeat timeout of that trial
LOCK_HOLD_S = 20.0
DISK_FULL_S = 10.0
GARBAGE_S = 5.0
HOLE_S = 20.0
TMPFS_SIZE = "96m"


def base_sets(steps: int) -> list[str]:
    return [f"trainer.num_steps={steps}", "trainer.groups_min=2", "trainer.groups_ideal=2",
            "rollout.group_size=4", "rollout.eval_every_steps=0", "rollout.max_concurrency=8",
            "launch.num_ranks=4", "launch.rollout_fraction=0.5", "system=async",
            "trainer.ra2p_mode=decoupled", "trainer.checkpoint_every=1", "env.latency=fixed:0.3"]


class ChaosError(RuntimeError):
    """A trial could not set up or inject its fault; the message says what."""


# ---- processes -----------------------------------------------------------------------------

def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def child_of(launcher: int, needle: str) -> int:
    pids = [p for p in _children(launcher) if needle in _cmdline(p)]
    if not pids:
        raise ChaosError(f"no child of launcher {launcher} runs {needle!r}")
    return pids[0]


def _default_sigint() -> None:
    """In a child before exec: SIGINT back to its default. A background job of a shell starts with
    SIGINT ignored, and the launcher would inherit that and never stop on the SIGINT it is sent."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGINT, grace_s: float = STOP_S) -> None:
    """`sig` to a child still running (a launcher stops its own children on SIGINT), SIGKILL to its
    process group after `grace_s`."""
    if proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGCONT)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def reap_run(run_dir: Path) -> list[int]:
    """What is left of a run's processes (tagged with TIDERL_RUN_DIR, or in the session of a rank that is
    gone, as the launcher's resume finds them): continued, then SIGKILLed."""
    from tiderl.run.launcher import rank_sessions
    from tiderl.run.procs import reap_leftovers
    from tiderl.store import RunStore, StoreError

    tag = f"TIDERL_RUN_DIR={run_dir.resolve()}".encode()
    for entry in Path("/proc").iterdir():  # a stopped process dies of SIGKILL too; continue it anyway
        try:
            if entry.name.isdigit() and tag in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGCONT)
        except (OSError, ProcessLookupError):
            continue
    sessions: list[int] = []
    if (run_dir / "run.db").is_file():  # else a trial that failed before the run started: the tags find it all
        try:
            store = RunStore.for_run_dir(run_dir, read_only=True)
            try:
                sessions = rank_sessions(store)
            finally:
                store.close()
        except StoreError as e:
            print(f"chaos: the ranks' sessions of {run_dir} could not be read ({e}): reaping by tag only",
                  file=sys.stderr)
    return reap_leftovers(run_dir, sessions)


# ---- the store, read-only ----------------------------------------------------------------------

def _query(db: Path, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
    try:
        conn.row_factory = sqlite3.Row
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def rank_pid(db: Path, role: str) -> tuple[int, int]:
    """(rank, pid) of a live rank holding `role` now; for rollout, one whose engine is up (the other
    may still be starting it: under load one engine can come up a minute after the other)."""
    up = {r[0] for r in _query(db, "SELECT DISTINCT rank FROM events WHERE kind = 'engine_up'")}
    live = [(r["rank"], r["pid"]) for r in _query(
        db, "SELECT rank, pid FROM ranks WHERE role = ? AND state = 'running' ORDER BY rank", (role,))
        if r["pid"] and "tiderl.run.rank" in _cmdline(r["pid"])]
    for rank, pid in sorted(live, key=lambda rp: role == "rollout" and rp[0] not in up):
        return rank, pid
    raise ChaosError(f"no live {role} rank in {db}")


def exactly_once(db: Path) -> dict[str, Any]:
    """Lost and doubled training data at the end of a run, from its store.

    lost: tasks of training groups that are not trained whole: failed by errors, still outstanding
    (open, ready, claimed) at the end, or consumed with fewer trajectories than the group has.
    Groups dropped as too stale (by the trainer, or open by the control plane) are counted apart
    (`dropped_stale`): dropped on purpose.
    twice: consumed trajectories beyond what the versions count, groups trained in more than one
    version, a prompt trained in two groups, a task with two trajectories, an evaluation trained."""
    run = _query(db, "SELECT state, version, message FROM runs WHERE id = 1")[0]
    groups = {g["id"]: g for g in _query(db, "SELECT id, kind, state, size, prompt_seed FROM task_groups")}
    tasks = _query(db, "SELECT id, group_id, state, attempts FROM tasks")
    trajs = _query(db, "SELECT task_id, group_id, kind, state, consumed_version, min_version FROM trajectories")
    counted = sum(v["num_trajectories"] for v in _query(db, "SELECT num_trajectories FROM versions WHERE version > 0"))
    consumed = [t for t in trajs if t["state"] == "consumed"]
    failed_tasks = {t["group_id"] for t in tasks if t["state"] == "failed"}
    # Dropped on purpose: by the trainer at its claim, or by the control plane while still open (a
    # trajectory of the group already older than the bound; its pending tasks then fail with it).
    dropped = {g for (data,) in _query(db, "SELECT data FROM events WHERE kind = 'groups_dropped'")
               for g in json.loads(data or "{}").get("groups", [])}
    by_group: dict[int, list[sqlite3.Row]] = {}
    for t in consumed:
        by_group.setdefault(t["group_id"], []).append(t)
    lost = {"failed": 0, "outstanding": 0, "short": 0}
    dropped_stale = 0
    for gid, g in groups.items():
        if g["kind"] != "train":
            continue
        if g["state"] == "failed":
            if gid in failed_tasks and gid not in dropped:
                lost["failed"] += g["size"]
            else:
                dropped_stale += g["size"]
        elif g["state"] in ("open", "ready", "claimed"):
            lost["outstanding"] += g["size"]
        elif g["state"] == "consumed":
            lost["short"] += max(0, g["size"] - len(by_group.get(gid, [])))
    seeds: dict[int, int] = {}
    for gid in by_group:
        seeds[groups[gid]["prompt_seed"]] = seeds.get(groups[gid]["prompt_seed"], 0) + 1
    twice = {
        "uncounted": max(0, len(consumed) - counted),
        "split_groups": sum(len({t["consumed_version"] for t in ts}) - 1 for ts in by_group.values()),
        "same_prompt": sum(n - 1 for n in seeds.values() if n > 1) * max((g["size"] for g in groups.values()), default=0),
        "same_task": len(trajs) - len({t["task_id"] for t in trajs}),
        "eval_trained": sum(1 for t in consumed if t["kind"] != "train"),
    }
    return {"state": run["state"], "version": run["version"], "message": run["message"] or "",
            "lost": lost, "twice": twice, "dropped_stale": dropped_stale, "consumed": len(consumed),
            "trajectories": len(trajs), "attempts": sum(t["attempts"] for t in tasks),
            "retried": sum(1 for t in tasks if t["attempts"] > 1),
            "stale_trained": sum(1 for t in consumed if t["consumed_version"] - 1 - t["min_version"] > 1),
            "events": {r["kind"]: r["n"] for r in _query(db, "SELECT kind, count(*) AS n FROM events WHERE kind NOT IN "
                                                            "('role', 'engine_up', 'stale_dropped') GROUP BY kind")}}


# ---- watching a run ------------------------------------------------------------------------------

@dataclass
class EnvCounts:
    """The sessions the env servers counted, summed over every server lifetime seen (a restarted
    server counts from zero: its uptime went down)."""
    lifetimes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, url: str, health: dict[str, Any]) -> None:
        seen = self.lifetimes.setdefault(url, [])
        if seen and health.get("uptime_s", 0) >= seen[-1].get("uptime_s", 0):
            seen[-1] = health
        else:
            seen.append(health)

    def total(self, name: str) -> int:
        return sum(int(h.get(name, 0)) for hs in self.lifetimes.values() for h in hs)

    def summary(self) -> str:
        if not self.lifetimes:
            return "env: no /health answer"
        n = sum(len(hs) for hs in self.lifetimes.values())
        return (f"env ({n} server lifetimes): {self.total('num_started')} sessions started, "
                f"{self.total('num_ended')} ended, {self.total('num_failed')} failed, "
                f"{self.total('num_reaped') + self.total('num_expired')} reaped or expired")


class Watcher(threading.Thread):
    """Polls the store's version (the time each new version was first seen) and the env servers' /health."""

    def __init__(self, run_dir: Path, env_urls: Callable[[], list[str]], token_file: Callable[[], Path]) -> None:
        super().__init__(name="chaos-watcher", daemon=True)
        self.db = run_dir / "run.db"
        self.env_urls, self.token_file = env_urls, token_file
        self.seen: dict[int, float] = {}
        self.env = EnvCounts()
        self.halt = threading.Event()

    def run(self) -> None:
        next_health = 0.0
        while not self.halt.wait(POLL_S):
            try:
                version = int(_query(self.db, "SELECT version FROM runs WHERE id = 1")[0][0])
                self.seen.setdefault(version, time.time())
            except (sqlite3.Error, IndexError):
                pass  # not created yet, or busy: the next poll
            if time.monotonic() >= next_health:
                next_health = time.monotonic() + HEALTH_S
                self._health()

    def _health(self) -> None:
        try:
            token = self.token_file().read_text().strip()
            urls = self.env_urls()
        except (OSError, ValueError):
            return
        for url in urls:
            req = urllib.request.Request(url.rstrip("/") + "/health", headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=2.0) as resp:
                    self.env.add(url, json.loads(resp.read()))
            except (OSError, ValueError, http.client.HTTPException):
                continue

    @property
    def version(self) -> int:
        return max(self.seen, default=-1)

    def next_version_after(self, t: float) -> float | None:
        """Seconds from `t` to the first version newer than the one published at `t`."""
        at_t = max((v for v, at in self.seen.items() if at <= t), default=-1)
        later = [at for v, at in self.seen.items() if v > at_t]
        return round(min(later) - t, 1) if later else None

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)


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


# ---- a trial -------------------------------------------------------------------------------

@dataclass
class Trial:
    fault: str
    seed: int
    steps: int
    work_dir: Path
    run_dir: Path
    deadline: float
    stack: ExitStack
    rng: random.Random
    sets: list[str] = field(default_factory=list)
    launcher: subprocess.Popen[bytes] | None = None
    watcher: Watcher | None = None
    env_urls: Callable[[], list[str]] | None = None
    token_file: Path | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def db(self) -> Path:
        return self.run_dir / "run.db"

    @property
    def log(self) -> Path:
        return self.work_dir / "launcher.log"

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def launch(self, *args: str) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "tiderl", "run", *args], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_default_sigint)
        self.stack.callback(stop_process, proc)
        self.launcher = proc
        return proc

    def wait_version(self, version: int) -> None:
        assert self.launcher is not None and self.watcher is not None
        while self.watcher.version < version:
            if self.launcher.poll() is not None:
                raise ChaosError(f"the launcher exited ({self.launcher.returncode}) before version {version}")
            if self.left_s() <= 0:
                raise ChaosError(f"version {version} not reached within the trial's timeout")
            time.sleep(POLL_S)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.left_s()))


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


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("rollout_kill", _kill_rank("rollout"), what="SIGKILL of a rollout rank"),
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
    Fault("store_lock", _lock_store, what=f"store write lock held {LOCK_HOLD_S:.0f} s by an outside connection"),
    Fault("disk_full", _fill_disk, setup=_mount_tmpfs, what=f"run directory's tmpfs full for {DISK_FULL_S:.0f} s"),
    Fault("env_garbage", _garbage, setup=_garbage_setup, what=f"env server answering malformed JSON for {GARBAGE_S:.0f} s"),
)}


def _launcher_lines(log: Path) -> list[str]:
    """The launcher's lines about children that died, restarts, how it stopped, and the last line of
    each traceback it printed (each line once)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keys = ("restarting it", "did not restart", "stopping:", "tiderl run:")
    out: list[str] = []
    for i, line in enumerate(lines):
        is_error = bool(re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt): ", line)) and (
            i + 1 == len(lines) or not lines[i + 1].startswith(("The above", "During handling", "(Background")))
        text = line.strip()[:300]
        if (is_error or any(k in line for k in keys)) and text not in out:
            out.append(text)
    return out[:8]


def run_trial(fault: Fault, *, seed: int, steps: int = 10, timeout_s: float = 1200.0,
              work_root: Path = Path("/tmp/tiderl-chaos"), keep: bool = False,
              model_path: Path | None = None) -> dict[str, Any]:
    """One run with one injected `fault`; returns its result line (see the module docstring)."""
    rng = random.Random(f"{fault.name}:{seed}")
    steps = max(steps, fault.min_steps)
    work_dir = work_root / f"{fault.name}-s{seed}"
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    result: dict[str, Any] = {"fault": fault.name, "seed": seed, "survived": None, "trajectories_lost": None,
                              "consumed_twice": None, "recovery_s": None, "exit_code": None,
                              "run_dir": str(work_dir / "run"), "note": ""}
    with ExitStack() as outer:  # mounts and helper servers: they outlive the run's processes
        trial = Trial(fault.name, seed, steps, work_dir, work_dir / "run", time.monotonic() + timeout_s, outer, rng,
                      sets=base_sets(steps) + list(fault.sets)
                      + ([f"model.path={model_path.resolve()}"] if model_path is not None else []))
        injected = False
        try:
            if fault.setup is not None:
                fault.setup(trial)
            with ExitStack() as inner:  # the run's processes: ended before the store is read
                trial.stack = inner
                inner.callback(lambda: trial.extra.__setitem__("reaped", reap_run(trial.run_dir)))
                injected = _inject_and_wait(trial, fault, result)
        except (ChaosError, sqlite3.Error, OSError, subprocess.SubprocessError) as e:
            # The campaign goes on with the next fault; this one's line says what went wrong.
            trial.notes.append(f"fault not injected: {type(e).__name__}: {e}")
        trial.stack = outer
        if trial.launcher is not None:
            result["exit_code"] = trial.launcher.returncode
        try:
            _fill(result, trial, exactly_once(trial.db), steps, injected)
        except (sqlite3.Error, IndexError) as e:
            result["note"] = "; ".join(trial.notes + [f"run store unreadable: {e}"] + _launcher_lines(trial.log))
        if keep and trial.run_dir != work_dir / "run" and trial.run_dir.exists():  # on the tmpfs: keep a copy
            shutil.copytree(trial.run_dir, work_dir / "run", dirs_exist_ok=True)
    if not keep:
        shutil.rmtree(work_dir, ignore_errors=True)
    return result


def _inject_and_wait(trial: Trial, fault: Fault, result: dict[str, Any]) -> bool:
    """Launch, inject the fault after version 1 or 2 and a random delay, wait for the launcher's end."""
    run_dir, steps = trial.run_dir, trial.steps
    trial.watcher = Watcher(run_dir, trial.env_urls or (lambda: json.loads((run_dir / "env_urls.json").read_text())),
                            lambda: trial.token_file or run_dir / "env.token")
    trial.watcher.start()
    trial.stack.callback(trial.watcher.stop)
    trial.launch("jobs/quickstart.yaml", "--run-dir", str(run_dir), *[a for s in trial.sets for a in ("--set", s)])
    trial.wait_version(1 + trial.rng.randrange(2))
    trial.sleep(trial.rng.uniform(0.0, 2.0))
    at_version, fault_at = trial.watcher.version, time.time()
    trial.notes.append(fault.inject(trial) + f" at v{at_version}")
    fault_at = trial.extra.get("fault_at", fault_at)
    if at_version >= steps:
        trial.notes.append("the run had reached its last version before the fault")
    assert trial.launcher is not None
    try:
        trial.launcher.wait(timeout=trial.left_s())
    except subprocess.TimeoutExpired:
        trial.notes.append("trial timeout: the run was still going; stopped")
    result["recovery_s"] = trial.watcher.next_version_after(fault_at)
    return True


def _fill(result: dict[str, Any], trial: Trial, facts: dict[str, Any], steps: int, injected: bool) -> None:
    lost, twice = sum(facts["lost"].values()), sum(facts["twice"].values())
    result["trajectories_lost"], result["consumed_twice"] = lost, twice
    if injected:
        result["survived"] = facts["state"] == "finished" and facts["version"] == steps and result["exit_code"] == 0
    notes = list(trial.notes)
    notes.append(f"run {facts['state']} at v{facts['version']} of {steps}"
                 + (f" ({facts['message']})" if facts["message"] and facts["state"] != "finished" else ""))
    if lost:
        notes.append("lost: " + ", ".join(f"{k} {v}" for k, v in facts["lost"].items() if v))
    if twice:
        notes.append("twice: " + ", ".join(f"{k} {v}" for k, v in facts["twice"].items() if v))
    if facts["dropped_stale"]:
        notes.append(f"{facts['dropped_stale']} trajectories dropped as too stale (by design, not counted as lost)")
    if facts["stale_trained"]:
        notes.append(f"{facts['stale_trained']} trajectories trained past the staleness bound")
    if facts["events"]:
        notes.append("store events: " + ", ".join(f"{k} x{n}" for k, n in sorted(facts["events"].items())))
    notes.append(f"store: {facts['trajectories']} trajectories ({facts['consumed']} trained), "
                 f"{facts['attempts']} task attempts, {facts['retried']} tasks retried")
    if trial.watcher is not None:
        notes.append(trial.watcher.env.summary())
    if "stopped_rank" in trial.extra:
        notes.append(_zombie(trial.db, trial.extra["stopped_rank"]))
    if trial.extra.get("reaped"):
        notes.append(f"the tool killed {len(trial.extra['reaped'])} processes the run left behind")
    notes += _launcher_lines(trial.log)
    result["note"] = "; ".join(n for n in notes if n)


def _zombie(db: Path, rank: int) -> str:
    """What a rank that was declared dead and came back did afterwards."""
    state = _query(db, "SELECT state FROM ranks WHERE rank = ?", (rank,))[0][0]
    dead_at = _query(db, "SELECT min(ts) FROM events WHERE kind = 'rank_dead' AND rank = ?", (rank,))[0][0]
    if dead_at is None:
        return f"rank {rank} was never declared dead (final state {state})"
    after = _query(db, "SELECT count(*) FROM trajectories WHERE rank = ? AND finished_at > ?", (rank, dead_at))[0][0]
    return f"rank {rank} declared dead, final state {state}; {after} trajectories of it accepted after that"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="Every fault, in the order listed by --fault's help.")
    parser.add_argument("--fault", action="append", default=[], choices=list(FAULTS),
                        help="A fault to inject (repeatable): " + ", ".join(FAULTS))
    parser.add_argument("--seed", type=int, default=0, help="Seeds each trial's fault point (version and delay).")
    parser.add_argument("--steps", type=int, default=10, help="trainer.num_steps of each run.")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="Wall-clock limit of one trial.")
    parser.add_argument("--keep", action="store_true", help="Keep the run directories (else removed after each).")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tiderl-chaos"), help="Where trials run.")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="An already built model for every trial (model.path); default: the job's own, "
                             "built by the first trial that needs it, inside that trial's timeout.")
    args = parser.parse_args(argv)
    names = list(FAULTS) if args.all else args.fault
    if not names:
        parser.error("give --all or at least one --fault")
    # SIGINT (even where a shell started the tool with it ignored), SIGTERM and SIGHUP end the campaign
    # like Ctrl-C: every trial's cleanup runs.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        for name in names:
            print(f"chaos: {name} (seed {args.seed}): {FAULTS[name].what}", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            line = run_trial(FAULTS[name], seed=args.seed, steps=args.steps, timeout_s=args.timeout_s,
                             work_root=args.work_dir, keep=args.keep, model_path=args.model_path)
            print(json.dumps(line), flush=True)
            print(f"chaos: {name} took {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("chaos: interrupted; the trial's processes and mounts are gone", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
