"""`tiderl plan`: which operating point (GPUs, groups per step, staleness) to run a workload at.

Pure so it can be tested without simulating: settings in, a cluster scaled to a GPU count, rows
from simulation results, a recommendation out. No simulator, no processes, no printing
(`tiderl.sim.plan_cli` runs the simulations and prints).

- *Scaling* (`scale_cluster`): a cluster grows the way one buys it, whole nodes of the same type.
  A node is the cluster file's `gpu.gpus_per_node`; a file of measured costs without `gpu` is one
  node of its `num_gpus` ranks (what `tiderl.sim.costs` assumes). Only `num_gpus` changes: the
  datasheet, the model, the per-rank engine and trainer settings, the ERS limits and the
  environment cluster (`env_concurrency`, a separate service) stay. A count that is not a whole
  number of nodes, a count under 2 ranks, one that leaves no rollout rank beside a fixed actor group,
  or any other count on a shared host (`measured.host_compute_slots`: every rank a process of one
  host, which more ranks would not make a bigger machine of) is refused with `ClusterScaleError`.
- *Split* (`settled_split`): the (rollout, actor, ref) ranks most steps of the last half of the run
  trained with (`per_step`), ties to the latest: where ERS settled, not where it started.
- *Bound* (`binding_bound`): the simulator's two bounds on goodput, both computed by
  `tiderl.sim.metrics` from the run's own consumed trajectories (docs/simulator.md, "Bounds"): the
  compute bound (`upper_bound_tok_s`: the work spread over every GPU with nothing wasted) and the
  staleness-latency bound (`latency_bound_tok_s`: (staleness + 1) x groups per step in flight over a
  group's least time in flight, Little's law). The smaller binds (`bound_term`: `compute` or
  `staleness_latency`, as `metrics.summarize` names it); over several seeds, the smaller of the
  two bounds' means.
- *Cost* (`cost_per_million_tokens`): USD per million trained (consumed trajectory) tokens at a
  price per GPU-hour: price x GPUs / 3600 / goodput x 1e6.
- *Staleness in learning* (`staleness_learning_cost`): what a staleness bound costs the model's
  learning is not measured by the project (no measurements file; docs/RESULTS.md compares
  off-policy corrections at one staleness, not staleness bounds), so it says "not measured".
- *Recommendation* (`recommend`): among the settings whose goodput is at least `goodput_floor` of
  the best goodput, the one with the lowest cost per million tokens (at one price, the highest
  goodput per GPU); ties to the lower staleness (less off-policy data), then fewer GPUs, then fewer
  groups. Speed first within a margin, then price: the fastest setting is seldom the cheapest,
  and the cheapest may be too slow to be worth it. The rule does not weigh staleness's cost in
  learning (not measured): a recommendation at a staleness above the sweep's lowest says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tiderl.sim.spec import ClusterSpec, WorkloadSpec

NOT_MEASURED = "not measured"
SECONDS_PER_HOUR = 3600.0


class ClusterScaleError(ValueError):
    """A GPU count the cluster's node shape cannot make."""


@dataclass(frozen=True, slots=True)
class PlanSetting:
    """One operating point of the sweep."""

    gpus: int
    """Ranks of the job (the cluster's `num_gpus`)."""
    groups: int
    """Groups one training step consumes (the workload's `groups_per_step`, B_ideal)."""
    staleness: int
    """Staleness bound in versions (the cluster's `training.max_staleness`)."""

    @property
    def label(self) -> str:
        return f"{self.gpus} GPUs, {self.groups} groups, staleness {self.staleness}"


@dataclass(frozen=True, slots=True)
class PlanRow:
    """What the simulator predicts at one setting (means over the seeds)."""

    setting: PlanSetting
    goodput_tok_s: float
    """Trajectory tokens the trainer consumed per second, mean over the seeds."""
    goodput_tok_s_per_seed: tuple[float, ...]
    split: tuple[int, int, int]
    """(rollout, actor, ref) ranks TideRL settled on: `settled_split`."""
    bound_term: str
    """`compute` or `staleness_latency`: the bound that binds (`binding_bound`)."""
    bound_tok_s: float
    compute_bound_tok_s: float
    latency_bound_tok_s: float
    cost_per_mtok_usd: float | None
    """USD per million trained tokens (None: no goodput)."""
    stale_dropped_groups: float
    """Groups dropped as older than the staleness bound, mean over the seeds."""
    step_time_s: float | None
    staleness_learning: str = NOT_MEASURED

    @property
    def goodput_per_gpu_tok_s(self) -> float:
        return self.goodput_tok_s / self.setting.gpus

    @property
    def bound_share(self) -> float | None:
        """Goodput over the binding bound: how much of what the mechanics allow the run reached."""
        return self.goodput_tok_s / self.bound_tok_s if self.bound_tok_s > 0 else None

    def to_json(self) -> dict:
        s = self.setting
        rollout, actor, ref = self.split
        return {
            "gpus": s.gpus, "groups": s.groups, "staleness": s.staleness,
            "goodput_tok_s": round(self.goodput_tok_s, 1),
            "goodput_tok_s_per_seed": [round(g, 1) for g in self.goodput_tok_s_per_seed],
            "goodput_per_gpu_tok_s": round(self.goodput_per_gpu_tok_s, 1),
            "split": {"rollout_ranks": rollout, "actor_ranks": actor, "ref_ranks": ref},
            "bound_term": self.bound_term,
            "bound_tok_s": round(self.bound_tok_s, 1),
            "compute_bound_tok_s": round(self.compute_bound_tok_s, 1),
            "latency_bound_tok_s": round(self.latency_bound_tok_s, 1),
            "goodput_over_bound": round(self.bound_share, 3) if self.bound_share is not None else None,
            "cost_per_mtok_usd": round(self.cost_per_mtok_usd, 4) if self.cost_per_mtok_usd is not None else None,
            "stale_dropped_groups": self.stale_dropped_groups,
            "step_time_s": self.step_time_s,
            "staleness_learning": self.staleness_learning,
        }


@dataclass(frozen=True, slots=True)
class PlanRecommendation:
    row: PlanRow
    goodput_floor: float
    best_goodput_tok_s: float
    eligible: int
    """Settings at or above the floor."""
    note: str | None = None

    def to_json(self) -> dict:
        s = self.row.setting
        return {"gpus": s.gpus, "groups": s.groups, "staleness": s.staleness,
                "goodput_tok_s": round(self.row.goodput_tok_s, 1),
                "cost_per_mtok_usd": (round(self.row.cost_per_mtok_usd, 4)
                                      if self.row.cost_per_mtok_usd is not None else None),
                "rule": RULE.format(floor=self.goodput_floor),
                "goodput_floor": self.goodput_floor, "best_goodput_tok_s": round(self.best_goodput_tok_s, 1),
                "eligible_settings": self.eligible, "note": self.note}


RULE = ("the lowest cost per million trained tokens among the settings whose goodput is at least {floor:g} "
        "of the best goodput (ties: lower staleness, fewer GPUs, fewer groups)")


def settings(gpus: Iterable[int], groups: Iterable[int], staleness: Iterable[int]) -> list[PlanSetting]:
    """Every combination, GPUs outermost, in the order given."""
    return [PlanSetting(g, b, s) for g, b, s in itertools.product(gpus, groups, staleness)]


def node_gpus(cluster: ClusterSpec) -> int:
    """GPUs of one node: the datasheet's, or the whole file for measured costs (as `tiderl.sim.costs`)."""
    return cluster.gpu.gpus_per_node if cluster.gpu is not None else cluster.num_gpus


def scale_cluster(cluster: ClusterSpec, gpus: int) -> ClusterSpec:
    """`cluster` with `gpus` ranks: more (or fewer) whole nodes of the same type; everything else as it is."""
    if gpus == cluster.num_gpus:
        return cluster
    if cluster.measured is not None and cluster.measured.host_compute_slots is not None:
        raise ClusterScaleError(
            f"{gpus} GPUs: {cluster.name} is one shared host ({cluster.num_gpus} ranks as processes of it, "
            f"measured.host_compute_slots); it is simulated only at its own {cluster.num_gpus}")
    if gpus < 2:
        raise ClusterScaleError(f"{gpus} GPUs: a job needs at least 2 ranks (a rollout and an actor rank)")
    node = node_gpus(cluster)
    if gpus % node:
        raise ClusterScaleError(
            f"{gpus} GPUs is not a whole number of {cluster.name}'s {node}-GPU nodes "
            f"(possible: multiples of {node}, e.g. {', '.join(str(node * k) for k in (1, 2, 4, 8))})")
    actors = cluster.training.actor_ranks
    if actors is not None and actors >= gpus:
        raise ClusterScaleError(f"{gpus} GPUs leave no rollout rank beside {cluster.name}'s {actors} actor ranks")
    return replace(cluster, name=f"{cluster.name}@{gpus}gpus", num_gpus=gpus)


def apply_setting(workload: WorkloadSpec, cluster: ClusterSpec,
                  setting: PlanSetting) -> tuple[WorkloadSpec, ClusterSpec]:
    """The workload and cluster of one setting: scaled, `groups_per_step` and `max_staleness` replaced."""
    scaled = scale_cluster(cluster, setting.gpus)
    scaled = replace(scaled, training=replace(scaled.training, max_staleness=setting.staleness))
    return replace(workload, groups_per_step=setting.groups), scaled


def settled_split(per_step: Sequence[dict]) -> tuple[int, int, int]:
    """The (rollout, actor, ref) ranks most steps of the last half trained with (ties: the latest).
    `per_step` rows carry `rollout_ranks`, `actor_ranks` and `ref_ranks` (the simulator's `per_step`)."""
    return most_common_split(per_step[len(per_step) // 2:])


def most_common_split(steps: Sequence[dict]) -> tuple[int, int, int]:
    """The (rollout, actor, ref) ranks most of `steps` trained with (ties: the one seen last)."""
    if not steps:
        raise ValueError("no step to read a split from")
    counts: dict[tuple[int, int, int], tuple[int, int]] = {}
    for i, step in enumerate(steps):
        split = (step["rollout_ranks"], step["actor_ranks"], step["ref_ranks"])
        counts[split] = (counts.get(split, (0, 0))[0] + 1, i)
    return max(counts, key=lambda s: counts[s])


def binding_bound(compute_tok_s: float, latency_tok_s: float) -> tuple[str, float]:
    """(`compute` or `staleness_latency`, its value): the smaller bound binds (a tie: compute),
    as `tiderl.sim.metrics.summarize` names it."""
    if compute_tok_s <= latency_tok_s:
        return "compute", compute_tok_s
    return "staleness_latency", latency_tok_s


def cost_per_million_tokens(price_usd_per_gpu_hour: float, gpus: int, goodput_tok_s: float) -> float | None:
    """USD per million trained tokens: price x GPUs / 3600 / goodput x 1e6 (None: no goodput)."""
    if goodput_tok_s <= 0:
        return None
    return price_usd_per_gpu_hour * gpus / SECONDS_PER_HOUR / goodput_tok_s * 1e6


def staleness_learning_cost(staleness: int) -> str:
    """What a staleness bound costs in learning: not measured by the project (see the module docstring)."""
    return NOT_MEASURED


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def make_row(setting: PlanSetting, results: Sequence[dict], price_usd_per_gpu_hour: float) -> PlanRow:
    """One row from the simulator's results of `setting` (one per seed; `tiderl sim --json` keys)."""
    if not results:
        raise ValueError(f"{setting.label}: no result")
    goodputs = tuple(r["goodput_tok_s"] for r in results)
    goodput = _mean(goodputs)
    compute = _mean([r["upper_bound_tok_s"] for r in results])
    latency = _mean([r["latency_bound_tok_s"] for r in results])
    term, bound = binding_bound(compute, latency)
    # Over several seeds: the split most steps of the seeds' last halves trained with.
    steps = [s for r in results for s in r["per_step"][len(r["per_step"]) // 2:]]
    step_times = [r["step_time_s"] for r in results if r["step_time_s"] is not None]
    return PlanRow(
        setting=setting,
        goodput_tok_s=goodput,
        goodput_tok_s_per_seed=goodputs,
        split=most_common_split(steps),
        bound_term=term,
        bound_tok_s=bound,
        compute_bound_tok_s=compute,
        latency_bound_tok_s=latency,
        cost_per_mtok_usd=cost_per_million_tokens(price_usd_per_gpu_hour, setting.gpus, goodput),
        stale_dropped_groups=_mean([r["stale_dropped_groups"] for r in results]),
        step_time_s=round(_mean(step_times), 3) if step_times else None,
        staleness_learning=staleness_learning_cost(setting.staleness),
    )


def recommend(rows: Sequence[PlanRow], goodput_floor: float) -> PlanRecommendation | None:
    """The setting `RULE` picks (None: no row has goodput)."""
    if not 0 < goodput_floor <= 1:
        raise ValueError(f"goodput_floor must lie in (0, 1], got {goodput_floor}")
    priced = [r for r in rows if r.cost_per_mtok_usd is not None]
    if not priced:
        return None
    best = max(r.goodput_tok_s for r in priced)
    eligible = [r for r in priced if r.goodput_tok_s >= goodput_floor * best]
    pick = min(eligible, key=lambda r: (r.cost_per_mtok_usd, r.setting.staleness, r.setting.gpus, r.setting.groups))
    lowest = min(r.setting.staleness for r in rows)
    note = None
    if pick.setting.staleness > lowest:
        note = (f"staleness {pick.setting.staleness} trains on older data than staleness {lowest}; "
                f"its cost in learning is {NOT_MEASURED}")
    return PlanRecommendation(pick, goodput_floor, best, len(eligible), note)
