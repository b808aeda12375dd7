"""Is learning the price of TideRL's speed? tiderl against sync on one job, seed by seed: evaluation per
version and per wall-clock second (issue 51, item 6).

    python tools/learning_vs_sync.py [--job jobs/quickstart.yaml] [--seeds 0,1,2] [--out DIR]
        [--model-cache DIR] [--set KEY=VALUE ...] [--tiderl-set KEY=VALUE ...]
        [--staleness advisor|job|N] [--advisor-workload FILE] [--reuse]
    python tools/learning_vs_sync.py --job jobs/quickstart-vision.yaml --staleness job --model-cache ~/.cache/tiderl

For every seed, `system=tiderl` runs, then `system=sync` (interleaved, so that a drift in the machine's load
falls on both alike), each as `tools/bench_learning.py` runs a seed (`bench_learning.run_seed`: `tiderl run JOB
--set seed=N ...`, the evaluations read from `tiderl status --json`), in DIR/tiderl/seed-N and DIR/sync/seed-N,
with one model cache for all runs (`--model-cache`, $TIDERL_CACHE of the runs: the model is looked up in
CACHE/models/; default DIR/model-cache, so the first run builds it). `--set` goes to both systems,
`--tiderl-set` to tiderl only. tiderl's staleness (`rollout.max_staleness`): `--staleness advisor` (the default)
takes the one `tiderl plan` recommends for the job (its simulator workload, `--advisor-workload`, default
jobs/sim/JOBSTEM.workload.yaml or the quickstart's hilo-bench.workload.yaml, with the job's own settings put in
as tools/plan_vs_real.py does, on jobs/sim/cpu.cluster.yaml, at the job's ranks and groups over staleness 0-3,
3 simulator seeds: seconds); `job` keeps the job's; a number sets it. sync trains on-policy whatever it is.
`--reuse` reads the runs already in DIR (each run's `seed-N.json` beside its run dir) instead of running them.

Per run, from its run store: when each version was published (`versions.created_at`), counted from the run's
creation (`runs.created_at`) and from the end of start-up, here the moment the last rank's first engine came up
(its first `engine_up` event: model load and engine start are over; a rank whose engine restarts later, or
which RA2P turns into a rollout rank later, does not move it), and when each evaluation's last task finished.

The comparisons, per seed (pure functions below, on plain dicts):

- Per version (`per_version`): at every version both runs evaluated, tiderl's greedy success rate against the
  95% Wilson interval of sync's (`tiderl.evalstats.wilson_interval`, the interval `tiderl status` prints).
  `within_interval_every_version`: tiderl's rate inside sync's interval at every one of them (the target's
  test); `not_below_interval_every_version`, beside it: nowhere under the interval's low end (a rate above the
  interval, e.g. 16/16 against sync's 15/16, whose interval ends at 0.989, is outside but is no price paid).
- Per wall-clock second (`per_second`), counted from the end of start-up (and, reported beside it, from the
  run's creation): (a) `faster_every_version`: tiderl published every version both evaluated, version 0
  apart (the base model, there before either trains), in fewer seconds than sync; (b) at each of sync's
  evaluated versions, at the second sync published it, tiderl's policy then (the latest version tiderl had
  published by that second and evaluated; version 0 from the start) is not behind sync's beyond noise
  (`not_behind`: the two-proportion z-test of `tiderl.evalstats.compare`, the end-of-run summary's test, does
  not find tiderl lower at 95%);
  `at_least` says where it is also >= sync's rate outright. `ahead_per_second` = (a) and (b) everywhere.
  A version counts by its publication: its evaluation measures the policy that existed from then on,
  whenever the evaluation itself ran.

Prints one JSON line: the overall verdicts `within_interval_every_version_every_seed` (with
`not_below_interval_every_version_every_seed` beside it) and `ahead_per_second_every_seed` (from the end of
start-up; `ahead_per_second_from_creation_every_seed` beside it), the job, the overrides, the staleness and
how it was chosen (the plan's rows where the advisor chose), and `seeds`: per seed both runs (wall time, model
build time, evaluations, load average before and after, start-up seconds, seconds to each evaluated version)
and both comparisons. Exit status 1 if a run failed.
Runs take minutes each on a CPU host: this is a benchmark, not a test (tests/test_learning_vs_sync.py tests
the comparisons).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from tiderl.evalstats import compare, wilson_interval  # noqa: E402

SYSTEMS = ("tiderl", "sync")
ADVISOR_STALENESS = (0, 1, 2, 3)
ADVISOR_SEEDS = 3
# Jobs whose simulator workload is not named after them (its header says whose shape it has).
ADVISOR_WORKLOADS = {"quickstart": "hilo-bench"}
EPS = 1e-9

Eval = dict[str, Any]  # {"version": int, "success_rate": float, "num_tasks": int}


# ---- the comparisons (pure) ---------------------------------------------------------------------------
def successes(e: Eval) -> int:
    return round(e["success_rate"] * e["num_tasks"])


def per_version(tiderl_evals: list[Eval], sync_evals: list[Eval]) -> dict[str, Any]:
    """tiderl's rate at every version both evaluated against sync's 95% Wilson interval there: `inside` it,
    `not_below` its low end (above it counts). Both verdicts are False where no version was evaluated by both."""
    sync = {e["version"]: e for e in sync_evals}
    rows = []
    for t in sorted(tiderl_evals, key=lambda e: e["version"]):
        s = sync.get(t["version"])
        if s is None:
            continue
        low, high = wilson_interval(successes(s), s["num_tasks"])
        rows.append({"version": t["version"], "tiderl": round(t["success_rate"], 4),
                     "sync": round(s["success_rate"], 4), "tasks": [t["num_tasks"], s["num_tasks"]],
                     "sync_ci95": [round(low, 4), round(high, 4)],
                     "inside": low - EPS <= t["success_rate"] <= high + EPS,
                     "not_below": t["success_rate"] >= low - EPS})
    return {"versions": rows, "within_interval_every_version": bool(rows) and all(r["inside"] for r in rows),
            "not_below_interval_every_version": bool(rows) and all(r["not_below"] for r in rows)}


def policy_at(evals: list[Eval], seconds: dict[int, float], t: float) -> Eval | None:
    """The evaluation of the latest version published by second `t` among the evaluated ones (None: none).
    Version 0, the base model, is there from the start whenever its row was written."""
    done = [e for e in evals if e["version"] == 0
            or (seconds.get(e["version"]) is not None and seconds[e["version"]] <= t + EPS)]
    return max(done, key=lambda e: e["version"]) if done else None


def per_second(tiderl: dict[str, Any], sync: dict[str, Any]) -> dict[str, Any]:
    """Each side: {"evals": [Eval], "seconds": {version: seconds to its publication}} (one origin for both).
    (a) tiderl reaches every version both evaluated (version 0 apart) in fewer seconds; (b) at the second sync
    published each version it evaluated, tiderl's latest evaluated policy is not lower beyond noise."""
    t_sec, s_sec = tiderl["seconds"], sync["seconds"]
    t_versions = {e["version"] for e in tiderl["evals"]}
    common = sorted(v for v in t_versions & {e["version"] for e in sync["evals"]}
                    if v >= 1 and t_sec.get(v) is not None and s_sec.get(v) is not None)
    faster = [{"version": v, "tiderl_s": round(t_sec[v], 1), "sync_s": round(s_sec[v], 1),
               "tiderl_over_sync": round(t_sec[v] / s_sec[v], 3) if s_sec[v] > 0 else None,
               "faster": t_sec[v] < s_sec[v]} for v in common]
    at_sync = []
    for s in sorted(sync["evals"], key=lambda e: e["version"]):
        at = s_sec.get(s["version"])
        if at is None:
            continue
        t = policy_at(tiderl["evals"], t_sec, at)
        row: dict[str, Any] = {"sync_version": s["version"], "at_s": round(at, 1), "sync": round(s["success_rate"], 4),
                               "tiderl_version": None, "tiderl": None, "z": None, "at_least": False,
                               "not_behind": False}
        if t is not None:
            c = compare(successes(s), s["num_tasks"], successes(t), t["num_tasks"])  # tiderl minus sync
            row |= {"tiderl_version": t["version"], "tiderl": round(t["success_rate"], 4), "z": round(c.z, 2),
                    "at_least": t["success_rate"] >= s["success_rate"] - EPS,
                    "not_behind": not (c.change < 0 and c.beyond_noise)}
        at_sync.append(row)
    faster_all = bool(faster) and all(r["faster"] for r in faster)
    not_behind_all = bool(at_sync) and all(r["not_behind"] for r in at_sync)
    return {"faster": faster, "at_sync_evaluations": at_sync, "faster_every_version": faster_all,
            "not_behind_at_every_sync_evaluation": not_behind_all,
            "at_least_at_every_sync_evaluation": bool(at_sync) and all(r["at_least"] for r in at_sync),
            "ahead_per_second": faster_all and not_behind_all}


def startup_end(created_at: float, engine_ups: list[tuple[int, float]]) -> float:
    """The end of start-up: the last rank's first `engine_up` ((rank, time) events); the run's creation without one."""
    first: dict[int, float] = {}
    for rank, ts in engine_ups:
        first[rank] = min(ts, first.get(rank, ts))
    return max(first.values(), default=created_at)


def timeline(created_at: float, published: dict[int, float], engine_ups: list[tuple[int, float]],
             eval_done: dict[int, float], versions: list[int]) -> dict[str, Any]:
    """Seconds to each of `versions` (publication) from the run's creation and from the end of start-up,
    and to each evaluation's end (from creation)."""
    end = startup_end(created_at, engine_ups)

    def since(origin: float, at: float | None) -> float | None:
        return None if at is None else round(at - origin, 2)

    return {"startup_s": round(end - created_at, 2),
            "from_creation_s": {v: since(created_at, published.get(v)) for v in versions},
            "from_startup_end_s": {v: since(end, published.get(v)) for v in versions},
            "eval_done_s": {v: since(created_at, eval_done.get(v)) for v in versions}}


def compare_seed(tiderl: dict[str, Any], sync: dict[str, Any]) -> dict[str, Any]:
    """One seed's comparisons; each side {"evals": [Eval], "timeline": timeline(...)}."""
    def side(run: dict[str, Any], key: str) -> dict[str, Any]:
        return {"evals": run["evals"], "seconds": run["timeline"][key]}

    by_startup = per_second(side(tiderl, "from_startup_end_s"), side(sync, "from_startup_end_s"))
    by_creation = per_second(side(tiderl, "from_creation_s"), side(sync, "from_creation_s"))
    return {"per_version": per_version(tiderl["evals"], sync["evals"]),
            "per_second": by_startup,
            "per_second_from_creation": by_creation}


def verdicts(seeds: list[dict[str, Any]]) -> dict[str, bool]:
    """The overall verdicts over the seeds' comparisons (False where a seed has none: a run failed)."""
    done: list[dict[str, Any]] = [s["comparison"] for s in seeds if s.get("comparison") is not None]
    ok = bool(seeds) and len(done) == len(seeds)
    return {
        "within_interval_every_version_every_seed":
            ok and all(c["per_version"]["within_interval_every_version"] for c in done),
        "not_below_interval_every_version_every_seed":
            ok and all(c["per_version"]["not_below_interval_every_version"] for c in done),
        "ahead_per_second_every_seed": ok and all(c["per_second"]["ahead_per_second"] for c in done),
        "ahead_per_second_from_creation_every_seed":
            ok and all(c["per_second_from_creation"]["ahead_per_second"] for c in done),
    }


# ---- reading a run ------------------------------------------------------------------------------------
def read_times(run_dir: Path) -> dict[str, Any]:
    """What the timeline needs from a finished run's store."""
    from sqlalchemy import func, select

    from tiderl.rundir import open_run
    from tiderl.store.schema import task_groups

    _, store = open_run(run_dir, read_only=True)
    try:
        created = store.run_info().created_at
        published = {int(r["version"]): float(r["created_at"]) for r in store.measure.version_rows()}
        ups = [(int(e["rank"]) if e["rank"] is not None else -1, float(e["ts"]))
               for e in store.recent_events(100_000, kinds=["engine_up"])]
        eval_done = store.tx.read(lambda c: {
            int(v): float(t) for v, t in c.execute(
                select(task_groups.c.eval_version, func.max(task_groups.c.completed_at))
                .where(task_groups.c.kind == "eval").group_by(task_groups.c.eval_version)) if t is not None})
    finally:
        store.close()
    return {"created_at": created, "published": published, "engine_ups": ups, "eval_done": eval_done}


def evals_of(result: dict[str, Any]) -> list[Eval]:
    return [{"version": v, "success_rate": r, "num_tasks": n} for v, r, n in result.get("evals", [])]


def run_pair(job: Path, seed: int, sets: dict[str, list[str]], out: Path, cache: Path, reuse: bool) -> dict[str, Any]:
    from bench_learning import run_seed

    runs: dict[str, Any] = {}
    for system in SYSTEMS:
        saved = out / system / f"seed-{seed}.json"
        if reuse and saved.is_file():
            result = json.loads(saved.read_text())
        else:
            (out / system).mkdir(parents=True, exist_ok=True)
            result = run_seed(job, seed, [f"system={system}", *sets[system]], out / system, cache)
            saved.write_text(json.dumps(result))
        if "error" not in result:
            evals = evals_of(result)
            times = read_times(Path(result["run_dir"]))
            result["timeline"] = timeline(times["created_at"], times["published"], times["engine_ups"],
                                          times["eval_done"], [e["version"] for e in evals])
            result["evals"] = evals
        runs[system] = result
        print(f"seed {seed} {system}: {json.dumps(result)}", file=sys.stderr, flush=True)
    doc: dict[str, Any] = {"seed": seed, **runs}
    if all("error" not in runs[s] for s in SYSTEMS):
        doc["comparison"] = compare_seed(runs["tiderl"], runs["sync"])
    return doc


# ---- tiderl's staleness -------------------------------------------------------------------------------
def advisor_workload(job: Path, given: Path | None) -> Path | None:
    if given is not None:
        return given
    sim = ROOT / "jobs" / "sim"
    for stem in (job.stem, ADVISOR_WORKLOADS.get(job.stem)):
        if stem and (sim / f"{stem}.workload.yaml").is_file():
            return sim / f"{stem}.workload.yaml"
    return None


def advised_staleness(job: Path, workload_file: Path, out: Path) -> dict[str, Any]:
    """`tiderl plan`'s recommended staleness for the job at its ranks and groups (its settings in the files)."""
    from tiderl.config import load_job
    from tiderl.config.schema import to_dict
    from tiderl.sim.from_job import job_settings

    config = to_dict(load_job(job))
    workload = yaml.safe_load(workload_file.read_text())
    cluster = yaml.safe_load((ROOT / "jobs" / "sim" / "cpu.cluster.yaml").read_text())
    cluster, workload, _, mismatch = job_settings(cluster, workload, config)
    out.mkdir(parents=True, exist_ok=True)
    wl, cl = out / f"{job.stem}.workload.yaml", out / f"{job.stem}.cluster.yaml"
    wl.write_text(yaml.safe_dump(workload, sort_keys=False))
    cl.write_text(yaml.safe_dump(cluster, sort_keys=False))
    groups = int(config["trainer"]["groups_ideal"])
    planned = subprocess.run([sys.executable, "-m", "tiderl", "plan", str(wl), str(cl),
                              "--gpus", str(config["launch"]["num_ranks"]), "--groups", str(groups),
                              "--staleness", ",".join(map(str, ADVISOR_STALENESS)), "--seeds", str(ADVISOR_SEEDS),
                              "--steps", str(config["trainer"]["num_steps"]), "--json"],
                             cwd=ROOT, capture_output=True, text=True)
    if planned.returncode != 0:
        raise RuntimeError(f"tiderl plan failed: {planned.stderr[-1500:]}")
    plan = json.loads(planned.stdout)
    rec = plan["recommendation"]
    return {"staleness": int(rec["staleness"]), "chosen_by": "advisor",
            "workload": str(workload_file.relative_to(ROOT) if workload_file.is_relative_to(ROOT) else workload_file),
            "groups": groups, "mismatch": mismatch,
            "plan": [{"staleness": r["staleness"], "goodput_tok_s": r["goodput_tok_s"]} for r in plan["rows"]],
            "rule": rec.get("rule")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=ROOT / "jobs" / "quickstart.yaml")
    parser.add_argument("--seeds", default="0,1,2", help="Comma-separated job seeds, run in this order.")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override passed to both systems' runs (repeatable).")
    parser.add_argument("--tiderl-set", dest="tiderl_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="Override passed to tiderl's runs only (repeatable).")
    parser.add_argument("--staleness", default="advisor",
                        help="tiderl's rollout.max_staleness: advisor (tiderl plan's recommendation), job, "
                             "or a number.")
    parser.add_argument("--advisor-workload", type=Path, default=None,
                        help="The simulator workload of the job for --staleness advisor.")
    parser.add_argument("--out", type=Path, default=None, help="Where the runs go (default: a temp dir).")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="$TIDERL_CACHE of the runs (models in DIR/models/; default OUT/model-cache).")
    parser.add_argument("--reuse", action="store_true", help="Read the runs already in --out instead of running them.")
    args = parser.parse_args(argv)
    from bench_learning import job_and_seeds

    job, seeds = job_and_seeds(parser, args)
    if any(o.split("=", 1)[0] == "system" for o in args.overrides + args.tiderl_overrides):
        parser.error("the systems are this tool's to set: no system= override")
    if args.reuse and args.out is None:
        parser.error("--reuse needs --out")
    out = (args.out or Path(tempfile.mkdtemp(prefix="tiderl-learning-vs-sync-"))).resolve()
    cache = (args.model_cache or out / "model-cache").expanduser().resolve()

    if args.staleness == "job":
        from tiderl.config import load_job

        staleness: dict[str, Any] = {"staleness": load_job(job).rollout.max_staleness, "chosen_by": "job"}
    elif args.staleness == "advisor":
        workload = advisor_workload(job, args.advisor_workload)
        if workload is None:
            parser.error(f"no simulator workload for {args.job} (jobs/sim/{job.stem}.workload.yaml): "
                         "give --advisor-workload, or --staleness job or a number")
        saved = out / "advisor.json"
        staleness = (json.loads(saved.read_text()) if args.reuse and saved.is_file()
                     else advised_staleness(job, workload, out / "advisor"))
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(staleness))
    else:
        try:
            staleness = {"staleness": int(args.staleness), "chosen_by": "given"}
        except ValueError:
            parser.error(f"--staleness: advisor, job or an integer, got {args.staleness!r}")
    print(f"tiderl's staleness: {json.dumps(staleness)}", file=sys.stderr, flush=True)
    sets = {"tiderl": [*args.overrides, f"rollout.max_staleness={staleness['staleness']}", *args.tiderl_overrides],
            "sync": list(args.overrides)}

    results = [run_pair(job, seed, sets, out, cache, args.reuse) for seed in seeds]
    print(json.dumps({
        **verdicts(results),
        "job": str(job.relative_to(ROOT) if job.is_relative_to(ROOT) else job),
        "overrides": sets,
        "tiderl_staleness": staleness,
        "out": str(out),
        "seeds": results,
    }))
    return 0 if all("comparison" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
