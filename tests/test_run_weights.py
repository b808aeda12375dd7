"""Which weights a rollout rank loads: verified against SHA256SUMS and the store's checksum; a version
pruned before (or while) it loads gives the newest one; a damaged one is rejected."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tiderl.config import load_job
from tiderl.rollout.engine import EngineError
from tiderl.rundir import create_run
from tiderl.run.weights import WeightsRejected, WeightsSource
from tiderl.store.runstore import RunStore
from tiderl.store.types import VersionRecord
from tiderl.trainer.publish import WeightPublisher, _write_checksums

ROOT = Path(__file__).resolve().parents[1]


def _publish(store: RunStore, root: Path, version: int, keep: int) -> Path:
    """What the trainer does: write weights/vN with its sums, record the version, prune."""
    final = root / f"v{version}"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(bytes([version]) * 64)
    (final / "config.json").write_text("{}")
    checksum = _write_checksums(final)
    store.publish_version(VersionRecord(version=version, path=str(final), checksum=checksum, trajectory_ids=[],
                                        step_started_at=0.0, duration_s=1.0), owner=0)
    WeightPublisher.prune(_Keep(root, keep))  # type: ignore[arg-type]
    return final


class _Keep:
    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep_versions = root, keep


@pytest.fixture
def source(tmp_path: Path) -> WeightsSource:
    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=2", "trainer.num_steps=10"])
    paths, store = create_run(config, tmp_path / "run")
    store.register_initial_version(str(tmp_path / "base"), "0")
    return WeightsSource(store, paths.weights, tmp_path / "base")


def test_a_published_version_verifies_and_version_0_is_the_base_model(source: WeightsSource) -> None:
    _publish(source.store, source.weights_root, 1, keep=3)
    w = source.resolve(1)
    assert (w.version, w.path, w.asked) == (1, source.weights_root / "v1", 1)
    assert source.resolve(0).path == source.base_dir


def test_a_version_pruned_before_the_load_gives_the_newest(source: WeightsSource) -> None:
    # A rank asks for v3; before it gets to it, v4..v6 are published and v3 is pruned.
    for v in range(1, 7):
        _publish(source.store, source.weights_root, v, keep=3)
    assert not (source.weights_root / "v3").exists()
    w = source.resolve(3)
    assert (w.version, w.asked) == (6, 3)


def test_a_version_pruned_while_it_loads_is_followed_to_the_newest(source: WeightsSource) -> None:
    for v in range(1, 4):
        _publish(source.store, source.weights_root, v, keep=3)
    loaded: list[int] = []

    async def load(w):  # an engine's reload reading the directory while the trainer publishes and prunes it
        if w.version == 1:
            for v in range(4, 7):
                _publish(source.store, source.weights_root, v, keep=3)
            raise EngineError(f"vLLM could not reload from {w.path}: no such directory")
        loaded.append(w.version)

    weights = asyncio.run(source.aload(1, load))
    assert (weights.version, weights.asked, loaded) == (6, 1, [6])
    assert asyncio.run(source.aload(5, load)).version == 5


def test_a_load_error_of_a_present_version_is_not_hidden(source: WeightsSource) -> None:
    _publish(source.store, source.weights_root, 1, keep=3)

    async def load(w):
        raise EngineError("out of memory")

    with pytest.raises(EngineError, match="out of memory"):
        asyncio.run(source.aload(1, load))


def test_damaged_or_replaced_weights_are_rejected(source: WeightsSource) -> None:
    v1 = _publish(source.store, source.weights_root, 1, keep=3)
    (v1 / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(WeightsRejected, match="v1 rejected: .*model.safetensors does not match"):
        source.resolve(1)
    # Files and sums consistent with each other, but not what the trainer published.
    _write_checksums(v1)
    with pytest.raises(WeightsRejected, match="not the one the trainer published"):
        source.resolve(1)
    shutil.rmtree(v1)
    with pytest.raises(WeightsRejected, match="does not exist"):  # nothing newer to fall back on
        source.resolve(1)


def test_the_transfer_stages_a_version_by_the_names_its_files_use(tmp_path: Path) -> None:
    """The engines get what a file reload would give them: the trainer's tensors where its names are the files'
    (a tied output layer left out as the files leave it out), the files' own tensors where the model renames
    its weights when it saves them."""
    import torch
    from safetensors.torch import save_file

    from tiderl.run.weights import _as_published

    embed = torch.ones(4, 2)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.zeros(2)}
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    staged = dict(_as_published(tmp_path, state))
    assert list(staged) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert staged["model.embed_tokens.weight"] is embed  # no copy: the server packs it
    renamed = {"model.language_model.embed_tokens.weight": embed, "model.language_model.norm.weight": torch.zeros(2)}
    staged = dict(_as_published(tmp_path, renamed))
    assert sorted(staged) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert torch.equal(staged["model.embed_tokens.weight"], embed)
