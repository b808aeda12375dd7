"""The staleness-latency bound (tiderl.sim.metrics, docs/simulator.md) and the best-fixed-partition
oracle (tiderl.sim.report.fixed_partitions / best_fixed, `tiderl sim --system best-fixed|all`)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from sim_helpers import ROOT, small_dicts, small_specs, write_small

from tiderl.sim.spec import ControlSpec
from tiderl.cli import main
from tiderl.config.schema import build
from tiderl.sim import metrics
from tiderl.sim.costs import Costs, derive_costs
from tiderl.sim.report import FIXED, best_fixed, fixed_partitions, refs_to_keep_up
from tiderl.sim.simulator import Simulation
from tiderl.sim.spec import ClusterSpec, WorkloadSpec, load_cluster, load_workload
from tiderl.sim.systems import SimSystemError, parse_system
from tiderl.sim.workload import TaskPlan

DRAINED = 1 - math.exp(-1)


def _costs(**edits) -> Costs:
    """Round figures: a batch-1 decode iteration of 0.009 + 0.001 = 0.010 s, prefill 1e-4 s a token."""
    base = dict(
        weights_read_s=0.0, kv_read_s_per_token=0.0, flop_s_per_token=0.001, attn_flop_s_per_token_pos=0.0,
        step_overhead_s=0.009, prefill_chunk_tokens=1000, max_num_seqs=16, kv_capacity_tokens=100_000,
        train_s_per_token=1e-4, train_attn_s_per_token_pos=0.0, swap_s=0.0, weight_sync_s=0.0,
        optimizer_s_multi_node=0.5, optimizer_s_single_node=0.5, phase_switch_s=0.0, train_state_bytes=0.0,
        network_bytes_per_s=1.0, communicator_init_s=0.0, gpus_per_node=8, prefill_s_per_token=1e-4,
        backward_ratio=2.0, ref_ratio=1.0, turn_overhead_s=0.05,
    )
    base.update(edits)
    return Costs(**base)


# Two turns: prompt 100, 10 generated, 50 observed, 20 generated; env start 3 s, steps 1 s and 2 s.
LONG = TaskPlan("t", prompt_tokens=100, gen_tokens=[10, 20], obs_tokens=[50], env_latency_s=[1.0, 2.0],
                start_latency_s=3.0)
# One turn: prompt 100, 10 generated; env start 1 s, step 0.5 s.
SHORT = TaskPlan("t", prompt_tokens=100, gen_tokens=[10], obs_tokens=[], env_latency_s=[0.5], start_latency_s=1.0)


def test_task_latency_by_hand():
    c = _costs()
    # Prefill of 100 tokens: one iteration (overhead 0.009 + the decode slot 0.001) plus (1 - 1/e) of
    # 100 x 1e-4 s of prefill FLOPs; then 10 tokens at 0.010 s, the turn overhead, the env step.
    turn0 = 0.009 + 0.001 + DRAINED * 0.01 + 10 * 0.010 + 0.05 + 1.0
    turn1 = 0.009 + 0.001 + DRAINED * 0.005 + 20 * 0.010 + 0.05 + 2.0  # 50 observed tokens prefilled
    assert metrics.task_min_latency_s(LONG, c) == pytest.approx(3.0 + turn0 + turn1)
    assert metrics.task_min_latency_s(LONG, c) == pytest.approx(6.4294818, abs=1e-6)
    assert metrics.task_min_latency_s(SHORT, c) == pytest.approx(1.0 + turn0 - 1.0 + 0.5)
    # A memory-bound iteration (weights 0.02 s) dominates the prefill FLOPs of a short prompt.
    slow = _costs(weights_read_s=0.02)
    assert metrics.turn_prefill_min_s(slow, 100, 100) == pytest.approx(0.009 + 0.02)
    # Past one chunk: new / chunk iterations, here compute-bound (0.158 s of drained FLOPs > 2.5 x 0.02 s).
    assert metrics.turn_prefill_min_s(slow, 2500, 2500) == pytest.approx(2.5 * 0.009 + 2.5 * 0.001 + DRAINED * 0.25)
    # A shared host of one slot, a busy rollout rank wanting 2 cores: engine and overhead at half speed.
    shared = _costs(host_compute_slots=1.0, rollout_busy_cores=2.0)
    assert metrics.task_min_latency_s(SHORT, shared) == pytest.approx(1.0 + 2 * (turn0 - 1.0) + 0.5)


def test_latency_bound_of_a_run_by_hand():
    """Two groups, the first consumed in step 1 (of 2), the second in the last step; staleness 1,
    B_ideal 1: two groups in flight."""
    c = _costs()
    g1, g2 = SimpleNamespace(id=("t", 0)), SimpleNamespace(id=("t", 1))  # both of the first release
    tasks = [SimpleNamespace(group=g1, plan=LONG), SimpleNamespace(group=g1, plan=SHORT),
             SimpleNamespace(group=g2, plan=SHORT), SimpleNamespace(group=g2, plan=SHORT)]
    sim = SimpleNamespace(
        consumed_tasks=tasks, costs=c, staleness=1, b_ideal=1, fetch=1,
        records=[SimpleNamespace(fetch_groups=1), SimpleNamespace(fetch_groups=1)],
        cluster=SimpleNamespace(control=ControlSpec(report_interval_s=0.2, poll_s=0.2, control_tick_s=0.4)),
        system=SimpleNamespace(synchronous=False),
    )
    seen = (0.2 + 0.2) / 2
    feed = (0.4 + 0.2) / 2
    # After its claim: the longest sequence's forward (1e-4 s a token) x (1 + backward 2), the optimizer.
    tail1 = 180 * 1e-4 * 3 + 0.5
    tail2 = 110 * 1e-4 * 3 + 0.5
    hold1 = 6.4294818 + seen + tail1 + feed  # not the last step: held until the next feed
    hold2 = metrics.task_min_latency_s(SHORT, c) + seen + tail2  # the run ends at the last publish
    expected = 2 * (290 + 220) / (hold1 + hold2)
    parts = metrics.latency_bound_parts(sim)
    assert parts["latency_bound_tok_s"] == pytest.approx(expected, rel=1e-6)
    assert parts["latency_bound_tok_s"] == pytest.approx(103.2096, abs=1e-3)
    assert parts["in_flight_groups"] == 2 and parts["tokens_per_group"] == 255.0
    # Little's law itself: N x tokens / sum of holds.
    assert metrics.little_bound_tok_s([100.0, 300.0], [1.0, 3.0], 2) == pytest.approx(200.0)


def test_group_holding_measures_each_trained_group_once_from_release_to_its_step_s_publish():
    """Two groups trained in the step from version 0 (published at 10 s), one in the step from version 1
    (published at 25 s), one claimed by a step that never published (left out)."""
    def group(released, seen, claimed, version):
        return SimpleNamespace(released_s=released, seen_s=seen, claimed_s=claimed, claim_version=version)
    a, b, c, d = group(0.0, 6.0, 6.5, 0), group(0.0, 8.0, 8.0, 0), group(3.0, 20.0, 21.0, 1), group(12.0, 26.0, 27.0, 2)
    sim = SimpleNamespace(
        records=[SimpleNamespace(version=0, end_s=10.0), SimpleNamespace(version=1, end_s=25.0)],
        consumed_tasks=[SimpleNamespace(group=g) for g in (a, a, b, b, c, c, d, d)])
    assert metrics.group_holding(sim) == {
        "groups": 3,
        "release_to_seen_s": round((6 + 8 + 17) / 3, 3),
        "seen_to_claim_s": round((0.5 + 0 + 1) / 3, 3),
        "claim_to_publish_s": round((3.5 + 2 + 4) / 3, 3),
    }
    # From the first publication on (tools/sim_vs_real.py's steady window): the group released at 3 s.
    assert metrics.group_holding(sim, released_from_s=3.0) == {
        "groups": 1, "release_to_seen_s": 17.0, "seen_to_claim_s": 1.0, "claim_to_publish_s": 4.0}


def test_the_latency_bound_binds_where_latency_dominates_and_holds():
    """Slow environments, plenty of compute: the staleness-latency bound binds, within a small factor."""
    wd, cd = small_dicts(4)
    wd.update(eval_every_steps=0, eval_groups=0)
    for t in wd["task_types"]:
        t["env_latency"] = {"mean_s": 4.0, "p99_s": 4.4}
        t["env_start"] = {"mean_s": 2.0, "p99_s": 2.2}
    w, c = build(WorkloadSpec, wd, "w"), build(ClusterSpec, cd, "c")
    r = Simulation(w, c, parse_system("tiderl-noers@0.5"), steps=6, seed=0).run()
    assert r["bound_term"] == "staleness_latency"
    assert r["latency_bound_tok_s"] < r["upper_bound_tok_s"] / 3
    assert 0.5 * r["bound_tok_s"] < r["goodput_tok_s"] <= r["bound_tok_s"]


SHIPPED = [
    ("hilo-bench", "cpu", ("sync", "async", "tiderl", "tiderl-noers@0.34+ref1"), 6),
    ("bench-latency", "cpu", ("sync", "run:stream", "tiderl"), 3),
    ("text-agentic", "h100x32", ("tiderl",), 2),
]


@pytest.mark.parametrize(("workload", "cluster", "systems", "steps"), SHIPPED, ids=[f"{w}-{c}" for w, c, *_ in SHIPPED])
def test_bound_holds_on_shipped_files(workload, cluster, systems, steps):
    wp = ROOT / "jobs" / "sim" / f"{workload}.workload.yaml"
    cp = ROOT / "jobs" / "sim" / f"{cluster}.cluster.yaml"
    if not wp.exists() or not cp.exists():
        pytest.skip(f"{wp.name} or {cp.name} is not shipped")
    w, c = load_workload(wp), load_cluster(cp)
    for name in systems:
        r = Simulation(w, c, parse_system(name), steps=steps, seed=0).run()
        assert 0 < r["goodput_tok_s"] <= r["bound_tok_s"], name
        assert r["bound_tok_s"] == min(r["upper_bound_tok_s"], r["latency_bound_tok_s"]), name
        assert r["bound_term"] == ("compute" if r["upper_bound_tok_s"] <= r["latency_bound_tok_s"]
                                   else "staleness_latency")
        # Every trained group's measured time in flight, and its least part (the slowest task's
        # unavoidable latency) at most what was measured.
        held, least = r["group_holding"], r["latency_bound"]
        assert held["groups"] == r["consumed_trajectories"] // w.group_size, name
        assert min(held["release_to_seen_s"], held["seen_to_claim_s"], held["claim_to_publish_s"]) >= 0, name
        assert held["release_to_seen_s"] >= least["slowest_task_s"] - 1e-3, name


def test_refs_to_keep_up_follow_the_cost_model():
    _, c = small_specs(8)
    costs = derive_costs(c)  # roofline: t_ref = t_act_f, t_act_b = 2 t_act_f: one ref per 3 actors
    assert [refs_to_keep_up(costs, m) for m in (1, 3, 4, 6, 7)] == [1, 1, 2, 2, 3]


def test_fixed_partitions_cover_every_split_the_ranks_allow():
    _, c = small_specs(8)
    systems = fixed_partitions(c)
    colocated = [s for s in systems if not s.fixed_refs]
    decoupled = [s for s in systems if s.fixed_refs]
    assert [round(s.rollout_fraction * 8) for s in colocated] == list(range(1, 8))
    # The rest split into M actors + the fewest refs keeping up: 7 -> 5+2, 6 -> 4+2, 5 -> 3+2, 4 -> 3+1,
    # 3 -> 2+1, 2 -> 1+1 (rollout 7 leaves one rank: no decoupled split).
    assert [(round(s.rollout_fraction * 8), s.fixed_refs) for s in decoupled] == [
        (1, 2), (2, 2), (3, 2), (4, 1), (5, 1), (6, 1)]
    assert all(s.name == FIXED for s in systems)
    # A fixed actor group (`tiderl run`: one actor rank) stays whole.
    cd = small_dicts(4)[1]
    cd["training"]["actor_ranks"] = 1
    fixed = fixed_partitions(build(ClusterSpec, cd, "c"))
    assert [(round(s.rollout_fraction * 4), s.fixed_refs) for s in fixed] == [
        (1, None), (2, None), (3, None), (1, 1), (2, 1)]


def test_a_fixed_decoupled_split_runs_decoupled_with_its_refs():
    w, c = small_specs(8)
    r = Simulation(w, c, parse_system("tiderl-noers@0.25+ref2"), steps=4, seed=0).run()
    assert r["system"] == "tiderl-noers@0.25+ref2"
    assert all((e["rollout"], e["actor"], e["ref"], e["mode"]) == (2, 4, 2, "decoupled") for e in r["roles_timeline"])
    assert r["ra2p"]["decoupled_steps"] == 4
    for bad in ("async@0.25+ref1", "tiderl@0.25+ref1", "tiderl-noers@0.25+ref0", "tiderl-noers@0.25+refs"):
        with pytest.raises(SimSystemError):
            parse_system(bad)
    with pytest.raises(ValueError, match="no actor"):
        Simulation(w, c, parse_system("tiderl-noers@0.75+ref2"), steps=1, seed=0)


def test_an_ablation_switches_rules_off_in_the_simulated_planner():
    """`tiderl~RULE`: the simulator's ERS limits lose that rule (named, or through its own switch)."""
    w, c = small_specs(8)
    system = parse_system("tiderl~walk~evaluation_actors~walk")
    assert system.ablate == ("walk", "evaluation_actors") and system.label == "tiderl~walk~evaluation_actors"
    sim = Simulation(w, c, system, steps=1, seed=0)
    assert sim.ers_limits.ablate == frozenset({"walk"}) and not sim.ers_limits.evaluation_actors
    assert Simulation(w, c, parse_system("tiderl"), steps=1, seed=0).ers_limits.ablate == frozenset()
    # A fraction before the rules or after them (the label's order) reads the same.
    at = parse_system("tiderl@0.25~valley")
    assert at == parse_system("tiderl~valley@0.25") == parse_system(at.label) and at.rollout_fraction == 0.25
    for bad, message in (("tiderl~nope", "no such ERS rule"), ("tiderl-noers~walk", "only an ERS system")):
        with pytest.raises(SimSystemError, match=message):
            parse_system(bad)


def test_best_fixed_picks_the_best_goodput_and_reports_its_split():
    def result(label, goodput, rollout, actor, ref):
        return {"system": label, "goodput_tok_s": goodput, "rollout_fraction": rollout / 8, "rwt_s": 1.0,
                "twt_s": 2.0, "bound_tok_s": 9e9, "bound_term": "compute",
                "roles_timeline": [{"rollout": rollout, "actor": actor, "ref": ref,
                                    "mode": "decoupled" if ref else "colocated"}]}

    results = [result("async@0.25", 99.0, 2, 6, 0), result(f"{FIXED}@0.25", 10.0, 2, 6, 0),
               result(f"{FIXED}@0.25+ref2", 12.0, 2, 4, 2), result(f"{FIXED}@0.5", 11.0, 4, 4, 0)]
    best = best_fixed(results)
    assert best["system"] == f"{FIXED}@0.25+ref2" and best["goodput_tok_s"] == 12.0
    assert (best["rollout_ranks"], best["actor_ranks"], best["ref_ranks"], best["ra2p_mode"]) == (2, 4, 2, "decoupled")
    assert best["rollout_fraction"] == 0.25 and len(best["sweep"]) == 3
    assert best_fixed(results[:1]) is None


@pytest.mark.slow
def test_cli_all_and_best_fixed_json(tmp_path, capsys):
    wp, cp = write_small(tmp_path, num_gpus=4)
    assert main(["sim", str(wp), str(cp), "--system", "all", "--steps", "2", "--json", "--jobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name, r in out["systems"].items():
        assert {"goodput_tok_s", "rwt_s", "twt_s", "bound_tok_s", "bound_term"} <= set(r), name
        assert r["goodput_tok_s"] <= r["bound_tok_s"], name
    best = out["best_fixed"]
    assert {"goodput_tok_s", "rollout_fraction", "ra2p_mode", "rwt_s", "twt_s", "rollout_ranks",
            "ref_ranks"} <= set(best)
    fixed = [r for name, r in out["systems"].items() if name.startswith(FIXED + "@")]
    assert len(fixed) == len(best["sweep"]) == 3 + 2  # rollout 1-3 colocated, 1-2 decoupled
    assert best["goodput_tok_s"] == max(r["goodput_tok_s"] for r in fixed)
    tiderl = out["systems"]["tiderl@0.5"]
    assert out["bound_tok_s"] == tiderl["bound_tok_s"] and out["bound_term"] == tiderl["bound_term"]
    assert out["ratios"]["tiderl_over_best_fixed"] == round(tiderl["goodput_tok_s"] / best["goodput_tok_s"], 3)
    assert out["ratios"]["tiderl_over_bound"] == round(tiderl["goodput_tok_s"] / tiderl["bound_tok_s"], 3)

    assert main(["sim", str(wp), str(cp), "--system", "best-fixed", "--steps", "2", "--json", "--jobs", "1"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["system"] == best["system"] and alone["goodput_tok_s"] == best["goodput_tok_s"]

    assert main(["sim", str(wp), str(cp), "--system", "all", "--steps", "2", "--jobs", "2"]) == 0
    text = capsys.readouterr().out
    assert "Best fixed partition" in text and "Bound of the TideRL run" in text
    held = tiderl["group_holding"]
    assert f"claim to publish {held['claim_to_publish_s']:.1f} s" in text

