"""tools/sim_seeds.py: systems side by side over seeds (the benchmark runs minutes: it lives in tools/)."""

from __future__ import annotations

import json

import pytest
import sim_seeds

from tiderl.sim import report
from tiderl.sim.systems import parse_system

WORKLOAD = "jobs/sim/hilo-bench.workload.yaml"
CLUSTER = "jobs/sim/cpu.cluster.yaml"


def test_seeds_parse_as_ranges_and_lists_each_once() -> None:
    assert sim_seeds.parse_seeds("0-3") == [0, 1, 2, 3]
    assert sim_seeds.parse_seeds("5, 1-2,2,9") == [5, 1, 2, 9]


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-x", ","])
def test_bad_seeds_are_refused_by_name(text: str) -> None:
    with pytest.raises(SystemExit, match="--seeds"):
        sim_seeds.parse_seeds(text)


def test_summary_compares_the_first_system_with_each_other_by_means_and_per_seed() -> None:
    out = sim_seeds.summarise(["a", "b", "c"], [[10.0, 12.0], [10.0, 8.0], [20.0, 24.0]], [0, 1])
    assert out["systems"]["a"]["mean_tok_s"] == 11.0
    assert out["systems"]["c"]["sd_share"] == pytest.approx(2 ** 0.5 * 2 / 22, abs=1e-4)
    assert out["ratios"]["a/b"] == {"of_means": pytest.approx(11 / 9, abs=1e-4), "per_seed_min": 1.0,
                                    "per_seed_max": 1.5}
    assert out["ratios"]["a/c"]["of_means"] == 0.5


def test_a_sweeping_system_without_a_fraction_is_refused(capsys) -> None:
    with pytest.raises(SystemExit, match="tiderl-noers sweeps"):
        sim_seeds.main([WORKLOAD, CLUSTER, "--systems", "tiderl,tiderl-noers", "--seeds", "0", "--steps", "2"])
    with pytest.raises(SystemExit, match="--systems"):
        sim_seeds.main([WORKLOAD, CLUSTER, "--systems", "no-such-system", "--seeds", "0", "--steps", "2"])


def test_every_system_runs_under_every_seed_as_tiderl_sim_would(capsys) -> None:
    assert sim_seeds.main([WORKLOAD, CLUSTER, "--systems", "tiderl,stream@0.34", "--seeds", "0-1",
                           "--steps", "3", "--jobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seeds"] == [0, 1] and set(out["systems"]) == {"tiderl", "stream@0.34"}
    # the same runs as `tiderl sim --system S --seed N` (tiderl at the cluster's default fraction)
    for name, system in (("tiderl", parse_system("tiderl@0.34")), ("stream@0.34", parse_system("stream@0.34"))):
        expect = [report.run_one(WORKLOAD, CLUSTER, system, 3, seed)["goodput_tok_s"] for seed in (0, 1)]
        assert out["systems"][name]["goodput_tok_s"] == expect
    assert "tiderl/stream@0.34" in out["ratios"]
