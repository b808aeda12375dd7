"""`tiderl samples`: a run's trajectories as text, the model's turns apart from the prompt and the environment's,
with reward and advantage; on a real SQLite run store with a real (small, trained here) tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiderl.cli import main
from tiderl.config import load_job
from tiderl.models.chatml import CHAT_TEMPLATE
from tiderl.models.tiny_model import train_tokenizer
from tiderl.rundir import create_run
from tiderl.samples import segments
from tiderl.store import FinishedTrajectory, NewGroup, RankReport, Role, RunState, TaskKind, VersionRecord

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "<|im_start|>user\nguess a number from 1 to 9<|im_end|>\n<|im_start|>assistant\n"


def test_segments_split_where_the_mask_changes() -> None:
    assert segments([1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 0]) == [
        ("prompt", [1, 2]), ("model", [3, 4]), ("env", [5]), ("model", [6]), ("env", [7])]
    assert segments([], []) == []


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = [PROMPT, "guess 5", "higher", "lower", "correct", "guess 7", "guess 3"] * 20
    tok = train_tokenizer(texts, vocab_size=300)
    tok.chat_template = CHAT_TEMPLATE
    out = tmp_path_factory.mktemp("base-model")
    tok.save_pretrained(out)
    return out


def _trajectory(tok, task_id: int, turns: list[tuple[str, str]], reward: float) -> FinishedTrajectory:
    """A trajectory of `turns` (the model's action, the environment's answer) after the prompt."""
    ids, mask = tok.encode(PROMPT), [0] * len(tok.encode(PROMPT))
    for action, answer in turns:
        a = tok.encode(action + "<|im_end|>")
        e = tok.encode(f"\n<|im_start|>user\n{answer}<|im_end|>\n<|im_start|>assistant\n")
        ids += a + e
        mask += [1] * len(a) + [0] * len(e)
    return FinishedTrajectory(task_id=task_id, token_ids=ids, loss_mask=mask, logprobs=[-0.5 if m else 0.0 for m in mask],
                              token_versions=[0 if m else -1 for m in mask], num_turns=len(turns), reward=reward,
                              success=reward > 0.5, finish="done")


@pytest.fixture
def run_dir(tmp_path: Path, tokenizer_dir: Path) -> Path:
    """A run at version 1: a group of 2 trained into version 1, a second group complete (not yet trained), a
    third with 1 of its 2 trajectories, and an evaluation of version 0 (2 tasks)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    run_dir = tmp_path / "r"
    _, s = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), run_dir)
    s.register_initial_version(str(tokenizer_dir), "c0")
    s.register_rank(0, Role.ROLLOUT)
    s.register_rank(1, Role.ACTOR)
    s.plan_roles(0, {0: Role.ROLLOUT, 1: Role.ACTOR})
    s.set_run_state(RunState.RUNNING)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    a, b = s.claim_tasks(0, 2)
    s.report(RankReport(rank=0, finished=[
        _trajectory(tok, a.task_id, [("guess 5", "higher"), ("guess 7", "correct")], 1.0),
        _trajectory(tok, b.task_id, [("guess 3", "higher"), ("guess 5", "higher")], 0.0)]))
    got = s.claim_ready_groups(1, 4)
    s.publish_version(VersionRecord(version=1, path="weights/v1", checksum="c1", trajectory_ids=[t.id for t in got],
                                    step_started_at=0.0, duration_s=1.0), owner=1)
    s.add_groups([NewGroup(TaskKind.TRAIN, 2, 2), NewGroup(TaskKind.TRAIN, 3, 2),
                  NewGroup(TaskKind.EVAL, 4, 2, eval_version=0)])
    claims = s.claim_tasks(0, 10, kinds=[TaskKind.TRAIN])
    c, d, e = claims[0], claims[1], claims[2]
    s.report(RankReport(rank=0, finished=[
        _trajectory(tok, c.task_id, [("guess 5", "lower")], 0.25),
        _trajectory(tok, d.task_id, [("guess 5", "lower")], 0.75),
        _trajectory(tok, e.task_id, [("guess 9", "lower")], 0.1)]))
    evals = s.claim_tasks(0, 10, kinds=[TaskKind.EVAL])
    s.report(RankReport(rank=0, finished=[_trajectory(tok, evals[0].task_id, [("guess 5", "correct")], 1.0),
                                           _trajectory(tok, evals[1].task_id, [("guess 2", "higher")], 0.0)]))
    s.close()
    return run_dir


def _blocks(out: str) -> list[str]:
    return [b for b in out.split("=== trajectory ") if b]


def test_the_trajectories_trained_into_a_version_turn_by_turn(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["samples", str(run_dir), "--version", "1", "--best"]) == 0
    best, worst = _blocks(capsys.readouterr().out)
    assert "reward 1.000  success yes  advantage +0.707" in best
    assert "2 turns" in best and "trained into version 1" in best and "generated at v0" in best
    # Turn by turn: the prompt, then each model turn, the environment's answer after it.
    body = best.split("\n", 2)[2]
    assert body.startswith("--- prompt (")
    assert "guess a number from 1 to 9" in body.split("--- model (turn 1")[0]
    model_1 = body.split("--- model (turn 1")[1].split("---\n", 1)[1].split("\n--- ")[0]
    assert model_1 == "guess 5<|im_end|>"
    env_1 = body.split("--- model (turn 2")[0].rsplit("--- env (", 1)[1]
    assert "higher" in env_1 and "guess" not in env_1
    assert "--- model (turn 2" in body and "guess 7<|im_end|>" in body and "correct" in body
    assert "reward 0.000  success no  advantage -0.707" in worst
    # The model's own text appears only under model markers.
    for block in (best, worst):
        for part in block.split("--- ")[1:]:
            if part.startswith(("prompt", "env")):
                assert "guess 3" not in part and "guess 7" not in part


def test_worst_best_and_recent_order_and_n(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rewards = {}
    for order in ("--worst", "--best", None):
        assert main(["samples", str(run_dir), "-n", "5", *([order] if order else [])]) == 0
        rewards[order] = [float(b.split("reward ")[1].split()[0]) for b in _blocks(capsys.readouterr().out)]
    assert rewards["--worst"] == [0.0, 0.1, 0.25, 0.75, 1.0]
    assert rewards["--best"] == [1.0, 0.75, 0.25, 0.1, 0.0]
    assert rewards[None] == [0.1, 0.75, 0.25, 0.0, 1.0]  # the most recent first (same time: the later one first)
    assert main(["samples", str(run_dir), "-n", "1", "--worst"]) == 0
    assert len(_blocks(capsys.readouterr().out)) == 1


def test_advantage_of_a_group_not_trained_yet_and_of_one_incomplete(run_dir: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["samples", str(run_dir), "-n", "3"]) == 0
    incomplete, high, low = _blocks(capsys.readouterr().out)
    # The store wrote the complete group's advantages when it completed; the incomplete group has none yet.
    assert "advantage +0.707" in high and "not trained (ready)" in high and "computed" not in high
    assert "advantage -0.707" in low
    assert "advantage - (its group has 1 of 2 trajectories)" in incomplete


def test_evaluation_trajectories_get_their_advantage_computed_over_the_group(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["samples", str(run_dir), "--eval", "--version", "0", "--best"]) == 0
    best, worst = _blocks(capsys.readouterr().out)
    assert "advantage +0.707 (computed over its group)" in best and "evaluation of version 0" in best
    assert "advantage -0.707 (computed over its group)" in worst


@pytest.mark.parametrize("version, message", [
    ("2", "version 2: the run's trained versions are 1 to 1"),
    ("-1", "version -1: the run's trained versions are 1 to 1"),
    ("0", "version 0 is the base model: no trajectories were trained into it; give 1 to 1 (the run's latest)"),
])
def test_a_version_out_of_range_exits_2_naming_the_range(run_dir: Path, capsys: pytest.CaptureFixture[str],
                                                          version: str, message: str) -> None:
    assert main(["samples", str(run_dir), "--version", version]) == 2
    err = capsys.readouterr().err
    assert err == f"tiderl samples: {message}\n"


def test_nothing_to_show_exits_1(tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, s = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "r")
    s.register_initial_version(str(tokenizer_dir), "c0")
    s.close()
    assert main(["samples", str(tmp_path / "r")]) == 1
    assert "no training trajectories in" in capsys.readouterr().err


def test_a_base_model_without_a_tokenizer_exits_2_naming_it(run_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["samples", str(run_dir), "--tokenizer", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tiderl samples: tokenizer: cannot load one from {empty}") and err.count("\n") == 1


def test_the_command_as_a_user_runs_it(run_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ok = subprocess.run([sys.executable, "-m", "tiderl", "samples", str(run_dir), "--version", "1", "-n", "1",
                         "--worst"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("=== trajectory ") and "--- model (turn 1" in ok.stdout and "guess 3" in ok.stdout
    not_a_run = subprocess.run([sys.executable, "-m", "tiderl", "samples", str(tmp_path)], capture_output=True,
                               text=True, env=env, timeout=120)
    assert not_a_run.returncode == 2 and not_a_run.stdout == ""
    assert not_a_run.stderr.startswith("tiderl samples: ") and "no run store" in not_a_run.stderr
    assert not_a_run.stderr.count("\n") == 1
