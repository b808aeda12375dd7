"""Bells (tiderl.run.bell): a ring wakes a waiter within a slice, a wait without one times out, a failed ring
loses nothing; the run rings them where its waiters wait."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from tiderl.run.bell import SLICE_S, Bell


def test_a_ring_wakes_a_waiter_of_another_view_within_a_slice(tmp_path: Path) -> None:
    path = tmp_path / "bells" / "published"
    waiter, ringer = Bell(path), Bell(path)
    assert not waiter.rang()
    rung_at: list[float] = []

    def ring_later() -> None:
        time.sleep(0.2)
        rung_at.append(time.monotonic())
        ringer.ring()

    threading.Thread(target=ring_later).start()
    assert waiter.wait(5.0)
    woke = time.monotonic() - rung_at[0]
    assert woke < 10 * SLICE_S  # generous on a loaded machine; the timeout is 5 s
    assert not waiter.rang()  # seen: the next wait sleeps again
    started = time.monotonic()
    assert not waiter.wait(0.1) and time.monotonic() - started >= 0.1


def test_every_ring_is_seen_even_within_one_clock_tick(tmp_path: Path) -> None:
    bell = Bell(tmp_path / "b")
    for _ in range(3):
        Bell(tmp_path / "b").ring()  # a new file each time: its inode changes where mtimes are coarse
        assert bell.rang()


def test_the_async_wait_wakes_on_a_ring(tmp_path: Path) -> None:
    bell = Bell(tmp_path / "planned")

    async def main() -> bool:
        async def ring() -> None:
            await asyncio.sleep(0.1)
            Bell(tmp_path / "planned").ring()

        task = asyncio.create_task(ring())
        rang = await bell.wait_async(5.0)
        await task
        return rang

    assert asyncio.run(main())
    assert not asyncio.run(bell.wait_async(0.05))


def test_a_ring_that_cannot_be_written_is_lost_quietly(tmp_path: Path) -> None:
    blocker = tmp_path / "bells"
    blocker.write_text("a file where the bells' directory should be")
    Bell(blocker / "published").ring()  # no exception: the waiters poll the store anyway
    assert list(tmp_path.iterdir()) == [blocker]


def test_a_rollout_report_that_finishes_trajectories_rings_the_finished_bell(tmp_path: Path) -> None:
    from tiderl.config import load_job
    from tiderl.run.context import RankContext
    from tiderl.run.rollout_role import _send
    from tiderl.rundir import create_run
    from tiderl.store.types import FinishedTrajectory, NewGroup, RankReport, Role, TaskKind
    from tiderl.systems import behaviour

    config = load_job(Path(__file__).resolve().parents[1] / "jobs" / "quickstart.yaml", ["rollout.group_size=2"])
    paths, store = create_run(config, tmp_path / "run")
    store.register_initial_version("model", "0")
    store.register_rank(1, Role.ROLLOUT)
    ctx = RankContext(rank=1, config=config, paths=paths, store=store, system=behaviour("async", max_staleness=1,
                      ra2p_mode="auto"), model_dir=tmp_path, env_urls=[])
    trainer = Bell(paths.bell("finished"))
    store.add_groups([NewGroup(TaskKind.TRAIN, 7, 2)])
    assert _send(ctx, RankReport(rank=1), 0, Role.ROLLOUT) == []  # a tick that finished nothing
    assert not trainer.rang()
    claims = store.claim_tasks(1, 2)
    _send(ctx, RankReport(rank=1, finished=[FinishedTrajectory(
        task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
        token_versions=[-1, 0, 0], num_turns=1, reward=1.0, success=True) for c in claims]), 0, Role.ROLLOUT)
    assert trainer.rang()
    assert store.buffer_state().groups_ready == 1
