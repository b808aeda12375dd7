"""tools/learning_vs_sync.py's comparisons of tiderl with sync, on hand-made evaluations (the runs are a benchmark)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import learning_vs_sync as lvs  # noqa: E402
from tiderl.evalstats import wilson_interval  # noqa: E402


def ev(version: int, rate: float, n: int = 16) -> dict:
    return {"version": version, "success_rate": rate, "num_tasks": n}


def test_a_rate_inside_syncs_interval_passes_and_one_outside_fails() -> None:
    sync = [ev(0, 0.375), ev(5, 1.0), ev(10, 1.0)]
    low, high = wilson_interval(16, 16)  # about (0.806, 1.0)
    assert 0.8 < low < 0.81 and high == 1.0
    inside = lvs.per_version([ev(0, 0.375), ev(5, 0.875), ev(10, 1.0)], sync)  # 14/16 = 0.875 >= 0.806
    assert inside["within_interval_every_version"] is True
    assert [r["inside"] for r in inside["versions"]] == [True, True, True]
    assert inside["versions"][1]["sync_ci95"] == [round(low, 4), 1.0]
    outside = lvs.per_version([ev(0, 0.375), ev(5, 0.75), ev(10, 1.0)], sync)  # 12/16 = 0.75 < 0.806
    assert outside["within_interval_every_version"] is False
    assert [r["inside"] for r in outside["versions"]] == [True, False, True]
    assert outside["not_below_interval_every_version"] is False and outside["versions"][1]["not_below"] is False


def test_above_syncs_interval_is_outside_too_and_only_common_versions_count() -> None:
    # sync at 2/16: its interval's top is about 0.36; tiderl at 0.5 is outside (better, but not "similar").
    got = lvs.per_version([ev(0, 0.125), ev(5, 0.5), ev(7, 0.0)], [ev(0, 0.125), ev(5, 0.125), ev(10, 1.0)])
    assert [r["version"] for r in got["versions"]] == [0, 5]
    assert got["versions"][1]["inside"] is False and got["within_interval_every_version"] is False
    assert got["versions"][1]["not_below"] is True and got["not_below_interval_every_version"] is True
    # 16/16 against sync's 15/16: above its interval (which ends at about 0.989), outside but not below.
    perfect = lvs.per_version([ev(10, 1.0)], [ev(10, 0.9375)])
    assert perfect["versions"][0]["sync_ci95"][1] < 0.99
    assert perfect["within_interval_every_version"] is False and perfect["not_below_interval_every_version"] is True
    none = lvs.per_version([ev(3, 0.5)], [ev(5, 0.5)])  # nothing in common
    assert none["within_interval_every_version"] is False and none["not_below_interval_every_version"] is False


def test_the_interval_edge_is_inside() -> None:
    low, high = wilson_interval(8, 16)
    assert lvs.per_version([ev(5, low)], [ev(5, 0.5)])["within_interval_every_version"] is True
    assert lvs.per_version([ev(5, high)], [ev(5, 0.5)])["within_interval_every_version"] is True
    assert lvs.per_version([ev(5, low - 0.001)], [ev(5, 0.5)])["within_interval_every_version"] is False


def _side(evals: list[dict], seconds: dict[int, float]) -> dict:
    return {"evals": evals, "seconds": seconds}


def test_ahead_when_every_version_comes_sooner_and_the_policy_is_never_behind() -> None:
    evals = [ev(0, 0.375), ev(5, 1.0), ev(10, 1.0)]
    got = lvs.per_second(_side(evals, {0: -5.0, 5: 40.0, 10: 80.0}), _side(evals, {0: -3.0, 5: 60.0, 10: 120.0}))
    assert got["faster_every_version"] is True and got["ahead_per_second"] is True
    assert [r["version"] for r in got["faster"]] == [5, 10]  # version 0 (the base model) does not count
    assert got["faster"][0]["tiderl_over_sync"] == round(40 / 60, 3)
    # At sync's v10 (120 s) tiderl's latest evaluated policy is its v10 (80 s).
    assert [(r["sync_version"], r["tiderl_version"]) for r in got["at_sync_evaluations"]] == [(0, 0), (5, 5), (10, 10)]
    assert got["at_least_at_every_sync_evaluation"] is True


def test_slower_to_one_version_is_not_ahead() -> None:
    evals = [ev(0, 0.375), ev(5, 1.0), ev(10, 1.0)]
    got = lvs.per_second(_side(evals, {0: 0.0, 5: 40.0, 10: 130.0}), _side(evals, {0: 0.0, 5: 60.0, 10: 120.0}))
    assert [r["faster"] for r in got["faster"]] == [True, False]
    assert got["faster_every_version"] is False and got["ahead_per_second"] is False
    tie = lvs.per_second(_side(evals, {0: 0.0, 5: 60.0, 10: 100.0}), _side(evals, {0: 0.0, 5: 60.0, 10: 120.0}))
    assert tie["faster_every_version"] is False  # as fast is not fewer seconds


def test_faster_but_behind_beyond_noise_at_a_sync_evaluation_is_not_ahead() -> None:
    # tiderl publishes sooner, but its v5 is 0.25 where sync's is 1.0: at sync's v5, tiderl's policy (v5) is behind.
    tiderl = [ev(0, 0.375), ev(5, 0.25), ev(10, 1.0)]
    sync = [ev(0, 0.375), ev(5, 1.0), ev(10, 1.0)]
    got = lvs.per_second(_side(tiderl, {0: 0.0, 5: 30.0, 10: 70.0}), _side(sync, {0: 0.0, 5: 60.0, 10: 120.0}))
    assert got["faster_every_version"] is True
    row = {r["sync_version"]: r for r in got["at_sync_evaluations"]}[5]
    assert row["tiderl_version"] == 5 and row["z"] < -1.96 and row["not_behind"] is False and row["at_least"] is False
    assert got["not_behind_at_every_sync_evaluation"] is False and got["ahead_per_second"] is False


def test_a_small_shortfall_is_not_behind_but_is_not_at_least() -> None:
    tiderl = [ev(0, 0.375), ev(5, 0.9375), ev(10, 1.0)]
    sync = [ev(0, 0.375), ev(5, 1.0), ev(10, 1.0)]
    got = lvs.per_second(_side(tiderl, {0: 0.0, 5: 30.0, 10: 70.0}), _side(sync, {0: 0.0, 5: 60.0, 10: 120.0}))
    row = {r["sync_version"]: r for r in got["at_sync_evaluations"]}[5]
    assert row["not_behind"] is True and row["at_least"] is False
    assert got["ahead_per_second"] is True and got["at_least_at_every_sync_evaluation"] is False


def test_at_syncs_evaluation_tiderls_latest_published_evaluated_version_counts() -> None:
    # By sync's v5 (60 s) tiderl had published v5 (50 s) but not v10 (65 s): its v5 counts, which is behind.
    tiderl = [ev(0, 0.375), ev(5, 0.125), ev(10, 1.0)]
    sync = [ev(0, 0.375), ev(5, 1.0), ev(10, 1.0)]
    got = lvs.per_second(_side(tiderl, {0: 0.0, 5: 50.0, 10: 65.0}), _side(sync, {0: 0.0, 5: 60.0, 10: 120.0}))
    rows = {r["sync_version"]: r for r in got["at_sync_evaluations"]}
    assert rows[5]["tiderl_version"] == 5 and rows[5]["not_behind"] is False
    assert rows[10]["tiderl_version"] == 10 and rows[10]["not_behind"] is True
    # Sooner still, its v10 counts at sync's v5.
    sooner = lvs.per_second(_side(tiderl, {0: 0.0, 5: 30.0, 10: 55.0}), _side(sync, {0: 0.0, 5: 60.0, 10: 120.0}))
    assert {r["sync_version"]: r for r in sooner["at_sync_evaluations"]}[5]["tiderl_version"] == 10
    assert sooner["ahead_per_second"] is True
    # Version 0, the base model, is there from the start, even where its row was written after sync's.
    base = lvs.per_second(_side(tiderl, {0: 5.0, 5: 30.0, 10: 55.0}), _side(sync, {0: 0.0, 5: 60.0, 10: 120.0}))
    assert base["at_sync_evaluations"][0]["tiderl_version"] == 0 and base["ahead_per_second"] is True
    # No tiderl evaluation by sync's first one (tiderl evaluated no version 0): not ahead.
    late = lvs.per_second(_side(tiderl[1:], {5: 30.0, 10: 55.0}), _side(sync, {0: 0.0, 5: 60.0, 10: 120.0}))
    first = late["at_sync_evaluations"][0]
    assert first["tiderl_version"] is None and first["not_behind"] is False and late["ahead_per_second"] is False


def test_startup_ends_when_the_last_ranks_first_engine_is_up() -> None:
    assert lvs.startup_end(100.0, [(1, 130.0), (2, 140.0), (1, 200.0), (3, 135.0)]) == 140.0
    assert lvs.startup_end(100.0, []) == 100.0
    t = lvs.timeline(100.0, {0: 101.0, 5: 190.0, 10: 250.0}, [(1, 130.0), (2, 140.0)], {0: 150.0, 5: 200.0},
                     [0, 5, 10])
    assert t["startup_s"] == 40.0
    assert t["from_creation_s"] == {0: 1.0, 5: 90.0, 10: 150.0}
    assert t["from_startup_end_s"] == {0: -39.0, 5: 50.0, 10: 110.0}
    assert t["eval_done_s"] == {0: 50.0, 5: 100.0, 10: None}


def _run(evals: list[dict], published: dict[int, float], up: float) -> dict:
    return {"evals": evals, "timeline": lvs.timeline(0.0, published, [(1, up)], {}, [e["version"] for e in evals])}


def test_a_seed_and_the_verdicts_over_seeds() -> None:
    evals = [ev(0, 0.375), ev(5, 1.0), ev(10, 1.0)]
    # tiderl's engines came up later (60 s against 30 s) but it trains faster after: ahead from the end of
    # start-up, not from creation.
    tiderl = _run(evals, {0: 1.0, 5: 100.0, 10: 140.0}, up=60.0)
    sync = _run(evals, {0: 1.0, 5: 90.0, 10: 150.0}, up=30.0)
    seed = lvs.compare_seed(tiderl, sync)
    assert seed["per_version"]["within_interval_every_version"] is True
    assert seed["per_second"]["ahead_per_second"] is True
    assert seed["per_second_from_creation"]["ahead_per_second"] is False
    behind = lvs.compare_seed(_run([ev(0, 0.375), ev(5, 0.5), ev(10, 1.0)], {0: 1.0, 5: 100.0, 10: 140.0}, 60.0),
                              sync)
    assert behind["per_version"]["within_interval_every_version"] is False
    good = lvs.verdicts([{"seed": 0, "comparison": seed}, {"seed": 1, "comparison": seed}])
    assert good == {"within_interval_every_version_every_seed": True,
                    "not_below_interval_every_version_every_seed": True,
                    "ahead_per_second_every_seed": True, "ahead_per_second_from_creation_every_seed": False}
    mixed = lvs.verdicts([{"seed": 0, "comparison": seed}, {"seed": 1, "comparison": behind}])
    assert mixed["within_interval_every_version_every_seed"] is False
    assert mixed["not_below_interval_every_version_every_seed"] is False
    assert mixed["ahead_per_second_every_seed"] is False  # its v5 (0.5) is behind sync's (1.0) at sync's v5
    failed = lvs.verdicts([{"seed": 0, "comparison": seed}, {"seed": 1, "tiderl": {"error": "exit 1"}}])
    assert not any(failed.values())
    assert not any(lvs.verdicts([]).values())


@pytest.mark.parametrize("staleness", ["x", "1.5"])
def test_a_bad_staleness_is_refused(staleness: str, tmp_path) -> None:
    with pytest.raises(SystemExit):
        lvs.main(["--staleness", staleness, "--seeds", "0", "--out", str(tmp_path)])


def test_a_system_override_is_refused(tmp_path) -> None:
    with pytest.raises(SystemExit):
        lvs.main(["--set", "system=async", "--out", str(tmp_path)])


def test_the_quickstart_has_an_advisor_workload_and_the_vision_job_none() -> None:
    sim = ROOT / "jobs" / "sim"
    assert lvs.advisor_workload(ROOT / "jobs" / "quickstart.yaml", None) == sim / "hilo-bench.workload.yaml"
    assert lvs.advisor_workload(ROOT / "jobs" / "quickstart-vision.yaml", None) is None
    assert lvs.advisor_workload(ROOT / "jobs" / "quickstart.yaml", Path("x.yaml")) == Path("x.yaml")
