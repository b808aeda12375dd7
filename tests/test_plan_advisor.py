"""`tiderl plan`: the cluster scaled by whole nodes, the cost formula, the split and bound a row reads,
the recommendation rule (tiderl.sim.advisor), and the command end to end on a shipped pair."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from tiderl.sim import advisor, plan_cli
from tiderl.sim.advisor import ClusterScaleError, PlanRow, PlanSetting
from tiderl.sim.spec import load_cluster, load_workload

ROOT = Path(__file__).resolve().parents[1]
H100X8 = str(ROOT / "jobs/sim/h100x8.cluster.yaml")
CPU = str(ROOT / "jobs/sim/cpu.cluster.yaml")
BENCH = str(ROOT / "jobs/sim/bench-latency.workload.yaml")
TEXT = str(ROOT / "jobs/sim/text-agentic.workload.yaml")


# -- scaling -------------------------------------------------------------------------------------

def test_a_cluster_scales_by_whole_nodes_of_its_type() -> None:
    cluster = load_cluster(H100X8)
    for gpus in (8, 16, 32, 128):
        scaled = advisor.scale_cluster(cluster, gpus)
        assert scaled.num_gpus == gpus
        assert (scaled.gpu, scaled.model, scaled.rollout, scaled.training, scaled.ers, scaled.env_concurrency) == (
            cluster.gpu, cluster.model, cluster.rollout, cluster.training, cluster.ers, cluster.env_concurrency)


@pytest.mark.parametrize("gpus", [4, 12, 1])
def test_a_count_that_is_not_whole_nodes_is_refused(gpus: int) -> None:
    with pytest.raises(ClusterScaleError, match=f"{gpus} GPUs"):
        advisor.scale_cluster(load_cluster(H100X8), gpus)


def test_a_shared_host_is_simulated_only_at_its_own_ranks() -> None:
    cpu = load_cluster(CPU)
    assert advisor.scale_cluster(cpu, cpu.num_gpus) is cpu
    with pytest.raises(ClusterScaleError, match="one shared host"):
        advisor.scale_cluster(cpu, 2 * cpu.num_gpus)


def test_a_fixed_actor_group_needs_a_rollout_rank_beside_it() -> None:
    big = advisor.scale_cluster(load_cluster(H100X8), 16)
    big = replace(big, training=replace(big.training, actor_ranks=10))
    assert advisor.scale_cluster(big, 32).training.actor_ranks == 10
    with pytest.raises(ClusterScaleError, match="no rollout rank"):
        advisor.scale_cluster(big, 8)


def test_a_setting_replaces_groups_and_staleness() -> None:
    workload, cluster = advisor.apply_setting(load_workload(TEXT), load_cluster(H100X8), PlanSetting(16, 8, 3))
    assert (workload.groups_per_step, cluster.num_gpus, cluster.training.max_staleness) == (8, 16, 3)


def test_settings_are_every_combination_gpus_outermost() -> None:
    grid = advisor.settings([8, 16], [32], [1, 2])
    assert [(s.gpus, s.groups, s.staleness) for s in grid] == [(8, 32, 1), (8, 32, 2), (16, 32, 1), (16, 32, 2)]


# -- cost, split, bound --------------------------------------------------------------------------

def test_cost_per_million_tokens_is_price_times_gpus_over_goodput() -> None:
    assert advisor.cost_per_million_tokens(2.5, 8, 10_000.0) == pytest.approx(2.5 * 8 / 3600 / 10_000 * 1e6)
    assert advisor.cost_per_million_tokens(2.5, 16, 10_000.0) == pytest.approx(2 * 0.5555556)
    assert advisor.cost_per_million_tokens(2.5, 8, 0.0) is None


def _step(r: int, a: int, ref: int) -> dict:
    return {"rollout_ranks": r, "actor_ranks": a, "ref_ranks": ref}


def test_the_split_is_the_most_common_of_the_last_half() -> None:
    # The first half (where ERS starts) does not count: 2/6/0 is most common overall, 3/5/0 in the last half.
    steps = [_step(2, 6, 0)] * 5 + [_step(3, 5, 0)] * 3 + [_step(3, 4, 1)] * 2
    assert advisor.settled_split(steps) == (3, 5, 0)


def test_a_tie_goes_to_the_split_seen_last() -> None:
    assert advisor.settled_split([_step(1, 1, 0)] * 4 + [_step(2, 6, 0), _step(3, 5, 0)] * 2) == (3, 5, 0)


def test_the_smaller_bound_binds() -> None:
    assert advisor.binding_bound(100.0, 200.0) == ("compute", 100.0)
    assert advisor.binding_bound(300.0, 200.0) == ("staleness_latency", 200.0)


def test_a_row_names_the_bound_the_simulator_names() -> None:
    setting = PlanSetting(8, 4, 1)
    result = plan_cli.simulate_setting(BENCH, H100X8, setting, 3, 0)
    row = advisor.make_row(setting, [result], 2.0)
    assert row.bound_term == result["bound_term"]
    assert row.bound_tok_s == min(result["upper_bound_tok_s"], result["latency_bound_tok_s"])
    assert row.split == advisor.settled_split(result["per_step"])
    assert row.cost_per_mtok_usd == advisor.cost_per_million_tokens(2.0, 8, result["goodput_tok_s"])
    assert row.staleness_learning == "not measured"


def test_a_row_over_seeds_takes_the_means() -> None:
    def result(goodput: float, compute: float, latency: float) -> dict:
        return {"goodput_tok_s": goodput, "upper_bound_tok_s": compute, "latency_bound_tok_s": latency,
                "stale_dropped_groups": 1, "step_time_s": 2.0, "per_step": [_step(2, 6, 0)] * 4}
    row = advisor.make_row(PlanSetting(8, 4, 1), [result(100, 150, 400), result(300, 250, 100)], 1.0)
    assert row.goodput_tok_s == 200 and row.goodput_tok_s_per_seed == (100, 300)
    assert (row.bound_term, row.bound_tok_s) == ("compute", 200)  # means 200 and 250
    assert row.split == (2, 6, 0)


# -- the recommendation --------------------------------------------------------------------------

def _row(gpus: int, goodput: float, staleness: int = 1, groups: int = 32) -> PlanRow:
    return PlanRow(setting=PlanSetting(gpus, groups, staleness), goodput_tok_s=goodput,
                   goodput_tok_s_per_seed=(goodput,), split=(1, 1, 0), bound_term="compute", bound_tok_s=goodput,
                   compute_bound_tok_s=goodput, latency_bound_tok_s=goodput,
                   cost_per_mtok_usd=advisor.cost_per_million_tokens(1.0, gpus, goodput),
                   stale_dropped_groups=0, step_time_s=1.0)


def test_the_cheapest_within_the_floor_of_the_best_goodput() -> None:
    rows = [_row(8, 20_000), _row(16, 38_000), _row(32, 40_000)]
    # 8 GPUs are the cheapest per token but below 0.9 x 40,000; 16 are within it and cheaper than 32.
    pick = advisor.recommend(rows, 0.9)
    assert pick is not None and pick.row.setting.gpus == 16 and pick.eligible == 2
    assert advisor.recommend(rows, 0.5).row.setting.gpus == 8  # type: ignore[union-attr]
    assert advisor.recommend(rows, 1.0).row.setting.gpus == 32  # type: ignore[union-attr]


def test_a_tie_in_cost_goes_to_the_lower_staleness_then_fewer_gpus() -> None:
    pick = advisor.recommend([_row(8, 10_000, staleness=2), _row(8, 10_000, staleness=1)], 0.9)
    assert pick is not None and pick.row.setting.staleness == 1 and pick.note is None
    pick = advisor.recommend([_row(16, 20_000), _row(8, 10_000)], 0.5)
    assert pick is not None and pick.row.setting.gpus == 8


def test_a_higher_staleness_recommended_says_its_learning_cost_is_not_measured() -> None:
    pick = advisor.recommend([_row(8, 10_000, staleness=1), _row(8, 15_000, staleness=2)], 0.9)
    assert pick is not None and pick.row.setting.staleness == 2
    assert pick.note is not None and "not measured" in pick.note


def test_no_recommendation_without_goodput() -> None:
    assert advisor.recommend([_row(8, 0.0)], 0.9) is None


# -- the command ---------------------------------------------------------------------------------

def _plan(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tiderl plan")
    plan_cli.add_arguments(parser)
    try:
        return plan_cli.run(parser.parse_args(list(argv)))
    except SystemExit as e:  # argparse's refusal
        return int(e.code or 0)


def test_the_command_is_registered() -> None:
    from tiderl.cli import COMMANDS

    assert COMMANDS["plan"][0] == "tiderl.sim.plan_cli"


def test_plan_end_to_end_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    code = _plan(BENCH, H100X8, "--gpus", "8,16", "--staleness", "0,1", "--steps", "3", "--gpu-hour-price", "3",
                 "--jobs", "2", "--json")
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["settings"] == [{"gpus": g, "groups": 4, "staleness": s} for g in (8, 16) for s in (0, 1)]
    assert [(r["gpus"], r["staleness"]) for r in doc["rows"]] == [(8, 0), (8, 1), (16, 0), (16, 1)]
    for row in doc["rows"]:
        assert row["goodput_tok_s"] > 0
        assert row["bound_term"] in ("compute", "staleness_latency")
        assert sum(row["split"].values()) == row["gpus"]
        assert row["cost_per_mtok_usd"] == pytest.approx(3 * row["gpus"] / 3600 / row["goodput_tok_s"] * 1e6, rel=1e-3)
        assert row["staleness_learning"] == "not measured"
    best = doc["recommendation"]
    assert {k: best[k] for k in ("gpus", "groups", "staleness")} in doc["settings"]
    assert best["cost_per_mtok_usd"] == min(r["cost_per_mtok_usd"] for r in doc["rows"]
                                            if r["goodput_tok_s"] >= 0.9 * best["best_goodput_tok_s"])
    assert err.count("simulations done") == 4  # a line per finished setting


@pytest.mark.parametrize("argv, named", [
    (["--gpus", ""], "--gpus"),
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "8,12"], "--gpus"),
    (["--gpus", "8", "--groups", "-1"], "--groups"),
    (["--gpus", "8", "--staleness", ","], "--staleness"),
    (["--gpus", "8", "--gpu-hour-price", "0"], "--gpu-hour-price"),
    (["--gpus", "8", "--steps", "0"], "--steps"),
    (["--gpus", "8", "--seeds", "-2"], "--seeds"),
    (["--gpus", "8", "--goodput-floor", "1.5"], "--goodput-floor"),
])
def test_bad_options_exit_2_naming_the_option(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(BENCH, H100X8, *argv) == 2
    err = capsys.readouterr().err
    assert named in err and "simulations done" not in err


def test_a_missing_file_or_swapped_files_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(BENCH, "jobs/sim/nope.cluster.yaml", "--gpus", "8") == 2
    assert "CLUSTER (second argument)" in capsys.readouterr().err
    assert _plan(H100X8, BENCH, "--gpus", "8") == 2
    assert "this is a cluster file" in capsys.readouterr().err
