"""`tiderl plan WORKLOAD.yaml CLUSTER.yaml --gpus 8,16,32`: the operating point (GPUs, groups per step,
staleness) a workload is cheapest at, predicted by the simulator (docs/simulator.md, "Choosing the
operating point"). The rules are `tiderl.sim.advisor`'s; this module runs and prints."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

from tiderl.config import ConfigError

if TYPE_CHECKING:
    from tiderl.sim.advisor import PlanRecommendation, PlanRow, PlanSetting

DEFAULT_STEPS = 30
DEFAULT_PRICE_USD = 2.5
DEFAULT_FLOOR = 0.9
# The result keys a row reads (the rest of a simulation's result stays in its worker).
_KEPT = ("goodput_tok_s", "upper_bound_tok_s", "latency_bound_tok_s", "bound_term", "stale_dropped_groups",
         "step_time_s", "wall_s")


def int_list(minimum: int) -> Any:
    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give at least one number (comma-separated, e.g. 8,16,32)")
        try:
            values = [int(x) for x in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: whole numbers, comma-separated (e.g. 8,16,32)") from e
        bad = [v for v in values if v < minimum]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]}: each must be >= {minimum}")
        return list(dict.fromkeys(values))  # in order, once each
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 1") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: a number > 0") from e
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g}: must be > 0")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{value:g}: a fraction in (0, 1]")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="Workload file, first (e.g. jobs/sim/text-agentic.workload.yaml).")
    parser.add_argument("cluster", help="Cluster file, second; its node type is scaled to each --gpus "
                        "(e.g. jobs/sim/h100x8.cluster.yaml).")
    parser.add_argument("--gpus", type=int_list(1), required=True,
                        help="GPU counts, comma-separated (e.g. 8,16,32): whole nodes of the cluster's type.")
    parser.add_argument("--groups", type=int_list(1),
                        help="Groups per training step (B_ideal), comma-separated (default: the workload's).")
    parser.add_argument("--staleness", type=int_list(0),
                        help="Staleness bounds in versions, comma-separated; 0 is on-policy (default: the "
                        "cluster's training.max_staleness).")
    parser.add_argument("--gpu-hour-price", type=_positive_float, default=DEFAULT_PRICE_USD,
                        help=f"USD per GPU-hour, for the cost per million trained tokens (default {DEFAULT_PRICE_USD:g}).")
    parser.add_argument("--goodput-floor", type=_fraction, default=DEFAULT_FLOOR,
                        help="The recommendation: the lowest cost per million trained tokens among the settings "
                        "whose goodput is at least this fraction of the best goodput (ties: lower staleness, "
                        f"fewer GPUs, fewer groups); staleness's cost in learning is not weighed (default "
                        f"{DEFAULT_FLOOR:g}).")
    parser.add_argument("--seeds", type=_positive_int, default=1,
                        help="Seeds per setting, 0..N-1; goodput and bounds are their means (default 1).")
    parser.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                        help=f"Training steps simulated per setting (default {DEFAULT_STEPS}).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object (settings, rows, recommendation).")
    parser.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                        help="Simulations run in parallel worker processes (default: CPUs).")


def _fail(message: str) -> int:
    print(f"tiderl plan: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from tiderl.sim import advisor
    from tiderl.sim.cli import check_order
    from tiderl.sim.spec import load_cluster, load_workload

    for label, path in (("WORKLOAD (first argument)", args.workload), ("CLUSTER (second argument)", args.cluster)):
        if not os.path.isfile(path):
            return _fail(f"{label}: {path}: no such file")
    try:
        check_order(args.workload, args.cluster)
        workload = load_workload(args.workload)
        cluster = load_cluster(args.cluster)
    except ConfigError as e:
        return _fail(f"config error: {e}")
    for gpus in args.gpus:
        try:
            advisor.scale_cluster(cluster, gpus)
        except advisor.ClusterScaleError as e:
            return _fail(f"--gpus: {e}")
    grid = advisor.settings(args.gpus, args.groups or [workload.groups_per_step],
                            args.staleness if args.staleness is not None else [cluster.training.max_staleness])
    work = [(i, seed) for i in range(len(grid)) for seed in range(args.seeds)]
    results = _simulate_all(args, grid, work)
    rows = [advisor.make_row(s, results[i], args.gpu_hour_price) for i, s in enumerate(grid)]
    best = advisor.recommend(rows, args.goodput_floor)
    if args.json:
        print(json.dumps(_doc(args, grid, rows, best)))
    else:
        print(_text(args, workload.name, cluster.name, rows, best))
    return 0


def _simulate_all(args: argparse.Namespace, grid: list[PlanSetting], work: list[tuple[int, int]]) -> list[list[dict]]:
    """Every (setting, seed) of `work`, `--jobs` worker processes at a time: per setting, its results
    in seed order. A line on stderr per finished simulation (`tiderl sim`'s progress)."""
    from tiderl.sim.cli import SimProgress

    results: list[list[dict | None]] = [[None] * args.seeds for _ in grid]
    calls = [(args.workload, args.cluster, grid[i], args.steps, seed) for i, seed in work]

    def record(progress: SimProgress, count: int, key: tuple[int, int], result: dict) -> None:
        i, seed = key
        results[i][seed] = result
        label = grid[i].label + (f", seed {seed}" if args.seeds > 1 else "")
        progress.done(count, len(work), {"system": f"{label}: {result['goodput_tok_s']:,.0f} tok/s"})

    if args.jobs <= 1 or len(work) == 1:
        progress = SimProgress(command="tiderl plan")
        try:
            for count, (key, call) in enumerate(zip(work, calls), 1):
                record(progress, count, key, simulate_setting(*call))
        finally:
            progress.stop.set()
        return results  # type: ignore[return-value]
    # Forked as `tiderl sim`'s pool is (spawn would re-run `python -m tiderl` in each worker). With fork
    # the pool starts all its workers at the first submit, so they are forked before the progress
    # thread exists and inherit none of its state.
    with ProcessPoolExecutor(min(args.jobs, len(work)), mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(simulate_setting, *call): key for key, call in zip(work, calls)}
        progress = SimProgress(command="tiderl plan")
        try:
            for count, future in enumerate(as_completed(futures), 1):
                record(progress, count, futures[future], future.result())
        finally:
            progress.stop.set()
    return results  # type: ignore[return-value]


def simulate_setting(workload_path: str, cluster_path: str, setting: PlanSetting, steps: int, seed: int) -> dict:
    """One simulation of the `tiderl` system (CTB, RA2P, ERS) at `setting` (run in a worker process):
    the result keys a row reads, and its per-step splits."""
    from tiderl.sim import report
    from tiderl.sim.advisor import apply_setting
    from tiderl.sim.simulator import Simulation
    from tiderl.sim.spec import load_cluster, load_workload
    from tiderl.sim.systems import SYSTEMS

    workload, cluster = apply_setting(load_workload(workload_path), load_cluster(cluster_path), setting)
    system = report.at_default_fraction(SYSTEMS["tiderl"], cluster.training.default_rollout_fraction)
    result = Simulation(workload, cluster, system, steps=steps, seed=seed).run()
    kept = {k: result[k] for k in _KEPT}
    kept["per_step"] = [{k: r[k] for k in ("rollout_ranks", "actor_ranks", "ref_ranks")} for r in result["per_step"]]
    return kept


def _doc(args: argparse.Namespace, grid: list[PlanSetting], rows: list[PlanRow],
         best: PlanRecommendation | None) -> dict:
    return {
        "workload": args.workload, "cluster": args.cluster, "system": "tiderl", "steps": args.steps,
        "seeds": list(range(args.seeds)), "gpu_hour_price_usd": args.gpu_hour_price,
        "settings": [{"gpus": s.gpus, "groups": s.groups, "staleness": s.staleness} for s in grid],
        "rows": [r.to_json() for r in rows],
        "recommendation": best.to_json() if best else None,
    }


def _text(args: argparse.Namespace, workload: str, cluster: str, rows: list[PlanRow],
          best: PlanRecommendation | None) -> str:
    seeds = f"seeds 0-{args.seeds - 1}, means" if args.seeds > 1 else "seed 0"
    out = [f"tiderl plan: {workload} x {cluster} scaled by nodes; system tiderl, {args.steps} steps, {seeds}; "
           f"${args.gpu_hour_price:.2f} per GPU-hour",
           f"{'GPUs':>5} {'groups':>6} {'stale':>5} {'goodput tok/s':>13} {'tok/s/GPU':>9} {'split r/a/ref':>13} "
           f"{'binds (goodput/bound)':>24} {'$/M tokens':>10}  staleness in learning"]
    out.append("-" * len(out[-1]))
    for r in rows:
        s = r.setting
        split = "/".join(str(n) for n in r.split)
        share = f" ({r.bound_share:.2f})" if r.bound_share is not None else ""
        cost = f"{r.cost_per_mtok_usd:.3f}" if r.cost_per_mtok_usd is not None else "-"
        out.append(f"{s.gpus:>5} {s.groups:>6} {s.staleness:>5} {r.goodput_tok_s:>13,.0f} "
                   f"{r.goodput_per_gpu_tok_s:>9,.0f} {split:>13} {r.bound_term + share:>24} {cost:>10}  "
                   f"{r.staleness_learning}")
    out.append("")
    if best is None:
        out.append("recommendation: none (no setting trained a token)")
        return "\n".join(out)
    b = best.row
    out.append(f"recommendation: {b.setting.label}: {b.goodput_tok_s:,.0f} tok/s, ${b.cost_per_mtok_usd:.3f} per "
               f"million trained tokens, split {'/'.join(str(n) for n in b.split)}")
    out.append(f"  rule: {best.to_json()['rule']} ({best.eligible} of {len(rows)} settings reach "
               f"{best.goodput_floor:g} x {best.best_goodput_tok_s:,.0f} tok/s)")
    if best.note:
        out.append(f"  note: {best.note}")
    return "\n".join(out)
