"""Small workload and cluster specs for the simulator tests: the shipped files,
scaled down so a whole run takes well under a second."""

from __future__ import annotations

from pathlib import Path

import yaml

from tiderl.config.schema import build
from tiderl.sim.spec import ClusterSpec, WorkloadSpec

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "jobs" / "sim" / "text-agentic.workload.yaml"
CLUSTER = ROOT / "jobs" / "sim" / "h100x8.cluster.yaml"


def small_dicts(num_gpus: int = 4) -> tuple[dict, dict]:
    w = yaml.safe_load(WORKLOAD.read_text())
    w.update(group_size=4, groups_per_step=4, eval_every_steps=3, eval_groups=3, eval_group_size=2,
             max_context_tokens=4096, drift_steps=10)
    for t in w["task_types"]:
        t["prompt_tokens"] = 300
        t["turns_mean"] = {"start": 4, "end": 3}
        t["turns_min"] = 2
        t["turns_max"] = 8
        t["tokens_mean"] = {"start": 1500, "end": 1200}
    c = yaml.safe_load(CLUSTER.read_text())
    c["num_gpus"] = num_gpus
    c["training"]["rollout_fraction_sweep"] = [0.25, 0.5]
    c["training"]["default_rollout_fraction"] = 0.5
    return w, c


def small_specs(num_gpus: int = 4) -> tuple[WorkloadSpec, ClusterSpec]:
    w, c = small_dicts(num_gpus)
    return build(WorkloadSpec, w, "test-workload"), build(ClusterSpec, c, "test-cluster")


def write_small(tmp_path: Path, num_gpus: int = 4) -> tuple[Path, Path]:
    w, c = small_dicts(num_gpus)
    wp, cp = tmp_path / "w.yaml", tmp_path / "c.yaml"
    wp.write_text(yaml.safe_dump(w))
    cp.write_text(yaml.safe_dump(c))
    return wp, cp
