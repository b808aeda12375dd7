"""Launcher pieces that need no processes: the progress line and each rank's environment."""

from __future__ import annotations

import os

from tiderl.run.launcher import progress_line, rank_env


def _doc(evals: list[dict]) -> dict:
    return {"version": 3, "goodput_tok_s": 12.4, "steps": [{"reward_mean": 0.5, "success_rate": 0.625}],
            "eval": evals, "ranks": [{"role": "actor"}, {"role": "rollout"}, {"role": "rollout"}],
            "buffer": {"tasks_pending": 4, "tasks_running": 8, "traj_ready": 2}}


def test_progress_line_shows_step_roles_buffer_and_only_complete_evaluations() -> None:
    line = progress_line(_doc([{"success_rate": 0.7, "eval_version": 0, "num_tasks": 32},
                               {"success_rate": 1.0, "eval_version": 5, "num_tasks": 3}]), eval_tasks=32)
    assert line.startswith("v3  reward 0.50  success 0.62")
    assert "eval 0.70@v0" in line and "@v5" not in line
    assert "goodput 12 tok/s" in line and "actor:1 rollout:2" in line
    assert "pending 4 running 8 ready 2" in line


def test_ranks_get_one_thread_and_their_own_core() -> None:
    env = rank_env(3)
    assert env["OMP_NUM_THREADS"] == "1"
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(3 % (os.cpu_count() or 1))
