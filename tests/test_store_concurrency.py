"""Many processes on one run store, on local disk, on JuiceFS and on PostgreSQL: no lost or duplicated
claim, no `database is locked` (or serialization failure) reaching a caller, a killed rank's claims come back."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_load import LoadSpec, run_load

from tiderl.store import RunStore


def assert_exactly_once(spec: LoadSpec, out: dict) -> None:
    """Every worker ended normally, every trajectory was claimed and trained once, the killed writer's
    tasks were redone. Read through the store, so the same checks hold for every backend."""
    # The crashing writer exits 0 on purpose; none died of a lock error.
    assert out["exit_codes"] == [0] * len(out["exit_codes"]), out["exit_codes"]
    claimers = [r for r in out["results"] if r["role"] == "claimer"]
    claimed = [i for r in claimers for i in r["claimed"]]
    total = spec.num_groups * spec.group_size
    assert len(claimed) == len(set(claimed)) == total, "a trajectory was claimed twice or lost"
    versions = sorted(v for r in claimers for v in r["versions"])
    assert versions == list(range(1, len(versions) + 1))
    s = RunStore.for_run_dir(Path(spec.run_dir), read_only=True)
    try:
        def one(sql: str) -> list[tuple]:
            return [tuple(r) for r in s.tx.read(lambda c: c.exec_driver_sql(sql).all())]

        assert dict(one("select state, count(*) from tasks group by state")) == {"done": total}
        assert one("select count(*), count(distinct task_id) from trajectories") == [(total, total)]
        assert one("select count(*) from trajectories where state='consumed'") == [(total,)]
        assert one("select sum(num_trajectories) from versions") == [(total,)], "a trajectory counted in two versions"
        assert one("select rank from ranks where state='dead'") == [(0,)], "the killed writer was not declared dead"
        assert one("select count(*) from tasks where attempts > 1")[0][0] >= 1, \
            "the killed writer's claimed tasks were not redone"
    finally:
        s.close()


@pytest.mark.slow
def test_writers_and_claimers_exactly_once(store_dir: Path, tmp_path: Path) -> None:
    # Commits on a FUSE filesystem take tens of ms and queue behind each other: a rank may go several
    # seconds without a successful heartbeat, so the timeout there is longer (production default: 30 s).
    timeout_s = 15.0 if "juicefs" in str(store_dir) else 5.0
    spec = LoadSpec(run_dir=str(store_dir), num_writers=4, num_claimers=2, num_readers=2, num_groups=100,
                    crash_writer=True, heartbeat_timeout_s=timeout_s, deadline_s=240)
    assert_exactly_once(spec, run_load(spec, tmp_path))


@pytest.mark.slow
@pytest.mark.postgres
def test_writers_and_claimers_exactly_once_on_postgresql(pg_server, tmp_path: Path) -> None:
    # Reports commit side by side on PostgreSQL (no run-wide lock): exactly-once comes from the row locks
    # they take (the groups they touch, SKIP LOCKED claims); every lock timeout or deadlock is retried inside
    # the store.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = LoadSpec(run_dir=str(run_dir), num_writers=4, num_claimers=2, num_readers=2, num_groups=100,
                    crash_writer=True, heartbeat_timeout_s=5.0, deadline_s=240, store_url=pg_server.url)
    out = run_load(spec, tmp_path)
    assert_exactly_once(spec, out)
    assert (run_dir / "store.url").read_text().startswith(pg_server.url), "the run directory does not name its store"
    assert not (run_dir / "run.db").exists(), "a SQLite store was made beside the PostgreSQL one"


@pytest.mark.slow
@pytest.mark.postgres
def test_siblings_reported_at_once_by_many_ranks_complete_their_group_once_on_postgresql(pg_server,
                                                                                        tmp_path: Path) -> None:
    """Each writer claims one task at a time, so the tasks of a group of 4 finish on different ranks and
    their reports commit side by side: every group must still complete exactly once (a report that counted
    its siblings before another's commit was visible would leave the group open for good, its trajectories
    never claimed), with every trajectory's advantage written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = LoadSpec(run_dir=str(run_dir), num_writers=6, num_claimers=2, num_readers=1, num_groups=60, group_size=4,
                    tasks_per_claim=1, crash_writer=True, heartbeat_timeout_s=5.0, deadline_s=240,
                    store_url=pg_server.url)
    out = run_load(spec, tmp_path)
    assert_exactly_once(spec, out)
    s = RunStore.for_run_dir(run_dir, read_only=True)
    try:
        split = s.tx.read(lambda c: c.exec_driver_sql(
            "select count(*) from (select group_id from trajectories group by group_id "
            "having count(distinct rank) > 1) g").scalar())
        assert split > 0, "no group was finished by more than one rank: the test did not race"
        assert s.tx.read(lambda c: c.exec_driver_sql(
            "select count(*) from trajectories where advantage is null").scalar()) == 0
    finally:
        s.close()
