"""A rank that leaves rollout for the trainer frees its engine's accelerator memory, and takes it back when it
rolls out again (tiderl.run.rollout_role.release_engine; vLLM's sleep mode on a GPU, the scripted engine here)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from fake_engine import FakeEngine
from tiderl.rollout.engine import EngineError, SamplingSpec
from tiderl.run.rollout_role import _restore, release_engine


class Events:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def record_event(self, source: str, kind: str, message: str, **_: object) -> None:
        self.kinds.append(kind)


def test_the_engine_is_released_for_the_trainer_once_and_restored_for_rollout() -> None:
    engine = FakeEngine(lambda prompt: [7, 8], kv_capacity_tokens=256)
    store = Events()
    ctx = SimpleNamespace(engine=engine, rank=3, store=store)
    sampling = SamplingSpec(max_new_tokens=2)
    asyncio.run(release_engine(ctx))
    assert engine.memory_released and store.kinds == ["engine_released"]
    with pytest.raises(EngineError, match="memory is released"):
        asyncio.run(engine.generate([1, 2, 3], sampling))
    asyncio.run(release_engine(ctx))  # a second trainer step: nothing more to free
    assert store.kinds == ["engine_released"]
    asyncio.run(_restore(ctx, engine))
    assert not engine.memory_released and store.kinds == ["engine_released", "engine_restored"]
    assert asyncio.run(engine.generate([1, 2, 3], sampling)).token_ids == (7, 8)
    asyncio.run(_restore(ctx, engine))  # restored already: no event
    assert store.kinds == ["engine_released", "engine_restored"]


def test_a_rank_without_an_engine_or_with_one_that_cannot_release_records_nothing() -> None:
    store = Events()
    asyncio.run(release_engine(SimpleNamespace(engine=None, rank=1, store=store)))

    class Kept(FakeEngine):
        async def release_memory(self) -> bool:  # a CPU vLLM engine: no sleep mode
            return False

    engine = Kept(lambda prompt: [7], kv_capacity_tokens=256)
    asyncio.run(release_engine(SimpleNamespace(engine=engine, rank=1, store=store)))
    assert store.kinds == [] and not engine.memory_released


@pytest.mark.parametrize("state", ["running", "finished"])
def test_a_failed_transfer_loads_the_files_while_the_run_goes_on_and_nothing_once_it_ended(
        tmp_path, monkeypatch, state: str) -> None:
    """The trainer leader stops its weight server when the run ends: a rank that asks after that stops too,
    without a `weights_transfer_failed` event or a reload from files (the test run's fall-back seen in CI)."""
    from tiderl.run import rollout_role
    from tiderl.run.context import RunStopped
    from tiderl.store.types import RankReport, Role, RunState

    engine = FakeEngine(lambda prompt: [7], kv_capacity_tokens=256)
    loaded: list[int] = []

    class Files:
        async def aload(self, version, load):
            loaded.append(version)
            return SimpleNamespace(version=version, asked=version)

    monkeypatch.setattr(rollout_role, "_weights", lambda ctx: Files())

    class Position:
        def position(self):
            if RunState(state).is_terminal:
                raise RunStopped(state)
            return 2

    ctx = SimpleNamespace(rank=1, config=SimpleNamespace(trainer=SimpleNamespace(weight_sync="transfer")),
                          paths=SimpleNamespace(weight_server=tmp_path / "weight-server.json"))  # no server named
    ctx.position = Position().position
    report = RankReport(rank=1, role=Role.ROLLOUT, version=1)
    if state == "finished":
        with pytest.raises(RunStopped):
            asyncio.run(rollout_role._reload(ctx, engine, 2, report))
        assert not loaded and not report.events
    else:
        assert asyncio.run(rollout_role._reload(ctx, engine, 2, report)) == 2
        assert loaded == [2] and [e.kind for e in report.events] == ["weights_transfer_failed"]
