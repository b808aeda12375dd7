"""`tiderl init-model`: the tiny warm-started model loads in transformers, is cached, and
plays hilo better than chance but not perfectly (room for RL)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.envs import make_env
from tiderl.models.demos import NoDemonstrationsError, play_demonstration
from tiderl.models.tiny_model import MANIFEST, TinyModelSpec, greedy_success_rate

ROOT = Path(__file__).resolve().parents[1]

SEEDS = range(10**7, 10**7 + 48)


@pytest.fixture(scope="module")
def model_dir(quickstart_model: Path) -> Path:
    # The quickstart's tiny model: built once (minutes on 2 cores), then found at once.
    return quickstart_model


def random_success_rate(seeds: range) -> float:
    rng = random.Random(0)
    total = 0.0
    for seed in seeds:
        env = make_env("hilo")
        env.reset(seed=seed, options={})
        done = False
        while not done:
            _, _, done, _ = env.step(str(rng.randint(1, 16)))
        total += env.final_reward()
    return total / len(seeds)


@pytest.mark.slow
def test_model_loads_in_transformers_and_is_small(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["head_dim"] == 32  # a head size vLLM's CPU attention supports
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "guess a number 1-16"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nguess a number 1-16<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_greedy_play_beats_random_but_is_not_perfect(model_dir: Path) -> None:
    greedy = greedy_success_rate(model_dir, "hilo", SEEDS)
    chance = random_success_rate(SEEDS)
    assert chance < greedy < 1.0, (chance, greedy)


@pytest.mark.slow
def test_a_second_call_returns_the_cached_model(model_dir: Path) -> None:
    from tiderl.config.job import load_job
    from tiderl.models import for_job

    built = json.loads((model_dir / MANIFEST).read_text())
    started = time.monotonic()
    assert for_job.model_dir(load_job(ROOT / "jobs" / "quickstart.yaml")) == model_dir
    assert time.monotonic() - started < 5
    assert json.loads((model_dir / MANIFEST).read_text()) == built


def test_spec_checks_name_the_field() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        TinyModelSpec(hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="demo_noise"):
        TinyModelSpec(demo_noise=1.5)


def test_demonstrations_are_noisy_and_unknown_envs_are_named() -> None:
    rewards = [play_demonstration("hilo", seed, noise=0.3)[1] for seed in range(200)]
    assert 0.5 < sum(rewards) / len(rewards) < 1.0
    messages, _ = play_demonstration("hilo", 1, noise=0.0)
    assert [m["role"] for m in messages[:3]] == ["user", "assistant", "user"]
    with pytest.raises(NoDemonstrationsError, match="hilo"):
        play_demonstration("nosuchenv", 0, noise=0.0)


def test_init_model_names_an_env_without_demonstrations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init-model", "--env", "pytool", "--out", str(tmp_path / "m")]) == 2
    assert "--env pytool" in capsys.readouterr().err and not (tmp_path / "m").exists()
