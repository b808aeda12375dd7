"""A rollout rank whose engine dies ends, its tasks back in the pool with no attempt counted (tiderl.run.rollout_role,
`_engine_failed`): here the engine fails while it loads a version (a mix of weights left), on a real store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fake_engine import FakeEngine
from test_run_eval_pinning import _publish, rollout_rank
from tiderl.models.demos import corpus_texts
from tiderl.models.tiny_model import train_tokenizer
from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import EngineError
from tiderl.run.rollout_role import EngineFailed, run_rollout
from tiderl.store.types import NewGroup, Role, TaskKind


class BreaksOnReload(FakeEngine):
    dead: BaseException | None = None

    @property
    def failure(self) -> BaseException | None:
        return self.dead

    async def reload_weights(self, weights_dir, version) -> None:
        self.dead = EngineError("reload_weights: a damaged bucket found while loading: the weights are a mix")
        raise self.dead

    async def generate(self, prompt_ids, sampling, images=()):
        if self.dead is not None:
            raise EngineError(f"the engine is unusable: {self.dead}")
        return await super().generate(prompt_ids, sampling, images)


def test_an_engine_that_dies_loading_a_version_gives_the_tasks_back_and_ends_the_rank(tmp_path: Path) -> None:
    fmt = ChatFormat(train_tokenizer(corpus_texts("hilo", range(200), noise=0.5), vocab_size=200))
    ctx = rollout_rank(tmp_path, fmt, [NewGroup(TaskKind.TRAIN, 7, 4)], BreaksOnReload, delay_s=0.5)
    paths, store = ctx.paths, ctx.store

    async def scenario() -> None:
        rank = asyncio.create_task(run_rollout(ctx, store.plan_at(0)))
        while store.buffer_state().tasks_running < 4:  # the rank holds every task
            await asyncio.sleep(0.02)
        _publish(store, 1, {0: Role.ROLLOUT, 1: Role.ACTOR}, paths.weights)  # the version it fails to load
        with pytest.raises(EngineFailed, match="engine failed"):
            await asyncio.wait_for(rank, 30)

    asyncio.run(scenario())
    buffer = store.buffer_state()
    assert (buffer.tasks_running, buffer.tasks_pending, buffer.tasks_failed) == (0, 4, 0)
    attempts = store.tx.read(lambda c: [r[0] for r in c.exec_driver_sql("select attempts from tasks")])
    assert attempts == [0, 0, 0, 0], attempts  # given back, not failed: no attempt counted
    kinds = store.tx.read(lambda c: [r[0] for r in c.exec_driver_sql("select kind from events")])
    assert "engine_failed" in kinds
