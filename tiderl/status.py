"""`tiderl status RUN_DIR [--json]`: run state, version, ranks and roles, buffer, goodput."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

STEP_KEYS = ("version", "success_rate", "reward_mean", "consumed_tokens", "duration_s", "goodput_tok_s",
             "ras", "tprm_s", "ra2p_mode", "max_staleness")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="Run directory (holds run.db).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of tables.")


def collect(store: Any) -> dict[str, Any]:
    """The status document of a run (what --json prints)."""
    from sqlalchemy import func, select

    from tiderl.store.schema import metrics

    info = store.run_info()
    steps = store.steps()
    end = info["finished_at"] or time.time()
    elapsed_s = max(end - info["created_at"], 1e-9)
    consumed = sum(s["consumed_tokens"] or 0 for s in steps)

    def waits(c: Any) -> dict[str, float]:
        q = select(metrics.c.name, func.sum(metrics.c.value)).where(metrics.c.name.in_(["rwt_s", "twt_s"]))
        return {name: float(v) for name, v in c.execute(q.group_by(metrics.c.name))}

    wait = store.tx.read(waits)
    return {
        "name": info["name"],
        "system": info["system"],
        "state": info["state"],
        "message": info["message"],
        "version": info["version"],
        "elapsed_s": round(elapsed_s, 3),
        "consumed_tokens": consumed,
        "goodput_tok_s": consumed / elapsed_s,
        "rwt_s": wait.get("rwt_s", 0.0),
        "twt_s": wait.get("twt_s", 0.0),
        "ranks": [{"rank": r["rank"], "role": r["role"], "state": r["state"], "version": r["version"],
                   "planned_role": r["planned_role"], "heartbeat_age_s": r["heartbeat_age_s"]}
                  for r in store.view("rank_roles")],
        "buffer": store.buffer_state(),
        "steps": [{k: s.get(k) for k in STEP_KEYS} | {"eval": False} for s in steps],
        "eval": [e | {"eval": True} for e in store.view("eval_summary")],
    }


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"run {doc['name']} ({doc['system']}): {doc['state']}" + (f" - {doc['message']}" if doc["message"] else ""),
        f"version {doc['version']}  elapsed {doc['elapsed_s']:.0f} s  consumed {doc['consumed_tokens']} tokens  "
        f"goodput {doc['goodput_tok_s']:.1f} tok/s  RWT {doc['rwt_s']:.1f} s  TWT {doc['twt_s']:.1f} s",
        "",
        "rank  role     state     version  heartbeat_age_s  planned",
    ]
    for r in doc["ranks"]:
        age = r["heartbeat_age_s"]
        lines.append(f"{r['rank']:>4}  {r['role']:<7}  {r['state']:<8}  {r['version']:>7}  "
                     f"{age if age is None else round(age, 1)!s:>15}  {r['planned_role'] or '-'}")
    b = doc["buffer"]
    lines += ["", "buffer: tasks pending {tasks_pending}, running {tasks_running}, done {tasks_done}, failed "
              "{tasks_failed}; trajectories waiting-for-group {traj_waiting_group}, ready {traj_ready} "
              "({ready_tokens} tokens), claimed {traj_claimed}, consumed {traj_consumed}".format(**b)]
    if doc["steps"]:
        lines += ["", "version  success  reward  tokens  step_s  tok/s    RAS  TPRM_s  mode"]
        for s in doc["steps"][-10:]:
            lines.append(f"{s['version']:>7}  {_f(s['success_rate'], 2):>7}  {_f(s['reward_mean'], 2):>6}  "
                         f"{s['consumed_tokens']:>6}  {_f(s['duration_s'], 1):>6}  {_f(s['goodput_tok_s'], 0):>5}  "
                         f"{s['ras'] if s['ras'] is not None else '-':>5}  {_f(s['tprm_s'], 2):>6}  "
                         f"{s['ra2p_mode'] or '-'}")
    for e in doc["eval"]:
        lines.append(f"eval @ version {e['eval_version']}: success {_f(e['success_rate'], 2)} over "
                     f"{e['num_tasks']} tasks")
    return "\n".join(lines)


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run(args: argparse.Namespace) -> int:
    from tiderl.rundir import RunDirError, open_run

    try:
        _, store = open_run(args.run_dir)
    except RunDirError as e:
        print(f"tiderl status: {e}", file=sys.stderr)
        return 2
    doc = collect(store)
    print(json.dumps(doc, default=str) if args.json else render(doc))
    return 0
