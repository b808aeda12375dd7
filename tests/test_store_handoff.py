"""A task released with its progress is carried on once: the next claim gets the progress, a
claim after that (its claimer died) starts the task afresh."""

from __future__ import annotations

from pathlib import Path

from tiderl.config.store import StoreConfig
from tiderl.rundir import open_run
from tiderl.store import RunStore
from tiderl.store.types import NewGroup, RankReport, Role, TaskKind


def new_store(run_dir: Path, url: str | None = None) -> RunStore:
    store = RunStore.for_run_dir(run_dir, StoreConfig(url=url))
    store.create_schema()
    store.init_run(name="t", system="tiderl", config_yaml="")
    return store


def test_progress_goes_to_exactly_the_next_claim(tmp_path: Path, store_url: str | None) -> None:
    store = new_store(tmp_path, store_url)
    store.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    for r in (0, 1, 2):
        store.register_rank(r, Role.ROLLOUT)
    first = store.claim_tasks(0, 2)
    progress = {"session_id": "s1", "server": "http://env:1", "token_ids": [1, 2], "loss_mask": [0, 1],
                "logprobs": [0.0, -0.5], "versions": [-1, 0], "num_prompt_tokens": 1, "num_turns": 1}
    # Only tasks released in the same report may carry progress; task 2 stays with rank 0.
    store.report(RankReport(rank=0, released=[first[0].task_id],
                            handed_over={first[0].task_id: progress, first[1].task_id: progress}))
    again = store.claim_tasks(1, 2)
    assert [(c.task_id, c.progress) for c in again] == [(first[0].task_id, progress)]
    assert again[0].attempts == 1  # a hand-over is not a failed attempt
    store.reclaim_expired(0.0, now=10**12)  # every rank dies...
    store.register_rank(2, Role.ROLLOUT)  # ...and rank 2 starts afresh
    third = store.claim_tasks(2, 2)
    assert sorted(c.task_id for c in third) == [c.task_id for c in first]
    assert all(c.progress is None for c in third)


def test_tasks_held_by_a_rank_that_left_rollout_come_back(tmp_path: Path, store_url: str | None) -> None:
    store = new_store(tmp_path, store_url)
    store.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    store.register_rank(0, Role.ROLLOUT)
    store.claim_tasks(0, 2)
    store.report(RankReport(rank=0, role=Role.REF))  # switched to ref without releasing them
    assert store.reclaim_expired(30.0).tasks_returned == 0  # within the grace period
    store.tx.write(lambda c: c.exec_driver_sql("update tasks set updated_at = updated_at - 100"))
    result = store.reclaim_expired(30.0)
    assert result.dead_ranks == [] and result.tasks_returned == 2  # the rank lives on as ref
    assert store.buffer_state().tasks_pending == 2
    assert [c.attempts for c in store.claim_tasks(0, 2)] == [1, 1]


def test_a_store_from_an_earlier_version_gains_the_new_columns(tmp_path: Path, store_url: str | None) -> None:
    store = new_store(tmp_path, store_url)
    store.tx.write(lambda c: c.exec_driver_sql("alter table tasks drop column progress"))
    store.tx.write(lambda c: c.exec_driver_sql("alter table control drop column fetch_groups"))
    store.close()
    (tmp_path / "config.yaml").write_text("")
    _, reopened = open_run(tmp_path)
    assert reopened.upgrade_schema() == []  # already done by open_run
    reopened.plan_roles(0, {0: Role.ACTOR}, fetch_groups=3)
    assert reopened.plan_at(0).fetch_groups == 3
    reopened.add_groups([NewGroup(TaskKind.TRAIN, 1, 1)])
    reopened.register_rank(1, Role.ROLLOUT)
    assert reopened.claim_tasks(1, 1)[0].progress is None


def test_whereabouts_of_running_tasks_reach_the_diagnosis(tmp_path: Path, store_url: str | None) -> None:
    from tiderl.store.types import TaskWhereabouts

    store = new_store(tmp_path, store_url)
    store.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    store.register_rank(3, Role.ROLLOUT)
    a, b = store.claim_tasks(3, 2)
    store.report(RankReport(rank=3, whereabouts=[
        TaskWhereabouts(a.task_id, turn=4, phase="env", phase_since=1000.0, env_server="http://env-7:8000"),
        TaskWhereabouts(b.task_id, turn=1, phase="generate", phase_since=1090.0)]))
    store.report(RankReport(rank=9, whereabouts=[  # not the owner: ignored
        TaskWhereabouts(b.task_id, turn=9, phase="paused", phase_since=0.0)]))
    rows = {t["id"]: t for g in store.reader.outstanding_groups() for t in g["unfinished"]}
    assert (rows[a.task_id]["turn"], rows[a.task_id]["phase"], rows[a.task_id]["env_server"]) == (
        4, "env", "http://env-7:8000")
    assert (rows[b.task_id]["turn"], rows[b.task_id]["phase"]) == (1, "generate")
    store.report(RankReport(rank=3, released=[a.task_id]))
    store.register_rank(4, Role.ROLLOUT)
    store.claim_tasks(4, 1)
    rows = {t["id"]: t for g in store.reader.outstanding_groups() for t in g["unfinished"]}
    assert rows[a.task_id]["phase"] is None and rows[a.task_id]["owner_rank"] == 4  # a new claim starts afresh
