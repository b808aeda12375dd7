"""What a GPU check's stages run with (tools/gpu_check.py, tools/gpu_check_stages.py): the size presets
(``--size``: the model and the workload), the resolved device, the work and model directories, and the
exception of a stage that failed with some figures measured."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Preset:
    """The model and the workload of a check (``--size``)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # at least the tokenizer's
    max_positions: int
    rope_theta: float
    tokenizer_vocab: int
    # the engine
    kv_blocks: int | None  # None: gpu_memory_utilization of the device
    max_model_len: int
    max_num_seqs: int
    requests: int
    prompt_tokens: int
    new_tokens: int
    agreement_seqs: int  # of the engine's generations, scored by the trainer and trained on
    # the trainer
    micro_batches: int
    seqs: int
    seq_tokens: int
    warmup: int
    steps: int
    lr: float
    transfer_versions: int


PRESETS = {
    # Qwen2.5-1.5B's shapes (its config.json): about 1.54 B parameters, the output layer tied to the embedding.
    "full": Preset("full", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
                   max_positions=32768, rope_theta=1e6, tokenizer_vocab=384, kv_blocks=None, max_model_len=2048,
                   max_num_seqs=64, requests=32, prompt_tokens=128, new_tokens=128, agreement_seqs=8,
                   micro_batches=4, seqs=2, seq_tokens=1024, warmup=1, steps=2, lr=1e-3, transfer_versions=2),
    # For a CPU (the test): head_dim 32, which vLLM's CPU attention supports.
    "tiny": Preset("tiny", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=0,
                   max_positions=4096, rope_theta=1e4, tokenizer_vocab=384, kv_blocks=16, max_model_len=480,
                   max_num_seqs=8, requests=4, prompt_tokens=24, new_tokens=8, agreement_seqs=4,
                   micro_batches=2, seqs=2, seq_tokens=48, warmup=1, steps=2, lr=1e-2, transfer_versions=2),
}


class Partial(Exception):
    """A stage that failed with some figures measured before it did."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


@dataclass(slots=True)
class Context:
    work: Path
    preset: Preset
    device: str  # cuda or cpu, resolved
    model_dir: Path
    engine_eager: bool = False

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
