"""Invariants of a finished (or resumed) run, read from its store: shared by the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select

from tiderl.store import RunStore
from tiderl.store.schema import control, events, task_groups, tasks, trajectories, versions


def check_run(run_dir: Path, *, max_staleness: int) -> dict:
    """Assert exactly-once consumption, advancing versions, bounded staleness, boundary-only role switches."""
    store = RunStore.for_run_dir(run_dir)
    try:
        with store.engine.connect() as c:
            vrows = c.execute(select(versions).order_by(versions.c.version)).mappings().all()
            trows = c.execute(select(trajectories.c.id, trajectories.c.task_id, trajectories.c.group_id,
                                     trajectories.c.state, trajectories.c.consumed_version,
                                     trajectories.c.min_version, trajectories.c.kind)).mappings().all()
            groups = {g.id: g for g in c.execute(select(task_groups)).mappings()}
            crows = c.execute(select(control)).mappings().all()
            erows = c.execute(select(events).where(events.c.kind == "role")).mappings().all()
            task_states = [r.state for r in c.execute(select(tasks.c.state))]
        origin = store.fork_origin()
    finally:
        store.close()
    # Versions advance one by one from 0 (a fork's: from the version of the checkpoint it started from, after 0,
    # its base model).
    start = origin.version if origin is not None else 0
    assert [v["version"] for v in vrows] == ([0] + list(range(start + 1, start + len(vrows))) if vrows else [])
    # Exactly once: every consumed trajectory belongs to one version, whose row counts it; one per task.
    consumed = [t for t in trows if t["state"] == "consumed"]
    assert len({t["task_id"] for t in trows}) == len(trows)
    for v in vrows[1:]:
        mine = [t for t in consumed if t["consumed_version"] == v["version"]]
        assert len(mine) == v["num_trajectories"] > 0, f"version {v['version']}"
        # Staleness: versions between generation and training.
        for t in mine:
            assert v["version"] - 1 - t["min_version"] <= max_staleness, (v["version"], dict(t))
        assert v["max_staleness"] <= max_staleness
    assert all(t["kind"] == "train" for t in consumed)
    # A group is trained whole, in one version.
    by_group: dict[int, set] = {}
    for t in consumed:
        by_group.setdefault(t["group_id"], set()).add(t["consumed_version"])
    for gid, vs in by_group.items():
        assert len(vs) == 1
        assert sum(1 for t in consumed if t["group_id"] == gid) == groups[gid]["size"]
    # Role switches only at boundaries: each role a rank takes up is the planned role of a published version.
    plans: dict[tuple[int, int], str] = {(r["version"], r["rank"]): r["role"] for r in crows}
    published = {v["version"] for v in vrows} | {start}
    for e in erows:
        data = json.loads(e["data"])
        assert data["version"] in published
        assert plans[(data["version"], e["rank"])] == data["role"]
    return {"versions": len(vrows) - 1, "consumed": len(consumed), "role_events": len(erows),
            "tasks": len(task_states)}


def shared_memory_left_behind() -> list[str]:
    """Weight-server shared-memory files whose server process has ended (a run must remove its own)."""
    from tiderl.weightsync.shm import left_by_dead

    return [p.name for p in left_by_dead()]
