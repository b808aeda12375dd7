"""Agent loop, worker and schedulers on the scripted fake engine and in-process hilo."""

from __future__ import annotations

import asyncio
import random

import pytest

from tiderl.rollout.agent_loop import LoopLimits
from tiderl.rollout.chat import ChatFormat
from tiderl.models.demos import corpus_texts, play_demonstration
from fake_engine import FakeEngine
from tiderl.rollout.local_env import LocalEnvLink
from tiderl.rollout.schedulers import UnknownSchedulerError, make_scheduler
from tiderl.models.tiny_model import train_tokenizer
from tiderl.rollout.trajectory import Trajectory, make_group
from tiderl.rollout.worker import RolloutWorker


@pytest.fixture(scope="module")
def fmt() -> ChatFormat:
    return ChatFormat(train_tokenizer(corpus_texts("hilo", range(200), noise=0.5), vocab_size=200))


def guesser(fmt: ChatFormat, seed: int = 0):
    """Answers every prompt with a random number in 1-16 (a legal hilo action)."""
    rng = random.Random(seed)
    return lambda prompt: fmt.encode(str(rng.randint(1, 16)))


def run_worker(fmt: ChatFormat, engine: FakeEngine, scheduler: str, groups, env: LocalEnvLink | None = None, **kwargs):
    env = env or LocalEnvLink()
    got: list[Trajectory] = []
    limits = kwargs.pop("limits", LoopLimits(max_turns=6, max_context_tokens=512, max_new_tokens=4))
    worker = RolloutWorker(engine, env, fmt, make_scheduler(scheduler), limits, sink=got.append, **kwargs)
    worker.add_groups(groups)
    report = asyncio.run(worker.run())
    return got, report, env


def test_id_pieces_equal_the_chat_template(fmt: ChatFormat) -> None:
    messages, _ = play_demonstration("hilo", seed=3, noise=0.5)
    ids = fmt.prompt_ids(messages[0]["content"])
    for i in range(1, len(messages) - 1, 2):
        ids += fmt.encode(messages[i]["content"]) + [fmt.end_of_turn_id] + fmt.env_turn_ids(messages[i + 1]["content"])
    conversation = messages  # ends with an environment answer; then the generation prompt
    expected = fmt.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ids == list(expected)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
    assert fmt.tokenizer.decode(ids) == text + "<|im_start|>assistant\n"  # ChatML, the tiny models' format


def test_trajectories_keep_the_exact_sampled_ids(fmt: ChatFormat) -> None:
    engine = FakeEngine(guesser(fmt))
    groups = [make_group(f"g{i}", "hilo", seed=i, group_size=3) for i in range(4)]
    got, report, _ = run_worker(fmt, engine, "vanilla", groups)
    assert len(got) == 12 and report.num_tasks == 12
    assert {t.task.group_id for t in got} == {f"g{i}" for i in range(4)}
    for t in got:
        t.check()
        assert t.num_turns >= 1 and t.finish in ("done", "max_turns")
        assert t.reward in (0.0, 1.0) and (t.reward == 0.0 or t.finish == "done")
        # Every prompt the engine saw is a prefix of the trajectory: nothing re-tokenised.
        prompts = [p for p in engine.prompts if list(p) == t.token_ids[: len(p)]]
        assert len(prompts) >= t.num_turns
        # Loss mask 1 exactly on sampled ids, which carry logprob and version; env ids 0.
        assert t.loss_mask[: t.num_prompt_tokens] == [0] * t.num_prompt_tokens
        for tok, m, lp, v in zip(t.token_ids, t.loss_mask, t.logprobs, t.versions):
            assert (m, lp, v) in ((1, -0.5, 0), (0, 0.0, -1)), (tok, m, lp, v)
        assert sum(t.loss_mask) == t.num_generated_tokens >= 2 * t.num_turns


def test_environment_answers_are_rendered_pieces(fmt: ChatFormat) -> None:
    engine = FakeEngine(guesser(fmt))
    got, _, _ = run_worker(fmt, engine, "vanilla", [make_group("g", "hilo", seed=5, group_size=1)])
    (t,) = got
    text = fmt.tokenizer.decode(t.token_ids)
    assert text.startswith("<|im_start|>user\nguess a number 1-16<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>assistant\n") == t.num_turns
    assert text.endswith("<|im_end|>")


def test_context_limit_ends_a_task(fmt: ChatFormat) -> None:
    engine = FakeEngine(lambda prompt: fmt.encode("99"))  # always wrong: hilo says "lower"
    limits = LoopLimits(max_turns=50, max_context_tokens=90, max_new_tokens=4)
    got, _, _ = run_worker(fmt, engine, "vanilla", [make_group("g", "hilo", seed=1, group_size=1)], limits=limits)
    (t,) = got
    assert t.finish == "max_context" and len(t.token_ids) <= 90 and t.reward == 0.0


def test_turn_limit_and_length_cut(fmt: ChatFormat) -> None:
    engine = FakeEngine(lambda prompt: fmt.encode("1 2 3 4 5 6"))  # never stops by itself
    limits = LoopLimits(max_turns=2, max_context_tokens=512, max_new_tokens=3)
    got, _, _ = run_worker(fmt, engine, "vanilla", [make_group("g", "hilo", seed=1, group_size=1)], limits=limits)
    (t,) = got
    assert t.finish == "max_turns" and t.num_turns == 2
    # The closing <|im_end|> after a cut generation is in the context but not trained on.
    ids, mask = t.token_ids, t.loss_mask
    cut = [i for i in range(1, len(ids)) if ids[i] == fmt.end_of_turn_id and mask[i] == 0 and mask[i - 1] == 1]
    assert len(cut) == 2 and fmt.end_of_turn_id not in [ids[i] for i in range(len(ids)) if mask[i]]


def test_eval_tasks_are_flagged_and_greedy(fmt: ChatFormat) -> None:
    engine = FakeEngine(guesser(fmt))
    groups = [make_group("e0", "hilo", seed=1, group_size=2, is_eval=True, eval_version=3), make_group("t0", "hilo", seed=1, group_size=2)]
    got, _, _ = run_worker(fmt, engine, "ctb", groups)
    evals = [t for t in got if t.task.is_eval]
    assert len(evals) == 2 and all(t.task.eval_version == 3 for t in evals)
    assert {s.temperature for s in engine.samplings} == {0.0, 1.0}


def test_vanilla_admits_up_to_its_concurrency(fmt: ChatFormat) -> None:
    engine = FakeEngine(guesser(fmt), delay_s=0.001)
    groups = [make_group(f"g{i}", "hilo", seed=i, group_size=4) for i in range(6)]
    got, report, env = run_worker(fmt, engine, "vanilla", groups, max_resident_tasks=5)
    assert len(got) == 24 and report.max_resident_tasks == 5 and report.num_pauses == 0
    assert env.max_sessions_seen <= 5


def test_ctb_pauses_and_resumes_under_a_small_budget(fmt: ChatFormat) -> None:
    engine = FakeEngine(guesser(fmt), kv_capacity_tokens=4096, delay_s=0.001)
    env = LocalEnvLink(latency="lognormal:0.004:0.03", seed=1)
    groups = [make_group(f"g{i}", "hilo", seed=i, group_size=4) for i in range(8)]
    got, report, env = run_worker(fmt, engine, "ctb", groups, env=env, budget_tokens=260)
    assert len(got) == 32 and {t.task.task_id for t in got} == {f"g{i}/{j}" for i in range(8) for j in range(4)}
    # A pause decided while a task took its last env step never parks it: resumes <= pauses.
    assert report.num_pauses > 0 and 0 < report.num_resumes <= report.num_pauses
    # Each pause that parked a task told the environment, and every parked task was resumed.
    assert env.num_pauses == env.num_resumes == sum(t.num_pauses for t in got) > 0
    assert not env.paused


def test_ctb_probes_a_group_before_admitting_the_rest(fmt: ChatFormat) -> None:
    engine = FakeEngine(guesser(fmt))
    env = LocalEnvLink()
    starts: list[str] = []
    real_start = env.start

    async def start(name, seed, options=None):
        starts.append(f"{name}:{seed}:{len(engine.prompts)}")
        return await real_start(name, seed, options)

    env.start = start  # type: ignore[method-assign]
    groups = [make_group("g", "hilo", seed=2, group_size=4)]
    run_worker(fmt, engine, "ctb", groups, env=env)
    # The probe starts alone; the other three start only after it reached the engine.
    assert starts[0].endswith(":0") and all(not s.endswith(":0") for s in starts[1:])


def test_ctb_keeps_more_prefix_hits_than_vanilla(fmt: ChatFormat) -> None:
    def hit_rate(scheduler: str) -> float:
        engine = FakeEngine(guesser(fmt, seed=7), kv_capacity_tokens=512, block_size=16, delay_s=0.001)
        env = LocalEnvLink(latency="fixed:0.002")
        groups = [make_group(f"g{i}", "hilo", seed=i, group_size=4) for i in range(12)]
        run_worker(fmt, engine, scheduler, groups, env=env, max_resident_tasks=48)
        stats = asyncio.run(engine.stats())
        return stats.hit_rate

    assert hit_rate("ctb") > hit_rate("vanilla")


def test_staleness_allowance_holds_training_tasks(fmt: ChatFormat) -> None:
    async def scenario() -> list[str]:
        engine = FakeEngine(guesser(fmt))
        order: list[str] = []
        allowed = {"n": 0}
        limits = LoopLimits(max_turns=6, max_context_tokens=512, max_new_tokens=4)
        worker = RolloutWorker(
            engine, LocalEnvLink(), fmt, make_scheduler("ctb"), limits,
            sink=lambda t: order.append(t.task.group_id),
            staleness_allowance=lambda: allowed["n"],
        )
        worker.add_groups([make_group("t", "hilo", seed=1, group_size=2), make_group("e", "hilo", seed=2, group_size=2, is_eval=True)])
        running = asyncio.create_task(worker.run())
        while order.count("e") < 2:
            await asyncio.sleep(0.01)
        assert order == ["e", "e"] and worker.num_unfinished == 2
        allowed["n"] = 2  # a new version raised the allowance
        worker.poke()
        await running
        return order

    assert asyncio.run(scenario()) == ["e", "e", "t", "t"]


def test_reload_changes_the_version_of_later_tokens(fmt: ChatFormat) -> None:
    async def scenario() -> list[Trajectory]:
        engine = FakeEngine(guesser(fmt))
        got: list[Trajectory] = []
        limits = LoopLimits(max_turns=6, max_context_tokens=512, max_new_tokens=4)
        worker = RolloutWorker(engine, LocalEnvLink(), fmt, make_scheduler("vanilla"), limits, sink=got.append)
        worker.add_groups([make_group("a", "hilo", seed=1, group_size=2)])
        await worker.run()
        await engine.reload_weights("weights/v1", version=1)
        worker.add_groups([make_group("b", "hilo", seed=1, group_size=2)])
        await worker.run()
        return got

    got = asyncio.run(scenario())
    versions = {t.task.group_id: {v for v in t.versions if v >= 0} for t in got}
    assert versions == {"a": {0}, "b": {1}}


def test_unknown_names_are_clear_errors(fmt: ChatFormat) -> None:
    with pytest.raises(UnknownSchedulerError, match="known schedulers: vanilla, ctb"):
        make_scheduler("fifo")
    with pytest.raises(ValueError, match="max_turns"):
        LoopLimits(max_turns=0, max_context_tokens=10, max_new_tokens=1)


def test_a_task_larger_than_the_budget_still_finishes(fmt: ChatFormat) -> None:
    engine = FakeEngine(lambda prompt: fmt.encode("99"), kv_capacity_tokens=4096)
    limits = LoopLimits(max_turns=30, max_context_tokens=400, max_new_tokens=4)
    groups = [make_group("g", "hilo", seed=1, group_size=2)]
    got, report, _ = run_worker(fmt, engine, "ctb", groups, budget_tokens=64, limits=limits)
    assert len(got) == 2 and all(len(t.token_ids) > 64 for t in got)


def test_a_failing_task_fails_the_worker_and_stops_the_others(fmt: ChatFormat) -> None:
    calls = {"n": 0}

    def respond(prompt):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("engine broke")
        return fmt.encode("3")

    engine = FakeEngine(respond, delay_s=0.001)
    env = LocalEnvLink()
    with pytest.raises(RuntimeError, match="engine broke"):
        groups = [make_group("g", "hilo", seed=1, group_size=2), make_group("h", "hilo", seed=2, group_size=4)]
        run_worker(fmt, engine, "vanilla", groups, env=env)
    assert env.max_sessions_seen >= 2 and env.num_sessions == 0  # every session was ended


def test_worker_from_job_config(fmt: ChatFormat) -> None:
    from tiderl.config.schema import ConfigError, build
    from tiderl.config.job import JobConfig
    from tiderl.rollout.from_config import rollout_worker

    job = build(JobConfig, {"system": "tiderl", "env": {"max_turns": 3}, "rollout": {"scheduler": "vanilla", "max_concurrency": 2}}, "job.yaml")
    got: list[Trajectory] = []
    worker = rollout_worker(job, FakeEngine(guesser(fmt), kv_capacity_tokens=2048), LocalEnvLink(), fmt, sink=got.append)
    assert worker.scheduler.name == "vanilla" and worker.budget_tokens == 2048
    worker.add_groups([make_group("g", "hilo", seed=4, group_size=job.rollout.group_size)])
    report = asyncio.run(worker.run())
    assert len(got) == 4 and report.max_resident_tasks == 2 and all(t.num_turns <= 3 for t in got)
    with pytest.raises(ConfigError, match="rollout.kv_block_size"):
        build(JobConfig, {"system": "tiderl", "rollout": {"kv_block_size": 40}}, "job.yaml")


def test_ctb_a_probe_that_fails_before_its_first_turn_does_not_hold_its_group(fmt: ChatFormat) -> None:
    # The probe's environment start fails: another task of the group must probe instead (the group
    # used to stay "probing" for ever, its other tasks never admitted, the run hung).
    engine = FakeEngine(guesser(fmt))
    env = LocalEnvLink()
    real_start = env.start
    calls: list[int] = []

    async def start(name, seed, options=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("env server answered garbage")
        return await real_start(name, seed, options)

    env.start = start  # type: ignore[method-assign]
    failed: list[str] = []
    worker = RolloutWorker(engine, env, fmt, make_scheduler("ctb"),
                           LoopLimits(max_turns=6, max_context_tokens=512, max_new_tokens=4), sink=[].append,
                           on_failure=lambda spec, e: failed.append(spec.task_id))
    worker.add_groups([make_group("g", "hilo", seed=2, group_size=4)])
    report = asyncio.run(asyncio.wait_for(worker.run(), 30))
    assert len(failed) == 1 and report.num_tasks == 3


def test_the_worker_counts_the_turns_whose_context_the_cache_kept(fmt: ChatFormat) -> None:
    def judged(capacity: int) -> tuple[int, int]:
        engine = FakeEngine(guesser(fmt, seed=3), kv_capacity_tokens=capacity, block_size=16, delay_s=0.001)
        groups = [make_group(f"g{i}", "hilo", seed=i, group_size=4) for i in range(8)]
        _, report, _ = run_worker(fmt, engine, "vanilla", groups, env=LocalEnvLink(latency="fixed:0.002"),
                                  max_resident_tasks=32)
        return report.prefix_kept_turns, report.prefix_evicted_turns

    kept, evicted = judged(1 << 16)
    assert kept > 0 and evicted == 0  # a cache that holds everything evicts nothing
    kept, evicted = judged(256)
    assert evicted > 0  # 32 tasks on 16 blocks: contexts are evicted while their tasks wait on the env


def test_an_adaptive_ctb_budget_grows_while_the_cache_keeps_what_it_held(fmt: ChatFormat) -> None:
    from tiderl.policy.ctb_budget import BudgetLimits

    def run(adaptive: bool):
        engine = FakeEngine(guesser(fmt, seed=5), kv_capacity_tokens=1 << 16, delay_s=0.001)
        groups = [make_group(f"g{i}", "hilo", seed=i, group_size=4) for i in range(10)]
        limits = BudgetLimits(floor_tokens=1, window_turns=4) if adaptive else None
        got, report, _ = run_worker(fmt, engine, "ctb", groups, env=LocalEnvLink(latency="fixed:0.003"),
                                    budget_tokens=260, budget_limits=limits)
        assert len(got) == 40
        return report

    fixed, adaptive = run(False), run(True)
    assert fixed.max_budget_tokens == 260 and adaptive.prefix_evicted_turns == 0
    assert 260 < adaptive.max_budget_tokens <= 4 * 260  # grown, within the ceiling (4 x the floor)
    assert adaptive.max_resident_tasks > fixed.max_resident_tasks


def test_the_worker_feeds_the_engine_s_iterations_to_the_cost_meter_and_the_cost_to_the_budget(
        fmt: ChatFormat, monkeypatch) -> None:
    """The adaptive budget's cost rule as the worker wires it: every iteration the engine timed is
    observed (wall time, prompt tokens prefilled, sequences decoding), and the meter's cost reaches the
    budget's judgement."""
    from tiderl.policy.ctb_budget import BudgetLimits, BudgetTracker, CostMeter

    observed, judged = [], []
    observe, judge = CostMeter.observe, BudgetTracker.judge

    def spy_observe(self, wall_s, prefilled, decoding):
        observed.append((wall_s, prefilled, decoding))
        return observe(self, wall_s, prefilled, decoding)

    def spy_judge(self, prefix, cached, block, generated=0, cost=None):
        judged.append((generated, cost))
        return judge(self, prefix, cached, block, generated, cost)

    monkeypatch.setattr(CostMeter, "observe", spy_observe)
    monkeypatch.setattr(CostMeter, "cost", lambda self: 2.5)
    monkeypatch.setattr(BudgetTracker, "judge", spy_judge)
    engine = FakeEngine(guesser(fmt, seed=5), kv_capacity_tokens=1 << 16, delay_s=0.002)
    groups = [make_group(f"g{i}", "hilo", seed=i, group_size=4) for i in range(4)]
    got, _, _ = run_worker(fmt, engine, "ctb", groups, env=LocalEnvLink(latency="fixed:0.003"), budget_tokens=260,
                           budget_limits=BudgetLimits(floor_tokens=1, window_turns=4))
    assert len(got) == 16 and observed and judged
    assert all(wall == 0.002 and pre >= 0 and dec >= 1 for wall, pre, dec in observed)
    assert all(cost == 2.5 and gen >= 1 for gen, cost in judged)
    # Every iteration the engine timed (one a generation here) reaches the meter once, but those after the
    # last judged turn.
    assert len(observed) + len(engine.iterations) == sum(t.num_turns for t in got) and len(engine.iterations) <= 16
    # A first turn prefills its whole prompt (25 tokens or more here), a later one of a task kept
    # resident only the new tokens past what the cache served (a few).
    prefilled = [pre for _, pre, _ in observed]
    assert max(prefilled) >= 25 and min(prefilled) <= 6
