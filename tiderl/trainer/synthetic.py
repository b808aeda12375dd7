"""Random-init Qwen2 model directories and random trajectories for trainer tests and benchmarks.

The model is a real ``Qwen2ForCausalLM`` with a real (word-level) tokenizer,
saved in the Hugging Face layout the rollout side uses; the trajectories have
the shape of multi-turn agent trajectories (prompt, then alternating model
and environment segments) with complete groups and GRPO advantages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from tiderl.advantages import group_advantages
from tiderl.trainer.batch import TrainSample


@dataclass(frozen=True, slots=True)
class ModelSize:
    vocab_size: int = 320  # at least the 256 byte tokens of the byte-level BPE plus specials
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2


def make_model_dir(path: Path, size: ModelSize = ModelSize(), seed: int = 0) -> Path:
    """Write a random-init Qwen2ForCausalLM plus tokenizer to ``path``; returns ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        head_dim=size.hidden_size // size.num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    # Byte-level BPE like Qwen's (transformers maps a qwen2 directory to its BPE tokenizer class).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab_size,
        special_tokens=["<|pad|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = ["guess higher lower number the is", "observation action reward done"]
    tok.train_from_iterator(words * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>")
    fast.save_pretrained(path)
    return path


def random_samples(
    num_groups: int,
    group_size: int,
    *,
    vocab_size: int = 320,
    min_tokens: int = 16,
    max_tokens: int = 64,
    version: int = 0,
    seed: int = 0,
) -> list[TrainSample]:
    """Complete groups of multi-turn-shaped trajectories with rewards in {0, 1} and their advantages."""
    if min_tokens < 4 or max_tokens < min_tokens:
        raise ValueError(f"random_samples: need 4 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    rng = random.Random(seed)
    out: list[TrainSample] = []
    for g in range(num_groups):
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        for i, adv in enumerate(group_advantages(rewards)):
            n = rng.randint(min_tokens, max_tokens)
            ids = [rng.randrange(3, vocab_size) for _ in range(n)]
            prompt = rng.randint(2, max(2, n // 4))
            mask = [0] * prompt
            while len(mask) < n:
                # A model turn then an environment observation, like an agent trajectory.
                mask += [1] * rng.randint(2, 8) + [0] * rng.randint(1, 6)
            mask = mask[:n]
            logprobs = [-rng.uniform(0.5, 4.0) if m else 0.0 for m in mask]
            versions = [max(0, version - rng.randint(0, 1)) if m else -1 for m in mask]
            out.append(
                TrainSample(
                    trajectory_id=f"g{g}t{i}",
                    group_id=f"g{g}",
                    token_ids=tuple(ids),
                    loss_mask=tuple(mask),
                    rollout_logprobs=tuple(logprobs),
                    token_versions=tuple(versions),
                    advantage=adv,
                    reward=rewards[i],
                )
            )
    return out
