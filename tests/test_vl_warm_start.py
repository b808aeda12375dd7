"""The tiny vision-language model's warm start: gridimage's two demonstrators (the expert who reads
the picture, the column-reader of `demo_column_fraction`), the demonstrations as the trainer's samples
(each picture's placeholder expanded into its tokens, loss on the actions only), the job's and the
CLI's warm-start options, and (slow) a warm start that reads the picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.envs import make_env
from tiderl.envs.base import EnvOptionError
from tiderl.models import demos
from tiderl.models.tiny_model import MANIFEST

ROOT = Path(__file__).resolve().parents[1]
GAMES = range(240)  # gridimage's 4x4 grid has 16 x 15 = 240 placements; consecutive seeds are distinct games


def _reads_columns(seed: int, fraction: float) -> bool:
    env = make_env("gridimage")
    env.reset(seed=seed, options={"demo_column_fraction": fraction})
    return bool(env.demo_columns)  # type: ignore[attr-defined]


def test_the_column_option_changes_the_demonstrator_and_not_the_game() -> None:
    for seed in (0, 7, 31):
        plain, mixed = make_env("gridimage"), make_env("gridimage")
        assert plain.reset(seed=seed, options={}) == mixed.reset(seed=seed, options={"demo_column_fraction": 1.0})
        assert plain.observation_images() == mixed.observation_images()  # type: ignore[attr-defined]
        for action in ("right", "right", "down", "left", "up"):
            if plain.done:  # type: ignore[attr-defined]
                break
            assert plain.step(action) == mixed.step(action)
            assert plain.observation_images() == mixed.observation_images()  # type: ignore[attr-defined]
    shares = [sum(_reads_columns(seed, f) for seed in GAMES) / len(GAMES) for f in (0.0, 0.6, 1.0)]
    assert shares[0] == 0.0 and shares[2] == 1.0 and 0.5 < shares[1] < 0.7, shares


def test_the_column_reader_walks_to_the_goals_column_only_and_the_expert_finds_every_goal() -> None:
    """The column-reader never moves up or down: it walks to the goal's column and on the way it went,
    so it finds exactly the goals on its own row (48 of the 240 games); the expert finds all of them."""
    found = 0
    for seed in GAMES:
        env = make_env("gridimage")
        env.reset(seed=seed, options={"demo_column_fraction": 1.0})
        last, done = "right", False
        while not done:
            agent, goal = env.agent, env.goal  # type: ignore[attr-defined]
            move = env.expert_action()  # type: ignore[attr-defined]
            expected = last if agent[1] == goal[1] else ("right" if goal[1] > agent[1] else "left")
            assert move == expected, (seed, agent, goal, move)
            last = move
            done = env.step(move).done
        found += int(env.final_reward())
    assert found == 48
    expert_rate = sum(demos.play_demonstration("gridimage", seed, 0.0)[1] for seed in GAMES) / len(GAMES)
    assert expert_rate == 1.0


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_the_column_fraction_is_a_probability(fraction: float) -> None:
    with pytest.raises(EnvOptionError, match="demo_column_fraction"):
        make_env("gridimage").reset(seed=0, options={"demo_column_fraction": fraction})


def test_demonstrations_become_samples_with_every_picture_expanded_and_loss_on_the_actions(tmp_path: Path) -> None:
    from tiderl.rollout.chat import ChatFormat, ImageTokens
    from tiderl.models.tiny_vl_model import TinyVisionSpec, build_processor, corpus_texts, demo_samples, train_vl_tokenizer
    from tiderl.trainer.images import ImageInputs

    spec = TinyVisionSpec(num_corpus_episodes=40)
    tokenizer = train_vl_tokenizer(corpus_texts(spec), spec.vocab_size)
    build_processor(spec, tokenizer).save_pretrained(tmp_path)
    fmt = ChatFormat(tokenizer, ImageTokens.of_model(tmp_path))
    played = [demos.play_demonstration("gridimage", seed, 0.0) for seed in (3, 11, 40)]
    samples = demo_samples(ImageInputs(tmp_path), fmt, [messages for messages, _ in played])
    for (messages, _), sample in zip(played, samples):
        actions = [m["content"] for m in messages[1::2]]
        pictures = len(actions)  # the first observation's and one per move but the last (it is left out)
        assert sample.images is not None and sum(sample.images.token_types) == 4 * pictures
        assert tuple(sample.images.grid_thw.shape) == (pictures, 3) and sample.images.pixel_values.shape[0] == 16 * pictures
        assert all(t == fmt.image_pad_id for t, kind in zip(sample.token_ids, sample.images.token_types) if kind)
        learnt = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
        assert fmt.tokenizer.decode(learnt, skip_special_tokens=False) == "".join(f"{a}<|im_end|>" for a in actions)


def test_the_job_and_the_cli_set_the_vision_warm_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Unset, the job's warm-start options leave the vision spec's defaults; set, they reach it (and its
    cache name); `tiderl init-model --train-steps 0` leaves random weights, a bad noise is refused."""
    from tiderl.config.job import load_job
    from tiderl.models import for_job, tiny_vl_model

    built = []
    monkeypatch.setattr(tiny_vl_model, "init_vl_model", lambda out, spec, **_: built.append((out, spec)) or out)
    for_job.model_dir(load_job(ROOT / "jobs/quickstart-vision.yaml", ["model.init_demo_noise=null"]))
    for_job.model_dir(load_job(ROOT / "jobs/quickstart-vision.yaml", ["model.init_train_steps=12"]))
    (dir_a, a), (dir_b, b) = built
    default = tiny_vl_model.TinyVisionSpec()
    assert (a.train_steps, a.demo_noise) == (default.train_steps, default.demo_noise)
    assert (b.train_steps, b.demo_noise) == (12, 0.05) and b.env_options == {"demo_column_fraction": 0.6}
    assert dir_a != dir_b
    monkeypatch.undo()

    out = tmp_path / "random"
    assert main(["init-model", "--env", "gridimage", "--out", str(out), "--train-steps", "0"]) == 0
    assert json.loads((out / MANIFEST).read_text())["warm_start"] is None
    capsys.readouterr()
    assert main(["init-model", "--env", "gridimage", "--out", str(out), "--demo-noise", "2"]) == 2
    assert "demo_noise" in capsys.readouterr().err
