"""The simulator against the real job: simulate each system `tools/bench_systems.py` ran and
print the error per system.

    python tools/sim_vs_real.py BENCH.json [--workload jobs/sim/hilo-bench.workload.yaml]
        [--cluster jobs/sim/cpu.cluster.yaml] [--seed 0] [--json]

BENCH.json is the JSON line `tools/bench_systems.py` prints (one object per system, each with
`run_dir`). Each real `system:` is simulated as `run:NAME` (tiderl/sim/systems.py) with the run's
`rollout.scheduler`, for as many steps as the run published. Figures compared, each the same
quantity on both sides:
- steady goodput: generated tokens trained by versions 2..N per second between the publication of
  version 1 and of version N (bench_systems' `steady_goodput_tok_s`: start-up left out);
- mean step time: seconds between two publications, versions 2..N;
- RWT and TWT per step, rank-seconds, versions 2..N (real: the store's per-version `rwt_s` and
  `twt_s` metrics; simulated: the per-step records).
The error is (simulated - measured) / measured; `over_threshold` lists what is off by more than 25%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
THRESHOLD = 0.25
FIGURES = ("steady_goodput_tok_s", "step_s", "rwt_s_per_step", "twt_s_per_step")


def rel_error(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or measured is None or measured == 0:
        return None
    return (simulated - measured) / measured


def steady_from_steps(rows: list[dict]) -> dict:
    """Steady figures from per-step rows in publication order, each with `end_s` (publication time),
    `gen_tokens`, `rwt_s` and `twt_s`: the first row (version 1) only marks the start."""
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
    return [{"end_s": r.created_at, "gen_tokens": r.consumed_tokens,
             "rwt_s": sums.get(("rwt_s", r.version - 1)), "twt_s": sums.get(("twt_s", r.version - 1))}
            for r in rows]


def simulate(system: str, scheduler: str, workload: Path, cluster: Path, steps: int, seed: int) -> dict:
    from tiderl.sim.simulator import Simulation
    from tiderl.sim.spec import load_cluster, load_workload
    from tiderl.sim.systems import parse_system, with_scheduler

    cl = load_cluster(cluster)
    sim_system = with_scheduler(parse_system(f"run:{system}"), scheduler)
    result = Simulation(load_workload(workload), cl, sim_system, steps=steps, seed=seed,
                        rollout_fraction=cl.training.default_rollout_fraction).run()
    return result


def sim_steps(result: dict) -> list[dict]:
    return [{"end_s": r["end_s"], "gen_tokens": r["consumed_gen_tokens"], "rwt_s": r.get("rwt_gpu_s"),
             "twt_s": r["twt_gpu_s"]} for r in result["per_step"]]


def main(argv: list[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", type=Path, help="The JSON line tools/bench_systems.py printed, in a file.")
    parser.add_argument("--workload", type=Path, default=ROOT / "jobs" / "sim" / "hilo-bench.workload.yaml")
    parser.add_argument("--cluster", type=Path, default=ROOT / "jobs" / "sim" / "cpu.cluster.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    bench = json.loads(args.bench.read_text().strip().splitlines()[-1])
    measured, simulated, raw = {}, {}, {}
    for name, run in bench.items():
        if "error" in run:
            continue
        run_dir = Path(run["run_dir"])
        measured[name] = steady_from_steps(real_steps(run_dir))
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        result = simulate(name, config["rollout"]["scheduler"], args.workload, args.cluster, run["steps"],
                          args.seed)
        simulated[name] = steady_from_steps(sim_steps(result))
        raw[name] = {k: result[k] for k in ("goodput_gen_tok_s", "rwt_s", "twt_s", "kv_hit_rate", "gpu_s",
                                            "ra2p", "roles_timeline")}
    out = compare(measured, simulated)
    out["simulated_runs"] = raw
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'system':8} {'figure':22} {'measured':>10} {'simulated':>10} {'error':>8}")
    for name, row in out["systems"].items():
        for fig, v in row.items():
            m, s, e = v["measured"], v["simulated"], v["error"]
            print(f"{name:8} {fig:22} {m if m is None else round(m, 2)!s:>10} "
                  f"{s if s is None else round(s, 2)!s:>10} {'-' if e is None else f'{e:+.0%}':>8}")
    print("over 25%:", ", ".join(out["over_threshold"]) or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
