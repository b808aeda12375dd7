"""The chat format comes from the model's own tokenizer: its chat template, its special tokens, its
end-of-text ids. Tokenizers of three families are built here (a byte-level BPE trained on the spot, each
family's special tokens and pre-tokenizer, and its chat template written out in that family's format,
tools left out); the id pieces the agent loop appends must equal the template's own tokenisation."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest

from tiderl.config.model import ModelConfig
from tiderl.config.schema import build
from tiderl.rollout.chat import ChatFormat, ChatFormatError

# The pre-tokenizer regexes of Qwen2 and Llama 3: newlines split apart from the text after them.
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN25_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

EMPTY_THINK = "<think>\n\n</think>\n\n"
OBSERVATIONS = ["Guess my number, 1 to 16.", "  Higher.\n", "Lower: 9 is too high.", "Higher, again!"]
ACTIONS = ["8", "I guess 12.", "10"]
CORPUS = [*OBSERVATIONS, *ACTIONS, QWEN25_SYSTEM, "Play the game well.", "Cutting Knowledge Date: December 2023",
          "Today Date: 26 Jul 2024", "system user assistant", "higher lower number guess think"] * 4


def make_tokenizer(split: str, special: list[str], template: str | None, *, eos: str, pad: str | None = None,
                   bos: str | None = None, added: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE with the family's pre-tokenizer and special tokens (a `bos` is added by its
    post-processor to `encode(..., add_special_tokens=True)`, as Llama 3's is)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos)
    fast.add_tokens(list(added))
    fast.chat_template = template
    return fast


def qwen25(template: str | None = QWEN25_TEMPLATE) -> Any:
    return make_tokenizer(QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], template, eos="<|im_end|>",
                          pad="<|endoftext|>")


def llama31() -> Any:
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return make_tokenizer(LLAMA3_SPLIT, special, LLAMA31_TEMPLATE, eos="<|eot_id|>", bos="<|begin_of_text|>")


def qwen3() -> Any:
    return make_tokenizer(QWEN_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], QWEN3_TEMPLATE,
                          eos="<|im_end|>", pad="<|endoftext|>", added=("<think>", "</think>"))


FAMILIES = {"qwen2.5": qwen25, "llama3.1": llama31, "qwen3": qwen3}


def conversation(system: str | None) -> list[dict[str, str]]:
    """An observation, then (action, observation) turns: the context before the model's 4th turn."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": OBSERVATIONS[0]})
    for action, observation in zip(ACTIONS, OBSERVATIONS[1:]):
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
    return messages


def context_ids(fmt: ChatFormat, actions: list[str], system: str | None = None) -> list[int]:
    """The context as the agent loop builds it, with `actions` as the model's sampled turns."""
    ids = fmt.prompt_ids(OBSERVATIONS[0], system=system)
    for action, observation in zip(actions, OBSERVATIONS[1:]):
        ids += fmt.encode(action) + [fmt.end_of_turn_id] + fmt.env_turn_ids(observation)
    return ids


def template_ids(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False,
                                              **kwargs))


@pytest.mark.parametrize("system", [None, "Play the game well."])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_pieces_of_a_conversation_are_the_templates_own_ids(family: str, system: str | None) -> None:
    tokenizer = FAMILIES[family]()
    fmt = ChatFormat(tokenizer)
    assert context_ids(fmt, ACTIONS, system) == template_ids(tokenizer, conversation(system))
    # A system prompt the format carries (the job's `model.system_prompt`) is the same as one given per prompt.
    if system is not None:
        assert context_ids(ChatFormat(tokenizer, system_prompt=system), ACTIONS) == context_ids(fmt, ACTIONS, system)


def test_each_family_closes_a_turn_with_its_own_token_and_renders_its_own_defaults() -> None:
    qwen, llama, thinking = (ChatFormat(make()) for make in (qwen25, llama31, qwen3))
    assert (qwen.end_of_turn, llama.end_of_turn, thinking.end_of_turn) == ("<|im_end|>", "<|eot_id|>", "<|im_end|>")
    # system=None: the template's default system prompt (Qwen2.5's), or none (Qwen3's).
    assert qwen.tokenizer.decode(qwen.prompt_ids("Go.")) == \
        f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n"
    assert thinking.tokenizer.decode(thinking.prompt_ids("Go.")) == \
        "<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n"
    # Llama 3.1: the template writes the one <|begin_of_text|> (no second one from encoding) and today's date.
    prompt = llama.prompt_ids(" Go. ")
    assert prompt.count(llama.tokenizer.bos_token_id) == 1 and prompt[0] == llama.tokenizer.bos_token_id
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert llama.tokenizer.decode(prompt) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        f"Today Date: {today}\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGo.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # The environment's piece starts right after the end-of-turn token (ChatML's newline is part of it).
    assert qwen.tokenizer.decode(qwen.env_turn_ids("Higher.")) == \
        "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    assert llama.tokenizer.decode(llama.env_turn_ids("  Higher.\n")) == \
        "<|start_header_id|>user<|end_header_id|>\n\nHigher.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


def test_qwen3_without_thinking_opens_every_turn_with_an_empty_think_block() -> None:
    tokenizer = qwen3()
    fmt = ChatFormat(tokenizer, template_kwargs={"enable_thinking": False})
    ids = context_ids(fmt, ACTIONS)

    def chatml(think_before: list[str]) -> str:
        text = f"<|im_start|>user\n{OBSERVATIONS[0]}<|im_end|>\n"
        for action, observation in zip(ACTIONS, OBSERVATIONS[1:]):
            think = EMPTY_THINK if action in think_before else ""
            text += f"<|im_start|>assistant\n{think}{action}<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n"
        return text + "<|im_start|>assistant\n" + EMPTY_THINK

    # What the model saw: each generation prompt with its empty think block, the turns as sampled after it.
    assert ids == fmt.encode(chatml(ACTIONS))
    # The template renders the whole conversation without the earlier turns' blocks: the context keeps them.
    assert ids != template_ids(tokenizer, conversation(None), enable_thinking=False)
    assert tokenizer.apply_chat_template(conversation(None), tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) == chatml([])


def test_qwen3_sampled_reasoning_stays_in_the_context_as_sampled() -> None:
    fmt = ChatFormat(qwen3())
    reasoning = "<think>\nmiddle first\n</think>\n\n8"
    text = fmt.tokenizer.decode(context_ids(fmt, [reasoning, *ACTIONS[1:]]))
    assert f"<|im_start|>assistant\n{reasoning}<|im_end|>\n<|im_start|>user\n{OBSERVATIONS[1]}" in text
    # The template drops it from a turn before the last user message; the context keeps what was sampled.
    messages = conversation(None)
    messages[1]["content"] = reasoning
    assert "middle first" not in fmt.render(messages, add_generation_prompt=True)


def test_stop_ids_are_the_end_of_turn_then_the_eos_ids_and_pad_falls_back_to_eos(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    qwen, llama = ChatFormat(qwen25()), ChatFormat(llama31())
    assert qwen.stop_ids == (qwen.end_of_turn_id,)  # eos is <|im_end|>: listed once
    assert qwen.pad_id == qwen.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert llama.tokenizer.pad_token_id is None and llama.pad_id == llama.end_of_turn_id == llama.tokenizer.eos_token_id
    # A model directory's generation_config.json adds its eos ids (Llama 3.1 Instruct stops at <|end_of_text|> too).
    llama.tokenizer.save_pretrained(tmp_path)
    end_of_text = llama.tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_text, llama.end_of_turn_id]}))
    loaded = ChatFormat(AutoTokenizer.from_pretrained(tmp_path))
    assert loaded.stop_ids == (llama.end_of_turn_id, end_of_text)
    assert loaded.closes_turn([5, end_of_text]) and loaded.closes_turn([llama.end_of_turn_id])
    assert not loaded.closes_turn([]) and not loaded.closes_turn([llama.end_of_turn_id, 5])


def test_the_action_is_the_text_without_its_stop_id_or_special_tokens() -> None:
    fmt = ChatFormat(qwen25())
    assert fmt.action_text(fmt.encode(" I guess 12. ") + [fmt.end_of_turn_id]) == "I guess 12."
    assert fmt.action_text(fmt.encode("10<|im_start|>")) == "10"  # cut by the length limit
    assert fmt.action_text([fmt.end_of_turn_id]) == ""


def test_the_tiny_models_chatml_pieces_are_unchanged() -> None:
    from tiderl.models.chatml import CHAT_TEMPLATE
    from tiderl.models.tiny_model import train_tokenizer

    tokenizer = train_tokenizer(CORPUS, vocab_size=300)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    fmt = ChatFormat(tokenizer)
    assert (fmt.end_of_turn, fmt.stop_ids, fmt.pad_id) == ("<|im_end|>", (2,), 0)
    assert fmt.prompt_ids("Go.") == fmt.encode("<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n")
    assert fmt.env_turn_ids(" Higher.\n") == \
        fmt.encode("\n<|im_start|>user\n Higher.\n<|im_end|>\n<|im_start|>assistant\n")


def test_a_tokenizer_without_a_usable_chat_template_is_named() -> None:
    with pytest.raises(ChatFormatError, match="no chat template"):
        ChatFormat(qwen25(template=None))
    tokenizer = qwen25()
    tokenizer.chat_template = {"tool_use": QWEN25_TEMPLATE}
    with pytest.raises(ChatFormatError, match=r"named \['tool_use'\], none 'default'"):
        ChatFormat(tokenizer)
    tokenizer.chat_template = {"default": QWEN25_TEMPLATE, "tool_use": "unused"}
    assert ChatFormat(tokenizer).end_of_turn == "<|im_end|>"


def test_a_template_whose_assistant_turn_ends_without_a_special_token_is_refused() -> None:
    plain = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(ChatFormatError, match=r"ends an assistant turn with '\\n'.*not with one of the tokenizer's special"):
        ChatFormat(qwen25(template=plain))
    assert issubclass(ChatFormatError, ValueError)


def test_a_mistral_like_template_closes_the_turn_with_eos() -> None:
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
    fmt = ChatFormat(make_tokenizer(QWEN_SPLIT, ["<s>", "</s>"], template, eos="</s>", bos="<s>"))
    assert fmt.end_of_turn == "</s>" and fmt.stop_ids == (fmt.end_of_turn_id,)
    assert fmt.tokenizer.decode(fmt.env_turn_ids("Higher.")) == "[INST] Higher. [/INST]"


def test_the_model_section_sets_the_system_prompt_and_the_template_variables(tmp_path: Path) -> None:
    from tiderl.rollout.from_config import chat_format

    assert build(ModelConfig, {}, "job.yaml", "model").chat_template_kwargs == {}
    model = build(ModelConfig, {"system_prompt": "Play the game well.", "chat_template_kwargs": {"enable_thinking": False}},
                  "job.yaml", "model")
    qwen3().save_pretrained(tmp_path)
    fmt = chat_format(tmp_path, model)
    assert fmt.system_prompt == "Play the game well." and fmt.template_kwargs == {"enable_thinking": False}
    assert fmt.tokenizer.decode(fmt.prompt_ids("Go.")) == ("<|im_start|>system\nPlay the game well.<|im_end|>\n"
                                                           f"<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINK}")
    assert chat_format(tmp_path).system_prompt is None


def test_a_template_that_ends_the_turn_otherwise_once_a_user_message_follows_is_refused() -> None:
    # The last assistant turn ends with <|im_end|>, an earlier one with <|endoftext|>: no piece can follow the
    # end-of-turn token the model stopped at.
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
                "{{ '<|im_end|>' if loop.last or m['role'] != 'assistant' else '<|endoftext|>' }}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    fmt = ChatFormat(qwen25(template=template))
    assert fmt.end_of_turn == "<|im_end|>"
    with pytest.raises(ChatFormatError, match="no longer ends an assistant turn with '<\\|im_end\\|>' once a user"):
        fmt.env_turn_ids("Higher.")
