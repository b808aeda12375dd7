"""An evaluation runs on the weights it evaluates: the store hands evaluation tasks only to a rank
holding those weights, a rollout rank keeps them past a boundary until its evaluation tasks finish,
and evaluation tasks nobody can run any more expire instead of holding the run open."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tiderl.config import load_job
from tiderl.rollout.chat import ChatFormat
from tiderl.models.demos import corpus_texts
from fake_engine import FakeEngine
from tiderl.rollout.local_env import LocalEnvLink
from tiderl.models.tiny_model import train_tokenizer
from tiderl.run.context import RankContext
from tiderl.run.control import ControlPlane
from tiderl.run.rollout_role import run_rollout
from tiderl.systems import behaviour
from tiderl.rundir import create_run
from tiderl.store import RunStore, codec
from tiderl.trainer.publish import _write_checksums
from tiderl.store.types import (GroupState, NewGroup, RankReport, RankState, Role, RunState, StoreTaskState,
                                TaskKind, VersionRecord)

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *sets: str):
    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["rollout.eval_every_steps=0", "launch.num_ranks=2",
                                                          "trainer.num_steps=3", *sets])
    paths, store = create_run(config, tmp_path / "run")
    store.register_initial_version("model", "0")
    return config, paths, store


def _publish(store: RunStore, version: int, roles: dict[int, Role], weights_root: Path | None = None) -> None:
    checksum = "c"
    if weights_root is not None:  # files the rank verifies before it loads them
        final = weights_root / f"v{version}"
        final.mkdir(parents=True)
        (final / "model.safetensors").write_bytes(bytes([version]) * 16)
        checksum = _write_checksums(final)
    store.publish_version(VersionRecord(version=version, path=f"weights/v{version}", checksum=checksum,
                                        trajectory_ids=[], step_started_at=0.0, duration_s=1.0), owner=1)
    store.plan_roles(version, roles, ra2p_mode="colocated", fetch_groups=1)


def test_store_gives_evaluation_tasks_only_to_their_weights_and_first(tmp_path: Path) -> None:
    _, _, store = _run(tmp_path)
    store.add_groups([NewGroup(TaskKind.TRAIN, 7, 2)])
    store.add_groups([NewGroup(TaskKind.EVAL, 100, 1, eval_version=1), NewGroup(TaskKind.EVAL, 101, 1, eval_version=2)])
    for r in (0, 1):
        store.register_rank(r, Role.ROLLOUT)
    on_v0 = store.claim_tasks(0, 10, weights_version=0)
    assert [c.kind for c in on_v0] == [TaskKind.TRAIN, TaskKind.TRAIN]
    on_v2 = store.claim_tasks(1, 10, weights_version=2)
    assert [(c.kind, c.eval_version) for c in on_v2] == [(TaskKind.EVAL, 2)]
    # Without a weights version (tools, tests) every pending task qualifies, evaluation first.
    assert [c.eval_version for c in store.claim_tasks(1, 10)] == [1]


def test_expired_evaluations_fail_and_no_longer_hold_the_run(tmp_path: Path) -> None:
    _, _, store = _run(tmp_path)
    store.add_groups([NewGroup(TaskKind.EVAL, 100 + v, 1, eval_version=v) for v in (0, 1, 2)])
    assert store.expire_evaluations(2) == 2
    counts = store.groups_by_state(TaskKind.EVAL)
    assert counts[GroupState.FAILED] == 2 and counts[GroupState.OPEN] == 1
    assert store.expire_evaluations(2) == 0
    assert [e["kind"] for e in store.tx.read(lambda c: [dict(r) for r in c.exec_driver_sql(
        "select kind from events where kind='eval_expired'").mappings()])] == ["eval_expired"]


def test_control_plane_expires_evaluations_only_once_no_rollout_rank_can_run_them(tmp_path: Path) -> None:
    config, _, store = _run(tmp_path, "rollout.max_staleness=1")
    plane = ControlPlane(config, store)
    store.register_rank(0, Role.ROLLOUT)
    store.register_rank(1, Role.ACTOR)
    store.add_groups([NewGroup(TaskKind.EVAL, 100, 1, eval_version=0)])
    assert plane.expire_evaluations() == 0
    # An open evaluation keeps ERS in preemptive maximum rollout (eval_every_steps is 0 here).
    _publish(store, 1, {0: Role.ROLLOUT, 1: Role.ACTOR})
    _publish(store, 2, {0: Role.ROLLOUT, 1: Role.ACTOR})
    assert plane.signals(2, {0: Role.ROLLOUT, 1: Role.ACTOR}).is_eval_next
    # Rank 0 still holds v0 (its evaluation is running long): the tasks stay, however old.
    store.report(RankReport(rank=0, role=Role.ROLLOUT, version=0))
    assert plane.expire_evaluations() == 0 and store.groups_by_state(TaskKind.EVAL)[GroupState.OPEN] == 1
    # A dead rank that held v0 does not keep them alive; a rollout rank on v2 cannot run them.
    store.register_rank(2, Role.ROLLOUT)
    store.report(RankReport(rank=2, role=Role.ROLLOUT, version=2))
    store.set_rank_state(0, RankState.DEAD)
    assert plane.expire_evaluations() == 1
    assert store.groups_by_state(TaskKind.EVAL)[GroupState.FAILED] == 1
    assert not plane.signals(2, {0: Role.ROLLOUT, 1: Role.ACTOR}).is_eval_next


def rollout_rank(tmp_path: Path, fmt: ChatFormat, groups: list[NewGroup], engine_class: type[FakeEngine] = FakeEngine,
                 delay_s: float = 0.05) -> RankContext:
    """Rank 0 of a run on a real store, rolling out from version 0 beside an actor rank (rank 1), `groups` in the
    pool, with a scripted engine of `engine_class` guessing at random and the environment in-process."""
    config, paths, store = _run(tmp_path, "rollout.max_staleness=1", "rollout.max_concurrency=4")
    store.plan_roles(0, {0: Role.ROLLOUT, 1: Role.ACTOR}, ra2p_mode="colocated", fetch_groups=1)
    store.register_rank(1, Role.ACTOR)
    store.add_groups(groups)
    rng = random.Random(0)
    ctx = RankContext(rank=0, config=config, paths=paths, store=store,
                      system=behaviour(config.system, max_staleness=1, ra2p_mode="auto"), model_dir=tmp_path,
                      env_urls=[], poll_s=0.05)
    ctx.engine = engine_class(lambda prompt: fmt.encode(str(rng.randint(1, 16))), delay_s=delay_s)
    ctx.pool, ctx.chat = LocalEnvLink(), fmt
    return ctx


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(train_tokenizer(corpus_texts("hilo", range(200), noise=0.5), vocab_size=200))


def test_rollout_rank_keeps_the_evaluated_weights_until_its_evaluation_finishes(tmp_path: Path,
                                                                                   fmt: ChatFormat) -> None:
    ctx = rollout_rank(tmp_path, fmt, [NewGroup(TaskKind.EVAL, 100 + i, 1, eval_version=0) for i in range(2)])
    paths, store, engine = ctx.paths, ctx.store, ctx.engine

    def trajectories() -> list[dict]:
        return store.tx.read(lambda c: [dict(r) for r in c.exec_driver_sql(
            "select t.token_versions, g.kind, g.eval_version from trajectories t "
            "join task_groups g on g.id = t.group_id").mappings()])

    async def scenario() -> None:
        rank = asyncio.create_task(run_rollout(ctx, store.plan_at(0)))
        while store.buffer_state().tasks_running < 2:  # the rank holds both evaluation tasks
            await asyncio.sleep(0.02)
        for v in (1, 2, 3):  # the run moves on by more than the staleness bound meanwhile
            _publish(store, v, {0: Role.ROLLOUT, 1: Role.ACTOR}, paths.weights)
        store.add_groups([NewGroup(TaskKind.TRAIN, 7, 2)])
        deadline = asyncio.get_running_loop().time() + 60
        while len(trajectories()) < 4:
            assert asyncio.get_running_loop().time() < deadline, f"only {len(trajectories())} trajectories"
            await asyncio.sleep(0.02)
        store.set_run_state(RunState.FINISHED, "test over")
        assert await asyncio.wait_for(rank, 30) is None

    asyncio.run(scenario())
    by_kind: dict[str, set[int]] = {"eval": set(), "train": set()}
    for t in trajectories():
        by_kind[t["kind"]] |= {v for v in codec.unpack_ints(t["token_versions"]) if v >= 0}
    assert by_kind["eval"] == {0}, "an evaluation of v0 generated with other weights"
    assert by_kind["train"] == {3}, "training tasks were claimed before the rank loaded v3"
    assert [v for _, v in engine.reloads] == [3]
    states = dict(store.tx.read(lambda c: c.exec_driver_sql(
        "select state, count(*) from tasks group by state").all()))
    assert states == {StoreTaskState.DONE.value: 4}
    kinds = store.tx.read(lambda c: [k for (k,) in c.exec_driver_sql("select kind from events")])
    assert "weights_kept" in kinds
    names = store.tx.read(lambda c: {n for (n,) in c.exec_driver_sql("select distinct name from metrics")})
    assert {"prefix_cache_queries", "prefix_cache_hits", "ctb_pauses", "ctb_resumes", "tasks_paused"} <= names
