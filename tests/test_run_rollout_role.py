"""The rollout role's worker wiring: store claims in, `FinishedTrajectory`s, failures and releases out."""

from __future__ import annotations

import asyncio
import random
import subprocess
from pathlib import Path

import pytest

from tiderl.config.env import EnvConfig
from tiderl.config.job import JobConfig
from tiderl.config.schema import build
from tiderl.envs.launch import make_pool, server_argv, wait_for_url
from tiderl.rollout.chat import ChatFormat
from tiderl.models.demos import corpus_texts
from fake_engine import FakeEngine
from tiderl.rollout.local_env import LocalEnvLink
from tiderl.models.tiny_model import train_tokenizer
from tiderl.run.rollout_role import RolloutRole
from tiderl.store.types import RankReport, TaskClaim, TaskKind


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(train_tokenizer(corpus_texts("hilo", range(200), noise=0.5), vocab_size=200))


def job(scheduler: str = "ctb", max_concurrency: int = 8) -> JobConfig:
    return build(JobConfig, {"system": "tiderl", "env": {"max_turns": 4},
                             "rollout": {"scheduler": scheduler, "max_concurrency": max_concurrency}}, "job.yaml")


def guesser(fmt: ChatFormat, seed: int = 0):
    rng = random.Random(seed)
    return lambda prompt: fmt.encode(str(rng.randint(1, 16)))


def claims(first_id: int, group_id: int, n: int, kind: TaskKind = TaskKind.TRAIN,
           eval_version: int | None = None) -> list[TaskClaim]:
    return [TaskClaim(task_id=first_id + i, group_id=group_id, index_in_group=i, kind=kind, seed=group_id,
                      attempts=1, eval_version=eval_version) for i in range(n)]


def check_trajectories(role: RolloutRole, version: int = 0) -> None:
    for traj in role.finished:
        n = len(traj.token_ids)
        assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.token_versions) == n
        assert traj.loss_mask[0] == 0 and 1 <= traj.num_turns <= 4
        for m, lp, v in zip(traj.loss_mask, traj.logprobs, traj.token_versions):
            assert (v == version and lp == -0.5) if m else (v == -1 and lp == 0.0)
        assert traj.success == (traj.reward > 0)
        assert traj.finish in ("done", "max_turns", "max_context")  # the store keeps how it ended
        assert traj.finish != "max_turns" or traj.num_turns == 4
        assert traj.env == "hilo"  # the environment it played: the step's figures per environment read it


@pytest.mark.parametrize("scheduler", ["ctb", "vanilla"])
def test_claims_become_finished_trajectories(fmt: ChatFormat, scheduler: str) -> None:
    async def scenario() -> RolloutRole:
        role = RolloutRole(job(scheduler), 0, FakeEngine(guesser(fmt)), LocalEnvLink(), fmt)
        role.add(claims(10, 1, 4) + claims(20, 2, 2, TaskKind.EVAL, eval_version=0))
        role.add(claims(14, 1, 2))  # the same store group claimed again later
        await role.runner
        return role

    role = asyncio.run(scenario())
    assert role.worker.scheduler.name == scheduler
    assert sorted(t.task_id for t in role.finished) == [10, 11, 12, 13, 14, 15, 20, 21]
    assert not role.failed and not role.claims and not role.worker.first_version
    check_trajectories(role)


def test_stale_tasks_and_a_role_change_are_released(fmt: ChatFormat) -> None:
    async def scenario() -> tuple[RolloutRole, list[int], list[int]]:
        engine = FakeEngine(lambda prompt: fmt.encode("1"), delay_s=0.05)  # "1" is never right: long tasks
        role = RolloutRole(job(), 0, engine, LocalEnvLink(), fmt)
        role.add(claims(10, 1, 3) + claims(20, 2, 1, TaskKind.EVAL, eval_version=0))
        while len(role.worker.first_version) < 4:
            await asyncio.sleep(0.01)
        await engine.reload_weights("weights/v2", version=2)
        stale, rest = RankReport(rank=0), RankReport(rank=0)
        await role.release(stale, role.stale(bound=1))  # staleness bound 1 at version 2
        role.worker.poke()
        await role.release(rest)
        await role.runner
        assert not stale.handed_over and not rest.handed_over  # without handoff, tasks start again
        return role, stale.released, rest.released

    role, stale, rest = asyncio.run(scenario())
    assert sorted(stale) == [10, 11, 12]  # the eval task is never stale
    assert rest == [20] and not role.claims and not role.finished
    assert role.worker.num_unfinished == 0 and role.worker.env.num_sessions == 0


def test_a_failing_task_is_reported_and_the_others_finish(fmt: ChatFormat) -> None:
    calls = {"n": 0}

    def respond(prompt):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("engine broke")
        return fmt.encode("3")

    async def scenario() -> RolloutRole:
        role = RolloutRole(job("vanilla"), 0, FakeEngine(respond, delay_s=0.001), LocalEnvLink(), fmt)
        role.add(claims(10, 1, 4))
        await role.runner
        return role

    role = asyncio.run(scenario())
    assert [f.task_id for f in role.failed] and "engine broke" in role.failed[0].reason
    assert len(role.failed) == 1 and len(role.finished) == 3
    report_ids = {f.task_id for f in role.failed} | {t.task_id for t in role.finished}
    assert report_ids == {10, 11, 12, 13}


@pytest.mark.slow
def test_the_role_plays_against_a_real_env_server(tmp_path: Path, fmt: ChatFormat) -> None:
    cfg = EnvConfig()
    proc = subprocess.Popen(server_argv(cfg, tmp_path / "port"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for_url(tmp_path / "port", proc)

        async def scenario() -> tuple[RolloutRole, list]:
            pool = make_pool(cfg, [url])
            try:
                # A small KV budget makes CTB pause and resume sessions over HTTP.
                role = RolloutRole(job(), 0, FakeEngine(guesser(fmt), kv_capacity_tokens=256), pool, fmt)
                role.add(claims(1, 1, 4) + claims(5, 2, 4))
                await role.runner
                return role, await pool.health()
            finally:
                await pool.close()

        role, health = asyncio.run(scenario())
    finally:
        proc.terminate()
        proc.wait(10)
    assert sorted(t.task_id for t in role.finished) == list(range(1, 9)) and not role.failed
    check_trajectories(role)
    assert health[0]["status"] == "ok" and role.worker.report.num_pauses > 0


async def hand_over(fmt: ChatFormat, env: object, first_claims: list[TaskClaim], min_turns: int) -> RankReport:
    """Rank 0 plays never-winning tasks until each has `min_turns` turns, then leaves rollout
    handing them over; its report."""
    first = RolloutRole(job(), 0, FakeEngine(lambda prompt: fmt.encode("1"), delay_s=0.02), env, fmt)
    first.add(first_claims)
    while min((r.num_turns for r in first.worker._runs.values()), default=0) < min_turns:
        await asyncio.sleep(0.005)
    report = RankReport(rank=0)
    await first.release(report, handoff=True)
    await first.runner
    return report


async def carry_on(fmt: ChatFormat, env: object, report: RankReport) -> RolloutRole:
    """Rank 1 claims what rank 0 released, with the progress it handed over, and plays it out."""
    second = RolloutRole(job(), 1, FakeEngine(guesser(fmt)), env, fmt)
    second.add([TaskClaim(task_id=t, group_id=1, index_in_group=i, kind=TaskKind.TRAIN, seed=1, attempts=2,
                          eval_version=None, progress=report.handed_over.get(t))
                for i, t in enumerate(report.released)])
    await second.runner
    return second


def test_tasks_handed_over_at_a_boundary_carry_on_elsewhere(fmt: ChatFormat) -> None:
    """A rank leaving rollout hands its tasks over: the next rank resumes each paused env session
    and continues the context (a fresh prefill), without replaying a single turn."""
    env = LocalEnvLink()  # both ranks reach the same sessions, like two ranks of one env server

    async def scenario() -> tuple[RolloutRole, RankReport, int]:
        report = await hand_over(fmt, env, claims(10, 1, 4), min_turns=2)
        starts = env.num_starts
        second = await carry_on(fmt, env, report)
        return second, report, env.num_starts - starts

    second, report, new_starts = asyncio.run(scenario())
    assert sorted(report.released) == [10, 11, 12, 13]
    assert len(report.handed_over) >= 1, "no task was stopped at a turn boundary"
    assert new_starts == 4 - len(report.handed_over), "a handed-over task started a new env session"
    assert sorted(t.task_id for t in second.finished) == [10, 11, 12, 13] and not second.failed
    for traj in second.finished:
        progress = report.handed_over.get(traj.task_id)
        if progress is None:
            continue
        n = len(progress["token_ids"])
        assert list(traj.token_ids[:n]) == progress["token_ids"] and traj.num_turns > progress["num_turns"] >= 2
        assert list(traj.token_versions[:n]) == progress["versions"]
    assert env.num_sessions == 0  # every session ended exactly once, by the rank that finished it


@pytest.mark.slow
def test_hand_over_through_a_real_env_server_between_two_pools(tmp_path: Path, fmt: ChatFormat) -> None:
    """Two ranks, two pools, one server: sessions stopped at a turn boundary move to the other
    pool; tasks caught in an env step (the server answers slowly) start again instead."""
    cfg = build(EnvConfig, {"latency": "lognormal:0.02:0.08"}, "env")
    proc = subprocess.Popen(server_argv(cfg, tmp_path / "port"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for_url(tmp_path / "port", proc)

        async def scenario() -> tuple[RolloutRole, RankReport, list]:
            first_pool, second_pool = make_pool(cfg, [url]), make_pool(cfg, [url])
            try:
                report = await hand_over(fmt, first_pool, claims(1, 1, 8), min_turns=1)
                second = await carry_on(fmt, second_pool, report)
                return second, report, await second_pool.health()
            finally:
                await first_pool.close()
                await second_pool.close()

        second, report, health = asyncio.run(scenario())
    finally:
        proc.terminate()
        proc.wait(10)
    assert sorted(report.released) == list(range(1, 9))
    assert report.handed_over, "no task was stopped at a turn boundary"
    assert all(p["server"] == url for p in report.handed_over.values())
    assert sorted(t.task_id for t in second.finished) == list(range(1, 9)) and not second.failed
    # Every handed-over session was ended by the rank that finished it; none stays paused. (A task cut
    # off while its env /start was in flight leaves a session the server reaps when it idles.)
    assert health[0]["paused"] == 0 and health[0]["sessions"] <= 8 - len(report.handed_over)


@pytest.mark.parametrize("wait_s", [0.0, 0.001, 0.02])
def test_tasks_claimed_just_before_a_role_switch_are_all_released(fmt: ChatFormat, wait_s: float) -> None:
    """Claims added a moment before the switch (still pending, just started, or mid-turn) all go back."""
    async def scenario() -> tuple[RolloutRole, RankReport]:
        role = RolloutRole(job(max_concurrency=4), 0, FakeEngine(lambda prompt: fmt.encode("1"), delay_s=0.01),
                           LocalEnvLink(), fmt)
        role.add(claims(10, 1, 6))  # more than the worker admits at once: some stay pending
        if wait_s:
            await asyncio.sleep(wait_s)
        report = RankReport(rank=0)
        await role.release(report, handoff=True)
        await asyncio.gather(role.runner, return_exceptions=True)
        role.drain(report)
        return role, report

    role, report = asyncio.run(scenario())
    finished = {t.task_id for t in report.finished}
    assert sorted(set(report.released) | finished) == list(range(10, 16))
    assert not set(report.released) & finished and not role.claims


def test_a_rank_builds_its_engine_once_on_the_base_model_whatever_version_it_joins_at(monkeypatch, tmp_path: Path):
    """A rank that joins rollout late (ERS moved it) starts its engine on the base model, which the trainer
    never prunes, and reloads the planned weights after (a start of a minute outlived the versions it
    asked for, one after the other, for the rest of a run)."""
    from types import SimpleNamespace

    import tiderl.rollout.from_config as from_config
    from tiderl.run.rollout_role import rank_engine

    built, events = [], []
    monkeypatch.setattr(from_config, "make_engine", lambda job, path, weights_version=0: built.append(
        (Path(path), weights_version)) or FakeEngine(lambda prompt: [1], weights_version=weights_version))
    store = SimpleNamespace(record_event=lambda source, kind, message, **kw: events.append(kind))
    ctx = SimpleNamespace(engine=None, rank=2, store=store, model_dir=tmp_path / "base",
                          paths=SimpleNamespace(weights=tmp_path / "weights"),
                          config=SimpleNamespace(rollout=SimpleNamespace(engine="vllm")))
    engine = rank_engine(ctx)
    assert built == [(tmp_path / "base", 0)] and engine.weights_version == 0 and events == ["engine_up"]
    assert rank_engine(ctx) is engine and len(built) == 1  # kept across role changes


def test_a_dead_engine_gives_every_task_back_uncounted_and_ends_the_rank(fmt: ChatFormat) -> None:
    """vLLM failing on one request kills the engine for all (a resumed image request did, in CI): the tasks
    that failed on it and those still in flight go back to the pool with no attempt counted, in the tick's
    report, and the rank ends (EngineFailed) for the launcher to start it afresh, instead of claiming tasks
    only to fail them."""
    from types import SimpleNamespace

    from tiderl.run.rollout_role import EngineFailed, _engine_failed

    class Dying(FakeEngine):
        dead: BaseException | None = None

        @property
        def failure(self) -> BaseException | None:
            return self.dead

        async def generate(self, prompt_ids, sampling, images=()):
            if self.dead is None and len(self.prompts) == 2:  # the third generation kills it
                self.dead = RuntimeError("engine core died")
            if self.dead is not None:
                raise EngineError(f"the engine is unusable: {self.dead}")
            return await super().generate(prompt_ids, sampling, images)

    sent: list[RankReport] = []
    store = SimpleNamespace(report=lambda report, **kw: sent.append(report) or {"accepted": True, "claims": []})
    ctx = SimpleNamespace(rank=2, store=store, config=job("vanilla"), bell=lambda name: SimpleNamespace(ring=lambda: None))

    async def scenario() -> RolloutRole:
        engine = Dying(lambda prompt: fmt.encode("1"), delay_s=0.3)  # "1" is never right: tasks last
        role = RolloutRole(job("vanilla", max_concurrency=4), 0, engine, LocalEnvLink(), fmt)
        role.add(claims(10, 1, 4))
        while engine.failure is None or not role.given_back:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineFailed, match="engine failed"):
            await _engine_failed(ctx, role, RankReport(rank=2), 0, engine.failure)
        await role.close()
        return role

    from tiderl.rollout.engine import EngineError

    role = asyncio.run(scenario())
    assert len(sent) == 1 and sorted(sent[0].released) == [10, 11, 12, 13]  # each once: failed or in flight
    assert not sent[0].failed and [e.kind for e in sent[0].events] == ["engine_failed"]
    assert sent[0].claim is None and not role.claims
