"""The control plane against a real run store, with the ranks' side played through the store API."""

from __future__ import annotations

import json
from pathlib import Path

from tiderl.config import load_job
from tiderl.run.control import ControlPlane
from tiderl.rundir import create_run
from tiderl.store import RunStore
from tiderl.store.types import (FinishedTrajectory, GroupState, RankReport, Role, RunState, TaskKind,
                                VersionRecord)

ROOT = Path(__file__).resolve().parents[1]


def _store(tmp_path: Path, *sets: str) -> tuple[RunStore, object]:
    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["trainer.groups_ideal=2", "trainer.groups_min=1",
                                                          "trainer.num_steps=2", "rollout.eval_every_steps=2",
                                                          "rollout.eval_groups=1", *sets])
    _, store = create_run(config, tmp_path / "run")
    store.register_initial_version("model", "0")
    return store, config


def _train_one_step(store: RunStore, version: int) -> None:
    """Rank 1 plays every pending training task; actor 0 trains them all into version + 1."""
    store.register_rank(1, Role.ROLLOUT)
    store.register_rank(0, Role.ACTOR)
    claims = [c for c in store.claim_tasks(1, 1000) if c.kind.value == "train"]
    store.report(RankReport(rank=1, finished=[FinishedTrajectory(
        task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
        token_versions=[-1, version, version], num_turns=1, reward=float(c.index_in_group % 2), success=True)
        for c in claims]))
    got = store.claim_ready_groups(0, 100)
    store.publish_version(VersionRecord(version=version + 1, path="w", checksum="c", trajectory_ids=[t.id for t in got],
                                        step_started_at=0.0, duration_s=1.0), owner=0)


def test_feeds_within_the_staleness_bound_and_plans_each_version(tmp_path: Path) -> None:
    store, config = _store(tmp_path, "system=async", "rollout.max_staleness=1")
    plane = ControlPlane(config, store)
    assert plane.tick()
    plan = store.plan_at(0)
    assert plan is not None and plan.roles[0] is Role.ACTOR and plan.fetch_groups == 2
    groups = store.view("buffer_state")[0]
    # (staleness + 1) x groups_ideal training groups of group_size tasks, plus one greedy evaluation task at v0.
    assert config.rollout.eval_temperature == 0
    assert groups["tasks_pending"] == (1 + 1) * 2 * config.rollout.group_size + 1
    _train_one_step(store, 0)
    assert plane.tick()
    assert store.latest_planned_version() == 1
    _train_one_step(store, 1)
    plane.tick()
    info = store.run_info()
    # Version 2 is the last; its evaluation group is still open, so the run is not finished yet.
    assert info.version == 2 and info.state is not RunState.FINISHED


def test_restarted_control_plane_carries_on_without_duplicates(tmp_path: Path) -> None:
    store, config = _store(tmp_path, "system=tiderl")
    ControlPlane(config, store).tick()
    before = store.buffer_state().tasks_pending
    again = ControlPlane(config, RunStore(store.url))
    again.tick()
    assert store.buffer_state().tasks_pending == before
    assert store.latest_planned_version() == 0
    # ERS cold start: every spare rank rolls out, colocated.
    plan = store.plan_at(0)
    assert plan is not None and plan.ra2p_mode == "colocated"
    assert plan.ranks_with(Role.REF) == [] and plan.ranks_with(Role.ACTOR) == [0]


def test_sync_feeds_one_batch_at_a_time(tmp_path: Path) -> None:
    store, config = _store(tmp_path, "system=sync", "rollout.eval_every_steps=0")
    plane = ControlPlane(config, store)
    plane.tick()
    plane.tick()
    assert store.buffer_state().tasks_pending == 2 * config.rollout.group_size
    _train_one_step(store, 0)
    plane.tick()
    assert store.buffer_state().tasks_pending == 2 * config.rollout.group_size
    _train_one_step(store, 1)
    assert not plane.tick()  # two steps done, no evaluation: finished
    assert store.run_info().state is RunState.FINISHED


def test_a_version_published_while_the_feeder_counts_does_not_overfeed(tmp_path: Path) -> None:
    """The tick reads the version first and counts the groups later; a version published in between
    consumed groups the old version still expects to train. Feeding on that old version created groups
    no remaining step would train (fed, generated, still outstanding at the end: lost)."""
    store, config = _store(tmp_path, "system=async", "rollout.max_staleness=1", "rollout.eval_every_steps=0")
    plane = ControlPlane(config, store)
    plane.tick()
    groups = store.groups_by_state(TaskKind.TRAIN)
    assert sum(groups.values()) == 4  # (staleness + 1) x groups_ideal, and 2 steps x 2 groups: all the run needs

    def play_and_train(version: int) -> None:
        store.register_rank(1, Role.ROLLOUT)
        store.register_rank(0, Role.ACTOR)
        claims = store.claim_tasks(1, 1000)
        store.report(RankReport(rank=1, finished=[FinishedTrajectory(
            task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
            token_versions=[-1, version, version], num_turns=1, reward=float(c.index_in_group % 2), success=True)
            for c in claims]))
        got = store.claim_ready_groups(0, config.trainer.groups_ideal)
        store.publish_version(VersionRecord(version=version + 1, path="w", checksum="c",
                                            trajectory_ids=[t.id for t in got], step_started_at=0.0,
                                            duration_s=1.0), owner=0)

    counted = store.groups_by_state
    published: list[int] = []

    def publish_then_count(kind: TaskKind) -> dict[GroupState, int]:
        if kind is TaskKind.TRAIN and not published:  # the actor publishes v1 after the tick read v0
            play_and_train(0)
            published.append(1)
        return counted(kind)

    store.groups_by_state = publish_then_count  # type: ignore[method-assign]
    plane.tick()
    del store.groups_by_state
    assert published and store.position()[1] == 1
    groups = store.groups_by_state(TaskKind.TRAIN)
    # One step is left and it trains groups_ideal = 2 groups: the 2 still outstanding, nothing more.
    assert sum(groups[s] for s in (GroupState.OPEN, GroupState.READY, GroupState.CLAIMED)) == 2
    assert sum(groups.values()) == 4
    play_and_train(1)
    assert not plane.tick()
    groups = store.groups_by_state(TaskKind.TRAIN)
    assert groups[GroupState.CONSUMED] == 4 and sum(groups.values()) == 4


def test_the_feed_counts_in_the_batch_the_coming_step_fetches(tmp_path: Path, monkeypatch) -> None:
    """tiderl: (staleness + 1) x ERS's planned fetch size, so adaptive retention's smaller batches do not
    feed groups that would wait past the staleness bound; stream, which trains groups_min as soon as
    they are ready, keeps (staleness + 1) x groups_ideal in flight, as the simulator does
    (tiderl.systems.feed_batch_groups)."""
    import dataclasses

    from tiderl.run import control

    planned = control.ers.plan
    monkeypatch.setattr(control.ers, "plan", lambda *a, **k: dataclasses.replace(planned(*a, **k), fetch_groups=2))
    sets = ("trainer.groups_ideal=4", "trainer.groups_min=2", "rollout.max_staleness=1", "rollout.eval_every_steps=0")
    for system, batch in (("tiderl", 2), ("stream", 4), ("async", 4)):
        store, config = _store(tmp_path / system, f"system={system}", *sets)
        ControlPlane(config, store).tick()
        assert store.plan_at(0).fetch_groups == {"tiderl": 2, "stream": 2, "async": 4}[system]
        assert store.buffer_state().tasks_pending == (1 + 1) * batch * config.rollout.group_size, system


def test_the_feed_keeps_within_ers_adaptive_admission(tmp_path: Path, monkeypatch) -> None:
    """tiderl: the control plane asks tiderl.policy.admission for the cap at each plan, with the step that
    just ended and the feed's batch, and feeds no more than the cap; with `ers.adaptive_admission: false`
    it (the default) feeds the staleness bound's (staleness + 1) batches."""
    from tiderl.run import control

    calls = []

    def cap(previous, last, batch, staleness):
        calls.append((previous, last, batch, staleness))
        return 5

    monkeypatch.setattr(control.admission, "inflight_cap", cap)
    sets = ("system=tiderl", "trainer.groups_ideal=4", "trainer.groups_min=2", "rollout.max_staleness=1",
            "rollout.eval_every_steps=0")
    store, config = _store(tmp_path / "on", *sets, "ers.adaptive_admission=true")
    ControlPlane(config, store).tick()
    assert calls == [(None, (), 4, 1)]  # the cold start: no step observed yet
    assert store.buffer_state().tasks_pending == 5 * config.rollout.group_size
    calls.clear()
    store, config = _store(tmp_path / "off", *sets)
    ControlPlane(config, store).tick()
    assert calls == [] and store.buffer_state().tasks_pending == 2 * 4 * config.rollout.group_size


def test_a_new_version_drops_the_open_groups_no_step_may_train_and_feeds_their_places(tmp_path: Path) -> None:
    """At each new version the control plane drops the open groups holding a trajectory older than the
    step's staleness bound (the trainer would drop them at its claim, after generating the rest of them)
    and the feed replaces them."""
    store, config = _store(tmp_path, "system=async", "rollout.max_staleness=1", "rollout.eval_every_steps=0",
                           "trainer.num_steps=4")
    plane = ControlPlane(config, store)
    plane.tick()
    store.register_rank(1, Role.ROLLOUT)
    store.register_rank(0, Role.ACTOR)
    claims = [c for c in store.claim_tasks(1, 1000) if c.kind.value == "train"]
    first = min(c.group_id for c in claims)
    straggler = next(c for c in claims if c.group_id == first)
    # One task of the first group finishes on version 0's weights; the group stays open.
    store.report(RankReport(rank=1, finished=[FinishedTrajectory(
        task_id=straggler.task_id, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], token_versions=[-1, 0],
        num_turns=1, reward=1.0, success=True)]))
    for version in (0, 1):  # the trainer publishes versions 1 and 2 from other groups
        store.publish_version(VersionRecord(version=version + 1, path="w", checksum="c", trajectory_ids=[],
                                            step_started_at=0.0, duration_s=1.0), owner=0)
        before = store.groups_by_state(TaskKind.TRAIN)
        plane.tick()
        after = store.groups_by_state(TaskKind.TRAIN)
        if version == 0:  # step 1 may still train version 0's tokens
            assert after[GroupState.FAILED] == 0
    # Step 2's bound is version 1: the first group can never be trained.
    assert after[GroupState.FAILED] == before[GroupState.FAILED] + 1
    assert sum(after.values()) == sum(before.values()) + 1  # its place fed again
    assert first in json.loads(store.tx.read(lambda c: c.exec_driver_sql(
        "select data from events where kind = 'groups_dropped'").scalar_one()))["groups"]


def test_each_plan_rings_the_planned_bell_and_only_a_plan(tmp_path: Path) -> None:
    from tiderl.run.bell import Bell

    store, config = _store(tmp_path, "system=async", "rollout.max_staleness=1")
    waiter = Bell(tmp_path / "bells" / "planned")
    plane = ControlPlane(config, store, planned=Bell(tmp_path / "bells" / "planned"))
    plane.tick()  # plans version 0
    assert waiter.rang()
    plane.tick()  # feeds, plans nothing
    assert not waiter.rang()
    _train_one_step(store, 0)
    plane.tick()
    assert store.latest_planned_version() == 1 and waiter.rang()


def test_the_control_plane_asks_an_idle_rank_once_to_start_its_engine(tmp_path: Path, monkeypatch) -> None:
    """A plan's `warm` ranks (engines on demand, docs/ers.md, the plan's invariant 14) get one `engine_wanted` event
    each, read by the rank at its boundary; the signals carry the ranks whose engine is up since their start."""
    import dataclasses

    from tiderl.run import control

    seen = []
    planned = control.ers.plan

    def plan(roles, signals, limits):
        seen.append(signals.engine_ranks)
        return dataclasses.replace(planned(roles, signals, limits), warm=(2,))

    monkeypatch.setattr(control.ers, "plan", plan)
    store, config = _store(tmp_path, "system=tiderl", "launch.num_ranks=3", "ers.host_slots=2")
    plane = ControlPlane(config, store)
    store.register_rank(1, Role.ROLLOUT)
    store.record_event("rank1", "engine_up", "rank 1: engine up", rank=1)
    plane.plan(0)
    plane.plan(0)  # planned again (a restarted control plane): not asked twice
    assert store.ranks_with_event("engine_wanted", since_start=False) == {2}
    assert len(store.recent_events(10, kinds=["engine_wanted"])) == 1
    assert seen == [frozenset({1}), frozenset({1})]


def test_the_planner_knows_an_evaluation_rounds_tasks_as_the_simulator_of_the_same_job_does(tmp_path: Path) -> None:
    import tempfile

    import yaml

    from tiderl.config.schema import to_dict
    from tiderl.sim.from_job import job_settings
    from tiderl.sim.simulator import Simulation
    from tiderl.sim.spec import load_cluster, load_workload
    from tiderl.sim.systems import parse_system

    sim_dir = ROOT / "jobs" / "sim"
    for sets, tasks in ((["rollout.eval_groups=3", "rollout.eval_temperature=0.7"], 3 * 4),  # sampled: a group each
                        (["rollout.eval_groups=3"], 3),  # greedy: one task a prompt
                        (["rollout.eval_every_steps=0"], 0)):  # no evaluation
        store, config = _store(tmp_path / str(len(list(tmp_path.iterdir()))), "rollout.group_size=4", *sets)
        plane = ControlPlane(config, store)
        assert plane.limits.evaluation_tasks == tasks
        cluster, workload, _, _ = job_settings(yaml.safe_load((sim_dir / "cpu.cluster.yaml").read_text()),
                                               yaml.safe_load((sim_dir / "bench-latency.workload.yaml").read_text()),
                                               to_dict(config))
        files = Path(tempfile.mkdtemp(dir=tmp_path))
        (files / "c.yaml").write_text(yaml.safe_dump(cluster))
        (files / "w.yaml").write_text(yaml.safe_dump(workload))
        sim = Simulation(load_workload(files / "w.yaml"), load_cluster(files / "c.yaml"), parse_system("tiderl"),
                         steps=1, seed=0)
        assert sim.ers_limits.evaluation_tasks == tasks
        # Both see version 0's round at the cold start: the planner's evaluation rule may take actor ranks for it.
        roles = {0: Role.ACTOR, 1: Role.ROLLOUT, 2: Role.ROLLOUT}
        assert plane.signals(0, roles).is_eval_next is sim._signals(0.0, None).is_eval_next is (tasks > 0)
