"""A job's settings in the simulator's files, and the operating points around it that `tiderl submit --dry-run
--advise` weighs (docs/simulator.md, "Choosing the operating point").

- `job_settings`: the workload and cluster documents with the values a job sets ([J] in the files) replaced by
  the job's resolved config: ranks, tasks per rollout rank, micro-batch tokens, staleness, B_min/B_ideal,
  actor ranks, the rollout split, the report interval and the `ers:` keys the simulator knows, for the
  cluster; group size, groups a step, evaluations and the context limit, for the workload. The simulator's
  comparison with a real run (`tools/sim_vs_real.py`) and `tools/plan_vs_real.py` take them the same way.
- `job_grid`: the job's own setting and its neighbours, half and twice the GPUs (whole nodes the cluster
  can make) and groups, one version of staleness less and more.
- `job_overrides`: the `--set` overrides that turn the job into a setting of the grid.

Pure: documents and configs in, documents and lists out; no simulation, no files.
"""

from __future__ import annotations

import copy
import typing
from dataclasses import fields
from typing import Any

from tiderl.sim.advisor import ClusterScaleError, PlanSetting, scale_cluster
from tiderl.sim.spec import ClusterSpec

_MISSING = object()


def job_settings(cluster: dict, workload: dict, config: dict) -> tuple[dict, dict, dict, list[str]]:
    """The cluster and workload documents (as loaded from YAML) with the values they take from the
    job ([J]) replaced by a run's resolved `config` (`tiderl.config.schema.to_dict`). Returns (cluster,
    workload, the replaced values as {"cluster.KEY" or "workload.KEY": [file value, run value]}, mismatches
    not replaced: a task type whose turn limit exceeds the job's `env.max_turns`)."""
    cluster, workload = copy.deepcopy(cluster), copy.deepcopy(workload)
    r, t, launch = config["rollout"], config["trainer"], config["launch"]
    changed: dict = {}

    def put(doc: dict, label: str, path: str, value: Any, default: Any = _MISSING) -> None:
        """Set doc[path] to value; record it unless it was so already (or absent and `default`)."""
        *parents, key = path.split(".")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        before = node.get(key, default)
        node[key] = value
        if before != value:
            changed[f"{label}.{path}"] = [None if before is _MISSING else before, value]

    put(cluster, "cluster", "num_gpus", launch["num_ranks"])
    put(cluster, "cluster", "rollout.max_num_seqs", r["max_concurrency"])
    put(cluster, "cluster", "training.micro_batch_tokens", t["micro_batch_tokens"])
    put(cluster, "cluster", "training.max_staleness", r["max_staleness"])
    put(cluster, "cluster", "training.min_batch_fraction", round(t["groups_min"] / t["groups_ideal"], 6))
    put(cluster, "cluster", "training.actor_ranks", t["actor_ranks"])
    put(cluster, "cluster", "training.default_rollout_fraction", launch["rollout_fraction"])
    put(cluster, "cluster", "training.rollout_fraction_sweep", [launch["rollout_fraction"]])
    if "control" in cluster:
        put(cluster, "cluster", "control.report_interval_s", r["report_interval_s"])
    # The `ers:` keys the simulator's cluster section knows; a key it does not know stays out.
    ers_type = typing.get_type_hints(ClusterSpec)["ers"]
    defaults = ers_type()
    known = {f.name for f in fields(ers_type)}
    for key, value in config.get("ers", {}).items():
        if key in known:
            put(cluster, "cluster", f"ers.{key}", value, getattr(defaults, key))

    put(workload, "workload", "group_size", r["group_size"])
    put(workload, "workload", "groups_per_step", t["groups_ideal"])
    put(workload, "workload", "eval_every_steps", r["eval_every_steps"])
    if r["eval_every_steps"]:
        put(workload, "workload", "eval_groups", r["eval_groups"])
        # Greedy evaluation plays one task per prompt (the control plane's feed_eval).
        put(workload, "workload", "eval_group_size", 1 if r["eval_temperature"] == 0 else r["group_size"])
    put(workload, "workload", "max_context_tokens", config["model"]["max_context_tokens"])
    mismatch = [f"workload.task_types[{task['name']}].turns_max {task.get('turns_max')} > env.max_turns "
                f"{config['env']['max_turns']}"
                for task in workload.get("task_types", []) if task.get("turns_max", 0) > config["env"]["max_turns"]]
    return cluster, workload, changed, mismatch


def job_setting(config: dict) -> PlanSetting:
    """The operating point the job is written at."""
    return PlanSetting(int(config["launch"]["num_ranks"]), int(config["trainer"]["groups_ideal"]),
                       int(config["rollout"]["max_staleness"]))


def job_grid(config: dict, cluster: ClusterSpec) -> tuple[list[int], list[int], list[int]]:
    """GPUs, groups and staleness to weigh around the job's setting (`cluster` holds the job's settings):
    half, the same and twice the GPUs where the cluster makes them (whole nodes, room beside the actors, not
    a shared host), half, the same and twice the groups, one version of staleness less (not below 0), the
    same and one more."""
    own = job_setting(config)
    gpus = []
    for n in (own.gpus // 2, own.gpus, own.gpus * 2):
        if n == own.gpus:
            gpus.append(n)
            continue
        try:
            scale_cluster(cluster, n)
        except ClusterScaleError:
            continue
        gpus.append(n)
    groups = sorted({max(1, own.groups // 2), own.groups, own.groups * 2})
    staleness = sorted({max(0, own.staleness - 1), own.staleness, own.staleness + 1})
    return sorted(set(gpus)), groups, staleness


def job_overrides(config: dict, setting: PlanSetting) -> list[str]:
    """The `--set` overrides that run the job at `setting` (none for the job's own): the ranks (and the Slurm
    nodes, at the job's ranks per node), the groups (B_min at the job's share of B_ideal) and the staleness."""
    own = job_setting(config)
    sets: list[str] = []
    if setting.gpus != own.gpus:
        sets.append(f"launch.num_ranks={setting.gpus}")
        nodes = int(config["slurm"]["nodes"])
        per_node, extra = divmod(own.gpus, nodes)
        if not extra and setting.gpus % per_node == 0:
            sets.append(f"slurm.nodes={setting.gpus // per_node}")
    if setting.groups != own.groups:
        share = int(config["trainer"]["groups_min"]) / own.groups
        sets += [f"trainer.groups_ideal={setting.groups}",
                 f"trainer.groups_min={max(1, min(setting.groups, round(share * setting.groups)))}"]
    if setting.staleness != own.staleness:
        sets.append(f"rollout.max_staleness={setting.staleness}")
    return sets
