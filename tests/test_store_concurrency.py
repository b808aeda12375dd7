"""Many processes on one run store, on local disk and on JuiceFS: no lost or duplicated claim,
no `database is locked` reaching a caller, a killed rank's claims come back."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from store_load import LoadSpec, run_load


@pytest.mark.slow
def test_writers_and_claimers_exactly_once(store_dir: Path, tmp_path: Path) -> None:
    # Commits on a FUSE filesystem take tens of ms and queue behind each other: a rank may go several
    # seconds without a successful heartbeat, so the timeout there is longer (production default: 30 s).
    timeout_s = 15.0 if "juicefs" in str(store_dir) else 5.0
    spec = LoadSpec(run_dir=str(store_dir), num_writers=4, num_claimers=2, num_readers=2, num_groups=100,
                    crash_writer=True, heartbeat_timeout_s=timeout_s, deadline_s=240)
    out = run_load(spec, tmp_path)
    # Every worker ended normally (the crashing writer exits 0 on purpose), none died of a lock error.
    assert out["exit_codes"] == [0] * 8, out["exit_codes"]
    claimers = [r for r in out["results"] if r["role"] == "claimer"]
    claimed = [i for r in claimers for i in r["claimed"]]
    assert len(claimed) == len(set(claimed)) == 200, "a trajectory was claimed twice or lost"
    versions = sorted(v for r in claimers for v in r["versions"])
    assert versions == list(range(1, len(versions) + 1))
    db = sqlite3.connect(Path(spec.run_dir) / "run.db")
    states = dict(db.execute("select state, count(*) from tasks group by state").fetchall())
    assert states == {"done": 200}
    n_traj, n_tasks = db.execute("select count(*), count(distinct task_id) from trajectories").fetchone()
    assert n_traj == n_tasks == 200
    consumed = db.execute("select count(*) from trajectories where state='consumed'").fetchone()[0]
    assert consumed == 200
    total = db.execute("select sum(num_trajectories) from versions").fetchone()[0]
    assert total == 200, "a trajectory was counted in two versions"
    dead = db.execute("select rank from ranks where state='dead'").fetchall()
    assert dead == [(0,)], "the killed writer was not declared dead"
    retried = db.execute("select count(*) from tasks where attempts > 1").fetchone()[0]
    assert retried >= 1, "the killed writer's claimed tasks were not redone"
