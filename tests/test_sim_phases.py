"""Workload phases (`phases:` of a workload file): validated like every config key, applied to the
groups that start at or after their step and not before, deterministic per (seed, group index)."""

from __future__ import annotations

import copy
import statistics
from collections import Counter

import pytest
import yaml
from sim_helpers import ROOT, WORKLOAD

from tiderl.config import ConfigError
from tiderl.config.schema import build
from tiderl.sim.spec import WorkloadPhase, WorkloadSpec, load_workload
from tiderl.sim.workload import TaskSampler

PHASE_CHANGE = ROOT / "jobs" / "sim" / "phase-change.workload.yaml"


def _base() -> dict:
    return yaml.safe_load(WORKLOAD.read_text())


def _workload(phases: list[dict], base: dict | None = None) -> WorkloadSpec:
    data = copy.deepcopy(base or _base())
    data["phases"] = phases
    return build(WorkloadSpec, data, "test-workload")


@pytest.mark.parametrize(
    ("phases", "key", "words"),
    [
        ([{"from_step": 0}], "phases[0].from_step", ">= 1"),
        ([{"from_step": 10}, {"from_step": 10}], "phases", "[1].from_step must be greater"),
        ([{"from_step": 20}, {"from_step": 10}], "phases", "[1].from_step must be greater"),
        ([{"from_step": 5, "env_latency_scale": 0}], "phases[0].env_latency_scale", "> 0"),
        ([{"from_step": 5, "env_start_scale": -1.0}], "phases[0].env_start_scale", "> 0"),
        ([{"from_step": 5, "share": {"osworld": 1.0}}], "phases", "unknown task types ['osworld']"),
        ([{"from_step": 5, "share": {"webshop": -0.5}}], "phases[0].share", ">= 0"),
        ([{"from_step": 5, "share": {"webshop": "half"}}], "phases[0].share", ">= 0"),
        ([{"from_step": 5, "share": ["webshop"]}], "phases[0].share", "mapping"),
        ([{"from_step": 5, "share": {"webshop": 0, "alfworld": 0}}], "phases", "no task type"),
        ([{"from_step": 5, "share": {"webshop": 0}}, {"from_step": 9, "share": {"alfworld": 0}}], "phases",
         "[1].share leaves no task type"),
        ([{"from_step": 5, "latency_scale": 2.0}], "phases[0].latency_scale", "unknown key"),
        ([{"env_latency_scale": 2.0}], "phases[0].from_step", "missing required key"),
    ],
)
def test_bad_phases_name_file_and_key(tmp_path, phases, key, words):
    data = _base()
    data["phases"] = phases
    path = tmp_path / "bad.workload.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_workload(path)
    assert e.value.source == str(path) and e.value.key == key
    assert words in e.value.message


def test_phase_built_in_python_is_checked_too():
    with pytest.raises(ValueError, match="env_latency_scale"):
        WorkloadPhase(from_step=3, env_latency_scale=0.0)
    with pytest.raises(ValueError, match="from_step"):
        WorkloadPhase(from_step=0)


def test_keys_left_out_carry_over_from_the_phase_before():
    w = _workload(
        [
            {"from_step": 10, "env_latency_scale": 3.0},
            {"from_step": 20, "share": {"webshop": 0.0}},
            {"from_step": 30, "env_start_scale": 2, "share": {"webshop": 1.0}},
        ]
    )
    got = [(r.from_step, r.env_latency_scale, r.env_start_scale, r.shares) for r in w.resolved_phases()]
    assert got == [
        (0, 1.0, 1.0, (0.5, 0.5)),
        (10, 3.0, 1.0, (0.5, 0.5)),
        (20, 3.0, 1.0, (0.0, 0.5)),
        (30, 3.0, 2.0, (1.0, 0.5)),
    ]
    assert [w.phase_at(s).from_step for s in (0, 9, 10, 19, 20, 29, 30, 1000)] == [0, 0, 10, 10, 20, 20, 30, 30]


def test_without_phases_the_sampling_is_unchanged():
    plain = TaskSampler(load_workload(WORKLOAD), seed=5)
    empty = TaskSampler(_workload([]), seed=5)
    for g in range(50):
        for step in (0, 50):
            assert plain.group(g, step, 8, False) == empty.group(g, step, 8, False)


def test_latency_scale_applies_from_its_step_on_and_not_before():
    base = TaskSampler(load_workload(WORKLOAD), seed=2)
    phased = TaskSampler(_workload([{"from_step": 50, "env_latency_scale": 3.0, "env_start_scale": 0.5}]), seed=2)
    for g in range(40):
        for step in (0, 20, 49):
            assert phased.group(g, step, 8, False) == base.group(g, step, 8, False)
        for step in (50, 51, 99):
            before, after = base.group(g, step, 8, False), phased.group(g, step, 8, False)
            for b, a in zip(before, after, strict=True):
                # the same draws (turns, tokens, type), the latencies multiplied
                assert (a.task_type, a.gen_tokens, a.obs_tokens) == (b.task_type, b.gen_tokens, b.obs_tokens)
                assert a.env_latency_s == pytest.approx([3.0 * x for x in b.env_latency_s], rel=1e-12)
                assert a.start_latency_s == pytest.approx(0.5 * b.start_latency_s, rel=1e-12)
    # evaluation groups run in the same (slower) environment
    e_before, e_after = base.group(0, 60, 4, True), phased.group(0, 60, 4, True)
    assert e_after[0].env_latency_s == pytest.approx([3.0 * x for x in e_before[0].env_latency_s], rel=1e-12)


def test_gen_tokens_scale_multiplies_the_same_draws_from_its_step_on_and_keeps_the_observations():
    base = TaskSampler(load_workload(WORKLOAD), seed=3)
    phased = TaskSampler(_workload([{"from_step": 30, "gen_tokens_scale": 4.0}]), seed=3)
    limit = load_workload(WORKLOAD).max_context_tokens
    compared = 0
    for g in range(80):
        assert phased.group(g, 29, 8, False) == base.group(g, 29, 8, False)
        for b, a in zip(base.group(g, 30, 8, False), phased.group(g, 30, 8, False), strict=True):
            assert a.task_type == b.task_type
            if a.total_tokens >= limit - 4 * max(b.gen_tokens) or len(a.gen_tokens) != len(b.gen_tokens):
                break  # cut at the context limit: the group's later draws shift (its stream is shared)
            assert (a.obs_tokens, a.env_latency_s, a.start_latency_s) == (b.obs_tokens, b.env_latency_s,
                                                                           b.start_latency_s)
            # round(4 x draw) against 4 x round(draw): within 2 tokens a turn
            assert all(abs(x - 4 * y) <= 2 for x, y in zip(a.gen_tokens, b.gen_tokens, strict=True))
            assert sum(a.gen_tokens) > 3 * sum(b.gen_tokens)
            compared += 1
    assert compared >= 100
    w = _workload([{"from_step": 30, "gen_tokens_scale": 4.0}, {"from_step": 60, "env_latency_scale": 2.0}])
    assert [r.gen_tokens_scale for r in w.resolved_phases()] == [1.0, 4.0, 4.0]  # carried over
    with pytest.raises(ValueError, match="gen_tokens_scale"):
        WorkloadPhase(from_step=3, gen_tokens_scale=0.0)


def test_share_moves_the_training_mix_from_its_step_on_and_not_before():
    w = _workload([{"from_step": 40, "share": {"webshop": 0.2, "alfworld": 0.8}}])
    sampler = TaskSampler(w, seed=7)
    base = TaskSampler(load_workload(WORKLOAD), seed=7)

    def mix(step: int) -> float:
        kinds = Counter(sampler.group(g, step, 1, False)[0].task_type for g in range(2000))
        return kinds["alfworld"] / 2000

    assert mix(39) == pytest.approx(0.5, abs=0.04)
    assert mix(40) == pytest.approx(0.8, abs=0.03)
    assert mix(75) == pytest.approx(0.8, abs=0.03)
    for g in range(100):
        assert sampler.group(g, 39, 8, False) == base.group(g, 39, 8, False)
    # evaluation groups keep the task types' own shares (a fixed evaluation set)
    for g in range(100):
        assert sampler.group(g, 40, 4, True) == base.group(g, 40, 4, True)
    # a share of 0 drops a type
    only = TaskSampler(_workload([{"from_step": 1, "share": {"webshop": 0}}]), seed=7)
    assert {only.group(g, 1, 1, False)[0].task_type for g in range(300)} == {"alfworld"}
    assert {only.group(g, 0, 1, False)[0].task_type for g in range(300)} == {"webshop", "alfworld"}


def test_phased_sampling_is_deterministic_per_seed_and_group():
    w = _workload([{"from_step": 10, "env_latency_scale": 2.0, "share": {"webshop": 3.0}}])
    a, b = TaskSampler(w, seed=11), TaskSampler(w, seed=11)
    order = [(g, s) for s in (0, 10, 30) for g in range(30)]
    first = {(g, s): a.group(g, s, 8, False) for g, s in order}
    second = {(g, s): b.group(g, s, 8, False) for g, s in reversed(order)}  # another order, same draws
    assert first == second
    other = TaskSampler(w, seed=12)
    assert any(other.group(g, 10, 8, False) != first[(g, 10)] for g in range(30))


def test_shipped_phase_change_workload():
    w = load_workload(PHASE_CHANGE)
    text = load_workload(WORKLOAD)
    # the text-agentic workload until step 50, an environment three times slower from there on
    assert w.task_types == text.task_types
    assert [(p.from_step, p.env_latency_scale, p.env_start_scale, p.share) for p in w.phases] == [(50, 3.0, 3.0, None)]
    sampler = TaskSampler(w, seed=0)
    lat = [x for g in range(200) for t in sampler.group(g, 60, 8, False) if t.task_type == "webshop"
           for x in t.env_latency_s]
    assert statistics.fmean(lat) == pytest.approx(3.0, rel=0.08)  # 3 x webshop's 1.0 s mean
    for line in PHASE_CHANGE.read_text().splitlines():
        body = line.split("#")[0]
        if ":" in body and body.split(":", 1)[1].strip():
            key = body.split(":")[0].strip().lstrip("- ")
            if key in ("name", "gen_tokens_sigma", "obs_tokens_sigma"):
                continue
            assert "#" in line, line
