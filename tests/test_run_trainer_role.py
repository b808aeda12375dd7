"""The trainer role the run executes (tiderl.run.trainer_role.run_actor_step), driven by a fast test: a real
run store in, real published weights out (a tiny synthetic Qwen2, real torch), the rollout side played
through the store API."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tiderl.config import load_job
from tiderl.policy.ra2p import Ra2pMode
from tiderl.rundir import create_run
from tiderl.run.context import RankContext
from tiderl.systems import behaviour
from tiderl.run.trainer_role import run_actor_step
from tiderl.store.types import FinishedTrajectory, NewGroup, PlanRecord, RankReport, Role, TaskKind
from tiderl.trainer.publish import verify
from tiderl.trainer.synthetic import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = 1


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("base"))


def _ctx(tmp_path: Path, base: Path, max_staleness: int, *overrides: str) -> RankContext:
    config = load_job(ROOT / "jobs" / "quickstart.yaml", [
        "trainer.groups_min=2", "trainer.groups_ideal=2", "trainer.num_steps=4", "trainer.micro_batch_tokens=64",
        "rollout.group_size=4", f"rollout.max_staleness={max_staleness}", "trainer.checkpoint_every=1", *overrides])
    paths, store = create_run(config, tmp_path / "run")
    store.register_initial_version(str(base), "0")
    store.register_rank(ROLLOUT, Role.ROLLOUT)
    store.register_rank(0, Role.ACTOR)
    system = behaviour("tiderl", max_staleness=max_staleness, ra2p_mode=config.trainer.ra2p_mode)
    return RankContext(rank=0, config=config, paths=paths, store=store, system=system, model_dir=base,
                       env_urls=[], poll_s=0.01)


def _feed(ctx: RankContext, seeds: range, version: int, finish: str | None = None) -> None:
    """Groups of 4 tasks played to the end by the rollout rank, their tokens sampled at `version`."""
    rng = random.Random(seeds.start)
    ctx.store.add_groups([NewGroup(TaskKind.TRAIN, s, 4) for s in seeds])
    finished = []
    for c in ctx.store.claim_tasks(ROLLOUT, 4 * len(seeds)):
        k = rng.randint(8, 20)
        mask = [0, 0, 0] + [1] * (k - 3)
        finished.append(FinishedTrajectory(
            task_id=c.task_id, token_ids=[rng.randrange(3, 300) for _ in range(k)], loss_mask=mask,
            logprobs=[-1.5 * m for m in mask], token_versions=[version if m else -1 for m in mask],
            num_turns=2, reward=float(c.index_in_group % 2), success=bool(c.index_in_group % 2),
            finish=finish if finish is None or c.index_in_group < 2 else "done"))
    ctx.store.report(RankReport(rank=ROLLOUT, finished=finished))


def _plan(version: int) -> PlanRecord:
    return PlanRecord(version=version, roles={0: Role.ACTOR, ROLLOUT: Role.ROLLOUT}, ra2p_mode=Ra2pMode.COLOCATED,
                      fetch_groups=2)


def test_a_step_claims_the_batch_trains_and_publishes_the_version(tmp_path: Path, base: Path) -> None:
    torch.manual_seed(0)
    ctx = _ctx(tmp_path, base, max_staleness=1)
    _feed(ctx, range(3), version=0)
    asyncio.run(run_actor_step(ctx, _plan(0)))
    info = ctx.store.run_info()
    assert info.version == 1
    (step,) = ctx.store.steps()
    assert step["num_trajectories"] == 8 and step["ras"] >= 1  # 2 groups of 4; the data was there at the start
    assert step["ra2p_mode"] == "colocated"
    assert verify(ctx.paths.weights_version(1))  # published whole, with its checksums
    assert ctx.paths.checkpoint(1).is_dir()
    buf = ctx.store.buffer_state()
    assert buf.traj_consumed == 8 and buf.groups_ready == 1  # the third group waits for the next step
    points = {m["name"]: m for m in ctx.store.reader.metric_rows(["kl", "train_s", "twt_s", "clip_frac", "entropy"])}
    assert set(points) == {"kl", "train_s", "twt_s", "clip_frac", "entropy"}
    assert points["train_s"]["value"] > 0 and points["kl"]["version"] == 0 and points["kl"]["role"] == "actor"
    assert points["entropy"]["value"] > 0 and points["entropy"]["role"] == "actor"


def test_a_streaming_system_trains_the_groups_that_are_ready_while_the_rest_are_generated(
        tmp_path: Path, base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tiderl streams (RA2P): a chunk as soon as a micro-batch's tokens are claimed, the groups that became
    ready meanwhile in the next, one optimizer step once the fetch is complete; async claims it whole."""
    from tiderl.trainer.rank import ActorRank

    chunks: list[int] = []
    feed = ActorRank.feed
    monkeypatch.setattr(ActorRank, "feed", lambda self, samples: (chunks.append(len(samples)), feed(self, samples)))

    async def step_while_generating(ctx: RankContext) -> None:
        async def generate() -> None:
            await asyncio.sleep(0.5)
            _feed(ctx, range(1, 2), version=0)

        await asyncio.gather(run_actor_step(ctx, _plan(0)), generate())

    # A group holds 32-80 tokens: a micro-batch of 32 is ready with the first.
    ctx = _ctx(tmp_path / "tiderl", base, 1, "trainer.micro_batch_tokens=32")
    _feed(ctx, range(1), version=0)  # one group ready at the start, the other 0.5 s later
    asyncio.run(step_while_generating(ctx))
    assert chunks == [4, 4]
    assert [m["value"] for m in ctx.store.reader.metric_rows(["chunks"])] == [2]
    assert ctx.paths.bell("published").is_file()  # rung after the commit: the control plane plans at once
    (step,) = ctx.store.steps()
    assert step["num_trajectories"] == 8 and verify(ctx.paths.weights_version(1))
    twt = sum(m["value"] for m in ctx.store.reader.metric_rows(["twt_s"]))
    assert 0.3 < twt < step["duration_s"]  # the wait for the second group, not the first chunk's training

    chunks.clear()
    ctx = _ctx(tmp_path / "async", base, 1, "trainer.micro_batch_tokens=32")
    ctx.system = behaviour("async", max_staleness=1, ra2p_mode="auto")
    _feed(ctx, range(1), version=0)
    asyncio.run(step_while_generating(ctx))
    assert chunks == [8]


def test_groups_beyond_the_staleness_bound_are_dropped_not_trained(tmp_path: Path, base: Path) -> None:
    ctx = _ctx(tmp_path, base, max_staleness=0)
    _feed(ctx, range(2), version=0)
    asyncio.run(run_actor_step(ctx, _plan(0)))
    _feed(ctx, range(2, 3), version=0)  # sampled on v0: too stale for step 1 at staleness 0
    _feed(ctx, range(3, 5), version=1)
    asyncio.run(run_actor_step(ctx, _plan(1)))
    assert ctx.store.run_info().version == 2
    second = ctx.store.steps()[-1]
    assert second["num_trajectories"] == 8
    buf = ctx.store.buffer_state()
    assert buf.traj_consumed == 16 and buf.groups_ready == 0 and buf.traj_claimed == 0
    (event,) = ctx.store.recent_events(kinds=["stale_dropped"])
    assert "1 groups dropped" in event["message"]


def test_how_a_task_ended_reaches_the_trainer(tmp_path: Path, base: Path) -> None:
    """A trajectory cut by its turn or context limit is marked so in the store and in its training sample
    (`trainer.mask_truncated` leaves such samples out of the step: tests/test_trainer_plan.py)."""
    from tiderl.trainer.store_io import samples_from_ready

    ctx = _ctx(tmp_path, base, max_staleness=1)
    _feed(ctx, range(1), version=0, finish="max_turns")
    got = ctx.store.claim_ready_groups(0, 1)
    assert sorted(t.finish for t in got) == ["done", "done", "max_turns", "max_turns"]
    assert sorted(s.truncated for t in got for s in samples_from_ready(t)) == [False, False, True, True]
    assert ctx.store.tx.read(lambda c: [r[0] for r in c.exec_driver_sql(
        "SELECT finish FROM trajectories ORDER BY id")]) == [t.finish for t in sorted(got, key=lambda t: t.id)]


def _member(run_dir: str, base: str, rank: int, role: str, versions: int = 1, fetch: int = 2) -> None:
    """A trainer rank of its own process, as in a run: a follower actor or a ref rank of the steps of
    versions 0 .. versions - 1 (one layout): the group formed for the first step runs the others."""
    from tiderl.paths import RunPaths
    from tiderl.run.trainer_role import run_ref_step
    from tiderl.store import RunStore

    paths = RunPaths(Path(run_dir))
    config = load_job(paths.config)
    ctx = RankContext(rank=rank, config=config, paths=paths, store=RunStore.for_run_dir(paths.root),
                      system=behaviour("tiderl", max_staleness=1, ra2p_mode=config.trainer.ra2p_mode),
                      model_dir=Path(base), env_urls=[], poll_s=0.01)
    step = run_ref_step if role == "ref" else run_actor_step
    comms = []
    for version in range(versions):
        asyncio.run(step(ctx, _group_plan(version, fetch)))
        assert ctx.trainer_group is not None and ctx.trainer_group.version == version
        comms.append(ctx.trainer_group.comm)
    assert all(c is comms[0] for c in comms), "the layout did not change: the group must be kept"


def _group_plan(version: int = 0, fetch: int = 2) -> PlanRecord:
    return PlanRecord(version=version, roles={0: Role.ACTOR, ROLLOUT: Role.ROLLOUT, 2: Role.REF, 3: Role.ACTOR},
                      ra2p_mode=Ra2pMode.DECOUPLED, fetch_groups=fetch)


def _start_members(ctx: RankContext, base: Path, versions: int, fetch: int) -> list:
    import subprocess
    import sys

    def start(rank: int, role: str) -> subprocess.Popen[str]:
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_run_trainer_role as t; "
                f"t._member({str(ctx.paths.root)!r}, {str(base)!r}, {rank}, {role!r}, versions={versions}, "
                f"fetch={fetch})")
        return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    return [start(0, "actor"), start(3, "actor"), start(2, "ref")]


def _join(members: list) -> None:
    try:
        for p in members:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out
    finally:
        for p in members:
            if p.poll() is None:
                p.kill()


def test_a_decoupled_data_parallel_step_runs_as_one_trainer_group(tmp_path: Path, base: Path) -> None:
    """Two actors (data parallel) and a ref rank, each its own process: the leader gathers and publishes, the
    other actor trains its share, the ref serves the reference log-probabilities; they meet in the trainer
    group's current restart generation, and keep that group for the next version's step (same layout)."""
    ctx = _ctx(tmp_path, base, max_staleness=1)
    ctx.store.register_rank(2, Role.REF)
    ctx.store.register_rank(3, Role.ACTOR)
    assert ctx.store.advance_trainer_generation(0, [0, 2, 3])  # as after one restart of the group
    _feed(ctx, range(4), version=0)
    _join(_start_members(ctx, base, versions=2, fetch=2))
    assert ctx.store.run_info().version == 2
    steps = ctx.store.steps()
    assert [(s["num_trajectories"], s["ra2p_mode"]) for s in steps] == [(8, "decoupled")] * 2
    assert verify(ctx.paths.weights_version(1)) and verify(ctx.paths.weights_version(2))
    assert ctx.paths.data_ready(0, 1).is_file() and not ctx.paths.rendezvous_generation(0).exists()
    trained = {(m["rank"], m["name"]) for m in ctx.store.reader.metric_rows(["train_s"])}
    assert {(0, "train_s"), (3, "train_s")} <= trained  # both actors trained their share


def test_a_streamed_decoupled_step_hands_each_chunk_to_the_group_as_its_groups_arrive(
        tmp_path: Path, base: Path) -> None:
    """Two actors and a ref rank, a fetch of 4 groups of which 3 are ready: the leader hands those to the
    group as chunk 0 (marker, broadcast, trained), the fourth, generated meanwhile, as chunk 1 behind its own
    marker; the step trains all 16 trajectories and publishes once."""
    import time

    ctx = _ctx(tmp_path, base, 1, "trainer.groups_ideal=4", "trainer.micro_batch_tokens=32")
    ctx.store.register_rank(2, Role.REF)
    ctx.store.register_rank(3, Role.ACTOR)
    _feed(ctx, range(3), version=0)
    members = _start_members(ctx, base, versions=1, fetch=4)
    generation = ctx.store.trainer_generation().number
    deadline = time.monotonic() + 240
    while not ctx.paths.data_ready(0, generation).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    _feed(ctx, range(3, 4), version=0)
    _join(members)
    assert ctx.paths.data_ready(0, generation, 1).is_file()
    (step,) = ctx.store.steps()
    assert step["num_trajectories"] == 16 and step["ra2p_mode"] == "decoupled"
    assert verify(ctx.paths.weights_version(1))


def test_a_held_trainer_group_runs_the_next_step_only_of_the_same_layout() -> None:
    from tiderl.trainer.group import HeldGroup
    from tiderl.trainer.modes import TrainerComm

    layout = ((0, 3), (2,), 1)
    held = HeldGroup(layout, 4, TrainerComm(rank=0, actor_ranks=(0, 1), ref_ranks=(2,)))
    assert held.continues(layout, 5)
    assert not held.continues(layout, 6)  # a version's step ran without this rank: another group met for it
    assert not held.continues(layout, 4)
    assert not held.continues(((0, 3), (), 1), 5)  # ERS moved the ref rank
    assert not held.continues(((0,), (2, 3), 1), 5)
    assert not held.continues(((0, 3), (2,), 2), 5)  # a restart moved the generation on


def _mover(run_dir: str, base: str, rank: int, layouts: list[list[int]]) -> None:
    """A trainer rank of its own process that acts on the plan of each version as a run's rank does: first
    the hand-off (tiderl.run.handoff), then its step where it is an actor; elsewhere it waits for the version."""
    import time

    from tiderl.paths import RunPaths
    from tiderl.run.handoff import hand_off
    from tiderl.store import RunStore

    paths = RunPaths(Path(run_dir))
    config = load_job(paths.config)
    ctx = RankContext(rank=rank, config=config, paths=paths, store=RunStore.for_run_dir(paths.root),
                      system=behaviour("async", max_staleness=3, ra2p_mode=config.trainer.ra2p_mode),
                      model_dir=Path(base), env_urls=[], poll_s=0.01)
    for version, actors in enumerate(layouts):
        while ctx.store.run_info().version < version:
            time.sleep(0.02)
        plan = PlanRecord(version=version, roles={r: Role.ACTOR if r in actors else Role.ROLLOUT for r in (0, 3)},
                          ra2p_mode=Ra2pMode.COLOCATED, fetch_groups=2)
        hand_off(ctx, plan)
        if rank in actors:
            asyncio.run(run_actor_step(ctx, plan))


def _sharded_run(tmp_path: Path, base: Path, layouts: list[list[int]]) -> RankContext:
    import subprocess
    import sys

    ctx = _ctx(tmp_path, base, 3, "trainer.backend=fsdp", "trainer.ra2p_mode=colocated", "trainer.checkpoint_every=100",
               "trainer.lr=1e-3", "trainer.num_steps=3")
    ctx.store.register_rank(3, Role.ACTOR)
    for v in range(len(layouts)):
        _feed(ctx, range(2 * v, 2 * v + 2), version=0)
    code = ("import sys; sys.path.insert(0, {tests!r}); import test_run_trainer_role as t; "
            "t._mover({run!r}, {base!r}, {rank}, {layouts!r})")
    _join([subprocess.Popen([sys.executable, "-c", code.format(tests=str(ROOT / "tests"), run=str(ctx.paths.root),
                                                               base=str(base), rank=rank, layouts=layouts)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 3)])
    return ctx


@pytest.mark.slow
def test_a_sharded_actor_moved_from_two_ranks_to_one_and_back_trains_as_one_that_stayed(
        tmp_path: Path, base: Path) -> None:
    """`trainer.backend: fsdp`, two actor ranks; ERS moves rank 3 to rollout after the first step and back after
    the second. Each time the ranks that hold the state check it in (their shards, then the lone actor's whole
    state) before the next layout trains, so no AdamW moment is lost: the weights of version 3 are those of a
    run whose actors never moved, within 1e-5 (at a learning rate of 1e-3, lost moments move them by ~1e-3)."""
    from safetensors.torch import load_file

    from tiderl.trainer.publish import Checkpointer

    moved = _sharded_run(tmp_path / "moved", base, [[0, 3], [0], [0, 3]])
    still = _sharded_run(tmp_path / "still", base, [[0, 3], [0, 3], [0, 3]])
    assert moved.store.run_info().version == still.store.run_info().version == 3
    handoffs = [e["message"] for e in reversed(moved.store.recent_events(kinds=["actor_handoff"]))]
    assert handoffs == ["actor state of version 1 checked in by ranks [0, 3] for actors [0]",
                        "actor state of version 2 checked in by ranks [0] for actors [0, 3]"], handoffs
    assert not still.store.recent_events(kinds=["actor_handoff"])
    assert Checkpointer(moved.paths.ckpt, every=1).latest().extra == {"handoff": True}
    a, b = (load_file(ctx.paths.weights_version(3) / "model.safetensors") for ctx in (moved, still))
    worst = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert worst <= 1e-5, worst
