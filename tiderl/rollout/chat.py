"""Chat format of TideRL's agent models, at the level of token ids.

A task is a conversation between the environment (role ``user``) and the agent
(role ``assistant``), optionally opened by a ``system`` message:

    <|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n{action}<|im_end|>\\n ...

The agent loop never re-tokenises what the model generated. It builds the
context by appending pieces of ids:

- the prompt: the rendered first messages plus ``<|im_start|>assistant\\n``;
- the model's sampled ids, exactly, ending with ``<|im_end|>``;
- an environment piece: ``\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n``.

A vision-language model's tokenizer also has ``<|vision_start|>``, ``<|image_pad|>`` and
``<|vision_end|>``: a user message's images come first, one placeholder
``<|vision_start|><|image_pad|><|vision_end|>`` each, then its text (Qwen2-VL's
convention). The context keeps one ``<|image_pad|>`` id per image; the engine expands
it into the image's tokens (:class:`ImageTokens` counts them, for CTB's footprint and
the context limit).

Special tokens are atomic in the tokenizer, so each piece tokenises the same on
its own as inside the whole rendered conversation: the concatenation equals
``apply_chat_template`` of the same messages whenever the model's ids are the
canonical tokenisation of its text (tested). ``CHAT_TEMPLATE`` is the same
format as a Jinja template, saved with the tokenizer for transformers and vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, IM_START, IM_END)
ROLES: tuple[str, ...] = ("system", "user", "assistant")
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PAD = "<|video_pad|>"
VISION_SPECIAL_TOKENS: tuple[str, ...] = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


@dataclasses.dataclass(frozen=True, slots=True)
class ImageTokens:
    """How many tokens an image becomes inside the engine (Qwen2-VL's image processor: the picture is
    resized to multiples of patch x merge pixels within [min_pixels, max_pixels], then each merge x merge
    block of patches is one token)."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def of_model(cls, model_dir: str | Path) -> "ImageTokens | None":
        """From the model directory's image processor config (`processor_config.json`'s `image_processor`,
        or `preprocessor_config.json`); None: the model has no image processor."""
        path = Path(model_dir) / "processor_config.json"
        c = json.loads(path.read_text()).get("image_processor") if path.is_file() else None
        if c is None:
            path = Path(model_dir) / "preprocessor_config.json"
            if not path.is_file():
                return None
            c = json.loads(path.read_text())
        size = c.get("size") or {}
        try:
            return cls(patch_size=int(c["patch_size"]), merge_size=int(c["merge_size"]),
                       min_pixels=int(c.get("min_pixels") or size["shortest_edge"]),
                       max_pixels=int(c.get("max_pixels") or size["longest_edge"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a Qwen2-VL image processor config (patch_size, merge_size, "
                             f"min_pixels, max_pixels): {e!r}") from e

    def count(self, width: int, height: int) -> int:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return (h // factor) * (w // factor)

def placeholder_spans(ids: Sequence[int], pad_id: int, start_id: int | None, end_id: int | None) -> list[tuple[int, int]]:
    """Where each image placeholder lies in `ids`: [start, end) around each `pad_id`, with its
    ``<|vision_start|>`` and ``<|vision_end|>`` ids where they surround it."""
    spans = []
    for i, t in enumerate(ids):
        if t == pad_id:
            start = i - 1 if i > 0 and ids[i - 1] == start_id else i
            end = i + 2 if i + 1 < len(ids) and ids[i + 1] == end_id else i + 1
            spans.append((start, end))
    return spans


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TextTokenizer(Protocol):
    """What the chat format needs from a tokenizer (a transformers fast tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def render_text(messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
    """The conversation as text, identical to ``CHAT_TEMPLATE``'s rendering."""
    parts = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: expected one of {ROLES}, got {role!r}")
        parts.append(f"{IM_START}{role}\n{message['content']}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


class ChatFormat:
    """Builds the id pieces of a conversation for one tokenizer (and, for a vision-language model, the
    count of an image's tokens in the engine)."""

    def __init__(self, tokenizer: TextTokenizer, image_tokens: ImageTokens | None = None) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_id = int(tokenizer.convert_tokens_to_ids(IM_END))
        self.pad_id = int(tokenizer.convert_tokens_to_ids(PAD))
        self.image_tokens = image_tokens
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.image_pad_id: int | None = int(vocab[IMAGE_PAD]) if image_tokens is not None and IMAGE_PAD in vocab \
            else None
        self.vision_ids = (vocab.get(VISION_START), vocab.get(VISION_END))
        # The vision tokens are the chat format's, never the model's to sample.
        self.banned_ids: tuple[int, ...] = tuple(sorted(int(vocab[t]) for t in VISION_SPECIAL_TOKENS if t in vocab)) \
            if self.image_pad_id is not None else ()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _images(self, images: int) -> str:
        if images and self.image_pad_id is None:
            raise ValueError(f"the environment's observation carries {images} image(s), but the model is text-only "
                             f"(no {IMAGE_PAD} token or no image processor config): use a vision-language model")
        return IMAGE_PLACEHOLDER * images

    def prompt_ids(self, first_observation: str, system: str | None = None, images: int = 0) -> list[int]:
        """The opening context: optional system message, the first observation (its `images` placeholders
        first), then the assistant header the model continues from."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": self._images(images) + first_observation})
        return self.encode(render_text(messages, add_generation_prompt=True))

    def env_turn_ids(self, observation: str, images: int = 0) -> list[int]:
        """The environment's answer after an assistant turn that ended with ``<|im_end|>``."""
        return self.encode(f"\n{IM_START}user\n{self._images(images)}{observation}{IM_END}\n{IM_START}assistant\n")

    def image_spans(self, ids: Sequence[int], offset: int = 0) -> list[tuple[int, int]]:
        """Where each image placeholder of `ids` lies, shifted by `offset` (none for a text model)."""
        if self.image_pad_id is None:
            return []
        return [(s + offset, e + offset) for s, e in placeholder_spans(ids, self.image_pad_id, *self.vision_ids)]

    def image_count(self, width: int, height: int) -> int:
        """Tokens an image of these pixels becomes in the engine (1 for a text model: never asked)."""
        return self.image_tokens.count(width, height) if self.image_tokens is not None else 1

    def action_text(self, generated_ids: Sequence[int]) -> str:
        """The action the environment receives: the generated text without the end marker."""
        ids = list(generated_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()
