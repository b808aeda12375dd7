"""Chat format of TideRL's agent models, at the level of token ids.

A task is a conversation between the environment (role ``user``) and the agent
(role ``assistant``), optionally opened by a ``system`` message:

    <|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n{action}<|im_end|>\\n ...

The agent loop never re-tokenises what the model generated. It builds the
context by appending pieces of ids:

- the prompt: the rendered first messages plus ``<|im_start|>assistant\\n``;
- the model's sampled ids, exactly, ending with ``<|im_end|>``;
- an environment piece: ``\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n``.

Special tokens are atomic in the tokenizer, so each piece tokenises the same on
its own as inside the whole rendered conversation: the concatenation equals
``apply_chat_template`` of the same messages whenever the model's ids are the
canonical tokenisation of its text (tested). ``CHAT_TEMPLATE`` is the same
format as a Jinja template, saved with the tokenizer for transformers and vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, IM_START, IM_END)
ROLES: tuple[str, ...] = ("system", "user", "assistant")

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
    """Builds the id pieces of a conversation for one tokenizer."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_id = int(tokenizer.convert_tokens_to_ids(IM_END))
        self.pad_id = int(tokenizer.convert_tokens_to_ids(PAD))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, first_observation: str, system: str | None = None) -> list[int]:
        """The opening context: optional system message, the first observation, then the
        assistant header the model continues from."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": first_observation})
        return self.encode(render_text(messages, add_generation_prompt=True))

    def env_turn_ids(self, observation: str) -> list[int]:
        """The environment's answer after an assistant turn that ended with ``<|im_end|>``."""
        return self.encode(f"\n{IM_START}user\n{observation}{IM_END}\n{IM_START}assistant\n")

    def action_text(self, generated_ids: Sequence[int]) -> str:
        """The action the environment receives: the generated text without the end marker."""
        ids = list(generated_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()
