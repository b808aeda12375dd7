"""The simulator against the real job: simulate each system `tools/bench_systems.py` ran and
print the error per system.

    python tools/sim_vs_real.py BENCH.json [--job JOB.yaml] [--workload jobs/sim/hilo-bench.workload.yaml]
        [--cluster jobs/sim/cpu.cluster.yaml] [--seed 0] [--json]

BENCH.json is the JSON line `tools/bench_systems.py` prints (one object per system, each with
`run_dir`). Each real `system:` is simulated as `run:NAME` (tiderl/sim/systems.py) with the run's
`rollout.scheduler`, for as many steps as the run published.

Without --job the workload and cluster files are simulated as they are (their defaults describe
the quickstart benchmark of docs/simulator.md: 3 ranks, 2 groups a step). With --job JOB.yaml (the
job bench_systems ran with --job) the workload defaults to jobs/sim/JOBSTEM.workload.yaml, and the
settings both files take from the job ([J] in them) are replaced by each run's resolved config
(RUN_DIR/config.yaml, so --set overrides count): ranks, rollout split, tasks per rollout rank,
micro-batch tokens, staleness, B_min/B_ideal, actor ranks, report interval and the `ers:` section
for the cluster; group size, groups a step, evaluations and the context limit for the workload.
The measured costs stay the calibration file's. Every value replaced is listed in `job_settings` (tiderl.sim.from_job);
a task type whose turn limit exceeds the run's `env.max_turns` is reported in `job_mismatch` (not
replaced: the turn statistics belong to that limit; a lower limit is the environment's own end of
its episodes, hilo's 6 turns under an agent loop's 8).
Figures compared, each the same quantity on both sides (and, beside them, the training groups each side
dropped as older than the staleness bound over the whole run):
- steady goodput: generated tokens trained by versions S+1..N per second between the publication of
  version S and of version N, S the run's `steady_from_version` in BENCH.json (bench_systems'
  `steady_goodput_tok_s`: start-up left out; 1 where the file has none), on both sides;
- mean step time: seconds between two publications, versions S+1..N;
- RWT and TWT per step, rank-seconds, versions S+1..N (real: the store's per-version `rwt_s` and
  `twt_s` metrics; simulated: the per-step records).
The error is (simulated - measured) / measured; `over_threshold` lists what is off by more than 25%.
Beside them, `group_holding`: where the training groups created from the publication of version S on
(the steady window's; one created during the start-up waits for the engines) spent their time in flight,
means per group on both sides (the simulator's `group_holding`, docs/simulator.md): from their creation to
their completion (`release_to_seen_s`; real: the report of its last task), until a trainer step claimed
them (`seen_to_claim_s`; real: its first trajectory's claim, so the trainer's poll counts here, in the
simulator in the part before) and until that step published (`claim_to_publish_s`). It shows which part
of a group's life the simulator gets wrong where a figure is off.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tiderl.sim.from_job import job_settings  # noqa: E402

THRESHOLD = 0.25
FIGURES = ("steady_goodput_tok_s", "step_s", "rwt_s_per_step", "twt_s_per_step")


def rel_error(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or measured is None or measured == 0:
        return None
    return (simulated - measured) / measured


def steady_from_steps(rows: list[dict], from_version: int = 1) -> dict:
    """Steady figures from per-step rows in publication order, each with `end_s` (publication time),
    `gen_tokens`, `rwt_s` and `twt_s` (and `version`, the version it published: rows before
    `from_version` are left out): the first row kept (version `from_version`) only marks the start."""
    rows = [r for r in rows if r.get("version", from_version) >= from_version]
    if len(rows) < 2 or rows[-1]["end_s"] <= rows[0]["end_s"]:
        return dict.fromkeys(FIGURES)
    later = rows[1:]
    span = rows[-1]["end_s"] - rows[0]["end_s"]

    def per_step(key: str) -> float | None:
        values = [r[key] for r in later if r.get(key) is not None]
        return sum(values) / len(later) if values else None

    return {
        "steady_goodput_tok_s": sum(r["gen_tokens"] for r in later) / span,
        "step_s": span / len(later),
        "rwt_s_per_step": per_step("rwt_s"),
        "twt_s_per_step": per_step("twt_s"),
    }


def compare(measured: dict[str, dict], simulated: dict[str, dict], threshold: float = THRESHOLD) -> dict:
    """Per system present on both sides: each figure measured, simulated and the relative error."""
    out: dict = {"systems": {}, "over_threshold": []}
    for name, real in measured.items():
        sim = simulated.get(name)
        if sim is None:
            continue
        row = {}
        for fig in FIGURES:
            err = rel_error(sim.get(fig), real.get(fig))
            row[fig] = {"measured": real.get(fig), "simulated": sim.get(fig),
                        "error": round(err, 3) if err is not None else None}
            if err is not None and abs(err) > threshold:
                out["over_threshold"].append(f"{name}.{fig}")
        out["systems"][name] = row
    return out


# ---- the two sides --------------------------------------------------------------------------------
def real_steps(run_dir: Path) -> list[dict]:
    """Per published version >= 1: publication time, generated tokens trained, RWT and TWT metrics."""
    from sqlalchemy import select

    from tiderl.store import RunStore
    from tiderl.store.schema import metrics, versions

    store = RunStore.for_run_dir(run_dir)
    try:
        rows = store.tx.read(lambda c: c.execute(
            select(versions.c.version, versions.c.created_at, versions.c.consumed_tokens)
            .where(versions.c.version >= 1).order_by(versions.c.version)).all())
        points = store.tx.read(lambda c: c.execute(
            select(metrics.c.name, metrics.c.version, metrics.c.value)
            .where(metrics.c.name.in_(("rwt_s", "twt_s")))).all())
    finally:
        store.close()
    sums: dict[tuple[str, int], float] = {}
    for p in points:
        sums[(p.name, p.version)] = sums.get((p.name, p.version), 0.0) + float(p.value)
    # A metric of version v is recorded while version v's weights roll out / the step to v+1 trains.
    return [{"version": r.version, "end_s": r.created_at, "gen_tokens": r.consumed_tokens,
             "rwt_s": sums.get(("rwt_s", r.version - 1)), "twt_s": sums.get(("twt_s", r.version - 1))}
            for r in rows]


def real_group_holding(run_dir: Path, from_version: int = 1) -> dict:
    """The real run's `group_holding` (RunReader.group_holding): the trained groups created at the
    publication of `from_version` or later (the steady window: one created during the start-up waits
    for the engines to start)."""
    from tiderl.store import RunStore

    store = RunStore.for_run_dir(run_dir)
    try:
        return store.reader.group_holding(from_version)
    finally:
        store.close()


HOLDING = ("release_to_seen_s", "seen_to_claim_s", "claim_to_publish_s")


def real_stale_drops(run_dir: Path) -> int:
    """Training groups of the real run dropped as older than the staleness bound: by its trainer at the
    claim or by its control plane while still open (generation that was never trained)."""
    from tiderl.store import RunStore

    store = RunStore.for_run_dir(run_dir)
    try:
        return len(store.measure.dropped_groups())
    finally:
        store.close()


def simulate(system: str, scheduler: str, workload, cluster, steps: int, seed: int, from_version: int = 1) -> dict:
    """One simulated run of `run:SYSTEM`; `workload` and `cluster` are loaded specs or file paths.
    `steady_group_holding`: the groups released from the publication of `from_version` on."""
    from tiderl.sim.metrics import group_holding
    from tiderl.sim.simulator import Simulation
    from tiderl.sim.spec import load_cluster, load_workload
    from tiderl.sim.systems import parse_system, with_scheduler

    cl = load_cluster(cluster) if isinstance(cluster, (str, Path)) else cluster
    wl = load_workload(workload) if isinstance(workload, (str, Path)) else workload
    sim_system = with_scheduler(parse_system(f"run:{system}"), scheduler)
    sim = Simulation(wl, cl, sim_system, steps=steps, seed=seed, rollout_fraction=cl.training.default_rollout_fraction)
    result = sim.run()
    # The groups released from the publication of `from_version` on, as real_group_holding reads them (a
    # step record trains from its version and publishes the next).
    start = next((r.end_s for r in sim.records if r.version + 1 >= from_version), math.inf)
    result["steady_group_holding"] = group_holding(sim, start)
    return result


def sim_steps(result: dict) -> list[dict]:
    # A simulated step trains from `version` and publishes version + 1.
    return [{"version": r["version"] + 1, "end_s": r["end_s"], "gen_tokens": r["consumed_gen_tokens"],
             "rwt_s": r.get("rwt_gpu_s"),
             "twt_s": r["twt_gpu_s"]} for r in result["per_step"]]


def main(argv: list[str] | None = None) -> int:
    import yaml

    from tiderl.config.schema import build
    from tiderl.sim.spec import ClusterSpec, WorkloadSpec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", type=Path, help="The JSON line tools/bench_systems.py printed, in a file.")
    parser.add_argument("--job", type=Path, default=None,
                        help="The job bench_systems ran (its --job): the workload defaults to "
                             "jobs/sim/JOBSTEM.workload.yaml and the job's settings in both files come "
                             "from each run's resolved config.")
    parser.add_argument("--workload", type=Path, default=None,
                        help="Simulator workload (default: jobs/sim/hilo-bench.workload.yaml, or with --job "
                             "jobs/sim/JOBSTEM.workload.yaml).")
    parser.add_argument("--cluster", type=Path, default=ROOT / "jobs" / "sim" / "cpu.cluster.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.workload is None:
        args.workload = (ROOT / "jobs" / "sim" / f"{args.job.stem}.workload.yaml" if args.job is not None
                         else ROOT / "jobs" / "sim" / "hilo-bench.workload.yaml")
    if not args.workload.exists():
        parser.error(f"no workload file {args.workload}" + (" (the job's default; pass --workload)" if args.job else ""))
    bench = json.loads(args.bench.read_text().strip().splitlines()[-1])
    cluster_doc = yaml.safe_load(args.cluster.read_text())
    workload_doc = yaml.safe_load(args.workload.read_text())
    measured, simulated, raw, settings, mismatches, drops, holding = {}, {}, {}, {}, set(), {}, {}
    for name, run in bench.items():
        if not isinstance(run, dict) or "error" in run or "run_dir" not in run:
            continue
        run_dir = Path(run["run_dir"])
        # The bench's steady window (from the first version published once every engine was up) on both
        # sides: the simulator starts its engines at once, so its own window would start at version 1.
        from_version = int(run.get("steady_from_version", 1))
        measured[name] = steady_from_steps(real_steps(run_dir), from_version)
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        if args.job is not None:
            cl_doc, wl_doc, changed, mismatch = job_settings(cluster_doc, workload_doc, config)
            settings[name] = changed
            mismatches.update(mismatch)
            cluster = build(ClusterSpec, cl_doc, f"{args.cluster} with {run_dir / 'config.yaml'}")
            workload = build(WorkloadSpec, wl_doc, f"{args.workload} with {run_dir / 'config.yaml'}")
        else:
            cluster, workload = args.cluster, args.workload
        result = simulate(name, config["rollout"]["scheduler"], workload, cluster, run["steps"], args.seed,
                          from_version)
        simulated[name] = steady_from_steps(sim_steps(result), from_version)
        raw[name] = {k: result[k] for k in ("goodput_gen_tok_s", "rwt_s", "twt_s", "kv_hit_rate", "gpu_s",
                                            "ra2p", "roles_timeline", "stale_dropped_groups")}
        drops[name] = {"measured": real_stale_drops(run_dir), "simulated": result["stale_dropped_groups"]}
        real_held, sim_held = real_group_holding(run_dir, from_version), result["steady_group_holding"]
        holding[name] = {}
        for part in HOLDING:
            err = rel_error(sim_held[part], real_held[part])
            holding[name][part] = {"measured": real_held[part], "simulated": sim_held[part],
                                   "error": None if err is None else round(err, 3)}
    out = compare(measured, simulated)
    out["stale_dropped_groups"] = drops
    out["group_holding"] = holding
    out["workload"], out["cluster"] = str(args.workload), str(args.cluster)
    if args.job is not None:
        out["job"] = str(args.job)
        out["job_settings"] = settings
        out["job_mismatch"] = sorted(mismatches)
    out["simulated_runs"] = raw
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"workload {args.workload}, cluster {args.cluster}" + (f", job settings from the runs of {args.job}"
                                                                  if args.job else ""))
    for name, changed in settings.items():
        if changed:
            print(f"  {name}: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
    for line in sorted(mismatches):
        print(f"  mismatch (kept): {line}")
    print(f"{'system':8} {'figure':22} {'measured':>10} {'simulated':>10} {'error':>8}")
    for name, row in out["systems"].items():
        for fig, v in row.items():
            m, s, e = v["measured"], v["simulated"], v["error"]
            print(f"{name:8} {fig:22} {m if m is None else round(m, 2)!s:>10} "
                  f"{s if s is None else round(s, 2)!s:>10} {'-' if e is None else f'{e:+.0%}':>8}")
    print("training groups dropped as stale (whole run), measured / simulated: " + ", ".join(
        f"{name} {d['measured']} / {d['simulated']}" for name, d in drops.items()))
    print("a steady training group's time in flight, seconds, measured / simulated:")
    for name, parts in holding.items():
        print(f"  {name:8} " + ", ".join(f"{part[:-2]} {v['measured']} / {v['simulated']}"
                                         for part, v in parts.items()))
    print("over 25%:", ", ".join(out["over_threshold"]) or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
