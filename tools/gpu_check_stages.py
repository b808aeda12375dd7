"""The stages of ``tools/gpu_check.py``, run in child processes (one per group of stages).

Each process writes one JSON line per stage to ``WORK/PROCESS.jsonl`` as soon as the stage ends, so a
process that is killed at its time budget still leaves the stages it finished. A stage's failure is
caught and written as its record (``ok: false`` with the error and the traceback's end); the next stage of
the process runs all the same.

Processes and their stages, in the order they run:

- ``environment``: ``environment`` (torch, CUDA, the device, NCCL, whether vLLM imports);
- ``model``: ``model`` (a random-init Qwen2 with Qwen2.5-1.5B's shapes, or a tiny one, in bf16, and a
  tokenizer trained on the spot by the tiny models' machinery);
- ``trainer``: ``fsdp_step`` (the ``fsdp`` backend on a one-rank NCCL group, GRPO steps by the project's
  step code);
- ``engine``: ``vllm_engine`` (start, generate, sleep and wake), ``logprob_agreement`` (the engine's
  sampled tokens scored by the trainer's actor), ``weight_transfer`` (a trained version to the engine
  through the ``trainer.weight_sync: transfer`` path, then the same agreement on the new weights).

The engine sleeps (vLLM's level 1) while the actor trains in its process, as a rollout rank's engine
does when its rank trains; the actor's optimizer state and the engine's KV cache never share the
device at once.

Where they live: this module maps processes to stages and runs one process (``main``, the child's entry
point); ``gpu_check_context.py`` holds the presets and a stage's context, ``gpu_check_meter.py`` the memory
metering and the stage records, and the stages themselves are in ``gpu_check_env.py`` (environment,
model), ``gpu_check_trainer.py`` (fsdp_step) and ``gpu_check_engine.py`` (the engine process's three).
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpu_check_context import PRESETS, Context, resolve_device
from gpu_check_engine import EngineStages
from gpu_check_env import stage_environment, stage_model
from gpu_check_meter import record
from gpu_check_trainer import stage_fsdp_step

PROCESSES: dict[str, tuple[str, ...]] = {
    "environment": ("environment",),
    "model": ("model",),
    "trainer": ("fsdp_step",),
    "engine": ("vllm_engine", "logprob_agreement", "weight_transfer"),
}


def run_process(name: str, ctx: Context) -> None:
    out = ctx.work / f"{name}.jsonl"
    if name == "environment":
        record(out, "environment", ctx.cuda, lambda: stage_environment(ctx))
    elif name == "model":
        record(out, "model", ctx.cuda, lambda: stage_model(ctx))
    elif name == "trainer":
        record(out, "fsdp_step", ctx.cuda, lambda: stage_fsdp_step(ctx))
    elif name == "engine":
        EngineStages(ctx, out).run()
    else:
        raise SystemExit(f"gpu_check: unknown process {name!r}")


def main(argv: list[str]) -> int:
    """``PROCESS WORK SIZE DEVICE MODEL_DIR EAGER``: run one process's stages (called by gpu_check.py)."""
    name, work, size, device, model_dir, eager = argv
    ctx = Context(work=Path(work), preset=PRESETS[size], device=resolve_device(device), model_dir=Path(model_dir),
                  engine_eager=eager == "1")
    run_process(name, ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
