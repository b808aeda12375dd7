"""ChatML, the chat format of the tiny models `tiderl init-model` builds:

    <|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n{action}<|im_end|>\\n ...

Their tokenizer is trained with these special tokens and saved with ``CHAT_TEMPLATE``;
the rollout reads the format back from that template (`tiderl.rollout.chat.ChatFormat`),
as it does for any Hugging Face chat model. This module is part of the tiny models'
cache key: its text determines their tokenizer and so their weights.
"""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

