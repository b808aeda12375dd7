"""The vLLM engine on the tiny model: ids in, ids + logprobs out, cache counters, reload.

One engine for the module (its start-up dominates): 32 blocks of 32 tokens."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tiderl.rollout.chat import ChatFormat
from tiderl.rollout.engine import EngineError, SamplingSpec

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(quickstart_model: Path) -> Path:
    return quickstart_model


@pytest.fixture(scope="module")
def fmt(model_dir: Path) -> ChatFormat:
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    from tiderl.rollout.vllm_engine import VllmEngine

    eng = VllmEngine(model_dir, num_kv_blocks=32, block_size=32, max_model_len=992, max_num_seqs=64)
    yield eng
    eng.close()


def long_prompt(fmt: ChatFormat) -> list[int]:
    ids = fmt.prompt_ids("guess a number 1-16")
    for guess, answer in (("8", "higher"), ("12", "lower"), ("10", "higher"), ("11", "lower")):
        ids += fmt.encode(guess) + [fmt.end_of_turn_id] + fmt.env_turn_ids(answer)
    return ids


def run(coro):
    return asyncio.run(coro)


def test_generate_returns_ids_and_their_logprobs(engine, fmt: ChatFormat, model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert engine.kv_capacity_tokens == 31 * 32 and engine.kv_block_tokens == 32
    prompt = long_prompt(fmt)
    spec = SamplingSpec(max_new_tokens=6, temperature=1.0, stop_token_ids=(fmt.end_of_turn_id,), seed=5)
    async def four():
        return await asyncio.gather(*(engine.generate(prompt, spec) for _ in range(4)))

    gens = run(four())
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) >= 1 and all(lp <= 0 for lp in g.logprobs)
        assert g.weights_version == 0 and g.num_prompt_tokens == len(prompt)
        assert (g.finish_reason == "stop") == (g.token_ids[-1] == fmt.end_of_turn_id)
    # The rollout logprobs are the policy's: transformers scores the same ids alike.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = gens[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + list(g.token_ids)])).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    ref = ref[torch.arange(len(g.token_ids)), torch.tensor(g.token_ids)]
    assert torch.allclose(ref, torch.tensor(g.logprobs), atol=1e-4), (ref, g.logprobs)


def test_prefix_cache_counters_see_a_repeated_context(engine, fmt: ChatFormat) -> None:
    prompt = long_prompt(fmt)
    greedy = SamplingSpec(max_new_tokens=4, temperature=0.0, stop_token_ids=(fmt.end_of_turn_id,))
    before = run(engine.stats())
    first = run(engine.generate(prompt, greedy))
    second = run(engine.generate(prompt, greedy))
    delta = run(engine.stats()).minus(before)
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens >= 32 * (len(prompt) // 32 - 1) > 0
    assert delta.prefix_cache_queries >= 2 * len(prompt) - second.num_cached_tokens
    assert delta.prefix_cache_hits >= second.num_cached_tokens
    assert delta.generation_tokens == len(first.token_ids) + len(second.token_ids)


def _transformers_logprobs(weights_dir: Path, prompt: list[int], generated: tuple[int, ...]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + list(generated)])).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return ref[torch.arange(len(generated)), torch.tensor(generated)].tolist()


def test_a_reload_serves_exactly_the_published_weights(engine, fmt: ChatFormat, model_dir: Path, tmp_path: Path) -> None:
    """After a reload the engine samples from the published version, its tied output layer included (vLLM's
    CPU path kept the base model's packed output layer: 0.35-1.3 nats off), and drops its cache."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = long_prompt(fmt)
    sampled = SamplingSpec(max_new_tokens=12, temperature=1.0, stop_token_ids=(), seed=11)
    original = run(engine.generate(prompt, sampled))
    # A trainer-style weights dir: model.safetensors + config + tokenizer.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    v1 = tmp_path / "weights" / "v1"
    model.save_pretrained(v1, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, v1 / name)

    run(engine.reload_weights(v1, version=1))
    assert engine.weights_version == 1
    changed = run(engine.generate(prompt, sampled))
    assert changed.weights_version == 1
    assert changed.num_cached_tokens == 0  # the old weights' cache was dropped
    assert changed.logprobs == pytest.approx(_transformers_logprobs(v1, prompt, changed.token_ids), abs=1e-4)

    run(engine.reload_weights(model_dir, version=2))
    back = run(engine.generate(prompt, sampled))
    assert back.token_ids == original.token_ids
    assert back.logprobs == pytest.approx(_transformers_logprobs(model_dir, prompt, back.token_ids), abs=1e-4)


def test_a_version_lacking_tensors_is_refused_and_the_engine_keeps_its_weights(
        engine, fmt: ChatFormat, model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    prompt = long_prompt(fmt)
    greedy = SamplingSpec(max_new_tokens=4, temperature=0.0, stop_token_ids=(fmt.end_of_turn_id,))
    before = run(engine.generate(prompt, greedy))
    tensors = load_file(model_dir / "model.safetensors")
    gone = next(n for n in sorted(tensors) if n.endswith("mlp.gate_proj.weight"))  # half of a fused projection
    del tensors[gone]
    part = tmp_path / "part"
    part.mkdir()
    save_file(tensors, part / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(model_dir / "config.json", part / "config.json")
    version = engine.weights_version
    with pytest.raises(EngineError, match=f"lacks 1 of the model's tensors \\({gone}\\)"):
        run(engine.reload_weights(part, version=version + 1))
    assert engine.weights_version == version
    after = run(engine.generate(prompt, greedy))
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def test_reload_from_a_dir_without_weights_is_a_clear_error(engine, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no \\*.safetensors"):
        run(engine.reload_weights(tmp_path, version=9))


def test_the_trainer_scores_tokens_at_the_engines_temperature(engine, fmt: ChatFormat, model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tiderl.trainer.grpo import token_logprobs

    prompt = long_prompt(fmt)
    spec = SamplingSpec(max_new_tokens=6, temperature=0.7, stop_token_ids=(fmt.end_of_turn_id,), seed=11)
    g = run(engine.generate(prompt, spec))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + list(g.token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    n = len(g.token_ids)
    at_t = token_logprobs(logits, ids, temperature=0.7)[0, -n:]
    plain = token_logprobs(logits, ids)[0, -n:]
    engine_lp = torch.tensor(g.logprobs)
    assert torch.allclose(at_t, engine_lp, atol=2e-3), (at_t, engine_lp)
    assert not torch.allclose(plain, engine_lp, atol=2e-3)  # T = 1 on the trainer's side would be off


def test_long_seeded_prompts_over_the_step_budget_run_whole(model_dir: Path, fmt: ChatFormat) -> None:
    """Eight seeded requests whose prompts together pass a step's token budget (4,096 on CPU). With
    vLLM's chunked prefill one of them was cut, its sampled token discarded, and the rewind of its seeded
    generator killed the engine on CPU ("CPU Generator does not use offset"); the engine now prefills
    whole prompts only."""
    from tiderl.rollout.vllm_engine import VllmEngine

    eng = VllmEngine(model_dir, num_kv_blocks=256, block_size=32, max_model_len=992, max_num_seqs=8)
    try:
        base = long_prompt(fmt)
        # Distinct from their first token on: no prefix-cache hit shortens a prefill.
        prompts = [(fmt.encode(str(i)) + base * (900 // len(base) + 1))[:900] for i in range(8)]

        async def eight():
            specs = [SamplingSpec(max_new_tokens=4, temperature=1.0, seed=i) for i in range(8)]
            return await asyncio.gather(*(eng.generate(p, s) for p, s in zip(prompts, specs)))

        gens = run(eight())
        assert len(gens) == 8 and all(g.num_prompt_tokens == 900 and g.token_ids for g in gens)
    finally:
        eng.close()
