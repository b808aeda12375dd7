"""`tiderl init-model --env gridimage --train-steps 0`: the tiny vision-language model (random weights) is written
as a directory transformers and vLLM load, with its processor, and is cached; vLLM runs it with
images (the `vllm` test runs tools/check_vision_engine.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.envs import make_env
from tiderl.models.tiny_model import MANIFEST
from tiderl.rollout.chat import IMAGE_PAD, IMAGE_PLACEHOLDER
from tiderl.models.tiny_vl_model import TinyVisionSpec, image_token_counts

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vl") / "tiny-gridimage"
    assert main(["init-model", "--env", "gridimage", "--out", str(out), "--train-steps", "0"]) == 0
    return out


def test_the_directory_holds_what_transformers_and_vllm_load(model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "processor_config.json", "chat_template.jinja", MANIFEST):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["vision_config"]["depth"] == 2 and config["vision_config"]["hidden_size"] == 128
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [4, 6, 6]
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert config["image_token_id"] == special[IMAGE_PAD]
    assert config["vision_start_token_id"] == special["<|vision_start|>"]
    manifest = json.loads((model_dir / MANIFEST).read_text())
    assert manifest["kind"] == "vision-language" and manifest["warm_start"] is None
    assert 0 < manifest["num_vision_parameters"] < manifest["num_parameters"] < 2_000_000


def test_the_processor_and_the_model_read_a_gridimage_picture(model_dir: Path) -> None:
    import torch
    from PIL import Image
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from tiderl.rollout.vision_compat import allow_processors_without_torchvision

    allow_processors_without_torchvision()
    processor = Qwen2VLProcessor.from_pretrained(model_dir)
    env = make_env("gridimage")
    env.reset(seed=4, options={})
    image = Image.open(io.BytesIO(env.observation_images()[0])).convert("RGB")  # type: ignore[attr-defined]
    text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}go<|im_end|>\n<|im_start|>assistant\n"
    batch = processor(text=[text], images=[image], return_tensors="pt")
    image_pad_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert int((batch["input_ids"] == image_pad_id).sum()) == 4 == image_token_counts(TinyVisionSpec(), [(56, 56)])[0]
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[-1] == model.config.text_config.vocab_size and torch.isfinite(logits).all()
    # The picture matters: another placement gives other logits.
    env.reset(seed=5, options={})
    other = Image.open(io.BytesIO(env.observation_images()[0])).convert("RGB")  # type: ignore[attr-defined]
    with torch.no_grad():
        logits_other = model(**processor(text=[text], images=[other], return_tensors="pt")).logits
    assert not torch.allclose(logits[0, -1], logits_other[0, -1])


def test_videos_are_refused_by_name_without_torchvision() -> None:
    from tiderl.rollout.vision_compat import (VideosNeedTorchvisionError, allow_processors_without_torchvision,
                                              images_only_video_processor)

    if not allow_processors_without_torchvision():
        pytest.skip("torchvision is installed: real video processors are used")
    with pytest.raises(VideosNeedTorchvisionError, match="videos need torchvision"):
        images_only_video_processor()(videos=[])


def test_a_second_call_returns_the_cached_model(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    started = time.monotonic()
    assert main(["init-model", "--env", "gridimage", "--out", str(model_dir), "--train-steps", "0"]) == 0
    assert time.monotonic() - started < 5
    out = json.loads(capsys.readouterr().out)
    assert out["cached"] is True and out["kind"] == "vision-language" and out["path"] == str(model_dir)


def test_spec_checks_name_the_field() -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        TinyVisionSpec(mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="vision_embed_dim"):
        TinyVisionSpec(vision_embed_dim=66)
    with pytest.raises(ValueError, match="min_pixels"):
        TinyVisionSpec(min_pixels=100, max_pixels=50)


def test_image_token_counts_follow_the_processor_rounding() -> None:
    spec = TinyVisionSpec()
    assert image_token_counts(spec, [(56, 56), (84, 84), (112, 112), (448, 448), (30, 30)]) == [4, 9, 16, 16, 4]


def test_unknown_envs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init-model", "--env", "nosuchenv", "--out", str(tmp_path / "m")]) == 2
    assert "--env nosuchenv" in capsys.readouterr().err and not (tmp_path / "m").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_runs_the_tiny_vl_model_with_images(tmp_path: Path) -> None:
    # Its own process: the engine is built under `if __name__ == "__main__":` there.
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_vision_engine.py"), "--out",
                           str(tmp_path / "tiny-vl")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    evidence = json.loads(lines[-1])
    assert done.returncode == 0 and all(evidence["checks"].values()), evidence
    assert evidence["tokens_per_image"] == 4 and evidence["ids_same_as_text"]
    assert evidence["prefix_cache_hit_tokens_repeat"] >= 32
    assert evidence["max_abs_logprob_diff"] < 1e-2
    # TideRL's own path: the rollout worker and agent loop hand every generation its images.
    assert evidence["loop_tasks"] >= 4 and evidence["loop_images_match"] and evidence["loop_lengths_match"]
    assert evidence["loop_cached_tokens_with_images"] > 0
    # A weight update resumes a request whose image the prefix cache covered: it finishes on both versions.
    assert evidence["reload_mid_request_spanned"] and evidence["reload_mid_request_cached_tokens"] > 0
    assert evidence["reload_mid_request_max_abs_logprob_diff"] < 1e-3  # against transformers, the picture seen again


def test_the_chat_format_places_images_as_the_chat_template_does(model_dir: Path) -> None:
    from tiderl.rollout.chat import ChatFormat, ImageTokens
    from tiderl.rollout.from_config import chat_format

    fmt = chat_format(model_dir)
    assert fmt.image_tokens == ImageTokens(patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=112 * 112)
    assert [fmt.image_count(w, h) for w, h in [(56, 56), (84, 84), (112, 112)]] == \
        image_token_counts(TinyVisionSpec(), [(56, 56), (84, 84), (112, 112)]) == [4, 9, 16]
    ids = fmt.prompt_ids("go", images=2) + fmt.encode("up") + [fmt.end_of_turn_id] + fmt.env_turn_ids("moved", 1)
    expected = fmt.tokenizer.apply_chat_template([
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "go"}]},
        {"role": "assistant", "content": "up"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "moved"}]}],
        tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected) and ids.count(fmt.image_pad_id) == 3
    text_only = ChatFormat(fmt.tokenizer)  # the same tokenizer without an image processor
    with pytest.raises(ValueError, match="carries 1 image.*text-only"):
        text_only.prompt_ids("go", images=1)


def test_an_image_task_hands_its_pictures_to_the_engine_every_turn(model_dir: Path) -> None:
    """gridimage in-process, a scripted engine: each generation gets the context's images in order, one
    placeholder id each; the context length CTB sees counts each image's tokens; a task handed over at a turn
    boundary carries its images (and their JSON form reads back)."""
    import asyncio
    import random

    from fake_engine import FakeEngine
    from tiderl.rollout.agent_loop import LoopLimits, TaskRun, progress_of, run_task
    from tiderl.rollout.from_config import chat_format
    from tiderl.rollout.local_env import LocalEnvLink
    from tiderl.rollout.trajectory import TaskProgress, make_group

    fmt = chat_format(model_dir)
    rng = random.Random(0)
    engine = FakeEngine(lambda prompt: fmt.encode(rng.choice(["up", "down", "left", "right"])))
    seen: list[tuple[int, int, int, TaskProgress | None]] = []

    class Gate:
        async def before_generate(self, run: TaskRun, env: object) -> None:
            assert run.trajectory is not None
            seen.append((run.context_tokens, run.trajectory.engine_tokens, len(run.trajectory.images),
                         progress_of(run, None)))

        def after_turn(self, run: TaskRun) -> None:
            pass

    spec = make_group("g0", "gridimage", seed=3, group_size=1).tasks[0]
    limits = LoopLimits(max_turns=4, max_context_tokens=1024, max_new_tokens=4, max_images=10)
    t = asyncio.run(run_task(spec, TaskRun(spec=spec), engine, LocalEnvLink(), fmt, limits, Gate()))
    assert t.num_turns >= 1 and len(t.images) == t.token_ids.count(fmt.image_pad_id) == len(t.image_tokens)
    assert all(n == 4 for n in t.image_tokens)  # 56 x 56 pictures: 4 tokens each
    for prompt, images in zip(engine.prompts, engine.images):
        assert len(images) == prompt.count(fmt.image_pad_id) >= 1
        assert list(images) == t.images[:len(images)]
    for context, engine_tokens, shown, progress in seen:
        assert context == engine_tokens
        assert progress is not None and len(progress.images) == shown
        assert engine_tokens == len(progress.token_ids) + 3 * shown  # each placeholder id stands for 4 tokens
        assert TaskProgress.from_json(progress.to_json()) == progress
    # The context limit counts image tokens: a limit the placeholders alone would pass, the pictures do not.
    short = LoopLimits(max_turns=4, max_context_tokens=seen[0][1] + 1, max_new_tokens=4, max_images=10)
    t = asyncio.run(run_task(spec, TaskRun(spec=spec), engine, LocalEnvLink(), fmt, short, Gate()))
    # (at most one id past it: the unsampled closing id of a turn the limit cut)
    assert t.finish == "max_context" and t.engine_tokens <= short.max_context_tokens + 1
    few = LoopLimits(max_turns=4, max_context_tokens=1024, max_new_tokens=4, max_images=1)
    t = asyncio.run(run_task(spec, TaskRun(spec=spec), engine, LocalEnvLink(), fmt, few, Gate()))
    assert t.finish == "max_context" and len(t.images) == 1


def test_options_the_environment_does_not_take_are_refused_before_the_run_is_created(tmp_path: Path) -> None:
    from tiderl.config import ConfigError, load_job
    from tiderl.rundir import create_run

    hilo_options = load_job(ROOT / "jobs" / "quickstart.yaml", ["env.name=gridimage", "model.init_env=gridimage"])
    with pytest.raises(ConfigError, match=r"env.options: gridimage: unknown option 'low'.*known options"):
        create_run(hilo_options, tmp_path / "a")
    wrong_type = load_job(ROOT / "jobs" / "quickstart-vision.yaml", ["env.options.size=big"])
    with pytest.raises(ConfigError, match=r"env.options: gridimage: option 'size' expects int, got 'big'"):
        create_run(wrong_type, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_run_on_an_image_environment_needs_a_vision_language_model(tmp_path: Path, model_dir: Path) -> None:
    from tiderl.config import ConfigError, load_job
    from tiderl.rundir import create_run

    text = load_job(ROOT / "jobs" / "quickstart.yaml", ["env.name=gridimage", "env.options={}"])  # init_env: hilo
    with pytest.raises(ConfigError, match="model.init_env: hilo builds a text model.*set model.init_env: gridimage"):
        create_run(text, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    tiny_text = ROOT / "tests"  # a directory without an image processor config
    with pytest.raises(ConfigError, match="model.path: .* has no image processor config"):
        create_run(load_job(ROOT / "jobs" / "quickstart.yaml", ["env.name=gridimage", "env.options={}",
                                                                  f"model.path={tiny_text}"]),
                   tmp_path / "b")
    for overrides in (["env.name=gridimage", "env.options={}", "model.init_env=gridimage"],
                      ["env.name=gridimage", "env.options={}", f"model.path={model_dir}"]):
        paths, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml", overrides), tmp_path / "c")
        store.close()
        import shutil

        shutil.rmtree(paths.root)


SMALL_STEP = [a for s in ("rollout.group_size=4", "trainer.groups_min=1", "trainer.groups_ideal=1", "launch.num_ranks=3",
                          "launch.rollout_fraction=0.34") for a in ("--set", s)]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vision_job_runs_images_end_to_end(tmp_path: Path) -> None:
    """jobs/quickstart-vision.yaml for 2 steps, for real: pictures to vLLM, into the store, through the
    trainer's vision tower; both towers published; the trainer's log-probabilities match the engine's, with a
    sliding image window of 3 keeping 1 that splits the longer trajectories (each part scored with the
    pruned context the engine saw)."""
    import sqlite3

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "tiderl", "run", "jobs/quickstart-vision.yaml", "--set",
                           "trainer.num_steps=2", "--set", "rollout.eval_every_steps=0", "--set", "model.init_train_steps=0",
                           "--set", "rollout.max_images=3", "--set", "rollout.keep_images=1",
                           # one group of 4 a step on one rollout rank: what is checked is each picture's path
                           *SMALL_STEP, "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    db = sqlite3.connect(run_dir / "run.db")
    try:
        state, version = db.execute("SELECT state, version FROM runs").fetchone()
        with_images, total = db.execute("SELECT count(images), count(*) FROM trajectories").fetchone()
        split = db.execute("SELECT count(prunes) FROM trajectories WHERE state = 'consumed'").fetchone()[0]
        mismatch = [v for (v,) in db.execute("SELECT value FROM metrics WHERE name = 'logprob_mismatch_on_policy'")]
        paths = {name for (name,) in db.execute("SELECT DISTINCT name FROM metrics WHERE name LIKE 'weights_%_stall_s'")}
    finally:
        db.close()
    assert (state, version) == ("finished", 2)
    assert total > 0 and with_images == total  # every trajectory kept its pictures
    assert split > 0  # trained trajectories the window split
    assert mismatch and max(mismatch) <= 1e-4, mismatch  # the engine serves the published weights
    assert paths == {"weights_files_stall_s"}, paths  # read from weights/vN (the files path of a real vLLM run)
    weights = json.loads((run_dir / "weights" / "v2" / "config.json").read_text())
    assert "vision_config" in weights  # the vision-language model was trained and published whole
