"""tools/plan_vs_real.py's comparison of `tiderl plan` with measured runs (the runs themselves are a benchmark)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import plan_vs_real  # noqa: E402


def _plan(rows: list[tuple[int, int, float]], recommended: tuple[int, int]) -> dict:
    """`tiderl plan --json`'s object, its rows and recommendation made by tiderl.sim.advisor's own to_json."""
    from tiderl.sim.advisor import PlanRecommendation, PlanRow, PlanSetting

    made = {(g, s): PlanRow(PlanSetting(4, g, s), tok, (tok,), (2, 1, 0), "compute", 2 * tok, 2 * tok, 3 * tok, 1.0,
                            0.0, 5.0) for g, s, tok in rows}
    best = PlanRecommendation(made[recommended], 0.9, max(made.values(), key=lambda r: r.goodput_tok_s).goodput_tok_s,
                              len(made), None)
    return {"rows": [r.to_json() for r in made.values()], "recommendation": best.to_json()}


def test_the_recommendation_is_scored_against_the_best_measured_setting() -> None:
    plan = _plan([(2, 1, 900.0), (4, 1, 1200.0), (4, 2, 1100.0)], recommended=(4, 1))
    got = plan_vs_real.compare(plan, {"g2-s1": 500.0, "g4-s1": 560.0, "g4-s2": 600.0})
    assert got["recommended"] == "g4-s1" and got["best_measured"] == "g4-s2"
    assert got["recommended_over_best_measured"] == round(560 / 600, 4) and got["met"] is True
    assert got["same_order"] is False  # predicted g4-s1 > g4-s2, measured the other way
    worse = plan_vs_real.compare(plan, {"g2-s1": 500.0, "g4-s1": 400.0, "g4-s2": 600.0})
    assert worse["met"] is False and worse["recommended_over_best_measured"] == round(400 / 600, 4)
    missing = plan_vs_real.compare(plan, {"g2-s1": 500.0, "g4-s1": None, "g4-s2": 600.0})
    assert missing["met"] is None and [r["measured_tok_s"] for r in missing["rows"]] == [500.0, None, 600.0]


def test_the_simulator_files_take_the_jobs_settings(tmp_path) -> None:
    workload, cluster, ranks, steps = plan_vs_real.sim_files(ROOT / "jobs" / "bench-latency.yaml", tmp_path)
    job = yaml.safe_load((ROOT / "jobs" / "bench-latency.yaml").read_text())
    w, c = yaml.safe_load(workload.read_text()), yaml.safe_load(cluster.read_text())
    assert ranks == job["launch"]["num_ranks"] == c["num_gpus"] and steps == job["trainer"]["num_steps"]
    assert w["groups_per_step"] == job["trainer"]["groups_ideal"] and w["group_size"] == job["rollout"]["group_size"]
    assert c["training"]["max_staleness"] == job["rollout"]["max_staleness"]
    assert c["rollout"]["max_num_seqs"] == job["rollout"]["max_concurrency"]
