"""hilo's `demo_scan_fraction`: the quickstart's warm start imitates two players (issue 14)."""

from __future__ import annotations

import pytest

from tiderl.envs import EnvOptionError, make_env
from tiderl.models import demos

OPTIONS = {"low": 1, "high": 16, "max_turns": 6}


def test_the_scan_fraction_changes_the_demonstrator_not_the_game() -> None:
    scans = 0
    for seed in range(400):
        plain, mixed = make_env("hilo"), make_env("hilo")
        plain.reset(seed=seed, options=OPTIONS)
        mixed.reset(seed=seed, options=OPTIONS | {"demo_scan_fraction": 0.6})
        assert mixed.secret == plain.secret
        for guess in ("5", "12", "3"):  # the same feedback for the same guesses
            if plain.done:
                break
            assert mixed.step(guess).observation == plain.step(guess).observation
        first = make_env("hilo")
        first.reset(seed=seed, options=OPTIONS | {"demo_scan_fraction": 0.6})
        scans += first.expert_action() == "1"  # the scanner's first guess; the bisector's is 8
    assert 0.5 < scans / 400 < 0.7


def test_a_demonstration_game_is_played_by_one_player() -> None:
    for seed in range(50):
        messages, _ = demos.play_demonstration("hilo", seed, 0.0, OPTIONS | {"demo_scan_fraction": 0.6})
        guesses = [int(m["content"]) for m in messages[1::2]]
        scanning = guesses[0] == 1
        # The scanner guesses 1, 2, 3, ... (each "higher"); the bisector starts at 8 and halves.
        assert guesses == (list(range(1, len(guesses) + 1)) if scanning else guesses), guesses
        if not scanning:
            assert guesses[0] == 8


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_the_scan_fraction_is_a_probability(fraction: float) -> None:
    with pytest.raises(EnvOptionError, match="demo_scan_fraction"):
        make_env("hilo").reset(seed=0, options={"demo_scan_fraction": fraction})


def test_the_job_sets_the_warm_start_demonstrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.init_demo_noise` and `model.init_train_steps` reach the tiny model's spec (and so its cache
    name); a noise outside [0, 1] is refused with the key named."""
    from pathlib import Path

    from tiderl.config.job import load_job
    from tiderl.config.schema import ConfigError
    from tiderl.models import for_job, tiny_model

    root = Path(__file__).resolve().parents[1]
    built = []
    monkeypatch.setattr(tiny_model, "init_model", lambda out, spec, **_: built.append((out, spec)) or out)
    for noise in ("0.05", "0.3"):
        job = load_job(root / "jobs/quickstart.yaml", [f"model.init_demo_noise={noise}", "model.init_train_steps=40"])
        for_job.model_dir(job)
    (dir_a, a), (dir_b, b) = built
    assert (a.demo_noise, b.demo_noise, a.train_steps) == (0.05, 0.3, 40)
    assert a.env_options == b.env_options == dict(job.env.options)
    assert dir_a != dir_b
    with pytest.raises(ConfigError, match="init_demo_noise"):
        load_job(root / "jobs/quickstart.yaml", ["model.init_demo_noise=1.5"])
