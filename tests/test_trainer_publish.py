"""Weight publishing, retention, checksums, checkpoints and resume on a tiny Qwen2."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiderl.config.trainer import TrainerConfig
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.modes import TrainerComm
from tiderl.trainer.publish import CHECKSUM_FILE, ChecksumError, verify
from tiderl.trainer.rank import ActorRank, PublishedStep, StepInput, find_resume_point
from tiderl.trainer.synthetic import make_model_dir, random_samples

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("base"))


class Source:
    def __init__(self, mode: Ra2pMode = Ra2pMode.COLOCATED) -> None:
        self.mode = mode

    def next_step(self, version: int) -> StepInput:
        return StepInput(version, tuple(random_samples(2, 4, version=version, seed=100 + version)), self.mode)


def run(rank: ActorRank, num_steps: int) -> list[PublishedStep]:
    """Train `num_steps` steps from the rank's version, as tiderl.run.trainer_role does one at a time."""
    out = []
    for _ in range(num_steps):
        result = rank.train_step(Source().next_step(rank.version))
        assert isinstance(result, PublishedStep)
        verify(result.published.path)  # the version directory is complete when the step returns
        out.append(result)
    return out


def _rank(base: Path, run: Path, **cfg) -> ActorRank:
    config = TrainerConfig(micro_batch_tokens=64, lr=1e-3, **cfg)
    return ActorRank(config, TrainerComm(rank=0, actor_ranks=(0,)), base_model=base,
                     weights_root=run / "weights", ckpt_root=run / "ckpt", with_ref=True)


def test_publish_each_step_keep_last_n_and_load_with_transformers(base, tmp_path):
    rank = _rank(base, tmp_path, keep_versions=2, checkpoint_every=2)
    results = run(rank, 3)
    assert [r.published.version for r in results] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step2"]
    assert [r.checkpoint is not None for r in results] == [False, True, False]
    v3 = tmp_path / "weights" / "v3"
    assert verify(v3) == results[-1].published.checksum
    model = AutoModelForCausalLM.from_pretrained(v3)
    tok = AutoTokenizer.from_pretrained(v3)
    ids = tok("guess 42 higher")["input_ids"]
    assert len(ids) > 1 and tok.decode(ids) == "guess 42 higher"
    trained = rank.actor.model.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, trained[name]), name
    # training moved the weights away from the base model
    base_model = AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(base_model.lm_head.weight, model.lm_head.weight)
    stats = results[-1].stats
    assert stats.num_sequences == 8 and stats.num_swaps == 2 and stats.staleness_max <= 1


def test_resume_continues_exactly_like_an_uninterrupted_run(base, tmp_path):
    straight = _rank(base, tmp_path / "a", checkpoint_every=1)
    run(straight, 3)
    first = _rank(base, tmp_path / "b", checkpoint_every=1)
    run(first, 2)
    resumed = _rank(base, tmp_path / "b", checkpoint_every=1)
    assert resumed.version == 2 and resumed.resumed_from.is_exact
    run(resumed, 1)
    a, b = straight.actor.model.state_dict(), resumed.actor.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_resume_with_an_older_checkpoint_keeps_the_newest_weights(base, tmp_path):
    first = _rank(base, tmp_path, checkpoint_every=2)
    run(first, 3)
    point = find_resume_point(base, tmp_path / "weights", tmp_path / "ckpt")
    assert point.version == 3 and point.checkpoint.version == 2 and not point.is_exact
    resumed = _rank(base, tmp_path, checkpoint_every=2)
    assert resumed.version == 3
    assert resumed.actor.optimizer.state_dict()["state"], "AdamW moments restored"


def test_damaged_version_is_detected_and_skipped(base, tmp_path):
    rank = _rank(base, tmp_path, keep_versions=3)
    run(rank, 2)
    v2 = tmp_path / "weights" / "v2"
    weights = next(v2.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ChecksumError, match="does not match"):
        verify(v2)
    assert find_resume_point(base, tmp_path / "weights", tmp_path / "ckpt").version == 1
    (tmp_path / "weights" / "v1" / CHECKSUM_FILE).unlink()
    assert find_resume_point(base, tmp_path / "weights", tmp_path / "ckpt").version == 0


def test_failed_publish_leaves_no_version_and_no_temporary(base, tmp_path):
    rank = _rank(base, tmp_path)

    def broken(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise OSError("disk full")

    rank.actor.save_weights = broken
    with pytest.raises(OSError, match="disk full"):
        rank.train_step(Source().next_step(0))
    assert list((tmp_path / "weights").iterdir()) == []


def test_verify_refuses_empty_malformed_and_incomplete_sums(base, tmp_path):
    rank = _rank(base, tmp_path, keep_versions=3)
    run(rank, 1)
    v1 = tmp_path / "weights" / "v1"
    sums = v1 / CHECKSUM_FILE
    good = sums.read_text()
    verify(v1)
    sums.write_text("")
    with pytest.raises(ChecksumError, match="lists no files"):
        verify(v1)
    sums.write_text("not-a-digest  config.json\n")
    with pytest.raises(ChecksumError, match="line 1 is not"):
        verify(v1)
    sums.write_text(good)
    (v1 / "extra.safetensors").write_bytes(b"\0" * 16)  # vLLM would load it too
    with pytest.raises(ChecksumError, match="not listed in SHA256SUMS: extra.safetensors"):
        verify(v1)
    (v1 / "extra.safetensors").unlink()
    sums.write_text("".join(line + "\n" for line in good.splitlines() if "safetensors" not in line))
    with pytest.raises(ChecksumError, match="not listed"):
        verify(v1)


def test_prune_removes_the_temporaries_of_interrupted_publishes(base, tmp_path):
    rank = _rank(base, tmp_path, keep_versions=2)
    run(rank, 1)
    left = tmp_path / "weights" / ".v2.tmp-killed"  # a trainer killed while it wrote v2
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 16)
    run(rank, 1)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v1", "v2"]
