"""Chat format of TideRL's agent models, at the level of token ids, read from the model's own
tokenizer and its chat template (any Hugging Face chat model).

A task is a conversation between the environment (role ``user``) and the agent (role
``assistant``), opened by a system message where the template or the job puts one. The agent
loop never re-tokenises what the model generated. It builds the context by appending pieces
of ids:

- the prompt: the template's rendering of ``[system?, user]`` with the generation prompt;
- the model's sampled ids, exactly, ending with a stop id (the end-of-turn token where the
  model closed its turn; appended, not sampled, where the length limit cut it);
- an environment piece: what the template renders after an assistant turn's end-of-turn
  token, up to and including the next generation prompt (ChatML:
  ``\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n``).

Nothing is spliced by hand: every piece is the template's rendering of the real messages
(templates transform content, Llama 3 trims it). The end-of-turn token is the special token
the template puts right after an assistant message's content; an environment piece is the
text after it once a user message follows, found by rendering a stand-in assistant turn
(``SENTINEL``) before the observation. Special tokens are atomic in the tokenizer, so each
piece tokenises the same on its own as inside the whole rendered conversation: the
concatenation equals ``apply_chat_template`` of the same messages whenever the model's ids
are the canonical tokenisation of its text (tested for ChatML, Qwen2.5, Llama 3.1, Qwen3).

A template that rewrites earlier assistant turns once a later user message comes (Qwen3
drops the ``<think>`` blocks of turns before the last user message) renders a conversation
differently from the context the model saw: the context keeps the sampled ids as sampled,
since RL trains on what was sampled; only the text after each end-of-turn token is taken
from the template.

A vision-language model's tokenizer also has ``<|vision_start|>``, ``<|image_pad|>`` and
``<|vision_end|>``: a user message's images come first, one placeholder
``<|vision_start|><|image_pad|><|vision_end|>`` each, then its text (Qwen2-VL's
convention). The context keeps one ``<|image_pad|>`` id per image; the engine expands
it into the image's tokens (:class:`ImageTokens` counts them, for CTB's footprint and
the context limit).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_PAD = "<|video_pad|>"
VISION_SPECIAL_TOKENS: tuple[str, ...] = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
SENTINEL = "TIDERL-SENTINEL-ACTION"
"""A stand-in assistant message: where it ends in a rendering, its turn ends."""


class ChatFormatError(ValueError):
    """The tokenizer's chat template does not give the pieces the agent loop builds a context from."""


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



class Tokenizer(Protocol):
    """What the chat format needs from a tokenizer (a transformers tokenizer fits); it also reads
    `chat_template`, `eos_token_id`, `pad_token_id` and `name_or_path`."""

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def get_added_vocab(self) -> dict[str, int]: ...

    def get_vocab(self) -> dict[str, int]: ...


class ChatFormat:
    """Builds the id pieces of a conversation for one tokenizer (and, for a vision-language model, the
    count of an image's tokens in the engine).

    `system_prompt`: the system message of every prompt (None: the template's own default, if any);
    `template_kwargs`: passed to every rendering (e.g. ``{"enable_thinking": False}`` for Qwen3)."""

    def __init__(self, tokenizer: Tokenizer, image_tokens: ImageTokens | None = None, *,
                 system_prompt: str | None = None, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.template = _chat_template(tokenizer)
        self.end_of_turn = self._end_of_turn()
        self.end_of_turn_id = int(tokenizer.convert_tokens_to_ids(self.end_of_turn))
        eos_ids = _eos_ids(tokenizer)
        # Where the model stops: its turn's end, or its end of text (a base model's, the generation config's).
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys([self.end_of_turn_id, *eos_ids]))
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else self.end_of_turn_id)
        self.image_tokens = image_tokens
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.image_pad_id: int | None = int(vocab[IMAGE_PAD]) if image_tokens is not None and IMAGE_PAD in vocab \
            else None
        self.vision_ids = (vocab.get(VISION_START), vocab.get(VISION_END))
        # The vision tokens are the chat format's, never the model's to sample.
        self.banned_ids: tuple[int, ...] = tuple(sorted(int(vocab[t]) for t in VISION_SPECIAL_TOKENS if t in vocab)) \
            if self.image_pad_id is not None else ()

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        """The template's text of `messages`."""
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, chat_template=self.template,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _probe(self) -> list[dict[str, str]]:
        """A conversation whose last message is the stand-in assistant turn."""
        system = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return system + [{"role": "user", "content": "U"}, {"role": "assistant", "content": SENTINEL}]

    def _end_of_turn(self) -> str:
        text = self.render(self._probe(), add_generation_prompt=False)
        at = text.rfind(SENTINEL)
        if at < 0:
            raise ChatFormatError(f"the chat template does not render an assistant message's content as given: "
                                  f"{text[-200:]!r}")
        after = text[at + len(SENTINEL):]
        tokens = set(self.tokenizer.get_added_vocab()) | set(getattr(self.tokenizer, "all_special_tokens", ()))
        matches = [t for t in tokens if t and after.startswith(t)]
        if not matches:
            raise ChatFormatError(f"the chat template ends an assistant turn with {after[:40]!r}, not with one of "
                                  f"the tokenizer's special tokens: no end-of-turn token for the model to stop at")
        return max(matches, key=len)

    def _images(self, images: int) -> str:
        if images and self.image_pad_id is None:
            raise ValueError(f"the environment's observation carries {images} image(s), but the model is text-only "
                             f"(no {IMAGE_PAD} token or no image processor config): use a vision-language model")
        return IMAGE_PLACEHOLDER * images

    def prompt_ids(self, first_observation: str, system: str | None = None, images: int = 0) -> list[int]:
        """The opening context: the system message (`system`, else the format's `system_prompt`, else the
        template's default), the first observation (its `images` placeholders first), then the
        generation prompt the model continues from."""
        system = self.system_prompt if system is None else system
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": self._images(images) + first_observation})
        return self.encode(self.render(messages, add_generation_prompt=True))

    def env_turn_ids(self, observation: str, images: int = 0) -> list[int]:
        """The environment's answer after an assistant turn that ended with the end-of-turn token: the
        template's text after that token, through the next generation prompt."""
        turn_end = SENTINEL + self.end_of_turn
        text = self.render(self._probe() + [{"role": "user", "content": self._images(images) + observation}],
                           add_generation_prompt=True)
        # Anchored at the stand-in turn's end, not at the whole rendering before it: what comes before may
        # render differently once a user message follows (Qwen3 drops the last assistant turn's empty
        # <think> block, Llama 3.1's date may change), and it is in the context already, as it was.
        at = text.find(turn_end)
        if at < 0:
            raise ChatFormatError(f"the chat template no longer ends an assistant turn with {self.end_of_turn!r} "
                                  f"once a user message follows: {text[-300:]!r}")
        return self.encode(text[at + len(turn_end):])

    def closes_turn(self, generated_ids: Sequence[int]) -> bool:
        """Whether the model ended its turn itself (the last id is a stop id)."""
        return bool(generated_ids) and generated_ids[-1] in self.stop_ids

    def image_spans(self, ids: Sequence[int], offset: int = 0) -> list[tuple[int, int]]:
        """Where each image placeholder of `ids` lies, shifted by `offset` (none for a text model)."""
        if self.image_pad_id is None:
            return []
        return [(s + offset, e + offset) for s, e in placeholder_spans(ids, self.image_pad_id, *self.vision_ids)]

    def image_count(self, width: int, height: int) -> int:
        """Tokens an image of these pixels becomes in the engine (1 for a text model: never asked)."""
        return self.image_tokens.count(width, height) if self.image_tokens is not None else 1

    def action_text(self, generated_ids: Sequence[int]) -> str:
        """The action the environment receives: the generated text without the stop id and special tokens."""
        ids = list(generated_ids)
        if self.closes_turn(ids):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


def _chat_template(tokenizer: Tokenizer) -> str:
    """The tokenizer's chat template (of a dict of named ones, the one named "default")."""
    template = getattr(tokenizer, "chat_template", None)
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    if isinstance(template, Mapping):
        if "default" not in template:
            raise ChatFormatError(f"{name}: its chat templates are named {sorted(template)}, none 'default': "
                                  "TideRL renders every turn with the default one")
        template = template["default"]
    if not template:
        raise ChatFormatError(f"{name}: the tokenizer has no chat template (tokenizer_config.json's chat_template "
                              "or chat_template.jinja): TideRL renders every turn with it; use a chat model")
    return str(template)


def _eos_ids(tokenizer: Tokenizer) -> list[int]:
    """The tokenizer's end-of-text id(s), then those of the model directory's generation_config.json."""
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None))
    name = getattr(tokenizer, "name_or_path", "")
    path = Path(name) / "generation_config.json" if name else None
    if path is not None and path.is_file():
        ids += _as_ids(json.loads(path.read_text()).get("eos_token_id"))
    return ids


def _as_ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
