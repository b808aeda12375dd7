"""Run store semantics: claims, group readiness, exactly-once publishing, reclaim of dead ranks."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from tiderl.config.store import StoreConfig
from sqlalchemy import select

from tiderl.store import (
    ClaimRequest,
    RankDeclaredDeadError,
    ClaimLostError,
    FinishedTrajectory,
    NewGroup,
    RankReport,
    Role,
    RunStore,
    StoreError,
    TaskFailure,
    TaskKind,
    VersionRecord,
)
from tiderl.store.codec import pack_floats, pack_ints, unpack_floats, unpack_ints
from tiderl.store.schema import trajectories


def make_store(d: Path, **kw: object) -> RunStore:
    s = RunStore.for_run_dir(d, StoreConfig(**kw))
    s.create_schema()
    s.init_run(name="t", system="tiderl", config_yaml="system: tiderl\n")
    s.register_initial_version("weights/v0", "sum0")
    for r, role in enumerate([Role.ROLLOUT, Role.ROLLOUT, Role.ACTOR]):
        s.register_rank(r, role)
    return s


def traj(task_id: int, reward: float, n: int = 6) -> FinishedTrajectory:
    mask = [0, 0] + [1] * (n - 2)
    return FinishedTrajectory(task_id=task_id, token_ids=list(range(n)), loss_mask=mask,
                              logprobs=[-0.5 * m for m in mask], token_versions=[0 if m else -1 for m in mask],
                              num_turns=2, reward=reward, success=reward > 0)


def finish(s: RunStore, rank: int, claims: list, rewards: list[float]) -> dict[str, int]:
    return s.report(RankReport(rank=rank, finished=[traj(c.task_id, r) for c, r in zip(claims, rewards)]))


def test_codec_round_trip() -> None:
    assert unpack_ints(pack_ints([1, -1, 2**31 - 1])) == [1, -1, 2**31 - 1]
    assert unpack_floats(pack_floats([0.5, -1.25])) == [0.5, -1.25]


def test_journal_mode_local_is_wal(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    assert sqlite3.connect(tmp_path / "run.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()


@pytest.mark.juicefs
def test_journal_mode_on_juicefs_is_rollback(juicefs_dir: Path) -> None:
    d = juicefs_dir / "jm"
    d.mkdir()
    s = make_store(d)
    assert sqlite3.connect(d / "run.db").execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    s.close()


def test_claims_are_exclusive_and_group_becomes_ready_with_advantages(store_dir: Path) -> None:
    s = make_store(store_dir)
    s.add_groups([NewGroup(TaskKind.TRAIN, 11, 2), NewGroup(TaskKind.TRAIN, 12, 2)])
    a = s.claim_tasks(0, 3)
    b = s.claim_tasks(1, 3)
    assert [c.task_id for c in a] == [1, 2, 3] and [c.task_id for c in b] == [4]
    assert s.claim_tasks(1, 3) == []
    finish(s, 0, a[:2], [1.0, 0.0])
    buf = s.buffer_state()
    assert buf.traj_ready == 2 and buf.groups_ready == 1
    got = s.claim_ready_groups(2, 10)
    assert sorted(t.reward for t in got) == [0.0, 1.0]
    adv = {t.reward: t.advantage for t in got}
    assert adv[1.0] == pytest.approx(0.7071, abs=1e-3) and adv[0.0] == pytest.approx(-0.7071, abs=1e-3)
    assert got[0].loss_mask == [0, 0, 1, 1, 1, 1] and got[0].logprobs[2] == -0.5
    s.close()


def test_group_waits_for_all_tasks(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 3)])
    c = s.claim_tasks(0, 3)
    finish(s, 0, c[:2], [1.0, 0.0])
    assert s.buffer_state().traj_waiting_group == 2
    assert s.claim_ready_groups(2, 5) == []
    finish(s, 0, c[2:], [1.0])
    assert len(s.claim_ready_groups(2, 5)) == 3


def test_publish_consumes_exactly_once_and_records_step(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    finish(s, 0, s.claim_tasks(0, 2), [1.0, 0.0])
    got = s.claim_ready_groups(2, 5)
    ids = [t.id for t in got]
    s.publish_version(VersionRecord(version=1, path="weights/v1", checksum="x", trajectory_ids=ids,
                                    step_started_at=0.0, duration_s=2.0, ras=1, tprm_s=0.5, ra2p_mode="colocated"),
                      owner=2)
    (step,) = s.steps()
    assert step["consumed_tokens"] == 8 and step["goodput_tok_s"] == 4.0 and step["success_rate"] == 0.5
    assert step["max_staleness"] == 0
    with pytest.raises(ClaimLostError):
        s.publish_version(VersionRecord(version=2, path="weights/v2", checksum="y", trajectory_ids=ids,
                                        step_started_at=0.0, duration_s=1.0), owner=2)
    assert s.run_info().version == 1


def test_version_must_follow_the_last(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    with pytest.raises(StoreError, match="version 3 published after 0"):
        s.publish_version(VersionRecord(version=3, path="p", checksum="c", trajectory_ids=[], step_started_at=0,
                                        duration_s=1), owner=2)


def test_dead_rank_claims_return_and_late_report_is_dropped(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.TRAIN, 2, 2)])
    mine = s.claim_tasks(0, 2)
    finish(s, 1, s.claim_tasks(1, 2), [1.0, 0.0])
    held = s.claim_ready_groups(2, 1)
    assert len(held) == 2
    import time

    later = time.time() + 100
    s.heartbeat(1)
    res = s.reclaim_expired(50, now=later)
    assert sorted(res.dead_ranks) == [0, 1, 2]
    assert res.tasks_returned == 2 and res.trajectories_returned == 2
    # The dead rank's late report must not create duplicates: the tasks went back to the pool, and the
    # process that was declared dead is told so (the whole tick refused).
    with pytest.raises(RankDeclaredDeadError, match="rank 0 .*declared dead"):
        finish(s, 0, mine, [1.0, 1.0])
    assert s.buffer_state().tasks_pending == 2
    s.register_rank(1, Role.ROLLOUT)
    again = s.claim_tasks(1, 5)
    assert sorted(c.task_id for c in again) == sorted(c.task_id for c in mine)
    assert all(c.attempts == 2 for c in again)
    with pytest.raises(ClaimLostError):
        s.publish_version(VersionRecord(version=1, path="p", checksum="c", trajectory_ids=[t.id for t in held],
                                        step_started_at=0, duration_s=1), owner=2)
    assert len(s.claim_ready_groups(2, 5)) == 2
    kinds = [e for e in s.tx.read(lambda c: c.exec_driver_sql("select kind from events").all())]
    assert len(kinds) == 3


def test_ranks_declared_dead_at_a_resume_say_why_not_a_silence(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    s.claim_tasks(0, 2)
    dead = s.reclaim_expired(0.0, reason="was not running when the run resumed").dead_ranks
    assert 0 in dead
    assert sorted(e["message"] for e in s.recent_events(kinds=["rank_dead"])) == [
        f"rank {r} was not running when the run resumed; its claims returned to the pool" for r in sorted(dead)]


def test_failed_task_retries_then_fails_its_group(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    for attempt in range(1, 4):
        (c, *_rest) = s.claim_tasks(0, 1)
        assert c.attempts == attempt
        s.report(RankReport(rank=0, failed=[TaskFailure(c.task_id, "env server http://x:1 said 500")]),
                 max_attempts=3)
    buf = s.buffer_state()
    assert buf.tasks_failed == 2 and buf.tasks_pending == 0


def test_a_failed_task_waits_its_backoff_doubling_with_each_failure(tmp_path: Path, store_url: str | None,
                                                                    monkeypatch) -> None:
    import tiderl.store.rank_side as rs

    clock = [1000.0]
    monkeypatch.setattr(rs.time, "time", lambda: clock[0])
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 1)])
    waits = []
    for _ in range(3):
        (c,) = s.claim_tasks(0, 1)
        s.report(RankReport(rank=0, failed=[TaskFailure(c.task_id, "boom")]), max_attempts=5, retry_backoff_s=2.0)
        start = clock[0]
        while not (again := s.claim_tasks(1, 1)):
            clock[0] += 0.5
        waits.append(clock[0] - start)
        s.report(RankReport(rank=1, released=[again[0].task_id]))  # back, no attempt counted
    assert waits == [2.0, 4.0, 8.0]


def test_tasks_of_a_failed_group_never_go_back_to_pending(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 3)])
    a, b, c = s.claim_tasks(0, 3)
    s.report(RankReport(rank=0, failed=[TaskFailure(a.task_id, "boom")]), max_attempts=1)  # the group fails
    s.report(RankReport(rank=0, failed=[TaskFailure(b.task_id, "boom too")], released=[c.task_id]), max_attempts=3)
    buf = s.buffer_state()
    assert buf.tasks_pending == 0 and buf.tasks_failed == 3
    assert s.claim_tasks(1, 3) == []


def test_released_tasks_go_back_without_counting_an_attempt(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    c = s.claim_tasks(0, 2)
    s.report(RankReport(rank=0, released=[x.task_id for x in c]))
    again = s.claim_tasks(1, 2)
    assert [x.attempts for x in again] == [1, 1]


def test_eval_groups_are_recorded_never_trained(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.EVAL, 5, 2, eval_version=0)])
    finish(s, 0, s.claim_tasks(0, 2), [1.0, 0.0])
    assert s.claim_ready_groups(2, 5) == []
    (ev,) = s.view("eval_summary")
    assert ev["eval_version"] == 0 and ev["success_rate"] == 0.5


def test_roles_at_uses_latest_record_per_rank(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.plan_roles(0, {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.ACTOR})
    s.plan_roles(3, {1: Role.REF}, ra2p_mode="decoupled", reason="consumption deficit")
    assert s.roles_at(2) == {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.ACTOR}
    assert s.roles_at(3) == {0: Role.ROLLOUT, 1: Role.REF, 2: Role.ACTOR}
    roles = {r["rank"]: r["planned_role"] for r in s.view("rank_roles")}
    assert roles == {0: "rollout", 1: "ref", 2: "actor"}


def test_a_retry_after_a_cut_off_commit_claims_and_publishes_nothing_twice(tmp_path: Path, store_url: str | None,
                                                                           monkeypatch) -> None:
    """A COMMIT whose answer was lost (the server went away) is retried not knowing it went through: every
    write runs twice here, and nothing is claimed, accepted or published twice."""
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.TRAIN, 2, 2)])
    write = s.tx.write
    monkeypatch.setattr(s.tx, "write", lambda fn, **kw: (write(fn, **kw), write(fn, **kw))[1])
    a = s.claim_tasks(0, 2)
    assert [c.task_id for c in a] == [1, 2] and [c.attempts for c in a] == [1, 1]
    out = s.report(RankReport(rank=0, finished=[traj(c.task_id, r) for c, r in zip(a, [1.0, 0.0])],
                              claim=ClaimRequest(limit=2)))
    assert (out["accepted"], out["dropped"]) == (2, 0) and [c.task_id for c in out["claims"]] == [3, 4]
    got = s.claim_ready_groups(2, 5)
    assert sorted(t.task_id for t in s.tx.read(lambda c: c.execute(
        select(trajectories.c.task_id).where(trajectories.c.claim_owner == 2)).all())) == [1, 2]
    record = VersionRecord(version=1, path="weights/v1", checksum="x", trajectory_ids=[t.id for t in got],
                           step_started_at=0.0, duration_s=1.0)
    s.publish_version(record, owner=2)
    assert s.run_info().version == 1 and len(s.measure.version_rows()) == 2
    buf = s.buffer_state()
    assert buf.traj_consumed == 2 and buf.tasks_running == 2 and buf.tasks_pending == 0
    s.close()


def test_trajectory_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="task 7: logprobs has 1 entries, token_ids has 2"):
        FinishedTrajectory(task_id=7, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0], token_versions=[0, 0],
                           num_turns=1, reward=0.0, success=False)


def test_non_busy_errors_name_the_database(tmp_path: Path, store_url: str | None) -> None:
    s = RunStore.for_run_dir(tmp_path, StoreConfig(url=store_url))  # no schema created
    where = str(tmp_path) if store_url is None else f"{store_url.split('?')[0]}, schema run_"
    with pytest.raises(StoreError, match=re.escape(where)):
        s.run_info()


def test_a_spread_claim_takes_the_ranks_share_of_the_tasks_in_flight(tmp_path: Path) -> None:
    s = make_store(tmp_path)  # two rollout ranks, one actor
    s.add_groups([NewGroup(TaskKind.TRAIN, g, 4) for g in range(5)])  # 20 tasks
    spread = ClaimRequest(limit=64, spread=True)
    first = s.report(RankReport(rank=0, role=Role.ROLLOUT, claim=spread))["claims"]
    assert len(first) == 10  # half of the 20 in flight, not all 20
    assert s.report(RankReport(rank=0, role=Role.ROLLOUT, claim=spread))["claims"] == []  # at its share
    assert len(s.report(RankReport(rank=1, role=Role.ROLLOUT, claim=spread))["claims"]) == 10
    s.add_groups([NewGroup(TaskKind.TRAIN, 9, 2)])  # 22 in flight: 11 each
    assert len(s.report(RankReport(rank=0, role=Role.ROLLOUT, claim=spread))["claims"]) == 1
    # Without spread, the free slots alone (the default for callers that are not rollout ranks' ticks).
    assert len(s.claim_tasks(1, 64)) == 1
    s.close()


def _statements(s: RunStore) -> list[str]:
    """The SQL statements `s` sends from now on (an executemany counts once)."""
    from sqlalchemy import event

    sent: list[str] = []
    event.listen(s.engine, "before_cursor_execute", lambda *a: sent.append(a[2].split(None, 1)[0].upper()))
    return sent


def test_a_typical_tick_is_seven_statements(tmp_path: Path, store_url: str | None) -> None:
    """A rank's tick (its heartbeat, one finished trajectory that completes no group, a metric, the claim of
    one task) is one transaction of 7 statements: the lock (SQLite: the write lock; PostgreSQL: the rows of
    the groups it touches), the heartbeat, the task marked done and found owned (one UPDATE ... RETURNING),
    the trajectory, the group-completion check, the claim (one WITH ... UPDATE ... RETURNING), the metric. A
    tick with nothing finished and nothing to claim is the heartbeat (and SQLite's write lock)."""
    from tiderl.store import MetricPoint

    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 4)])
    (held,) = s.claim_tasks(0, 1)
    sent = _statements(s)
    out = s.report(RankReport(rank=0, role=Role.ROLLOUT, version=0, finished=[traj(held.task_id, 1.0)],
                              metrics=[MetricPoint("rollout_busy_s", 1.0, 0, "rollout")],
                              claim=ClaimRequest(limit=1, weights_version=0)))
    assert (out["accepted"], out["dropped"]) == (1, 0) and [c.task_id for c in out["claims"]] == [2]
    assert len(sent) == 7, sent
    assert sent.count("UPDATE") == 2 and sent.count("WITH") == 1 and sent.count("INSERT") == 2
    assert sent[-1] == "INSERT"  # the metric last: after every statement that may wait on a lock
    sent.clear()
    s.report(RankReport(rank=1, role=Role.ROLLOUT, version=0))
    assert len(sent) == (1 if s.dialect == "postgresql" else 2), sent  # the heartbeat (and the write lock)
    s.close()


def test_a_claim_returns_eval_version_and_carries_progress_on_once(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.EVAL, 7, 1, eval_version=0)])
    first = s.report(RankReport(rank=0, claim=ClaimRequest(limit=3)))["claims"]
    assert [(c.task_id, c.kind, c.eval_version, c.attempts) for c in first] == [  # in task order
        (1, TaskKind.TRAIN, None, 1), (2, TaskKind.TRAIN, None, 1), (3, TaskKind.EVAL, 0, 1)]
    s.report(RankReport(rank=0, released=[1, 2], handed_over={1: {"turn": 3}}))
    again = s.report(RankReport(rank=1, claim=ClaimRequest(limit=5)))["claims"]
    assert [(c.task_id, c.progress) for c in again] == [(1, {"turn": 3}), (2, None)]
    s.report(RankReport(rank=1, released=[1]))
    (third,) = s.report(RankReport(rank=0, claim=ClaimRequest(limit=1)))["claims"]
    assert (third.task_id, third.progress) == (1, None)  # carried on once, not twice
    s.close()


def test_a_task_reported_twice_in_one_tick_counts_once(tmp_path: Path, store_url: str | None) -> None:
    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    a, b = s.claim_tasks(0, 2)
    out = s.report(RankReport(rank=0, finished=[traj(a.task_id, 1.0), traj(a.task_id, 1.0)]))
    assert (out["accepted"], out["dropped"]) == (1, 0)
    out = s.report(RankReport(rank=1, finished=[traj(b.task_id, 0.0)]))  # not rank 1's task
    assert (out["accepted"], out["dropped"]) == (0, 1)
    assert s.buffer_state().tasks_running == 1
    s.close()


def test_open_groups_holding_a_trajectory_older_than_the_bound_are_dropped(tmp_path: Path,
                                                                            store_url: str | None) -> None:
    """drop_doomed_groups: an open training group that already holds a trajectory generated before the
    bound can never be trained; it fails now (not after its other tasks were generated), its pending
    tasks fail, a task its rank still plays fails at release and its late trajectory revives nothing."""
    import json

    from tiderl.store.schema import events, task_groups, tasks

    s = make_store(tmp_path, url=store_url)
    s.add_groups([NewGroup(TaskKind.TRAIN, seed, 3) for seed in (1, 2, 3)])
    claims = s.claim_tasks(0, 9)
    by_group: dict[int, list] = {}
    for c in claims:
        by_group.setdefault(c.group_id, []).append(c)
    old, fresh, untouched = sorted(by_group)

    def at(claim, version: int) -> FinishedTrajectory:
        return FinishedTrajectory(task_id=claim.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                                  logprobs=[0.0, -1.0, -1.0], token_versions=[-1, version, version + 1], num_turns=1,
                                  reward=1.0, success=True)

    s.report(RankReport(rank=0, finished=[at(by_group[old][0], 1), at(by_group[fresh][0], 2)],
                        released=[by_group[old][1].task_id]))  # one task of the old group back to pending
    assert s.drop_doomed_groups(2, "older than version 2") == [old]
    assert s.drop_doomed_groups(2, "older than version 2") == []  # once
    rows = s.tx.read(lambda c: c.execute(select(tasks.c.group_id, tasks.c.state, tasks.c.last_error)).all())
    states = {(g, st) for g, st, _ in rows}
    assert (old, "failed") in states and (old, "pending") not in states  # the released task will not restart
    assert {st for g, st, _ in rows if g in (fresh, untouched)} <= {"running", "done"}
    assert any("older than version 2" in (e or "") for g, _, e in rows if g == old)
    # The task still running in the dropped group: its trajectory is accepted but makes no ready group.
    s.report(RankReport(rank=0, finished=[at(by_group[old][2], 3)]))
    assert s.tx.read(lambda c: c.execute(select(task_groups.c.state).where(task_groups.c.id == old)).scalar_one()) \
        == "failed"
    event = s.tx.read(lambda c: c.execute(select(events.c.data).where(events.c.kind == "groups_dropped")).all())
    assert [json.loads(d)["groups"] for (d,) in event] == [[old]]
    assert s.measure.dropped_groups() == [old]
    assert s.claim_ready_groups(2, 10) == []
