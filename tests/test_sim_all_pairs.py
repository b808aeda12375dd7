"""Every system of SYSTEMS (and a fixed decoupled split) on every shipped workload x cluster pair
(jobs/sim/*.workload.yaml x jobs/sim/*.cluster.yaml, globbed: new files are covered), for two steps.

The workloads keep their task families (turns, tokens, latencies, phases) but play at most
`GROUPS` groups a step and `EVAL_GROUPS` evaluation groups, so the whole test stays well under a
minute on two cores."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tiderl.config.schema import build
from tiderl.sim.report import FIXED, fixed_partitions
from tiderl.sim.simulator import Simulation
from tiderl.sim.spec import ClusterSpec, WorkloadSpec
from tiderl.sim.systems import SYSTEMS

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = sorted((ROOT / "jobs" / "sim").glob("*.workload.yaml"))
CLUSTERS = sorted((ROOT / "jobs" / "sim").glob("*.cluster.yaml"))
STEPS = 2
GROUPS = 4
EVAL_GROUPS = 4


def _workload(path: Path) -> WorkloadSpec:
    w = yaml.safe_load(path.read_text())
    w["groups_per_step"] = min(w["groups_per_step"], GROUPS)
    w["eval_groups"] = min(w.get("eval_groups", 0), EVAL_GROUPS)
    return build(WorkloadSpec, w, str(path))


def _cluster(path: Path) -> ClusterSpec:
    return build(ClusterSpec, yaml.safe_load(path.read_text()), str(path))


def test_the_shipped_files_are_found():
    assert len(WORKLOADS) >= 2 and len(CLUSTERS) >= 3


@pytest.mark.parametrize("workload_path", WORKLOADS, ids=lambda p: p.name.split(".")[0])
@pytest.mark.parametrize("cluster_path", CLUSTERS, ids=lambda p: p.name.split(".")[0])
def test_every_system_runs_on_every_shipped_pair(workload_path, cluster_path):
    workload, cluster = _workload(workload_path), _cluster(cluster_path)
    decoupled = next(s for s in fixed_partitions(cluster) if s.fixed_refs)
    systems = list(SYSTEMS.values()) + [decoupled]
    failures = []
    for system in systems:
        try:
            r = Simulation(workload, cluster, system, steps=STEPS, seed=0).run()
        except Exception as e:  # collect every failing system of the pair, not just the first
            failures.append(f"{system.label}: {type(e).__name__}: {e}")
            continue
        label = r["system"]
        assert r["steps"] == STEPS, label
        fetched = [s["fetch_groups"] for s in r["per_step"]]
        assert r["consumed_trajectories"] == sum(fetched) * workload.group_size, label
        assert r["goodput_tok_s"] > 0, label
        # Both bounds hold on every run.
        assert r["goodput_tok_s"] <= r["upper_bound_tok_s"], label
        assert r["goodput_tok_s"] <= r["latency_bound_tok_s"], label
        assert r["bound_tok_s"] == min(r["upper_bound_tok_s"], r["latency_bound_tok_s"]), label
        assert r["rwt_s"] >= 0 and r["twt_s"] >= 0, label
        if not system.synchronous:
            for entry in r["roles_timeline"]:
                assert entry["rollout"] + entry["actor"] + entry["ref"] <= cluster.num_gpus, label
                assert entry["rollout"] >= 1 and entry["actor"] >= 1, label
        if system is decoupled:
            assert r["system"].startswith(FIXED) and r["ra2p"]["decoupled_steps"] == STEPS, label
    assert not failures, "\n".join(failures)
