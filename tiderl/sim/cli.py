"""`tiderl sim WORKLOAD.yaml CLUSTER.yaml --system NAME|all`: the cluster-scale
simulator (docs/simulator.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import yaml

from tiderl.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="Workload file, first (e.g. jobs/sim/text-agentic.workload.yaml).")
    parser.add_argument("cluster", help="Cluster file, second (e.g. jobs/sim/h100x32.cluster.yaml).")
    parser.add_argument(
        "--system",
        default="tiderl",
        help="sync, async, stream, stream+ra2p, stream+ra2p+ers, tiderl, tiderl-noers, and run:sync, "
        "run:async, run:stream, run:tiderl (the `system:` values of `tiderl run`); NAME@F fixes the "
        "rollout fraction (NAME@F+refR: with R dedicated ref ranks, decoupled); `best-fixed` sweeps every "
        "fixed CTB+RA2P split the ranks allow, colocated and decoupled, and reports the best; `all` runs every "
        "system, the ablations and that sweep (default: tiderl).",
    )
    parser.add_argument("--steps", type=int, default=100, help="Training steps to simulate (default 100).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the task sampling (default 0).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of tables.")
    parser.add_argument("--plot", metavar="FILE.png", help="Draw goodput, RWT/TWT and the role timeline.")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="Simulations run in parallel (default: CPUs)."
    )


# Keys only one kind of file has: a file given in the other's place is named as such.
_CLUSTER_ONLY = ("num_gpus", "env_concurrency", "gpu", "efficiency", "measured")


def check_order(workload: str, cluster: str) -> None:
    """ConfigError when the workload argument is a cluster file (the two swapped, or two cluster files)."""
    try:
        data = yaml.safe_load(open(workload).read())
    except (OSError, yaml.YAMLError):
        return  # the loader names a missing or broken file
    if isinstance(data, dict) and any(key in data for key in _CLUSTER_ONLY):
        raise ConfigError(workload, "", f"this is a cluster file (it has {next(k for k in _CLUSTER_ONLY if k in data)}), "
                          "given as the first argument, the workload; usage: tiderl sim WORKLOAD.yaml CLUSTER.yaml "
                          f"(here: tiderl sim {cluster} {workload}?)")


class SimProgress:
    """Signs of life on stderr: a line per finished simulation, and one every `every_s` seconds without one."""

    def __init__(self, out: TextIO | None = None, every_s: float = 10.0, command: str = "tiderl sim") -> None:
        self.out = out if out is not None else sys.stderr  # the stream of now, not of the import
        self.command = command
        self.every_s = every_s
        self.started = self.last = time.monotonic()
        self.finished, self.total = 0, 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _line(self, text: str) -> None:
        with self.lock:
            self.last = time.monotonic()
            print(f"{self.command}: {text}, {self.last - self.started:.0f} s", file=self.out, flush=True)

    def _beat(self) -> None:
        while not self.stop.wait(1.0):
            if time.monotonic() - self.last >= self.every_s:
                done = f"{self.finished}/{self.total}" if self.total else str(self.finished)
                self._line(f"simulating ({done} simulations done)")

    def done(self, count: int, total: int, result: dict) -> None:
        self.finished, self.total = count, total
        self._line(f"{count}/{total} simulations done ({result.get('system', '?')})")
        if count == total:
            self.stop.set()


def run(args: argparse.Namespace) -> int:
    from tiderl.sim.spec import load_cluster, load_workload

    if args.steps < 1:
        print("tiderl sim: --steps must be >= 1", file=sys.stderr)
        return 2
    check_order(args.workload, args.cluster)
    load_workload(args.workload)  # fail early, with the file and key, on a bad file
    cluster = load_cluster(args.cluster)
    fractions = cluster.training.rollout_fraction_sweep
    progress = SimProgress()
    try:
        return _simulate(args, cluster, fractions, progress)
    finally:
        progress.stop.set()  # no sign of life after the answer (or an early return, or an error)


def _simulate(args: argparse.Namespace, cluster: Any, fractions: Any, progress: SimProgress) -> int:
    from tiderl.sim import report
    from tiderl.sim.systems import SimSystemError, parse_system

    default = cluster.training.default_rollout_fraction

    if args.system == "best-fixed":
        results = report.run_many(args.workload, args.cluster, report.fixed_partitions(cluster), args.steps,
                                  args.seed, args.jobs, progress.done)
        best = report.best_fixed(results)
        return _emit(args, results, best,
                     lambda: report.format_table(results) + "\n\n" + "\n".join(report.format_best_fixed(best)))

    if args.system == "all":
        systems = report.all_systems(default, fractions, report.fixed_partitions(cluster))
        results = report.run_many(args.workload, args.cluster, systems, args.steps, args.seed, args.jobs,
                                  progress.done)
        out = report.compare(results, default)
        return _emit(args, results, out, lambda: report.format_report(out))

    try:
        system = parse_system(args.system)
    except SimSystemError as e:
        print(f"tiderl sim: {e}", file=sys.stderr)
        return 2
    runs = report.expand(report.at_default_fraction(system, default), fractions)
    results = report.run_many(args.workload, args.cluster, runs, args.steps, args.seed, args.jobs, progress.done)
    result = report.best_of(results) if len(results) > 1 else results[0]
    best = f"\nbest: {result['system']}" if len(results) > 1 else ""
    return _emit(args, results, result, lambda: report.format_table(results) + best)


def _emit(args: argparse.Namespace, results: list[dict], doc: dict, text: Callable[[], str]) -> int:
    """Plot if asked, then print `doc` as JSON or the text report."""
    from tiderl.sim import report

    if args.plot:
        report.plot(results, args.plot)
    print(json.dumps(doc) if args.json else text())
    return 0
