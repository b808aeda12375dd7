"""A run's status document: state, version, ranks and roles, buffer, goodput, and a diagnosis of who waits
for what (`tiderl.observe.diagnose`), its rendering, and the launcher's progress line and summary. The command
`tiderl status` is `tiderl.observe_cli.status` (it also looks up the run's Slurm jobs)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tiderl.observe import diagnose_types as dg
from tiderl.observe.diagnose import diagnose

STEP_KEYS = ("version", "success_rate", "reward_mean", "turns_mean", "turns_max", "consumed_tokens", "duration_s",
             "goodput_tok_s", "ras", "tprm_s", "ra2p_mode", "max_staleness", "env_figures")
RWT_WINDOW_S = 30.0  # a rollout rank counts as waiting if it recorded RWT within this window
ENV_PROBE_TIMEOUT_S = 2.0
# What CTB decided and what the prefix cache kept (metrics of the rollout ranks: increments summed; levels averaged).
CTB_SUMS = ("ctb_admitted", "ctb_pauses", "ctb_resumes", "ctb_prefix_kept", "ctb_prefix_evicted",
            "prefix_cache_queries", "prefix_cache_hits")
CTB_LEVELS = ("kv_usage", "ctb_budget_tokens")
SEVERITY_MARK = {"error": "!!", "warning": " !", "info": " -"}


TRAINER_KEYS = ("loss", "grad_norm", "lr", "response_tokens_mean", "entropy", "kl", "clip_frac",
                "logprob_mismatch_on_policy", "logprob_mismatch_stale", "is_weight_mean", "is_truncated_frac",
                "staleness_max")


def collect(store: Any) -> dict[str, Any]:
    """The status document of a run (what --json prints, without the diagnosis)."""
    info = store.run_info()
    steps = store.steps()
    end = info.finished_at or time.time()
    elapsed_s = max(end - info.created_at, 1e-9)
    consumed = sum(s["consumed_tokens"] or 0 for s in steps)
    steady = steady_of(store, created_at=info.created_at)
    wait: dict[str, float] = {}
    for row in store.reader.metric_sums(["rwt_s", "twt_s"]):
        wait[row["name"]] = wait.get(row["name"], 0.0) + float(row["value"])
    rollout = dict.fromkeys(CTB_SUMS, 0.0)
    for row in store.reader.metric_sums(CTB_SUMS):
        rollout[row["name"]] += float(row["value"])
    kv_peak = max((float(r["max"]) for r in store.reader.metric_sums(["kv_usage"])), default=None)
    return {
        "name": info.name,
        "system": info.system,
        "state": info.state.value,
        "message": info.message,
        "version": info.version,
        "elapsed_s": round(elapsed_s, 3),
        "consumed_tokens": consumed,
        "goodput_tok_s": consumed / elapsed_s,
        # Once the run is up: from the first version published after the last engine came up (start-up apart).
        "steady_goodput_tok_s": steady.tok_s,
        "steady_from_version": steady.from_version,
        "startup_s": None if steady.startup_s is None else round(steady.startup_s, 1),
        "rwt_s": wait.get("rwt_s", 0.0),
        "twt_s": wait.get("twt_s", 0.0),
        "ranks": [{"rank": r["rank"], "role": r["role"], "state": r["state"], "version": r["version"],
                   "planned_role": r["planned_role"], "heartbeat_age_s": r["heartbeat_age_s"]}
                  for r in store.view("rank_roles")],
        "buffer": dataclasses.asdict(store.buffer_state()),
        "steps": [{k: s.get(k) for k in STEP_KEYS} | {"eval": False} for s in steps],
        "eval": [_with_interval(e) | {"eval": True} for e in store.view("eval_summary")],
        "trainer": store.measure.latest_metrics(TRAINER_KEYS),
        "rollout": ({k: int(v) for k, v in rollout.items()} | store.measure.latest_metrics(CTB_LEVELS)
                    | ({} if kv_peak is None else {"kv_usage_peak": kv_peak})
                    if any(rollout.values()) else {}),
    }


def _with_interval(e: dict[str, Any]) -> dict[str, Any]:
    """An evaluation with `success_ci95`: the 95% (Wilson) interval of its success rate, [low, high] (None: no tasks)."""
    from tiderl.evalstats import wilson_interval

    ci = None
    if e["success_rate"] is not None and e["num_tasks"]:
        ci = [round(x, 4) for x in wilson_interval(round(e["success_rate"] * e["num_tasks"]), e["num_tasks"])]
    return e | {"success_ci95": ci}


# ---- the snapshot the diagnosis reads ---------------------------------------------------------------
def limits_of(config: Any, stall_after_s: float | None = None) -> dg.Limits:
    from tiderl.systems import behaviour, feed_allowance

    system = behaviour(config.system, max_staleness=config.rollout.max_staleness, ra2p_mode=config.trainer.ra2p_mode)
    return dg.Limits(
        num_ranks=config.launch.num_ranks, num_steps=config.trainer.num_steps, max_staleness=system.max_staleness,
        groups_ideal=config.trainer.groups_ideal,
        feed_cap_groups=feed_allowance(0, config.trainer.groups_ideal, system.max_staleness),
        max_concurrency=config.rollout.max_concurrency, heartbeat_s=config.launch.heartbeat_s,
        heartbeat_timeout_s=config.launch.heartbeat_timeout_s,
        stall_after_s=stall_after_s if stall_after_s is not None else config.monitor.stall_after_s,
        slow_task_s=config.monitor.slow_task_s, rwt_window_s=RWT_WINDOW_S,
        max_on_policy_mismatch=config.monitor.max_on_policy_mismatch)


def snapshot(store: Any, limits: dg.Limits, *, now: float, env_servers: tuple[dg.EnvServerView, ...] = (),
             slurm_jobs: tuple[dg.SlurmJobView, ...] = ()) -> dg.Snapshot:
    """What the run store says now, as the diagnosis's input (ages relative to `now`)."""
    from tiderl.store.types import GroupState, TaskKind

    info = store.run_info()
    version = info.version
    last = [v for v in store.measure.version_rows() if v["version"] == version]
    progress_at = max([info.created_at, info.updated_at] + ([last[0]["created_at"]] if last else []))
    groups = store.reader.outstanding_groups()
    running: dict[int, int] = {}
    for g in groups:
        for t in g["unfinished"]:
            if t["state"] == "running" and t["owner_rank"] is not None:
                running[t["owner_rank"]] = running.get(t["owner_rank"], 0) + 1
    rwt: dict[int, float] = {}
    for row in store.reader.metric_sums(["rwt_s"], since=now - limits.rwt_window_s):
        if row["rank"] is not None:
            rwt[row["rank"]] = rwt.get(row["rank"], 0.0) + float(row["value"])
    claims = {c["rank"]: c for c in store.reader.trainer_claims() if c["rank"] is not None}
    planned = {r["rank"]: r["planned_role"] for r in store.view("rank_roles")}
    ranks = tuple(dg.RankStatusView(
        rank=r.rank, role=r.role.value, state=r.state.value, version=r.version,
        heartbeat_age_s=now - r.heartbeat_at, planned_role=planned.get(r.rank),
        running_tasks=running.get(r.rank, 0), rwt_recent_s=rwt.get(r.rank, 0.0),
        claimed_groups=int(claims[r.rank]["groups"]) if r.rank in claims else 0,
        claimed_age_s=now - claims[r.rank]["latest_claimed_at"] if r.rank in claims else None,
        up_s=now - r.started_at)
        for r in store.ranks())
    plan = store.plan_at(version)
    mismatch = store.measure.latest_metrics(["logprob_mismatch_on_policy"]).get("logprob_mismatch_on_policy")
    return dg.Snapshot(
        state=info.state.value, version=version, message=info.message, since_progress_s=max(0.0, now - progress_at),
        control_age_s=now - info.control_seen_at if info.control_seen_at else None,
        limits=limits, ranks=ranks, on_policy_mismatch=None if mismatch is None else float(mismatch),
        groups=tuple(dg.GroupView(
            group_id=g["id"], kind=g["kind"], state=g["state"], size=g["size"], num_done=g["num_done"],
            unfinished=tuple(dg.TaskView(
                task_id=t["id"], group_id=t["group_id"], state=t["state"], owner_rank=t["owner_rank"],
                running_s=now - t["claimed_at"] if t["state"] == "running" and t["claimed_at"] else None,
                attempts=t["attempts"], last_error=t["last_error"], turn=t["turn"], phase=t["phase"],
                phase_s=now - t["phase_since"] if t["phase_since"] else None, env_server=t["env_server"])
                for t in g["unfinished"]))
            for g in groups),
        fetch_groups=plan.fetch_groups if plan else None, ra2p_mode=plan.ra2p_mode.value if plan else None,
        failed_groups=store.groups_by_state(TaskKind.TRAIN)[GroupState.FAILED],
        events=tuple(dg.EventView(kind=e["kind"], age_s=now - e["ts"], message=e["message"], rank=e["rank"])
                     for e in store.recent_events(50)),
        env_servers=env_servers, slurm_jobs=slurm_jobs)


def probe_env_servers(run_dir: Path, env: Any = None,
                      timeout_s: float = ENV_PROBE_TIMEOUT_S) -> tuple[dg.EnvServerView, ...]:
    """Ask each env server of the run (RUN_DIR/env_urls.json) for /health, with the run's token
    (`env`: the job's `env:` section; the token source is the one the ranks use)."""
    from tiderl.envs.launch import TokenError, read_token
    from tiderl.paths import RunPaths

    try:
        urls = json.loads(RunPaths(run_dir).env_urls.read_text())
    except (OSError, ValueError):
        return ()  # not started yet: the launcher writes the file once the servers are up
    if not urls:
        return ()
    try:
        token = read_token(env, run_dir) if env is not None else None
    except TokenError:
        token = None  # another user's run: its token is not ours to read; /health then says 401
    with ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:  # a dead server costs one timeout, not N
        return tuple(pool.map(lambda url: _probe(url, timeout_s, token), urls))


def _probe(url: str, timeout_s: float, token: str | None = None) -> dg.EnvServerView:
    request = urllib.request.Request(f"{url.rstrip('/')}/health",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
        return dg.EnvServerView(url=url, is_reachable=True, sessions=body.get("active"),
                                step_p99_ms=body.get("step_p99_ms"))
    except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors; ValueError: not JSON
        return dg.EnvServerView(url=url, is_reachable=False, error=f"{type(e).__name__}: {e}")


def status_document(run_dir: Path, store: Any, *, stall_after_s: float | None = None, probe: bool = True,
                    jobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`collect` plus `diagnosis` (and `slurm`: the run's Slurm `jobs`, where the caller looked them up; and
    `forked_from`: a fork's source run directory and the step and version of its checkpoint the fork started
    from, `tiderl.store.ForkOrigin`, for a fork only): what `tiderl status --json` prints."""
    from tiderl.config import load_job
    from tiderl.paths import RunPaths

    doc = {"at": time.time()} | collect(store)
    origin = store.fork_origin()
    if origin is not None:  # a fork (`tiderl run --resume RUN_DIR --fork NEW_DIR`): where it started
        doc["forked_from"] = dataclasses.asdict(origin)
    config = load_job(RunPaths(run_dir).config)
    is_live = doc["state"] not in dg.TERMINAL_STATES
    snap = snapshot(store, limits_of(config, stall_after_s), now=time.time(),
                    env_servers=probe_env_servers(run_dir, config.env) if probe and is_live else (),
                    slurm_jobs=tuple(dg.SlurmJobView(str(j["job_id"]), str(j["state"]), j.get("reason"))
                                     for j in jobs or ()))
    doc["diagnosis"] = diagnose(snap).to_dict()
    if jobs is not None:
        doc["slurm"] = jobs
    return doc


# ---- rendering ---------------------------------------------------------------------------------------
def render(doc: dict[str, Any]) -> str:
    lines = [
        f"run {doc['name']} ({doc['system']}): {doc['state']}" + (f" - {doc['message']}" if doc["message"] else ""),
        f"version {doc['version']}  elapsed {doc['elapsed_s']:.0f} s  consumed {doc['consumed_tokens']} tokens  "
        f"goodput {doc['goodput_tok_s']:.1f} tok/s  RWT {doc['rwt_s']:.1f} s  TWT {doc['twt_s']:.1f} s",
        *([f"forked from {origin['run_dir']} at its checkpoint of step {origin['step']} (version "
           f"{origin['version']})"] if (origin := doc.get("forked_from")) else []),
        *([f"steady goodput {doc['steady_goodput_tok_s']:.1f} tok/s from version {doc['steady_from_version']} "
           f"(start-up before it {doc['startup_s']:.0f} s: model, engines, first steps)"]
          if doc.get("steady_goodput_tok_s") is not None else []),
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
        lines += ["", "version  success  reward  turns  tokens  step_s  tok/s    RAS  TPRM_s  mode"]
        for s in doc["steps"][-10:]:
            lines.append(f"{s['version']:>7}  {_f(s['success_rate'], 2):>7}  {_f(s['reward_mean'], 2):>6}  "
                         f"{_f(s['turns_mean'], 1):>5}  {s['consumed_tokens']:>6}  {_f(s['duration_s'], 1):>6}  "
                         f"{_f(s['goodput_tok_s'], 0):>5}  "
                         f"{s['ras'] if s['ras'] is not None else '-':>5}  {_f(s['tprm_s'], 2):>6}  "
                         f"{s['ra2p_mode'] or '-'}")
        envs = doc["steps"][-1].get("env_figures") or {}
        if len(envs) > 1:
            lines.append("per environment (last step): " + "; ".join(
                f"{env} reward {_f(f['reward_mean'], 2)} success {_f(f['success_rate'], 2)} "
                f"({f['num_trajectories']} trajectories)" for env, f in envs.items()))
    r = doc.get("rollout") or {}
    if r:
        hits = f"{r['prefix_cache_hits'] / r['prefix_cache_queries']:.2f}" if r["prefix_cache_queries"] else "-"
        lines.append(f"rollout (run so far): admitted {r['ctb_admitted']}, paused {r['ctb_pauses']}, resumed "
                     f"{r['ctb_resumes']}; turns whose context the prefix cache kept {r['ctb_prefix_kept']}, evicted "
                     f"{r['ctb_prefix_evicted']}; prefix-cache hit rate {hits}"
                     + (f"; KV usage {r['kv_usage']:.2f}" if "kv_usage" in r else "")
                     + (f" (peak {r['kv_usage_peak']:.2f})" if "kv_usage_peak" in r else "")
                     + (f"; CTB budget {r['ctb_budget_tokens']:.0f} tokens" if "ctb_budget_tokens" in r else ""))
    t = doc.get("trainer") or {}
    if t:
        lines.append("trainer (last step): " + ", ".join(f"{k} {_g(t[k])}" for k in TRAINER_KEYS if k in t))
    for e in doc["eval"]:
        ci = "" if not e.get("success_ci95") else " (95% {:.2f}-{:.2f})".format(*e["success_ci95"])
        lines.append(f"eval @ version {e['eval_version']}: success {_f(e['success_rate'], 2)}{ci} over "
                     f"{e['num_tasks']} tasks")
    for j in doc.get("slurm") or ():
        lines.append(f"slurm job {j['job_id']}: {j['state']}" + (f" ({j['reason']})" if j.get("reason") else ""))
    if "diagnosis" in doc:
        lines += ["", *render_diagnosis(doc["diagnosis"], state=doc["state"])]
    return "\n".join(lines)


def render_diagnosis(d: dict[str, Any], *, skip: tuple[str, ...] = (), state: str | None = None) -> list[str]:
    """The diagnosis's lines; the time since the last new version only while the run goes on (`state`)."""
    over = state in dg.TERMINAL_STATES
    lines = [f"diagnosis (run {state})" if over else f"diagnosis ({_age(d['since_progress_s'])} since the last new "
             "version" + (", STALLED)" if d["is_stalled"] else ")"),
             f"  trainer: {d['trainer']}", f"  rollout: {d['rollout']}"]
    lines += [f"  {SEVERITY_MARK[f['severity']]} {f['message']}" for f in d["findings"] if f["kind"] not in skip]
    return lines


def verdict(doc: dict[str, Any]) -> str:
    """The one line `--check` starts with."""
    d = doc["diagnosis"]
    where = f"run {doc['name']} at version {doc['version']} ({doc['state']})"
    if d["is_stalled"]:
        return f"STALLED: {where}: {d['culprit']['message'] if d['culprit'] else 'no culprit found'}"
    if doc["state"] in ("failed", "cancelled"):
        return f"{doc['state'].upper()}: {where}" + (f": {doc['message']}" if doc["message"] else "")
    if d["needs_attention"]:  # not stalled (yet), but an error-level finding: say the first
        first = next(f for f in d["findings"] if f["severity"] == "error")
        return f"ERROR: {where}: {first['message']}"
    if doc["state"] == "finished":
        return f"OK: {where}"
    return f"OK: {where}, last new version {_age(d['since_progress_s'])} ago"


def _age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _g(value: float | None) -> str:
    """Four significant digits: a learning rate of 1e-6 as well as a loss of 0.174."""
    return "-" if value is None else f"{value:.4g}"


# ---- the command -------------------------------------------------------------------------------------
# The launcher's progress line and end-of-run summary, `tiderl submit --wait`'s too.

def progress_line(doc: dict[str, Any], eval_tasks: int = 0, engines: tuple[int, int] | None = None) -> str:
    """One line of progress; an evaluation shows once its `eval_tasks` tasks are all done; `engines`
    (up, wanted) while the launch waits for its rollout engines."""
    steps = doc["steps"]
    last = steps[-1] if steps else {}
    evals = [e for e in doc["eval"] if e["success_rate"] is not None and e["num_tasks"] >= eval_tasks]
    roles: dict[str, int] = {}
    for r in doc["ranks"]:
        roles[r["role"]] = roles.get(r["role"], 0) + 1
    b = doc["buffer"]
    return (f"v{doc['version']}  reward {_f(last.get('reward_mean'), 2)}  success {_f(last.get('success_rate'), 2)}"
            + (f"  eval {_f(evals[-1]['success_rate'], 2)}@v{evals[-1]['eval_version']}" if evals else "")
            + (f"  goodput {doc['goodput_tok_s']:.0f} tok/s" if steps else "  goodput -")  # none before a step
            + "  roles "
            + " ".join(f"{k}:{v}" for k, v in sorted(roles.items()))
            + f"  buffer pending {b['tasks_pending']} running {b['tasks_running']} ready {b['traj_ready']}"
            + (f"  engines {engines[0]}/{engines[1]} up" if engines is not None and engines[0] < engines[1] else "")
            + "   ")


def steady_of(store: Any, from_version: int | None = None, created_at: float | None = None) -> Any:
    """The run's :class:`tiderl.store.step_figures.SteadyGoodput` (from_version None: from the first version
    published after the last engine came up; created_at: the run's, where the caller has read it)."""
    from tiderl.store.step_figures import steady_goodput

    published = [(r["version"], r["created_at"], r["consumed_tokens"] or 0) for r in store.measure.version_rows()]
    ups = [e["ts"] for e in store.recent_events(100_000, kinds=["engine_up"])]
    created = store.run_info().created_at if created_at is None else created_at
    return steady_goodput(published, ups, created, from_version)


def summary(store: Any) -> str:
    """The end-of-run summary: the status and the evaluation trend."""
    doc = collect(store)
    lines = [render(doc)]
    trend = eval_trend(doc["eval"])
    if trend:
        lines.append(trend)
    return "\n".join(lines)


def eval_trend(evals: list[dict[str, Any]]) -> str | None:
    """The first and last evaluation's success rate, whether the change is beyond noise (95%), and the best
    later one if it beats the last."""
    from tiderl.evalstats import compare

    done = [e for e in evals if e["success_rate"] is not None and e["num_tasks"]]
    if len(done) < 2:
        return None
    first, last = done[0], done[-1]
    best = max(done[1:], key=lambda e: e["success_rate"])
    line = (f"eval success rate: {first['success_rate']:.2f} at version {first['eval_version']} -> "
            f"{last['success_rate']:.2f} at version {last['eval_version']}")
    c = compare(round(first["success_rate"] * first["num_tasks"]), first["num_tasks"],
                round(last["success_rate"] * last["num_tasks"]), last["num_tasks"])
    line += (f": {c.change:+.2f}, {'beyond' if c.beyond_noise else 'within'} noise (95%, z {c.z:+.1f}, "
             f"{first['num_tasks']} and {last['num_tasks']} tasks)")
    if best["success_rate"] > last["success_rate"]:
        line += f" (best {best['success_rate']:.2f} at version {best['eval_version']})"
    return line
