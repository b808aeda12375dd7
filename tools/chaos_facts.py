"""What the fault campaign (tools/chaos.py) reads of a run: its store (read-only: the live ranks, the
lost and doubled training data at its end, a rank that came back after it was declared dead), its
versions and env servers' session counters as the run goes, and its launcher's log."""

from __future__ import annotations

import http.client
import json
import re
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_procs import ChaosError, _cmdline

POLL_S = 0.25
HEALTH_S = 2.0


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


def _zombie(db: Path, rank: int) -> str:
    """What a rank that was declared dead and came back did afterwards."""
    state = _query(db, "SELECT state FROM ranks WHERE rank = ?", (rank,))[0][0]
    dead_at = _query(db, "SELECT min(ts) FROM events WHERE kind = 'rank_dead' AND rank = ?", (rank,))[0][0]
    if dead_at is None:
        return f"rank {rank} was never declared dead (final state {state})"
    after = _query(db, "SELECT count(*) FROM trajectories WHERE rank = ? AND finished_at > ?", (rank, dead_at))[0][0]
    return f"rank {rank} declared dead, final state {state}; {after} trajectories of it accepted after that"


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


# ---- the launcher's log ----------------------------------------------------------------------

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
