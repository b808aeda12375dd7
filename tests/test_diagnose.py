"""The diagnosis (tiderl/observe/diagnose.py) on built snapshots with a known story: one test per invariant."""

from __future__ import annotations

from dataclasses import replace

from tiderl.observe.diagnose import diagnose
from tiderl.observe.diagnose_types import (EnvServerView, EventView, GroupView, Kind, Limits, RankStatusView, Severity,
                                           SlurmJobView, Snapshot, TaskView)

LIMITS = Limits(num_ranks=4, num_steps=30, max_staleness=1, groups_ideal=4, feed_cap_groups=8, max_concurrency=16,
                heartbeat_s=2.0, heartbeat_timeout_s=30.0, stall_after_s=600.0, slow_task_s=60.0,
                rwt_window_s=30.0)


def rank(r: int, role: str, *, age: float = 0.5, state: str = "running", **kw: object) -> RankStatusView:
    return RankStatusView(rank=r, role=role, state=state, version=7, heartbeat_age_s=age, **kw)


def group(gid: int, *, done: int, size: int = 4, state: str = "open", tasks: tuple[TaskView, ...] = ()) -> GroupView:
    return GroupView(group_id=gid, kind="train", state=state, size=size, num_done=done, unfinished=tasks)


def running(tid: int, gid: int, owner: int, seconds: float, **kw: object) -> TaskView:
    return TaskView(task_id=tid, group_id=gid, state="running", owner_rank=owner, running_s=seconds,
                    **({"attempts": 1} | kw))  # type: ignore[arg-type]


def healthy_ranks() -> tuple[RankStatusView, ...]:
    return (rank(0, "actor"), rank(1, "rollout", running_tasks=3), rank(2, "rollout", running_tasks=2),
            rank(3, "ref"))


def snap(**kw: object) -> Snapshot:
    base = dict(state="running", version=7, since_progress_s=20.0, limits=LIMITS, ranks=healthy_ranks(),
                fetch_groups=3, ra2p_mode="decoupled")
    return Snapshot(**(base | kw))  # type: ignore[arg-type]


def kinds(d: object) -> list[Kind]:
    return [f.kind for f in d.findings]  # type: ignore[attr-defined]


# ---- the stories of the issue ------------------------------------------------------------------------
def test_stuck_environment_turn_is_named_with_server_and_seconds() -> None:
    stuck = running(57, 9, 2, 130.0, turn=4, phase="env", phase_s=95.0, env_server="http://node3:8100")
    groups = (group(9, done=3, tasks=(stuck,)),
              group(10, done=2, tasks=(running(61, 10, 1, 12.0), running(62, 10, 1, 8.0))),
              group(11, done=1, tasks=(running(65, 11, 1, 40.0), TaskView(66, 11, "pending"),
                                      TaskView(67, 11, "pending"))),
              group(12, done=0, tasks=tuple(TaskView(70 + i, 12, "pending") for i in range(4))))
    d = diagnose(snap(groups=groups, since_progress_s=700.0))
    assert "waits for 3 more" in d.trainer and "3 incomplete groups" in d.trainer
    assert "environment turn 4 for 95 s on env server http://node3:8100" in d.trainer
    assert d.is_stalled and d.culprit is not None and d.culprit.kind is Kind.SLOW_TASK
    assert d.culprit.data["env_server"] == "http://node3:8100" and d.culprit.rank == 2
    assert "task 57 (group 9)" in d.culprit.message


def test_without_turn_records_the_claim_age_is_used() -> None:
    groups = (group(9, done=3, tasks=(running(57, 9, 2, 95.0),)),)
    d = diagnose(snap(groups=groups, fetch_groups=1))
    assert "the slowest task has been running on rank 2 for 95 s" in d.trainer
    assert Kind.SLOW_TASK in kinds(d)


def test_dead_rank_and_missed_heartbeats_are_reported() -> None:
    ranks = (rank(0, "actor"), rank(1, "rollout", age=45.0, state="dead"), rank(2, "rollout", age=9.0),
             rank(3, "rollout", age=1.0))
    events = (EventView("rank_dead", 14.0, "rank 1 missed heartbeats for 30 s", rank=1),)
    d = diagnose(snap(ranks=ranks, events=events))
    dead = next(f for f in d.findings if f.kind is Kind.RANK_DEAD)
    assert dead.rank == 1 and "declared dead 14 s ago" in dead.message
    silent = next(f for f in d.findings if f.kind is Kind.RANK_SILENT)
    assert silent.rank == 2 and silent.data["missed_heartbeats"] == 4
    assert "missed 4 heartbeats" in silent.message


def test_staleness_held_rollout_ranks() -> None:
    full = tuple(group(g, done=4, state="ready") for g in range(1, 3)) + tuple(
        group(g, done=1, tasks=(running(100 + g, g, 1, 3.0),)) for g in range(3, 9))
    ranks = (rank(0, "actor"), rank(1, "rollout", running_tasks=6, rwt_recent_s=0.0),
             rank(2, "rollout", running_tasks=0, rwt_recent_s=27.0), rank(3, "rollout", running_tasks=0,
                                                                          rwt_recent_s=30.0))
    d = diagnose(snap(groups=full, ranks=ranks, ra2p_mode="colocated"))
    held = next(f for f in d.findings if f.kind is Kind.ROLLOUT_HELD)
    assert held.data["ranks"] == [2, 3] and held.data["outstanding_groups"] == 8
    assert "2 rollout ranks 2, 3 are held by the staleness bound" in held.message
    assert "2 held by the staleness bound" in d.rollout


# ---- invariants ---------------------------------------------------------------------------------------
def test_inv1_a_run_that_is_over_is_never_stalled() -> None:
    for state in ("finished", "failed", "cancelled"):
        d = diagnose(snap(state=state, since_progress_s=10_000.0, message="rank1 exited with code 1"))
        assert not d.is_stalled
        assert d.needs_attention == (state == "failed")
    failed = diagnose(snap(state="failed", message="rank1 exited with code 1"))
    assert failed.findings[0].kind is Kind.RUN_FAILED and failed.findings[0].severity is Severity.ERROR
    assert failed.culprit is failed.findings[0]


def test_inv2_stalled_iff_no_version_for_longer_than_the_limit_and_always_a_culprit() -> None:
    assert not diagnose(snap(since_progress_s=599.0)).is_stalled
    d = diagnose(snap(since_progress_s=601.0))
    assert d.is_stalled and d.needs_attention
    assert d.culprit is not None  # nothing specific: the stall itself, pointing at the logs
    assert d.findings[0].kind is Kind.STALLED and "logs" in d.findings[0].message
    starting = diagnose(snap(state="starting", version=0, since_progress_s=601.0, ranks=()))
    assert starting.is_stalled and starting.culprit is not None


def test_inv3_trainer_names_missing_groups_and_slowest_task() -> None:
    groups = (group(1, done=4, state="claimed"), group(2, done=4, state="ready"),
              group(3, done=2, tasks=(running(9, 3, 1, 20.0), running(10, 3, 2, 50.0, attempts=2))),
              group(4, done=0, tasks=tuple(TaskView(20 + i, 4, "pending") for i in range(4))))
    d = diagnose(snap(groups=groups, fetch_groups=3))
    assert "holds 1 of 3 groups (1 ready) and waits for 1 more" in d.trainer
    assert "1 incomplete group (2 of 4 tasks done, 2 running, 0 not started)" in d.trainer
    assert "running on rank 2 for 50 s, attempt 2" in d.trainer
    has_data = diagnose(snap(groups=(group(1, done=4, state="claimed"),) * 3, fetch_groups=3,
                             ranks=(rank(0, "actor", claimed_age_s=12.0),) + healthy_ranks()[1:]))
    assert "holds its 3 groups and is training for 12 s" in has_data.trainer


def test_inv4_heartbeats_within_two_periods_are_fine() -> None:
    d = diagnose(snap(ranks=(rank(0, "actor", age=3.9), rank(1, "rollout", age=4.1), rank(2, "rollout"),
                             rank(3, "ref"))))
    assert [f.rank for f in d.findings if f.kind is Kind.RANK_SILENT] == [1]


def test_inv5_waiting_below_the_bound_is_not_staleness() -> None:
    few = (group(1, done=1, tasks=(running(5, 1, 1, 3.0),)),)
    ranks = (rank(0, "actor"), rank(1, "rollout", running_tasks=1), rank(2, "rollout", rwt_recent_s=20.0))
    d = diagnose(snap(groups=few, ranks=ranks))
    assert Kind.ROLLOUT_HELD not in kinds(d)
    assert Kind.ROLLOUT_NO_WORK in kinds(d)
    last = tuple(group(g, done=1, tasks=(running(g, g, 1, 3.0),)) for g in range(1, 5))
    end = diagnose(snap(groups=last, ranks=ranks, version=29, fetch_groups=4))  # the last step: all fed
    assert Kind.ROLLOUT_NO_WORK not in kinds(end) and "every remaining training group is fed" in end.rollout


def test_inv6_culprit_order_and_severity_order() -> None:
    groups = (group(9, done=3, tasks=(running(57, 9, 2, 400.0),)),)
    ranks = (rank(0, "actor", age=50.0, state="dead"), rank(1, "rollout"), rank(2, "rollout"))
    d = diagnose(snap(groups=groups, ranks=ranks, since_progress_s=900.0))
    assert d.culprit is not None and d.culprit.kind is Kind.ACTOR_DOWN
    assert "no live actor: rank 0 is dead" == d.trainer
    order = [f.severity for f in d.findings]
    assert order == sorted(order, key=[Severity.ERROR, Severity.WARNING, Severity.INFO].index)
    ref_dead = (rank(0, "actor", claimed_age_s=5.0), rank(1, "rollout"), rank(3, "ref", age=40.0, state="dead"))
    d2 = diagnose(snap(groups=(group(1, done=4, state="claimed"),) * 3, ranks=ref_dead, since_progress_s=900.0))
    assert d2.culprit is not None and d2.culprit.kind is Kind.REF_DOWN and d2.culprit.rank == 3
    assert "waiting for ref rank 3" in d2.trainer


def test_no_rollout_rank_for_pending_tasks() -> None:
    groups = (group(1, done=0, tasks=tuple(TaskView(i, 1, "pending") for i in range(4))),)
    d = diagnose(snap(groups=groups, ranks=(rank(0, "actor"), rank(1, "rollout", state="dead", age=99.0))))
    assert Kind.NO_ROLLOUT in kinds(d) and "no live rollout rank" in d.rollout


def test_env_server_down_and_slurm_job_gone() -> None:
    d = diagnose(snap(env_servers=(EnvServerView("http://n1:8100", False, "ConnectionRefusedError"),
                                   EnvServerView("http://n2:8100", True, sessions=3)),
                      slurm_jobs=(SlurmJobView("812", "TIMEOUT"),), since_progress_s=1000.0))
    assert [f.data["url"] for f in d.findings if f.kind is Kind.ENV_SERVER_DOWN] == ["http://n1:8100"]
    assert d.culprit is not None and d.culprit.kind is Kind.SLURM_JOB and "812 is TIMEOUT" in d.culprit.message
    requeued = diagnose(snap(slurm_jobs=(SlurmJobView("812", "PREEMPTED"), SlurmJobView("813", "RUNNING"))))
    assert Kind.SLURM_JOB not in kinds(requeued)
    queued = diagnose(snap(slurm_jobs=(SlurmJobView("814", "PENDING", "Resources"),)))
    (waiting,) = [f for f in queued.findings if f.kind is Kind.SLURM_JOB]
    assert waiting.severity is Severity.INFO and "waits for its allocation" in waiting.message


def test_retried_tasks_failed_groups_and_missing_ranks() -> None:
    t = replace(running(57, 9, 2, 5.0), attempts=3, last_error="EnvError: /observation timed out after 60 s")
    d = diagnose(snap(groups=(group(9, done=3, tasks=(t,)),), failed_groups=2,
                      ranks=(rank(0, "actor"), rank(1, "rollout"))))
    retried = next(f for f in d.findings if f.kind is Kind.TASK_RETRIED)
    assert "attempt 3" in retried.message and "timed out" in retried.message
    assert Kind.GROUPS_FAILED in kinds(d)
    missing = next(f for f in d.findings if f.kind is Kind.RANK_MISSING)
    assert missing.data["ranks"] == [2, 3]


def test_to_dict_is_plain_data() -> None:
    import json

    d = diagnose(snap(since_progress_s=700.0))
    doc = json.loads(json.dumps(d.to_dict()))
    assert doc["is_stalled"] and doc["culprit"]["kind"] == "stalled" and doc["findings"][0]["severity"] == "error"


def test_rollout_ranks_that_do_not_claim_while_tasks_are_pending() -> None:
    groups = (group(1, done=0, tasks=tuple(TaskView(i, 1, "pending") for i in range(4))),)
    ranks = (rank(0, "actor"), rank(1, "rollout", up_s=480.0), rank(2, "rollout", running_tasks=2))
    d = diagnose(snap(groups=groups, ranks=ranks, since_progress_s=900.0))
    assert "1 with tasks, 1 not claiming" in d.rollout and "rank 1 (up for 8.0 min) holds no task" in d.culprit.message
    assert d.culprit is not None and d.culprit.kind is Kind.ROLLOUT_NOT_CLAIMING and d.culprit.rank == 1


def test_tasks_left_running_on_a_rank_that_left_rollout() -> None:
    groups = (group(12, done=2, tasks=(running(34, 12, 2, 88.0), running(36, 12, 2, 88.0))),)
    ranks = (rank(0, "actor"), rank(1, "rollout"), rank(2, "ref"))
    d = diagnose(snap(groups=groups, ranks=ranks, fetch_groups=1, ra2p_mode="colocated", since_progress_s=900.0))
    assert d.culprit is not None and d.culprit.kind is Kind.ORPHANED_TASKS and d.culprit.rank == 2
    assert "2 tasks 34, 36 (group 12) are still running on rank 2, which is ref now" in d.culprit.message


def test_every_rank_silent_means_the_run_is_gone() -> None:
    ranks = tuple(rank(r, role, age=40.0) for r, role in enumerate(("actor", "rollout", "rollout", "ref")))
    d = diagnose(snap(ranks=ranks, since_progress_s=900.0,
                      env_servers=(EnvServerView("http://n1:8100", False, "ConnectionRefusedError"),)))
    assert d.culprit is not None and d.culprit.kind is Kind.RUN_GONE
    assert "no env server answers" in d.culprit.message and "--resume" in d.culprit.message
    silent = [f for f in d.findings if f.kind is Kind.RANK_SILENT]
    assert len(silent) == 4 and "is the control plane running?" in silent[0].message
    one = diagnose(snap(ranks=(rank(0, "actor"),) + ranks[1:]))
    assert Kind.RUN_GONE not in kinds(one)


def test_a_control_plane_that_stopped_ticking_is_named() -> None:
    d = diagnose(snap(control_age_s=95.0, since_progress_s=700.0))
    assert Kind.CONTROL_DOWN in kinds(d) and d.culprit is not None and d.culprit.kind is Kind.CONTROL_DOWN
    assert "control plane has not ticked for 95 s" in d.culprit.message
    assert Kind.CONTROL_DOWN not in kinds(diagnose(snap(control_age_s=1.0)))
    assert Kind.CONTROL_DOWN not in kinds(diagnose(snap(control_age_s=95.0, state="finished")))


def test_state_names_agree_with_the_store() -> None:
    from tiderl.observe.diagnose_types import LIVE_RANK_STATES, TERMINAL_STATES
    from tiderl.store.types import RankState, RunState

    assert set(TERMINAL_STATES) == {s.value for s in RunState if s.is_terminal}
    assert set(LIVE_RANK_STATES) == {RankState.STARTING.value, RankState.RUNNING.value}


def test_a_rank_that_failed_is_an_error_even_after_the_run_ended() -> None:
    # The weights race of a restarted rank: the run finished, the rank had died with an error.
    ranks = (rank(0, "actor"), rank(1, "rollout"), rank(2, "rollout", state="failed"), rank(3, "ref"))
    event = EventView(kind="rank_failed", age_s=50.0, rank=2,
                      message="rank 2 failed: EngineError: vLLM could not start on model weights/v3")
    for state in ("running", "finished"):
        d = diagnose(snap(state=state, ranks=ranks, events=(event,)))
        failed = [f for f in d.findings if f.kind is Kind.RANK_FAILED]
        assert len(failed) == 1 and failed[0].severity is Severity.ERROR and failed[0].rank == 2
        assert "EngineError: vLLM could not start" in failed[0].message
        assert d.needs_attention  # `status --check` exits 1
    d = diagnose(snap(state="finished", ranks=ranks))
    assert [f.message for f in d.findings if f.kind is Kind.RANK_FAILED][0].startswith("rank 2 (rollout) failed")


def test_check_needs_attention_for_every_error_finding() -> None:
    d = diagnose(snap(ranks=tuple(rank(r.rank, r.role, age=200.0) for r in healthy_ranks())))
    assert any(f.kind is Kind.RUN_GONE and f.severity is Severity.ERROR for f in d.findings)
    assert not d.is_stalled and d.needs_attention


def test_restarted_processes_are_reported() -> None:
    events = (EventView(kind="restarted", age_s=12.0, rank=2,
                        message="rank2 restarted (1 of 3) after it exited with code -9; its 4 tasks went back"),)
    d = diagnose(snap(events=events))
    [f] = [f for f in d.findings if f.kind is Kind.RESTARTED]
    assert f.severity is Severity.WARNING and f.rank == 2 and "1 restart of processes that died" in f.message
    assert "exited with code -9" in f.message and not d.needs_attention


def test_an_engine_that_does_not_serve_the_trained_weights_is_a_warning() -> None:
    quiet = diagnose(snap(on_policy_mismatch=2e-6))
    assert Kind.ENGINE_MISMATCH not in kinds(quiet) and not quiet.needs_attention
    loud = diagnose(snap(on_policy_mismatch=0.03))
    found = next(f for f in loud.findings if f.kind is Kind.ENGINE_MISMATCH)
    assert found.severity is Severity.WARNING and "0.03" in found.message
    assert "monitor.max_on_policy_mismatch" in found.message
    assert Kind.ENGINE_MISMATCH not in kinds(diagnose(snap()))  # not measured yet: nothing said
