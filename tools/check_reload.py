"""Does the rollout engine serve exactly the weights the trainer published?

For each version of a run (the base model, then every `weights/vN` still on disk), the run's own
engine (`rollout.engine: vllm`, built from the run's config) reloads the version as a rollout rank
does, samples a few tokens after the opening context of some of the run's environment's games (their
pictures too, for an image environment) at the run's temperature, and the trainer's reference backend
(transformers) loaded from the same published files scores those tokens. Prints one JSON line per
version: `max_abs_logprob_diff` over the sampled tokens, with the token count and the reload time.
Exit status 1 where a version differs by more than `--tolerance` (1e-4 nats: fp32 on a CPU).

    python tools/check_reload.py --versions RUN_DIR [--model DIR] [--games 16] [--tokens 16]

`--model`: the base model directory (default: the run's own, version 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any


def published_versions(run_dir: Path) -> list[tuple[int, Path]]:
    """`weights/vN` directories that hold weights, by version."""
    found = []
    for d in (run_dir / "weights").glob("v*"):
        m = re.fullmatch(r"v(\d+)", d.name)
        if m and d.is_dir() and any(d.glob("*.safetensors")):
            found.append((int(m.group(1)), d))
    return sorted(found)


def opening_contexts(job: Any, fmt: Any, games: int) -> list[tuple[list[int], list[bytes]]]:
    """The opening context (ids, pictures) of the job's environment's games 0..games-1, as the agent loop builds it."""
    from tiderl.envs import make_env

    out = []
    for seed in range(games):
        env = make_env(job.env.name)
        observation, _ = env.reset(seed=seed, options=dict(job.env.options))
        pictures = list(getattr(env, "observation_images", lambda: [])())
        env.close()
        out.append((fmt.prompt_ids(observation, images=len(pictures)), pictures))
    return out


async def sample(engine: Any, fmt: Any, contexts: list[tuple[list[int], list[bytes]]], tokens: int,
                 temperature: float) -> list[Any]:
    from tiderl.envs.images import check_png
    from tiderl.rollout.engine import SamplingSpec

    def spec(seed: int) -> SamplingSpec:
        return SamplingSpec(max_new_tokens=tokens, temperature=temperature, stop_token_ids=(),
                            banned_token_ids=fmt.banned_ids, seed=seed)

    return list(await asyncio.gather(*(engine.generate(ids, spec(i), [check_png(p) for p in pngs])
                                       for i, (ids, pngs) in enumerate(contexts))))


def scored_diff(weights_dir: Path, contexts: list[tuple[list[int], list[bytes]]], generations: list[Any],
                temperature: float, pad_id: int) -> tuple[float, int]:
    """The largest |engine - trainer| log-probability over the generated tokens, and their count."""
    import torch

    from tiderl.rollout.chat import ImageTokens
    from tiderl.trainer.batch import TrainSample, collate
    from tiderl.trainer.torch_backend import TorchRef

    ref = TorchRef(weights_dir, torch.device("cpu"), temperature=temperature)
    images = None
    if ImageTokens.of_model(weights_dir) is not None:
        from tiderl.trainer.images import ImageInputs

        images = ImageInputs(weights_dir)
    worst, count = 0.0, 0
    for i, ((ids, pngs), g) in enumerate(zip(contexts, generations)):
        n = len(ids)
        s = TrainSample(trajectory_id=i, group_id=0, token_ids=tuple(ids) + g.token_ids,
                        loss_mask=(0,) * n + (1,) * len(g.token_ids),
                        rollout_logprobs=(0.0,) * n + g.logprobs, token_versions=(0,) * (n + len(g.token_ids)),
                        advantage=0.0)
        if images is not None:
            s = images.expand(s, pngs)
        mb = collate([s], pad_id=pad_id)
        keep = mb.loss_mask > 0
        diff = (ref.logprobs(mb)[keep] - mb.old_logprobs[keep]).abs()
        worst = max(worst, float(diff.max()))
        count += int(keep.sum())
    return worst, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=Path, required=True, metavar="RUN_DIR", help="A run directory.")
    parser.add_argument("--model", type=Path, default=None, help="Base model directory (default: the run's).")
    parser.add_argument("--games", type=int, default=16, help="Opening contexts sampled after, per version.")
    parser.add_argument("--tokens", type=int, default=16, help="Tokens sampled per context.")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="Largest accepted difference (nats).")
    args = parser.parse_args(argv)

    from tiderl.config import load_job
    from tiderl.models.for_job import model_dir
    from tiderl.rollout.from_config import chat_format
    from tiderl.rollout.vllm_engine import for_job

    job = load_job(args.versions / "config.yaml", [])
    base = args.model or model_dir(job)
    fmt = chat_format(str(base), job.model)
    contexts = opening_contexts(job, fmt, args.games)
    temperature = job.rollout.temperature
    engine = for_job(job, base)
    failed = False
    try:
        for version, weights_dir in [(0, base), *published_versions(args.versions)]:
            t0 = time.perf_counter()
            if version:
                asyncio.run(engine.reload_weights(weights_dir, version))
            reload_s = time.perf_counter() - t0
            generations = asyncio.run(sample(engine, fmt, contexts, args.tokens, temperature))
            worst, count = scored_diff(weights_dir, contexts, generations, temperature, fmt.pad_id)
            ok = worst <= args.tolerance
            failed |= not ok
            print(json.dumps({"version": version, "weights": str(weights_dir), "max_abs_logprob_diff": worst,
                              "tokens": count, "reload_s": round(reload_s, 3), "ok": ok}), flush=True)
    finally:
        engine.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
