"""The trainer's image path (issue 15 item 5): a trajectory's images kept by the run store, its
placeholders expanded into the image tokens the engine saw, its pixels through the vision tower of the
actor and the reference, the weights of both towers published."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tiderl.config import load_job
from tiderl.envs import make_env
from tiderl.policy.ra2p import Ra2pMode
from tiderl.rollout.from_config import chat_format
from tiderl.models.tiny_vl_model import TinyVisionSpec, init_vl_model
from tiderl.rundir import create_run
from tiderl.run.context import RankContext
from tiderl.systems import behaviour
from tiderl.run.trainer_role import run_actor_step
from tiderl.store import codec
from tiderl.store.types import FinishedTrajectory, NewGroup, PlanRecord, RankReport, Role, RunState, TaskKind
from tiderl.trainer.batch import TrainSample, collate
from tiderl.trainer.images import ImageInputs
from tiderl.trainer.publish import verify
from tiderl.trainer.torch_backend import make

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_vl_model(tmp_path_factory.mktemp("vl") / "tiny-gridimage", TinyVisionSpec(num_corpus_episodes=60, train_steps=0))


def _pictures(seed: int, n: int) -> list[bytes]:
    env = make_env("gridimage")
    env.reset(seed=seed, options={})
    out = [env.observation_images()[0]]
    while len(out) < n:
        env.step(env.expert_action())
        out.append(env.observation_images()[0])
    return out


def _sample(vl_model: Path, images: int, seed: int = 0) -> tuple[TrainSample, list[bytes]]:
    """A two-turn image context as the agent loop builds it: `images` pictures, one placeholder each."""
    fmt = chat_format(vl_model)
    rng = random.Random(seed)
    ids = fmt.prompt_ids("where is the goal", images=images - 1)
    mask = [0] * len(ids)
    action = fmt.encode(rng.choice(["up", "down"])) + [fmt.end_of_turn_id]
    ids += action + fmt.env_turn_ids("moved", 1)
    mask += [1] * len(action) + [0] * (len(ids) - len(mask) - len(action))
    action = fmt.encode("left") + [fmt.end_of_turn_id]
    ids += action
    mask += [1] * len(action)
    logprobs = [-1.0 * m for m in mask]
    versions = [0 if m else -1 for m in mask]
    sample = TrainSample(trajectory_id=seed, group_id=0, token_ids=tuple(ids), loss_mask=tuple(mask),
                         rollout_logprobs=tuple(logprobs), token_versions=tuple(versions), advantage=1.0)
    return sample, _pictures(seed, images)


def test_images_pack_into_one_blob_and_a_cut_one_is_named() -> None:
    blobs = [b"\x89PNG a", b"", b"x" * 70_000]
    assert codec.unpack_blobs(codec.pack_blobs(blobs)) == blobs
    assert codec.unpack_blobs(b"") == []
    with pytest.raises(ValueError, match="runs past the end"):
        codec.unpack_blobs(codec.pack_blobs(blobs)[:-1])


def test_expansion_gives_each_picture_its_tokens_and_keeps_the_sampled_ones(vl_model: Path) -> None:
    inputs = ImageInputs(vl_model)
    sample, pngs = _sample(vl_model, images=2)
    out = inputs.expand(sample, pngs)
    assert out.num_tokens == sample.num_tokens + 2 * 3  # 56 x 56 pictures: 4 tokens each, not 1
    assert out.images is not None and out.images.grid_thw.tolist() == [[1, 4, 4], [1, 4, 4]]
    assert sum(out.images.token_types) == 8 and len(out.images.token_types) == out.num_tokens
    # The sampled tokens, their log-probabilities and versions are unchanged, in order.
    assert [t for t, m in zip(out.token_ids, out.loss_mask) if m] == [t for t, m in zip(sample.token_ids,
                                                                                         sample.loss_mask) if m]
    assert out.num_model_tokens == sample.num_model_tokens
    assert all(m == 0 and v == -1 for m, v, k in zip(out.loss_mask, out.token_versions, out.images.token_types) if k)
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        inputs.expand(sample, pngs[:1])


def test_the_trainer_scores_images_through_the_vision_tower(vl_model: Path) -> None:
    inputs = ImageInputs(vl_model)
    ref = make("ref", vl_model)
    sample, pngs = _sample(vl_model, images=2)
    other = _pictures(7, 2)
    a = collate([inputs.expand(sample, pngs)])
    b = collate([inputs.expand(sample, other)])
    assert set(a.vision) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
    lp_a, lp_b = ref.logprobs(a), ref.logprobs(b)
    assert torch.isfinite(lp_a).all()
    sampled = a.loss_mask.bool()
    assert not torch.allclose(lp_a[sampled], lp_b[sampled])  # the pictures reach the scores
    # A text sample and an image sample in one micro-batch: each row scores as on its own.
    text = TrainSample(trajectory_id=9, group_id=1, token_ids=(1, 5, 6, 7), loss_mask=(0, 1, 1, 1),
                       rollout_logprobs=(0.0, -1.0, -1.0, -1.0), token_versions=(-1, 0, 0, 0), advantage=0.5)
    both = collate([text, inputs.expand(sample, pngs)])
    lp_both = ref.logprobs(both)
    assert torch.allclose(lp_both[1][both.loss_mask[1].bool()], lp_a[0][sampled[0]], atol=1e-4)


def test_an_actor_step_trains_on_image_trajectories_and_publishes_both_towers(tmp_path: Path, vl_model: Path) -> None:
    config = load_job(ROOT / "jobs" / "quickstart.yaml", [
        "trainer.groups_min=1", "trainer.groups_ideal=1", "trainer.num_steps=2", "trainer.micro_batch_tokens=256",
        "rollout.group_size=2"])
    paths, store = create_run(config, tmp_path / "run")
    store.register_initial_version(str(vl_model), "0")
    store.register_rank(1, Role.ROLLOUT)
    store.register_rank(0, Role.ACTOR)
    store.set_run_state(RunState.RUNNING)
    store.add_groups([NewGroup(TaskKind.TRAIN, 3, 2)])
    finished = []
    for i, c in enumerate(store.claim_tasks(1, 2)):
        sample, pngs = _sample(vl_model, images=2, seed=i)
        finished.append(FinishedTrajectory(
            task_id=c.task_id, token_ids=list(sample.token_ids), loss_mask=list(sample.loss_mask),
            logprobs=list(sample.rollout_logprobs), token_versions=list(sample.token_versions), num_turns=2,
            reward=float(i), success=bool(i), images=tuple(pngs)))
    store.report(RankReport(rank=1, finished=finished))
    ctx = RankContext(rank=0, config=config, paths=paths, store=store,
                      system=behaviour("tiderl", max_staleness=1, ra2p_mode=config.trainer.ra2p_mode),
                      model_dir=vl_model, env_urls=[], poll_s=0.01)
    plan = PlanRecord(version=0, roles={0: Role.ACTOR, 1: Role.ROLLOUT}, ra2p_mode=Ra2pMode.COLOCATED, fetch_groups=1)
    asyncio.run(run_actor_step(ctx, plan))
    assert store.run_info().version == 1
    (step,) = store.steps()
    assert step["num_trajectories"] == 2
    published = paths.weights_version(1)
    assert verify(published)
    from safetensors import safe_open

    names = set()
    for f in published.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert any(".visual." in f".{n}" for n in names) and any("embed_tokens" in n for n in names)
    # What the store handed the trainer is what the rollout rank reported.
    claimed = store.tx.read(lambda c: c.exec_driver_sql("SELECT images FROM trajectories ORDER BY id").fetchall())
    assert [codec.unpack_blobs(r[0]) for r in claimed] == [list(f.images) for f in finished]


def test_banned_ids_leave_the_distribution_and_no_position_becomes_infinite() -> None:
    from tiderl.trainer.grpo import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 10)
    ids = torch.randint(0, 7, (2, 6))
    ids[0, 3] = 8  # a banned id in the context (an image placeholder of the prompt)
    got = token_logprobs(logits, ids, temperature=0.7, banned=(7, 8))
    scaled = logits[:, :-1] / 0.7
    allowed = torch.log_softmax(scaled.index_fill(-1, torch.tensor([7, 8]), float("-inf")), -1)
    plain = torch.log_softmax(scaled, -1)
    target = ids[:, 1:]
    is_banned = torch.isin(target, torch.tensor([7, 8]))
    want = torch.where(is_banned, plain.gather(-1, target[..., None])[..., 0], allowed.gather(-1, target[..., None])[..., 0])
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5)
    assert torch.equal(token_logprobs(logits, ids), torch.log_softmax(logits[:, :-1], -1).gather(
        -1, target[..., None])[..., 0])  # no banned ids: the plain path, unchanged


def test_the_engine_is_told_never_to_sample_the_vision_tokens(vl_model: Path) -> None:
    from fake_engine import FakeEngine
    from tiderl.rollout.agent_loop import LoopLimits, TaskRun, run_task
    from tiderl.rollout.chat import IMAGE_PAD
    from tiderl.rollout.local_env import LocalEnvLink
    from tiderl.rollout.trajectory import make_group

    fmt = chat_format(vl_model)
    assert fmt.image_pad_id in fmt.banned_ids and len(fmt.banned_ids) == 4
    assert fmt.tokenizer.convert_tokens_to_ids(IMAGE_PAD) == fmt.image_pad_id

    class Gate:
        async def before_generate(self, run: TaskRun, env: object) -> None:
            pass

        def after_turn(self, run: TaskRun) -> None:
            pass

    engine = FakeEngine(lambda prompt: fmt.encode("up"))
    spec = make_group("g", "gridimage", seed=1, group_size=1).tasks[0]
    asyncio.run(run_task(spec, TaskRun(spec=spec), engine, LocalEnvLink(), fmt,
                         LoopLimits(max_turns=2, max_context_tokens=512, max_new_tokens=4), Gate()))
    assert engine.samplings and all(s.banned_token_ids == fmt.banned_ids for s in engine.samplings)
    assert make("ref", vl_model).banned == fmt.banned_ids  # the trainer leaves out the same ids
