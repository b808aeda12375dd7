"""The shared-host model (tiderl.policy.host), and the simulator running the same one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiderl.config.ers import ErsConfig
from tiderl.policy.ers import ErsLimits
from tiderl.policy.host import HostShare
from tiderl.sim.costs import derive_costs
from tiderl.sim.spec import load_cluster

ROOT = Path(__file__).resolve().parents[1]


def test_ranks_run_at_full_speed_within_the_slots_and_share_them_beyond():
    host = HostShare(slots=2.0, rollout_weight=1.5)
    assert host.speed(0, 0) == 1.0 and host.speed(1, 0.5) == 1.0
    assert host.speed(2, 1) == pytest.approx(2.0 / 4.0)
    assert host.speed(2, 2) < host.speed(2, 1) < host.speed(1, 1)


@pytest.mark.parametrize("slots, weight", [(0, 1.0), (-1, 1.0), (1.0, 0)])
def test_a_host_without_slots_or_weight_is_refused(slots, weight):
    with pytest.raises(ValueError, match="host"):
        HostShare(slots, weight)


def test_the_simulator_and_the_planner_share_one_host_model():
    cluster = load_cluster(ROOT / "jobs/sim/cpu.cluster.yaml")
    costs = derive_costs(cluster)
    assert costs.host == HostShare(cluster.measured.host_compute_slots, cluster.measured.rollout_busy_cores)
    for engines, trainer in [(0, 1), (1, 0), (2, 1), (3, 1)]:
        assert costs.host_speed(engines, trainer) == costs.host.speed(engines, trainer)
    assert derive_costs(load_cluster(ROOT / "jobs/sim/h100x8.cluster.yaml")).host is None


def test_the_job_config_names_the_host_for_the_planner():
    assert ErsLimits.from_config(ErsConfig(), 1, 2).host is None
    limits = ErsLimits.from_config(ErsConfig(host_slots=1.0, rollout_host_weight=1.6), 1, 2)
    assert limits.host == HostShare(1.0, 1.6)
    given = HostShare(2.0)
    assert ErsLimits.from_config(ErsConfig(host_slots=1.0), 1, 2, host=given).host is given
