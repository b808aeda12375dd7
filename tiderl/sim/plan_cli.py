"""`tiderl plan WORKLOAD.yaml CLUSTER.yaml --gpus 8,16,32`: the operating point (GPUs, groups per step,
staleness) a workload is cheapest at, predicted by the simulator (docs/simulator.md, "Choosing the
operating point"). The rules are `tiderl.sim.advisor`'s; this module runs and prints. `advise_job` is the
plan around one job that `tiderl submit --dry-run --advise WORKLOAD CLUSTER` prints (`advice_lines`)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

from tiderl.config import ConfigError

if TYPE_CHECKING:
    from tiderl.config import JobConfig
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
    rows, best = plan(args.workload, args.cluster, grid, seeds=args.seeds, steps=args.steps, jobs=args.jobs,
                      price=args.gpu_hour_price, floor=args.goodput_floor)
    if args.json:
        print(json.dumps(_doc(args, grid, rows, best)))
    else:
        print(text(workload.name, cluster.name, rows, best, steps=args.steps, seeds=args.seeds,
                   price=args.gpu_hour_price))
    return 0


def plan(workload: str, cluster: str, grid: list[PlanSetting], *, seeds: int = 1, steps: int = DEFAULT_STEPS,
         jobs: int = 1, price: float = DEFAULT_PRICE_USD, floor: float = DEFAULT_FLOOR,
         command: str = "tiderl plan") -> tuple[list[PlanRow], PlanRecommendation | None]:
    """Simulate every setting of `grid` (the workload and cluster files, checked before) over `seeds`, `jobs`
    worker processes at a time (progress on stderr, as `command`): its rows and the recommendation."""
    from tiderl.sim import advisor

    work = [(i, seed) for i in range(len(grid)) for seed in range(seeds)]
    results = _simulate_all(workload, cluster, grid, work, seeds=seeds, steps=steps, jobs=jobs, command=command)
    rows = [advisor.make_row(s, results[i], price) for i, s in enumerate(grid)]
    return rows, advisor.recommend(rows, floor)


def _simulate_all(workload: str, cluster: str, grid: list[PlanSetting], work: list[tuple[int, int]], *, seeds: int,
                  steps: int, jobs: int, command: str) -> list[list[dict]]:
    """Every (setting, seed) of `work`, `jobs` worker processes at a time: per setting, its results
    in seed order. A line on stderr per finished simulation (`tiderl sim`'s progress)."""
    from tiderl.sim.cli import SimProgress

    results: list[list[dict | None]] = [[None] * seeds for _ in grid]
    calls = [(workload, cluster, grid[i], steps, seed) for i, seed in work]

    def record(progress: SimProgress, count: int, key: tuple[int, int], result: dict) -> None:
        i, seed = key
        results[i][seed] = result
        label = grid[i].label + (f", seed {seed}" if seeds > 1 else "")
        progress.done(count, len(work), {"system": f"{label}: {result['goodput_tok_s']:,.0f} tok/s"})

    if jobs <= 1 or len(work) == 1:
        progress = SimProgress(command=command)
        try:
            for count, (key, call) in enumerate(zip(work, calls), 1):
                record(progress, count, key, simulate_setting(*call))
        finally:
            progress.stop.set()
        return results  # type: ignore[return-value]
    # Forked as `tiderl sim`'s pool is (spawn would re-run `python -m tiderl` in each worker). With fork
    # the pool starts all its workers at the first submit, so they are forked before the progress
    # thread exists and inherit none of its state.
    with ProcessPoolExecutor(min(jobs, len(work)), mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(simulate_setting, *call): key for key, call in zip(work, calls)}
        progress = SimProgress(command=command)
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


def text(workload: str, cluster: str, rows: list[PlanRow], best: PlanRecommendation | None, *, steps: int,
         seeds: int, price: float) -> str:
    """The plan as `tiderl plan` prints it: a row per setting, then the recommendation."""
    seeds_text = f"seeds 0-{seeds - 1}, means" if seeds > 1 else "seed 0"
    out = [f"tiderl plan: {workload} x {cluster} scaled by nodes; system tiderl, {steps} steps, {seeds_text}; "
           f"${price:.2f} per GPU-hour",
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


def advise_job(config: JobConfig, workload_path: str, cluster_path: str, *, jobs: int = 1,
               price: float = DEFAULT_PRICE_USD, floor: float = DEFAULT_FLOOR) -> dict:
    """`tiderl submit --dry-run --advise`: the job's operating point and its neighbours (`from_job.job_grid`),
    simulated on the workload and cluster files with the job's settings in them (`from_job.job_settings`), for
    the job's steps (at most DEFAULT_STEPS), seed 0. Returns the plan's JSON document with `job` (the job's own
    row) and `overrides` (the `--set`s that run the job at the recommendation; empty: it is the job's own).
    Raises ConfigError for a file that does not load or a swapped pair."""
    import tempfile

    import yaml

    from tiderl.config.schema import to_dict
    from tiderl.sim.cli import check_order
    from tiderl.sim.from_job import job_grid, job_overrides, job_setting, job_settings
    from tiderl.sim.spec import load_cluster, load_workload

    check_order(workload_path, cluster_path)
    load_workload(workload_path)  # a broken file is named as it is given
    load_cluster(cluster_path)
    doc = to_dict(config)
    with open(workload_path) as f:
        workload_doc = yaml.safe_load(f)
    with open(cluster_path) as f:
        cluster_doc = yaml.safe_load(f)
    cluster_doc, workload_doc, changed, mismatch = job_settings(cluster_doc, workload_doc, doc)
    steps = min(int(doc["trainer"]["num_steps"]), DEFAULT_STEPS)
    with tempfile.TemporaryDirectory(prefix="tiderl-advise-") as tmp:
        paths = f"{tmp}/workload.yaml", f"{tmp}/cluster.yaml"
        for path, data in zip(paths, (workload_doc, cluster_doc)):
            with open(path, "w") as f:
                yaml.safe_dump(data, f, sort_keys=False)
        try:
            cluster = load_cluster(paths[1])
            load_workload(paths[0])
        except ConfigError as e:
            raise ConfigError(cluster_path, "", f"with the job's settings in it: {e}") from e
        gpus, groups, staleness = job_grid(doc, cluster)
        from tiderl.sim import advisor

        grid = advisor.settings(gpus, groups, staleness)
        rows, best = plan(paths[0], paths[1], grid, steps=steps, jobs=jobs, price=price, floor=floor,
                          command="tiderl submit --advise")
    own = job_setting(doc)
    job_row = next(r for r in rows if r.setting == own)
    return {
        "workload": workload_path, "cluster": cluster_path, "system": "tiderl", "steps": steps, "seeds": [0],
        "gpu_hour_price_usd": price, "job_settings": changed, "job_mismatch": mismatch,
        "rows": [r.to_json() for r in rows],
        "job": job_row.to_json(),
        "recommendation": best.to_json() if best else None,
        "overrides": job_overrides(doc, best.row.setting) if best else [],
        "text": text(f"{workload_path} (with this job's settings)", cluster_path, rows, best, steps=steps, seeds=1,
                     price=price),
    }


def advice_lines(advice: dict, job_path: str, overrides: Sequence[str] = ()) -> str:
    """The advice as comment lines after `tiderl submit --dry-run`'s script: the plan, the job's own row, and the
    command that runs the job at the recommendation (after the job's own `overrides`, which the advice's follow)."""
    out = ["", "# Advice: the job's operating point and its neighbours in the simulator (tiderl plan)"]
    out += [f"# {line}".rstrip() for line in advice["text"].splitlines()]
    job = advice["job"]
    out.append(f"# this job as written: {job['gpus']} GPUs, {job['groups']} groups, staleness {job['staleness']}: "
               f"{job['goodput_tok_s']:,.0f} tok/s predicted")
    rec = advice["recommendation"]
    if rec is None:
        out.append("# no advice: no setting trained a token in the simulator")
    elif not advice["overrides"]:
        out.append("# the recommendation is the job as written")
    else:
        ratio = rec["goodput_tok_s"] / job["goodput_tok_s"] if job["goodput_tok_s"] > 0 else float("inf")
        command = shlex.join(["tiderl", "submit", job_path,
                              *(a for s in [*overrides, *advice["overrides"]] for a in ("--set", s))])
        out.append(f"# to run at the recommendation ({ratio:.2f}x this job's predicted goodput): {command}")
    for m in advice["job_mismatch"]:
        out.append(f"# note: {m} (the workload's turn statistics are for its own limit)")
    return "\n".join(out) + "\n"
