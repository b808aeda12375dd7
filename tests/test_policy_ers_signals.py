"""The one signal path: tiderl.policy.ers.signals (one test per invariant of docs/ers.md's signals), and the control plane
and the simulator building the same signals from the same measurements."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from tiderl.config import load_job
from tiderl.policy.ers import ErsLimits, ErsPolicy, StepObservation
from tiderl.policy.ers.signals import ErsSnapshot, build_signals, rate_window, slot_wait_s, task_times
from tiderl.policy.ra2p import StageTimes
from tiderl.roles import Role

R, A, F = Role.ROLLOUT, Role.ACTOR, Role.REF
TIMES = StageTimes(t_ref_s=0.2, t_act_f_s=0.4, t_act_b_s=0.8, t_swap_s=0.1)


def step(rollout: int = 2, actors: int = 2, refs: int = 0, **kw: float) -> StepObservation:
    values = dict(version=5, duration_s=10.0, consumed_tokens=4000, produced_tokens=4000, groups_completed=4,
                  group_latency_sum_s=40.0, group_env_sum_s=20.0, rollout_idle_rank_s=5.0)
    values.update(kw)
    return StepObservation(rollout_ranks=rollout, actor_ranks=actors, ref_ranks=refs, **values)  # type: ignore[arg-type]


def snapshot(**kw: object) -> ErsSnapshot:
    values: dict = dict(roles=(R, R, A, A), micro_batch_tokens=500, ready_tokens=2600, ready_groups=3,
                        oldest_ready_age_s=4.0, steps=(step(), step(), step()), stage_times=TIMES)
    values.update(kw)
    return ErsSnapshot(**values)


def test_1_equal_snapshots_give_equal_signals():
    assert build_signals(snapshot(), 5) == build_signals(snapshot(), 5)


def test_2_ras_microbatches_and_idle_ranks_follow_the_definitions():
    s = build_signals(snapshot(), 5)
    assert s.ras_microbatches == 2600 // (500 * 2)  # full micro-batches of the actor group
    assert s.microbatches_per_step == 4  # ceil(4000 / (500 x 2))
    assert s.rollout_idle_ranks == pytest.approx(0.5)  # 5 rank-seconds over a 10 s step
    assert s.micro_batch_tokens == 500 and s.hol_latency_s == 4.0
    assert build_signals(snapshot(roles=(R, R, F)), 5).ras_microbatches == 0  # no actor rank


def test_3_no_history_is_a_cold_start():
    s = build_signals(snapshot(steps=()), 5)
    assert s.step_history_s == () and s.tprm_s is None and s.window == () and s.group_latency_s is None


def test_4_the_rate_window_is_the_settled_steps_of_the_last_split():
    steps = (step(3, 1), step(2, 2), step(2, 2, duration_s=11.0), step(2, 2, duration_s=12.0))
    window = rate_window(steps, 5)
    assert [s.duration_s for s in window] == [11.0, 12.0]  # the first step on 2/2 is left out
    assert rate_window(steps, 1) == (steps[-1],)
    assert rate_window((step(3, 1), step(2, 2)), 5) == ()  # one step on the split: not settled yet
    s = build_signals(snapshot(steps=steps), 5)
    assert s.group_latency_s == pytest.approx(10.0) and s.group_env_s == pytest.approx(5.0)
    assert s.tokens_per_group == pytest.approx(1000.0)
    assert s.step_history_s == (10.0, 10.0, 11.0, 12.0)  # the HoL rule keeps every recent step
    fill = build_signals(snapshot(steps=steps, fill_steps=5), 5)  # every step is version 5: all fill
    assert fill.window == () and fill.gen_latency_by_rollout == () and fill.step_history_s == s.step_history_s


def test_4_after_the_fill_the_first_step_counts_when_no_move_or_evaluation_came_before_it():
    def run(*splits: tuple[int, int], evaluation_at: int = 0) -> tuple[StepObservation, ...]:
        return tuple(step(r, a, version=v, duration_s=10.0 + v, evaluation=v == evaluation_at)
                     for v, (r, a) in enumerate(splits, 1))

    # Versions 1-2 fill the pipeline on 3/1; versions 3-4 run on it: both are settled (no move came before 3).
    cold = build_signals(snapshot(steps=run((3, 1), (3, 1), (3, 1), (3, 1)), fill_steps=2), 5)
    assert [s.version for s in cold.window] == [3, 4]
    assert rate_window(run((3, 1), (3, 1))[1:], 5, before=run((3, 1))[0]) == run((3, 1), (3, 1))[1:]
    # A move at the fill's end (the cold start's plan): version 3 carries it and is left out, as after any move.
    moved = build_signals(snapshot(steps=run((3, 1), (3, 1), (2, 2), (2, 2)), fill_steps=2), 5)
    assert [s.version for s in moved.window] == [4]
    # An evaluation in the fill's last step: its tail is in version 3, left out.
    evaluated = build_signals(snapshot(steps=run((3, 1), (3, 1), (3, 1), (3, 1), evaluation_at=2), fill_steps=2), 5)
    assert [s.version for s in evaluated.window] == [4]
    # Planned from those two steps, the next split is unmeasured: the walk is the first run's window, as judged.
    walked = build_signals(snapshot(steps=run((3, 1), (3, 1), (3, 1), (3, 1), (2, 2)), fill_steps=2), 5)
    assert walked.window == () and walked.walk is not None and walked.walk.window == cold.window
    # Without a fill (a snapshot that starts mid-run) the first step of the run is left out.
    assert [s.version for s in build_signals(snapshot(steps=run((3, 1), (3, 1), (3, 1))), 5).window] == [2, 3]


def test_limits_come_from_the_ers_section_and_the_system():
    from tiderl.config.ers import ErsConfig

    limits = ErsLimits.from_config(ErsConfig(policy="paper", rate_margin=0.1, max_moves_per_step=2), 2, 4, 0)
    assert (limits.policy, limits.rate_margin, limits.max_moves_per_step, limits.max_staleness) == (
        ErsPolicy.PAPER, 0.1, 2, 0)
    assert ErsLimits.from_config(ErsConfig(), 2, 4, 1).policy is ErsPolicy.RATE  # the default


def test_the_control_plane_builds_its_signals_from_the_store_like_the_builder(tmp_path: Path) -> None:
    """The control plane's path (store -> StepObservation -> build_signals) against a snapshot written
    by hand from the same facts: the measurements a simulator would hand over."""
    from tiderl.rundir import create_run
    from tiderl.run.control import ControlPlane
    from tiderl.store.types import FinishedTrajectory, MetricPoint, NewGroup, RankReport, TaskKind, VersionRecord

    root = Path(__file__).resolve().parents[1]
    config = load_job(root / "jobs" / "quickstart.yaml", ["rollout.eval_every_steps=0", "launch.num_ranks=3",
                                                          "trainer.num_steps=3", "trainer.micro_batch_tokens=16"])
    _, store = create_run(config, tmp_path / "run")
    store.register_initial_version("model", "0")
    plane = ControlPlane(config, store)
    roles = {0: A, 1: R, 2: R}
    store.plan_roles(0, roles, ra2p_mode="colocated", fetch_groups=1)
    store.record_event("rank2", "engine_up", "an engine up before rank 2 registered: a restart's", rank=2)
    time.sleep(0.01)
    store.register_rank(1, R)
    store.register_rank(2, R)
    store.record_event("rank1", "engine_up", "rank 1: engine up", rank=1)
    store.add_groups([NewGroup(TaskKind.TRAIN, 7, 2)])
    claims = store.claim_tasks(1, 2)
    trajectories = [FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                                       logprobs=[0.0, -1.0, -1.0], token_versions=[-1, 0, 0], num_turns=1,
                                       reward=float(i), success=bool(i), env_s=0.5 + i) for i, c in enumerate(claims)]
    time.sleep(0.01)
    store.report(RankReport(rank=1, role=R, version=0, finished=trajectories,
                            metrics=[MetricPoint("rollout_busy_s", 0.75, 0, "rollout"),
                                     MetricPoint("rollout_idle_s", 0.25, 0, "rollout")]))
    got = store.claim_ready_groups(0, 1)
    time.sleep(0.01)
    store.publish_version(VersionRecord(version=1, path="weights/v1", checksum="c", trajectory_ids=[t.id for t in got],
                                        step_started_at=0.0, duration_s=1.0), owner=0)
    signals = plane.signals(1, roles)
    rows = {r["version"]: r for r in store.measure.version_rows()}
    duration = rows[1]["created_at"] - rows[0]["created_at"]
    created, completed = store.tx.read(lambda c: c.exec_driver_sql(
        "select created_at, completed_at from task_groups").one())
    slot_s, wait_s = store.tx.read(lambda c: c.exec_driver_sql(
        "select sum(r.finished_at - t.claimed_at), sum(t.claimed_at - g.created_at) from trajectories r"
        " join tasks t on t.id = r.task_id join task_groups g on g.id = t.group_id").one())
    assert 0 < slot_s < 10 and 0 <= wait_s < 10
    expected = StepObservation(version=1, duration_s=duration, consumed_tokens=6, rollout_ranks=2, actor_ranks=1, ref_ranks=0,
                               produced_tokens=6, groups_completed=1, group_latency_sum_s=completed - created,
                               group_env_sum_s=1.5, rollout_busy_rank_s=0.75, rollout_idle_rank_s=0.25,
                               tasks_completed=2, task_env_sum_s=2.0, task_slot_sum_s=pytest.approx(slot_s),
                               task_wait_sum_s=pytest.approx(wait_s))
    assert len(got) == 2 and signals.window == ()  # one step on this split: not settled
    assert signals.rollout_idle_ranks == pytest.approx(0.25 / duration)  # the real run's idle rollout ranks
    assert build_signals(snapshot(roles=(A, R, R), micro_batch_tokens=16, ready_tokens=0, ready_groups=0,
                                  oldest_ready_age_s=None, steps=(expected,), stage_times=None, fetch_groups=1,
                                  fill_steps=2, engine_ranks=frozenset({1})),
                         config.ers.history_steps) == signals


def test_the_control_plane_counts_tprm_in_global_micro_batches(tmp_path: Path) -> None:
    """The trainer times arrivals of one rank's share (micro_batch_tokens); ERS counts a micro-batch as
    the shares of every actor rank, as the simulator does: with 2 actors a share every 0.5 s is a
    micro-batch every second."""
    from tiderl.rundir import create_run
    from tiderl.run.control import ControlPlane
    from tiderl.store.types import VersionRecord

    root = Path(__file__).resolve().parents[1]
    config = load_job(root / "jobs" / "quickstart.yaml", ["rollout.eval_every_steps=0", "launch.num_ranks=3",
                                                          "trainer.num_steps=3"])
    _, store = create_run(config, tmp_path / "run")
    store.register_initial_version("model", "0")
    roles = {0: A, 1: A, 2: R}
    store.plan_roles(0, roles, ra2p_mode="colocated", fetch_groups=1)
    store.publish_version(VersionRecord(version=1, path="weights/v1", checksum="c", trajectory_ids=[],
                                        step_started_at=0.0, duration_s=1.0, ras=4, tprm_s=0.5), owner=0)
    signals = ControlPlane(config, store).signals(1, roles)
    assert signals.tprm_s == pytest.approx(1.0)
    # The step's RAS likewise: 4 shares ready at its start are 2 micro-batches of the 2 actors.
    step = ControlPlane(config, store)._observations(1)[-1]
    assert step.ras_microbatches == 2 and step.tprm_s == pytest.approx(1.0)


def test_5_the_walk_is_the_last_measured_split_while_the_current_one_is_not_measured():
    measured = (step(2, 2), step(2, 2, duration_s=11.0), step(2, 2, duration_s=12.0))  # two settled steps
    walked = measured + (step(3, 1, duration_s=9.0),)  # one step on 3/1: not measured
    s = build_signals(snapshot(steps=walked), 5)
    assert s.window == () and s.walk is not None
    assert s.walk == replace(build_signals(snapshot(steps=measured), 5), walk=None)
    assert s.walk.window == measured[1:] and s.walk.walk is None
    # Two steps on the new split: one settled, still short of MIN_WINDOW_STEPS; the walk is still the old one.
    s2 = build_signals(snapshot(steps=walked + (step(3, 1),)), 5)
    assert len(s2.window) == 1 and s2.walk == s.walk
    # Measured: no walk. No earlier split measured: no walk.
    assert build_signals(snapshot(steps=walked + (step(3, 1), step(3, 1))), 5).walk is None
    assert build_signals(snapshot(steps=(step(2, 2), step(2, 2), step(3, 1))), 5).walk is None
    # The pipeline fill is not a measurement.
    assert build_signals(snapshot(steps=walked, fill_steps=5), 5).walk is None


def test_4_evaluation_steps_are_in_no_window_and_break_the_runs():
    ev = step(2, 2, evaluation=True, duration_s=30.0)
    steps = (step(2, 2), step(2, 2), step(2, 2), ev)
    assert rate_window(steps, 5) == ()  # the last step ran an evaluation: nothing to judge now
    after = steps + (step(2, 2, duration_s=13.0), step(2, 2, duration_s=14.0))
    assert [s.duration_s for s in rate_window(after, 5)] == [14.0]  # the first step after it is left out
    s = build_signals(snapshot(steps=after), 5)
    # Its latency is not the split's either; the walk is the measurement before the evaluation.
    assert s.walk is not None and s.walk.window == steps[1:3]
    slow = step(3, 1, evaluation=True, group_latency_sum_s=400.0)
    assert build_signals(snapshot(steps=(step(3, 1), step(3, 1), slow, step(2, 2))), 5).gen_latency_by_rollout == (
        (3, 5.0),)  # 40 - 20 s over 4 groups, from the settled step before the evaluation step


def test_4_the_latency_memory_is_scaled_to_the_work_of_a_group_now():
    # 3 rollout ranks measured while a group was 2,000 tokens of work, 2 ranks now at 1,000: the earlier
    # generation latency (60 - 20 s over 2 groups = 20 s) counts as 10 s at today's work, so a workload
    # whose tasks shrink does not make the earlier split look slow.
    earlier = step(3, 1, produced_tokens=4000, groups_completed=2, group_latency_sum_s=60.0, group_env_sum_s=20.0)
    steps = (step(3, 1), earlier, earlier, step(2, 2), step(2, 2), step(2, 2))
    s = build_signals(snapshot(steps=steps), 5)
    assert s.tokens_per_group == pytest.approx(1000.0)
    assert s.gen_latency_by_rollout == ((2, pytest.approx(5.0)), (3, pytest.approx(10.0)))
    from tiderl.policy.ers.signals import gen_latency_by_rollout

    assert gen_latency_by_rollout(steps) == ((2, pytest.approx(5.0)), (3, pytest.approx(20.0)))  # unscaled


def test_the_store_marks_a_step_during_which_an_evaluation_group_was_open(tmp_path: Path) -> None:
    from tiderl.rundir import create_run
    from tiderl.store.types import NewGroup, TaskKind

    root = Path(__file__).resolve().parents[1]
    _, store = create_run(load_job(root / "jobs" / "quickstart.yaml", []), tmp_path / "run")
    t0 = time.time()
    assert not store.measure.step_window(1, t0 - 10, t0 + 10).evaluation
    store.add_groups([NewGroup(TaskKind.EVAL, 3, 1, eval_version=0)])
    t1 = time.time()
    assert store.measure.step_window(1, t0 - 10, t1 + 10).evaluation  # open, created before the step's end
    assert not store.measure.step_window(1, t0 - 20, t0 - 10).evaluation  # created after that step ended
    store.tx.write(lambda c: c.exec_driver_sql(f"update task_groups set state='evaluated', completed_at={t1 + 1}"))
    assert store.measure.step_window(2, t1 + 0.5, t1 + 10).evaluation  # completed during the step
    assert not store.measure.step_window(3, t1 + 2, t1 + 10).evaluation  # completed before it


def test_the_store_counts_the_tokens_of_the_groups_dropped_as_stale_in_the_step(tmp_path: Path) -> None:
    from tiderl.rundir import create_run
    from tiderl.run.control import ControlPlane
    from tiderl.store.types import FinishedTrajectory, RankReport, Role

    root = Path(__file__).resolve().parents[1]
    config = load_job(root / "jobs" / "quickstart.yaml", ["rollout.eval_every_steps=0"])
    _, store = create_run(config, tmp_path / "run")
    store.register_initial_version("model", "0")
    ControlPlane(config, store).tick()  # feeds the first groups
    store.register_rank(1, Role.ROLLOUT)
    store.register_rank(0, Role.ACTOR)
    claims = [c for c in store.claim_tasks(1, 1000) if c.kind.value == "train"]
    store.report(RankReport(rank=1, finished=[FinishedTrajectory(
        task_id=c.task_id, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], logprobs=[0.0, -1.0, -1.0, -1.0],
        token_versions=[-1, 0, 0, 0], num_turns=1, reward=float(c.index_in_group % 2), success=True)
        for c in claims]))
    got = store.claim_ready_groups(0, 2)
    groups = sorted({t.group_id for t in got})
    t0 = time.time()
    assert store.drop_claimed_groups(0, groups[:1], "test") == 1
    t1 = time.time()
    dropped = sum(t.num_tokens for t in got if t.group_id == groups[0])
    assert dropped > 0
    assert store.measure.step_window(1, t0 - 0.001, t1 + 1).stale_dropped_tokens == dropped
    assert store.measure.step_window(1, t1 + 1, t1 + 2).stale_dropped_tokens == 0  # dropped before that step
    assert store.measure.dropped_groups() == groups[:1] == store.measure.dropped_groups(t0 - 0.001, t1 + 1)
    assert store.measure.dropped_groups(t1 + 1, t1 + 2) == []


def test_a_group_s_wait_for_a_task_slot_is_taken_out_of_its_generation_latency():
    # Each group: 10 s latency, 5 s of it its slowest task's environment; each of its 8 tasks 3 s in a slot,
    # 2 s of them its environment's (1 s of its own generation), after a mean wait of 3.5 s for the claim.
    # 4 of the 5 s beyond the environment were the wait: the wait counts up to what the tasks' own time
    # leaves of the latency.
    queued = dict(tasks_completed=32, task_env_sum_s=64.0, task_slot_sum_s=96.0, task_wait_sum_s=32 * 3.5)
    steps = (step(), step(**queued), step(**queued), step(**queued))
    assert task_times(steps[1:]) == (pytest.approx(3.0), pytest.approx(2.0))
    assert slot_wait_s(steps[1:]) == pytest.approx(3.5)
    s = build_signals(snapshot(steps=steps), 5)
    assert s.slot_wait_s == pytest.approx(3.5)
    assert s.group_latency_s == pytest.approx(10.0)  # the measurement itself is kept
    assert s.gen_latency_by_rollout == ((2, pytest.approx(1.5)),)
    longer = dict(queued, task_wait_sum_s=32 * 6.0)  # a longer wait than the latency leaves: at most 4 s
    assert slot_wait_s((step(**longer),) * 2) == pytest.approx(4.0)
    # Claimed at once: the latency is the engines' and the environment's, nothing taken out.
    at_once = dict(queued, task_wait_sum_s=0.0)
    assert slot_wait_s((step(**at_once),) * 2) == 0.0
    assert build_signals(snapshot(steps=(step(),) + (step(**at_once),) * 3), 5).gen_latency_by_rollout == (
        (2, pytest.approx(5.0)),)
    # Not measured (no tasks' slot seconds): as before.
    assert slot_wait_s((step(), step())) == 0.0 and task_times((step(),)) is None
