"""The vLLM engine on the tiny model: ids in, ids + logprobs out, cache counters, reload.

One engine for the module (its start-up dominates): 32 blocks of 32 tokens."""

from __future__ import annotations

import asyncio
import shutil
import time
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


def test_the_engine_times_its_iterations_with_their_prefill_and_decoding(engine, fmt: ChatFormat) -> None:
    """What CTB's cost meter learns from: every batch the core sends counted (each request's prompt less
    its cached tokens prefilled once, every later token decoded), iterations timed while the core ran."""
    import asyncio

    engine.take_iterations()
    clock = engine._clock
    prefilled0, decoded0 = clock.prefilled_total, clock.decoded_total
    base = long_prompt(fmt)
    prompts = [base[: len(base) - 7 * i] for i in range(8)]
    spec = SamplingSpec(max_new_tokens=6, temperature=0.0, stop_token_ids=())

    async def all_at_once():
        return await asyncio.gather(*(engine.generate(p, spec) for p in prompts))

    gens = run(all_at_once())
    # The first token of each comes with its prefill; every later one is a decoding step.
    assert clock.decoded_total - decoded0 == sum(len(g.token_ids) - 1 for g in gens) > 0
    assert clock.prefilled_total - prefilled0 == sum(g.num_prompt_tokens - g.num_cached_tokens for g in gens)
    timed = engine.take_iterations()
    assert timed and all(it.wall_s > 0 and it.decoding + it.prefill_tokens > 0 for it in timed)
    assert sum(it.decoding for it in timed) <= 8 * 5 and engine.take_iterations() == []


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


def test_a_cpu_engine_keeps_its_memory_when_the_rank_trains(engine) -> None:
    # vLLM's sleep mode needs a GPU: on a CPU the call runs and says nothing was released.
    assert run(engine.release_memory()) is False and not engine.memory_released
    run(engine.restore_memory())  # nothing to take back


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


def _perturbed(model_dir: Path, seed: int | None):
    """The model of `model_dir`, every weight moved by noise of `seed` (None: as it is)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if seed is None:
        return model
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _scored(model, ids: list[int], start: int, end: int, banned: tuple[int, ...] = ()) -> list[float]:
    """The model's logprobs of ids[start:end] given what comes before each (`banned` ids biased by -100, as
    the engine does)."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:end]])).logits[0]
    logits[:, list(banned)] -= 100.0
    lp = torch.log_softmax(logits[start - 1:end - 1], dim=-1)
    return lp[torch.arange(end - start), torch.tensor(ids[start:end])].tolist()


def test_a_transfer_serves_exactly_the_trainers_weights_and_a_failed_one_loads_nothing(
        engine, fmt: ChatFormat, model_dir: Path) -> None:
    """Weights without files: the trainer's server stages and commits a version, the engine pulls it through
    vLLM's weight-transfer API and samples from it (tied output layer included), its cache dropped. A
    version the server cannot give raises WeightsNotReceived and leaves the engine's weights as they were."""
    from tiderl.rollout.engine import WeightsNotReceived
    from tiderl.weightsync.server import WeightServer

    prompt = long_prompt(fmt)
    sampled = SamplingSpec(max_new_tokens=12, temperature=1.0, stop_token_ids=(), seed=11)
    model = _perturbed(model_dir, 1)
    server = WeightServer(commit_wait_s=0.5)
    try:
        server.stage(7, model.state_dict().items())
        server.commit(7)
        assert run(engine.receive_weights(server.address, 7)) == 7
        assert engine.weights_version == 7 and engine.last_update.path == "transfer"
        assert engine.last_update.via == "shared_memory"  # vLLM's worker process is on the server's host
        # Every tensor once, in fp32: the tied output layer is the embedding's storage and is not sent again.
        assert engine.last_update.nbytes == sum(t.numel() * 4 for n, t in model.state_dict().items() if n != "lm_head.weight")
        g = run(engine.generate(prompt, sampled))
        assert g.weights_version == 7 and g.num_cached_tokens == 0
        ids = prompt + list(g.token_ids)
        assert g.logprobs == pytest.approx(_scored(model, ids, len(prompt), len(ids)), abs=1e-4)
        with pytest.raises(WeightsNotReceived, match="no committed version >= 8"):
            run(engine.receive_weights(server.address, 8))
        again = run(engine.generate(prompt, sampled))
        assert engine.weights_version == 7 and again.token_ids == g.token_ids
        assert again.logprobs == pytest.approx(g.logprobs, abs=1e-6)
    finally:
        server.close()
    with pytest.raises(WeightsNotReceived, match="cannot reach the weight server"):
        run(engine.receive_weights(server.address, 8))
    run(engine.reload_weights(model_dir, version=8))  # the base model again, for the tests after


def test_requests_in_flight_go_on_through_an_update_on_the_new_weights(engine, fmt: ChatFormat, model_dir: Path) -> None:
    """An update does not wait for the requests in flight, nor drop or restart them: they stop between two
    steps, and the tokens sampled after it come from the new weights over the whole context (their KV
    recomputed), each token stamped with the version that sampled it."""
    from tiderl.weightsync.server import WeightServer

    base = engine.weights_version
    prompt = long_prompt(fmt)
    spec = SamplingSpec(max_new_tokens=600, temperature=1.0, stop_token_ids=(), seed=3,
                        banned_token_ids=tuple({fmt.end_of_turn_id, *fmt.stop_ids}))
    model = _perturbed(model_dir, 2)
    server = WeightServer(shared_memory=False)  # the bytes sent, as to an engine on another host
    try:
        server.stage(base + 1, model.state_dict().items())
        server.commit(base + 1)

        async def update_midway():
            task = asyncio.ensure_future(engine.generate(prompt, spec))
            deadline = time.monotonic() + 300
            # The tokens the engine has taken so far for the request (vLLM's Prometheus counters are the
            # process's: another engine of this module replaced them).
            while sum(len(w.token_ids) for w in engine._waiters.values()) < 20 and not task.done():
                assert time.monotonic() < deadline, "the request sampled nothing"
                await asyncio.sleep(0.01)
            await engine.receive_weights(server.address, base + 1)
            return await task

        g = run(update_midway())
    finally:
        server.close()
    assert engine.last_update.in_flight == 1 and engine.last_update.stall_s > 0
    assert engine.last_update.via == "sent"
    versions = g.versions
    switch = versions.index(base + 1)
    assert len(g.token_ids) == 600 and 20 <= switch < 600
    assert set(versions[:switch]) == {base} and set(versions[switch:]) == {base + 1}
    ids = prompt + list(g.token_ids)
    start = len(prompt)
    old = _scored(_perturbed(model_dir, None), ids, start, start + switch, spec.banned_token_ids)
    new = _scored(model, ids, start + switch, len(ids), spec.banned_token_ids)
    assert list(g.logprobs[:switch]) == pytest.approx(old, abs=1e-4)
    assert list(g.logprobs[switch:]) == pytest.approx(new, abs=1e-4)
    run(engine.reload_weights(model_dir, version=base + 2))



def test_an_engine_whose_core_dies_mid_generation_fails_its_requests(fmt: ChatFormat, model_dir: Path) -> None:
    """The engine core killed while a request generates (the chaos campaign's `engine_kill`): vLLM's client shuts
    down without waking a step that waits for the core's outputs, so the request waited for ever and its rank
    with it. The engine's watch wakes it: the request fails with EngineError, `failure` says why, and close()
    leaves none of vLLM's processes behind."""
    import os
    import signal

    from tiderl.rollout.vllm_engine import VllmEngine

    eng = VllmEngine(model_dir, num_kv_blocks=32, block_size=32, max_model_len=992, max_num_seqs=8)
    processes = list(eng._processes)
    try:
        core = next(p for p in processes if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM::Engine"))
        spec = SamplingSpec(max_new_tokens=900, temperature=1.0, seed=3, banned_token_ids=(fmt.end_of_turn_id,))

        async def scenario() -> None:
            task = asyncio.ensure_future(eng.generate(long_prompt(fmt), spec))
            while not any(w.token_ids for w in eng._waiters.values()):  # it generates: the thread waits on the core
                await asyncio.sleep(0.005)
            os.kill(core.pid, signal.SIGKILL)
            with pytest.raises(EngineError):
                await asyncio.wait_for(task, 60)

        run(scenario())
        assert eng.failure is not None
        with pytest.raises(EngineError, match="unusable"):
            run(eng.generate(long_prompt(fmt), spec))
    finally:
        eng.close()
    import psutil

    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
