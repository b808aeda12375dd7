"""One test per invariant of tiderl.policy.ctb (numbered as in its docstring)."""

from __future__ import annotations

import dataclasses
import random

from tiderl.policy.ctb import (
    AdmissionLimits,
    CandidateGroup,
    CtbDecision,
    CtbTask,
    PriorityWeights,
    RankView,
    TaskState,
    decide,
    priority,
)

A, W, P = TaskState.ACTIVE, TaskState.WAITING_ENV, TaskState.PAUSED
WEIGHTS = PriorityWeights()


def task(tid: str, state: TaskState, fp: int, *, group: str = "g", ctx: int | None = None, **kw) -> CtbTask:
    return CtbTask(tid, group, state, fp, fp if ctx is None else ctx, **kw)


def random_rank(rng: random.Random, budget: int = 10_000) -> tuple[RankView, list[CandidateGroup], AdmissionLimits]:
    tasks = []
    for i in range(rng.randint(0, 14)):
        tasks.append(
            CtbTask(
                task_id=f"t{i}",
                group_id=f"g{rng.randint(0, 4)}",
                state=rng.choice([A, W, P]),
                footprint_tokens=rng.randint(100, 3000),
                context_tokens=rng.randint(50, 8000),
                is_eval=rng.random() < 0.15,
                group_completion=rng.choice([0, 0.25, 0.5, 0.75]),
                task_type=rng.choice(["webshop", "alfworld"]),
                is_home=rng.random() < 0.7,
            )
        )
    cands = [
        CandidateGroup(
            group_id=f"n{j}",
            task_ids=tuple(f"n{j}.{k}" for k in range(rng.randint(1, 4))),
            probed_footprint_tokens=rng.randint(100, 2000),
            is_eval=rng.random() < 0.2,
            task_type=rng.choice(["webshop", "alfworld"]),
        )
        for j in range(rng.randint(0, 5))
    ]
    limits = AdmissionLimits(
        max_resident_tasks=rng.choice([None, 4, 8, 12]), staleness_task_allowance=rng.choice([None, 0, 2, 5])
    )
    return RankView(budget, tuple(tasks)), cands, limits


def cases(n: int = 400):
    rng = random.Random(7)
    for _ in range(n):
        rank, cands, limits = random_rank(rng)
        yield rank, cands, limits, decide(rank, cands, limits, WEIGHTS)


def resident_after(rank: RankView, cands: list[CandidateGroup], d: CtbDecision) -> int:
    by_id = {t.task_id: t for t in rank.tasks}
    probe = {tid: g.probed_footprint_tokens for g in cands for tid in g.task_ids}
    kept = [t for t in rank.tasks if t.state is not P and t.task_id not in d.pause]
    return (
        sum(t.footprint_tokens for t in kept)
        + sum(by_id[t].footprint_tokens for t in d.resume)
        + sum(probe[t] for t in d.admit)
    )


def test_1_budget_respected_after_decision():
    for rank, cands, _, d in cases():
        used = resident_after(rank, cands, d)
        assert used == d.resident_tokens
        assert used <= rank.budget_tokens


def test_2_pauses_lowest_priority_first():
    rank = RankView(
        5000,
        (
            task("eval", W, 2000, is_eval=True),
            task("nearly-done-group", W, 2000, group_completion=0.75),
            task("generating", A, 2000),
            task("idle-long", W, 2000, ctx=6000),
            task("idle-short", W, 2000, ctx=500),
        ),
    )
    d = decide(rank)
    assert d.pause == ("idle-short", "idle-long", "generating")  # Table 1 tiers, lowest first
    assert d.resident_tokens == 4000
    for rank, _, _, d in cases():
        if not d.pause:
            continue
        by_id = {t.task_id: t for t in rank.tasks}
        worst_paused = max(priority(by_id[t], WEIGHTS) for t in d.pause)
        kept = [t for t in rank.tasks if t.state is not P and t.task_id not in d.pause]
        assert all(priority(t, WEIGHTS) >= worst_paused for t in kept)


def test_3_a_pausing_decision_neither_resumes_nor_admits():
    seen = 0
    for _, _, _, d in cases():
        if d.pause:
            seen += 1
            assert d.resume == () and d.admit == ()
    assert seen > 20


def test_4_resume_before_admit():
    rank = RankView(4000, (task("r", W, 1000), task("p", P, 3500)))
    cand = [CandidateGroup("new", ("n0",), 500)]
    # The paused task does not fit the 3,000 free tokens yet: nothing new may take its room.
    assert decide(rank, cand) == CtbDecision(resident_tokens=1000, budget_bound=True)
    # A paused task too big for the whole rank does not block admission forever.
    big = RankView(4000, (task("r", W, 1000), task("huge", P, 5000)))
    assert decide(big, cand).admit == ("n0",)
    for rank, _, _, d in cases():
        if d.admit:
            fits = [t.task_id for t in rank.tasks if t.state is P and t.footprint_tokens <= rank.budget_tokens]
            assert set(fits) <= set(d.resume)


def test_5_resume_order_is_affinity_then_priority_prefix():
    rank = RankView(
        3000,
        (
            task("here", W, 500, group="g1"),
            task("orphan-low", P, 800, group="g9", is_home=False),
            task("orphan-same-group", P, 800, group="g1", is_home=False),
            task("home-low", P, 800, group="g2"),
            task("home-eval", P, 800, group="g3", is_eval=True),
        ),
    )
    d = decide(rank)
    # Affinity first (home tasks and the orphan of a resident group), by priority; 2,500 free -> three fit.
    assert d.resume == ("home-eval", "orphan-same-group", "home-low")
    for rank, _, _, d in cases():
        resident_groups = {t.group_id for t in rank.tasks if t.state is not P}
        paused = sorted(
            (t for t in rank.tasks if t.state is P and t.footprint_tokens <= rank.budget_tokens),
            key=lambda t: (not (t.is_home or t.group_id in resident_groups), -priority(t, WEIGHTS)),
        )
        assert list(d.resume) == [t.task_id for t in paused[: len(d.resume)]]


def test_6_admission_limits():
    cands = [CandidateGroup("e", ("e0", "e1"), 100, is_eval=True), CandidateGroup("t", ("t0", "t1", "t2"), 100)]
    d = decide(RankView(10_000, ()), cands, AdmissionLimits(staleness_task_allowance=1))
    assert d.admit == ("e0", "e1", "t0")  # eval exempt from staleness, one training task allowed
    d = decide(RankView(10_000, (task("r", W, 100),)), cands, AdmissionLimits(max_resident_tasks=3))
    assert d.admit == ("e0", "e1")
    for rank, cands, limits, d in cases():
        resident = sum(1 for t in rank.tasks if t.state is not P)
        if limits.max_resident_tasks is not None and (d.resume or d.admit):
            assert resident + len(d.resume) + len(d.admit) <= max(limits.max_resident_tasks, resident)
        if limits.staleness_task_allowance is not None:
            train = {tid for g in cands if not g.is_eval for tid in g.task_ids}
            assert sum(1 for t in d.admit if t in train) <= limits.staleness_task_allowance


def test_7_every_admitted_task_fitted_when_admitted():
    for rank, cands, _, d in cases():
        probe = {tid: g.probed_footprint_tokens for g in cands for tid in g.task_ids}
        used = d.resident_tokens - sum(probe[t] for t in d.admit)
        for t in d.admit:
            assert used + probe[t] <= rank.budget_tokens
            used += probe[t]


def test_8_candidate_order_eval_then_diversity_then_fifo_prefix():
    rank = RankView(10_000, (task("w1", W, 100, task_type="webshop"), task("w2", W, 100, task_type="webshop")))
    cands = [
        CandidateGroup("ws", ("ws0",), 100, task_type="webshop"),
        CandidateGroup("big", ("big0",), 20_000, task_type="alfworld"),
        CandidateGroup("al", ("al0",), 100, task_type="alfworld"),
        CandidateGroup("ev", ("ev0",), 100, is_eval=True),
    ]
    # Eval first; then alfworld (less resident) before webshop; the big alfworld group does not
    # fit and blocks the rest instead of being overtaken forever.
    assert decide(rank, cands).admit == ("ev0",)
    assert decide(rank, [cands[0], cands[2], cands[3]]).admit == ("ev0", "al0", "ws0")


def test_9_outputs_disjoint_and_refer_to_tasks_in_the_right_state():
    for rank, cands, _, d in cases():
        ids = list(d.pause) + list(d.resume) + list(d.admit)
        assert len(ids) == len(set(ids))
        states = {t.task_id: t.state for t in rank.tasks}
        assert all(states[t] in (A, W) for t in d.pause)
        assert all(states[t] is P for t in d.resume)
        assert set(d.admit) <= {tid for g in cands for tid in g.task_ids}


def test_10_pure_and_frozen():
    rng = random.Random(3)
    rank, cands, limits = random_rank(rng)
    before = repr((rank, cands, limits))
    assert decide(rank, cands, limits) == decide(rank, cands, limits)
    assert repr((rank, cands, limits)) == before
    try:
        rank.tasks[0].footprint_tokens = 1  # type: ignore[misc]
    except (dataclasses.FrozenInstanceError, IndexError):
        pass
    else:
        raise AssertionError("CtbTask must be frozen")


def test_11_budget_bound_says_whether_the_budget_held_a_task_back():
    # Invariant 11: budget_bound iff tasks were paused, or a resume or an admission stopped for room.
    over = RankView(1000, (task("a", A, 800), task("b", W, 400)))
    assert decide(over, []).budget_bound and decide(over, []).pause
    room = RankView(4000, (task("r", W, 1000),))
    assert not decide(room, [CandidateGroup("new", ("n0", "n1"), 500)]).budget_bound  # all admitted
    assert decide(room, [CandidateGroup("new", ("n0", "n1"), 2000)]).budget_bound  # the second waits for room
    capped = decide(room, [CandidateGroup("new", ("n0", "n1"), 500)], AdmissionLimits(max_resident_tasks=2))
    assert capped.admit == ("n0",) and not capped.budget_bound  # the cap, not the budget, held n1 back
    stale = decide(room, [CandidateGroup("new", ("n0",), 500)], AdmissionLimits(staleness_task_allowance=0))
    assert not stale.admit and not stale.budget_bound
    for rank, cands, limits, d in cases():
        if d.pause:
            assert d.budget_bound
        if d.budget_bound and not d.pause:
            # Something that was not admitted or resumed would have overflowed the budget.
            used = d.resident_tokens
            waiting = [t.footprint_tokens for t in rank.tasks if t.state is P and t.task_id not in d.resume
                       and t.footprint_tokens <= rank.budget_tokens]
            probes = [g.probed_footprint_tokens for g in cands if any(t not in d.admit for t in g.task_ids)]
            assert any(used + fp > rank.budget_tokens for fp in waiting + probes)


def test_12_claims_spread_over_the_ranks():
    from tiderl.policy.ctb import claim_limit
    # 1,000 tasks released to 4 idle ranks with 1,024 free slots each: 250 each, not all to the first.
    assert claim_limit(1024, 0, 1000, 4) == 250
    # A rank at or past its share claims nothing; the free slots still bound the claim.
    assert claim_limit(1024, 300, 1000, 4) == 0
    assert claim_limit(10, 0, 1000, 4) == 10
    # Without a rank count (none registered yet) the free slots decide.
    assert claim_limit(64, 0, 1000, 0) == 64 and claim_limit(-3, 0, 10, 2) == 0
    # Ranks claiming in turn up to their limits claim every task in flight, and none holds more than its share.
    import random
    rng = random.Random(5)
    for _ in range(300):
        ranks = rng.randint(1, 9)
        held = [rng.randint(0, 20) for _ in range(ranks)]
        queued = rng.randint(0, 200)
        in_flight = sum(held) + queued
        share = -(-in_flight // ranks)
        for i in range(ranks):
            take = min(queued, claim_limit(1024, held[i], in_flight, ranks))
            assert held[i] + take <= max(share, held[i])
            held[i] += take
            queued -= take
        assert queued == 0
