"""The tiny policy model: a tokenizer trained on the spot, a small Qwen2 causal LM and a
short supervised warm start on noisy-expert demonstrations.

`init_model(env, out_dir)` writes a Hugging Face model directory (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json with the chat template)
that transformers and vLLM both load. The directory records the content hash of
everything that determines it (spec, this code, the environment's code) in
``tiderl-model.json``; asking again for the same hash returns at once.

Sizes: head_dim 32 because vLLM's CPU attention kernels support head sizes
{32, 64, 80, ...}; about 0.6 M parameters, so a warm start takes about a minute
on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import random
import shutil
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from tiderl.models import chatml, demos
from tiderl.rollout.chat import ChatFormat

MANIFEST = "tiderl-model.json"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelSpec:
    """Everything that determines the model directory (its hash is the cache key)."""

    env: str = "hilo"
    env_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Options of the demonstration episodes (e.g. hilo's range): the warm start plays the task RL trains on."""
    seed: int = 0
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    num_demos: int = 3000
    demo_noise: float = 0.3
    train_steps: int = 250
    batch_size: int = 32
    learning_rate: float = 3e-3

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if not 0.0 <= self.demo_noise <= 1.0:
            raise ValueError(f"demo_noise: must be in [0, 1], got {self.demo_noise}")
        if self.train_steps < 0:
            raise ValueError(f"train_steps: must be >= 0, got {self.train_steps}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def spec_hash(spec: TinyModelSpec) -> str:
    """Hash of the spec and of the code that turns it into weights."""
    from tiderl.envs.registry import env_class

    h = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    for module in (chatml, demos, inspect.getmodule(spec_hash), inspect.getmodule(env_class(spec.env))):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """TideRL's cache on this machine: $TIDERL_CACHE or ~/.cache/tiderl."""
    return Path(os.environ.get("TIDERL_CACHE", Path.home() / ".cache" / "tiderl"))


def default_model_dir(env: str) -> Path:
    """Where `tiderl init-model` puts the tiny model of ``env``: $TIDERL_CACHE or ~/.cache/tiderl."""
    return cache_root() / "models" / f"tiny-{env}"


def spec_model_dir(spec: TinyModelSpec) -> Path:
    """The cache directory of ``spec``: the default one for the default spec of its environment, one
    named by the spec's hash otherwise, so that jobs with different warm starts keep a model each
    instead of rebuilding one directory in turn."""
    if spec == TinyModelSpec(env=spec.env):
        return default_model_dir(spec.env)
    return default_model_dir(spec.env).with_name(f"tiny-{spec.env}-{spec_hash(spec)}")


def cached_hash(out_dir: Path) -> str | None:
    try:
        return json.loads((out_dir / MANIFEST).read_text()).get("hash")
    except (OSError, ValueError):
        return None


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE (every string encodes) wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one by one: numbers compose from digit tokens, as in Qwen's tokenizer.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(chatml.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=chatml.IM_END, pad_token=chatml.PAD, model_max_length=1 << 16
    )
    fast.chat_template = chatml.CHAT_TEMPLATE
    return fast


def build_model(spec: TinyModelSpec, vocab_size: int, pad_id: int, eos_id: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config)


def demo_sequences(fmt: ChatFormat, conversations: list[list[dict[str, str]]]) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per conversation, built from the same id pieces the agent loop uses;
    the observation after the last action is left out (nothing is generated after it)."""
    out = []
    for messages in conversations:
        ids = fmt.prompt_ids(messages[0]["content"])
        mask = [0] * len(ids)
        for i in range(1, len(messages), 2):
            action = fmt.encode(messages[i]["content"]) + [fmt.end_of_turn_id]
            ids += action
            mask += [1] * len(action)
            if i + 2 < len(messages):
                piece = fmt.env_turn_ids(messages[i + 1]["content"])
                ids += piece
                mask += [0] * len(piece)
        out.append((ids, mask))
    return out


class WarmStartSpec(Protocol):
    seed: int
    learning_rate: float
    train_steps: int
    batch_size: int


def warm_start(model: Any, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], spec: WarmStartSpec, pad_id: int,
               on_step: Callable[[int, float], None] | None = None,
               extra_inputs: Callable[[list[int], int], dict[str, Any]] | None = None) -> list[float]:
    """Supervised fine-tuning on the action tokens only; returns the loss every 25 steps and
    calls `on_step(step, loss)` then. `extra_inputs(rows, width)` gives more model inputs for the
    batch of those sequence indices padded to `width` (a vision-language model's images)."""
    import torch

    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / max(1, spec.train_steps)))
    model.train()
    losses = []
    for step in range(spec.train_steps):
        rows = rng.sample(range(len(sequences)), min(spec.batch_size, len(sequences)))
        batch = [sequences[r] for r in rows]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        extra = extra_inputs(rows, width) if extra_inputs is not None else {}
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels, **extra).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == spec.train_steps - 1:
            losses.append(round(loss.item(), 4))
            if on_step is not None:
                on_step(step, losses[-1])
    model.eval()
    return losses


def init_model(out_dir: str | Path, spec: TinyModelSpec | None = None, *, force: bool = False) -> Path:
    """Build (or find cached) the tiny model for ``spec.env`` in ``out_dir``."""
    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    digest = spec_hash(spec)
    if not force and cached_hash(out_dir) == digest:
        return out_dir
    with one_builder(out_dir):
        if not force and cached_hash(out_dir) == digest:  # another process built it while this one waited
            return out_dir
        return _build(out_dir, spec, digest)


@contextmanager
def one_builder(out_dir: Path) -> Iterator[None]:
    """One process at a time builds a model directory (a lock file beside it): a second process that wants
    the same model (another rank of the node, a second `tiderl run`) waits for the first and then finds it
    built, instead of building it again beside it."""
    from filelock import FileLock

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir.with_name(f".{out_dir.name}.lock"))):
        yield


def _build(out_dir: Path, spec: TinyModelSpec, digest: str) -> Path:
    from tiderl.observe import Progress

    started = time.monotonic()
    build_threads()
    seeds = range(spec.seed * 1_000_000, spec.seed * 1_000_000 + spec.num_demos)
    conversations, rewards = [], []
    progress = Progress(f"init-model {spec.env}", total=spec.train_steps + 3, unit="steps")
    try:
        progress.step(f"playing {spec.num_demos} demonstrations")
        for seed in seeds:
            messages, reward = demos.play_demonstration(spec.env, seed, spec.demo_noise, spec.env_options)
            conversations.append(messages)
            rewards.append(reward)
        progress.step("training the tokenizer")
        tokenizer = train_tokenizer([m["content"] for c in conversations for m in c], spec.vocab_size)
        fmt = ChatFormat(tokenizer)
        model = build_model(spec, len(tokenizer), fmt.pad_id, fmt.end_of_turn_id)
        progress.step("warm start")
        losses = warm_start(model, demo_sequences(fmt, conversations), spec, fmt.pad_id,
                            on_step=lambda step, loss: progress.update(f"warm start, loss {loss:.3f}",
                                                                       done=3 + step))
        progress.update("saving", done=spec.train_steps + 2)
        path = _save(out_dir, model, tokenizer, spec, digest, rewards, losses, started)
    except BaseException:
        progress.close("failed")
        raise
    progress.close()
    return path


def _save(out_dir: Path, model: Any, tokenizer: Any, spec: TinyModelSpec, digest: str, rewards: list[float],
          losses: list[float], started: float) -> Path:
    """Write beside the target, then swap in: a reader never sees a half-written model."""
    tmp = build_dir(out_dir)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    manifest = {
        "hash": digest,
        "spec": dataclasses.asdict(spec),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "demo_success_rate": sum(rewards) / len(rewards),
        "warm_start_losses": losses,
        "build_s": round(time.monotonic() - started, 1),
    }
    return swap_in(tmp, out_dir, manifest)


def build_dir(out_dir: Path) -> Path:
    """The directory a model is written in beside `out_dir` (emptied), before `swap_in`."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def swap_in(tmp: Path, out_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write the manifest into `tmp`, then put `tmp` in the place of `out_dir`: a reader never sees a
    half-written model."""
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir


def build_threads() -> None:
    """Torch's threads for a build: at most the machine's cores."""
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))


def greedy_success_rate(model_dir: str | Path, env_name: str, seeds: range, max_new_tokens: int = 8,
                        options: dict[str, Any] | None = None) -> float:
    """Mean final reward of greedy play with transformers (a check of the warm start that
    does not need vLLM). Observations are appended as id pieces, as in the agent loop."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def turn(ids: list[int], pngs: list[bytes]) -> Callable[[list[int]], Any]:
        return lambda generated: model(input_ids=torch.tensor([ids + generated])).logits[0, -1]

    return greedy_play(ChatFormat(tokenizer), turn, env_name, seeds, max_new_tokens, options)


def greedy_play(fmt: ChatFormat, turn: Callable[[list[int], list[bytes]], Callable[[list[int]], Any]],
                env_name: str, seeds: Iterable[int], max_new_tokens: int = 8,
                options: dict[str, Any] | None = None) -> float:
    """Mean final reward of greedy play of `env_name`'s games `seeds`, the context built as the agent
    loop builds it. `turn(context ids, the context's pictures)` is called once a turn and gives the
    next-token logits of the context followed by the ids generated so far; the chat format's banned
    ids are never chosen."""
    import torch

    from tiderl.envs import make_env

    banned = list(fmt.banned_ids)
    rewards = []
    for seed in seeds:
        env = make_env(env_name)
        pictures = getattr(env, "observation_images", lambda: [])
        observation, _ = env.reset(seed=seed, options=options or {})
        pngs = list(pictures())
        ids = fmt.prompt_ids(observation, images=len(pngs))
        done = False
        while not done:
            logits_after = turn(ids, pngs)
            generated: list[int] = []
            with torch.no_grad():
                while len(generated) < max_new_tokens and not fmt.closes_turn(generated):
                    logits = logits_after(generated)
                    logits[banned] = -torch.inf
                    generated.append(int(logits.argmax()))
            ids += generated
            observation, _, done, _ = env.step(fmt.action_text(generated))
            if not fmt.closes_turn(generated):
                ids.append(fmt.end_of_turn_id)
            new = list(pictures())
            ids += fmt.env_turn_ids(observation, images=len(new))
            pngs += new
        rewards.append(env.final_reward())
        env.close()
    return sum(rewards) / len(rewards)
