"""The rollout role's agent loop against a real env server (HTTP) with the scripted engine."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from tiderl.config.env import EnvConfig
from tiderl.envs.launch import make_pool, server_argv, wait_for_url
from tiderl.rollout.chat import IM_END, IM_START, PAD, ChatFormat
from tiderl.rollout.fake_engine import FakeEngine
from tiderl.run.agent import AgentSettings, Episode, play_task
from tiderl.store.types import TaskClaim, TaskKind

SPECIALS = (PAD, IM_START, IM_END)


class CharTokenizer:
    """One id per character, the chat markers atomic: enough for the chat format's id pieces."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for k, special in enumerate(SPECIALS):
                if text.startswith(special, i):
                    ids.append(k)
                    i += len(special)
                    break
            else:
                ids.append(len(SPECIALS) + ord(text[i]))
                i += 1
        return ids

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIALS.index(token)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - len(SPECIALS)) if i >= len(SPECIALS) else ("" if skip_special_tokens else SPECIALS[i])
                       for i in ids)


@pytest.mark.slow
def test_play_task_records_masks_versions_and_reward(tmp_path: Path) -> None:
    cfg = EnvConfig()
    proc = subprocess.Popen(server_argv(cfg, tmp_path / "port"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for_url(tmp_path / "port", proc)
        tok = CharTokenizer()
        fmt = ChatFormat(tok)
        guesses = iter(["8", "4", "12", "2", "6", "10", "14", "16"])
        engine = FakeEngine(lambda prompt: tok.encode(next(guesses)))  # it appends the stop id
        settings = AgentSettings("hilo", {}, max_turns=4, max_context_tokens=4096, max_new_tokens=8, temperature=1.0)
        claim = TaskClaim(task_id=7, group_id=1, index_in_group=0, kind=TaskKind.TRAIN, seed=3, attempts=1,
                          eval_version=None)

        async def play() -> tuple:
            pool = make_pool(cfg, [url])
            try:
                episode = Episode()
                return await play_task(claim, engine, pool, fmt, settings, episode), episode, await pool.health()
            finally:
                await pool.close()

        traj, episode, health = asyncio.run(play())
    finally:
        proc.terminate()
        proc.wait(10)
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.token_versions) == n
    assert traj.loss_mask[0] == 0 and 1 <= traj.num_turns <= 4
    for m, lp, v in zip(traj.loss_mask, traj.logprobs, traj.token_versions):
        assert (v == 0 and lp == -0.5) if m else (v == -1 and lp == 0.0)
    # Every generated turn ends with the end-of-turn marker, which the model produced itself.
    assert sum(traj.loss_mask) == sum(len(g) + 1 for g in ["8", "4", "12", "2"][:traj.num_turns])
    assert traj.success == (traj.reward > 0)
    assert episode.min_version == 0
    assert health[0]["status"] == "ok"
