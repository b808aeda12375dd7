"""Who waits for what in a run: a store snapshot in, plain-words findings out.

Pure: no database, no clock, no HTTP, no processes. The snapshot and the findings are records of
their own (`tiderl.observe.diagnose_types`); `tiderl.observe.status` builds a :class:`Snapshot` from
the run store (every time is an age in seconds relative to the moment of the snapshot) and calls
:func:`diagnose`; the tests build snapshots with a known story and check that the diagnosis tells it.

Invariants (tests/test_diagnose.py)
1. A run that is over (finished, failed, cancelled) is never stalled; a failed one
   is a finding of severity error.
2. A starting or running run is stalled iff no weights version was published for
   longer than `Limits.stall_after_s`; a stalled diagnosis always names a culprit.
3. The trainer sentence names the groups the current step still misses and the
   slowest unfinished task among them (rank, seconds, and turn, phase and env server
   when the snapshot knows them).
4. A rank whose heartbeat is older than two heartbeat periods is reported with the
   number of heartbeats it missed; a dead rank is reported as dead.
5. A live rollout rank with free slots that waited for work while the feeder is at
   its staleness bound is reported as held by the staleness bound.
6. Findings are ordered by severity (error first); the culprit is the finding that
   most likely blocks progress, in `CULPRIT_ORDER` (a gone run before a dead actor
   before a dead ref before orphaned tasks before a stuck task before a lack of
   rollout ranks before a held rollout rank).
7. A task running on a rank that no longer rolls out (or stopped) is orphaned.
8. Every live rank silent means the run's processes are gone (launcher or Slurm job).
9. Only the latest Slurm job of the run counts; one waiting in the queue is information,
   one ended while the run is not is an error.
"""

from __future__ import annotations

from tiderl.observe.diagnose_types import (LIVE_RANK_STATES, SLURM_ALIVE, SLURM_WAITING, TERMINAL_STATES, Diagnosis,
                                           Finding, Kind, Limits, RankStatusView, Severity, Snapshot, TaskView)

# Which finding most likely blocks progress, most likely first (invariant 6).
CULPRIT_ORDER = (Kind.RUN_FAILED, Kind.SLURM_JOB, Kind.RUN_GONE, Kind.CONTROL_DOWN, Kind.ACTOR_DOWN, Kind.REF_DOWN, Kind.ENV_SERVER_DOWN,
                 Kind.ORPHANED_TASKS, Kind.SLOW_TASK, Kind.NO_ROLLOUT, Kind.ROLLOUT_NOT_CLAIMING, Kind.RANK_FAILED, Kind.RANK_DEAD, Kind.RANK_SILENT, Kind.RANK_MISSING,
                 Kind.ROLLOUT_NO_WORK, Kind.ROLLOUT_HELD, Kind.TASK_RETRIED, Kind.RESTARTED, Kind.GROUPS_FAILED)
_SEVERITY_ORDER = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}


# ---- the diagnosis ---------------------------------------------------------------------------------
def diagnose(snap: Snapshot) -> Diagnosis:
    findings: list[Finding] = []
    findings += _rank_findings(snap)
    findings += _infrastructure_findings(snap)
    trainer, trainer_findings = _trainer_side(snap)
    rollout, rollout_findings = _rollout_side(snap)
    findings += trainer_findings + rollout_findings
    findings += _task_findings(snap)
    findings += _engine_findings(snap)
    is_over = snap.state in TERMINAL_STATES
    if is_over:
        kind, severity = (Kind.RUN_FAILED, Severity.ERROR) if snap.state == "failed" else (Kind.RUN_ENDED,
                                                                                           Severity.INFO)
        findings.append(Finding(kind, severity, f"the run is {snap.state} at version {snap.version}"
                                + (f": {snap.message}" if snap.message else "")))
    is_stalled = not is_over and snap.since_progress_s > snap.limits.stall_after_s
    findings.sort(key=lambda f: _SEVERITY_ORDER[f.severity])
    culprit = _culprit(findings) if (is_stalled or snap.state == "failed") else None
    if is_stalled:
        blame = culprit.message if culprit else ("no finding explains it: read logs/control.log and the "
                                                 "rank logs")
        stall = Finding(Kind.STALLED, Severity.ERROR,
                        f"no progress: no new weights version for {_dur(snap.since_progress_s)} (limit "
                        f"{_dur(snap.limits.stall_after_s)}); likely culprit: {blame}",
                        data={"since_progress_s": round(snap.since_progress_s, 1)})
        if culprit is None:
            culprit = stall
        findings.insert(0, stall)
    return Diagnosis(trainer=trainer, rollout=rollout, findings=tuple(findings), is_stalled=is_stalled,
                     culprit=culprit, since_progress_s=snap.since_progress_s)


def _culprit(findings: list[Finding]) -> Finding | None:
    for kind in CULPRIT_ORDER:
        for f in findings:
            if f.kind is kind:
                return f
    return None


# ---- ranks -----------------------------------------------------------------------------------------
def _is_live(r: RankStatusView) -> bool:
    return r.state in LIVE_RANK_STATES


def _missed(r: RankStatusView, limits: Limits) -> int:
    """Heartbeats a live rank missed (0 while it is within two heartbeat periods)."""
    age = r.heartbeat_age_s
    if age is None or not _is_live(r) or age <= 2 * limits.heartbeat_s:
        return 0
    return int(age // limits.heartbeat_s)


def _is_healthy(r: RankStatusView, limits: Limits) -> bool:
    return _is_live(r) and _missed(r, limits) == 0


def _rank_findings(snap: Snapshot) -> list[Finding]:
    lim = snap.limits
    out: list[Finding] = []
    dead_events = {e.rank: e for e in snap.events if e.kind == "rank_dead" and e.rank is not None}
    failed_events = {e.rank: e for e in snap.events if e.kind == "rank_failed" and e.rank is not None}
    for r in snap.ranks:
        if r.state == "failed":  # also once the run is over: what the rank died of stays worth reading
            event = failed_events.get(r.rank)
            out.append(Finding(Kind.RANK_FAILED, Severity.ERROR,
                               (event.message if event else f"rank {r.rank} ({r.role}) failed")
                               + f" (its log: tiderl logs RUN_DIR --rank {r.rank})", rank=r.rank))
            continue
        if r.state == "dead" and snap.state not in TERMINAL_STATES:
            when = dead_events.get(r.rank)
            out.append(Finding(Kind.RANK_DEAD, Severity.WARNING,
                               f"rank {r.rank} ({r.role}) is dead: silent for "
                               f"{_dur(r.heartbeat_age_s)}" + (f", declared dead {_dur(when.age_s)} ago"
                                                               if when else "")
                               + "; its claims went back to the pool", rank=r.rank,
                               data={"heartbeat_age_s": _round(r.heartbeat_age_s)}))
            continue
        missed = _missed(r, lim)
        if missed and snap.state not in TERMINAL_STATES:
            left = lim.heartbeat_timeout_s - (r.heartbeat_age_s or 0.0)
            when = (f"declared dead in {_dur(left)}" if left > lim.heartbeat_s else
                    f"past the {_dur(lim.heartbeat_timeout_s)} timeout and not declared dead: is the control "
                    "plane running? see logs/control.log")
            out.append(Finding(Kind.RANK_SILENT, Severity.WARNING,
                               f"rank {r.rank} ({r.role}) missed {missed} heartbeats (last one "
                               f"{_dur(r.heartbeat_age_s)} ago; {when})", rank=r.rank,
                               data={"missed_heartbeats": missed, "heartbeat_age_s": _round(r.heartbeat_age_s)}))
    live = [r for r in snap.ranks if _is_live(r)]
    if live and snap.state not in TERMINAL_STATES and all(_missed(r, lim) for r in live):
        servers_down = bool(snap.env_servers) and not any(s.is_reachable for s in snap.env_servers)
        youngest = min(r.heartbeat_age_s or 0.0 for r in live)
        out.append(Finding(Kind.RUN_GONE, Severity.ERROR,
                           f"no rank of the run has heartbeated for {_dur(youngest)}"
                           + (" and no env server answers" if servers_down else "")
                           + ": the launcher (or the Slurm job) is gone while the store still says "
                           f"{snap.state}; continue it with `tiderl run --resume RUN_DIR`",
                           data={"heartbeat_age_s": _round(youngest), "env_servers_down": servers_down}))
    control_late = snap.control_age_s is not None and snap.control_age_s > lim.heartbeat_timeout_s
    if control_late and snap.state not in TERMINAL_STATES and not any(f.kind is Kind.RUN_GONE for f in out):
        out.append(Finding(Kind.CONTROL_DOWN, Severity.ERROR,
                           f"the control plane has not ticked for {_dur(snap.control_age_s)}: nobody feeds tasks, "
                           "plans the next version or declares dead ranks (see logs/control.log; "
                           "`tiderl run --resume RUN_DIR` starts it again)",
                           data={"control_age_s": _round(snap.control_age_s)}))
    known = {r.rank for r in snap.ranks}
    missing = [i for i in range(lim.num_ranks) if i not in known]
    if missing and snap.state not in TERMINAL_STATES:
        out.append(Finding(Kind.RANK_MISSING, Severity.INFO if snap.version == 0 else Severity.WARNING,
                           f"{_plural(len(missing), 'rank')} {_list(missing)} not registered yet (starting up, or "
                           "failed to start: see logs/rank{R}.log)", data={"ranks": missing}))
    return out


def _infrastructure_findings(snap: Snapshot) -> list[Finding]:
    out: list[Finding] = []
    for s in snap.env_servers:
        if not s.is_reachable:
            out.append(Finding(Kind.ENV_SERVER_DOWN, Severity.ERROR,
                               f"env server {s.url} does not answer /health: {s.error or 'no answer'}",
                               data={"url": s.url}))
    if snap.slurm_jobs:
        # The latest job is the run's current one; earlier ones were preempted or requeued before it.
        j = snap.slurm_jobs[-1]
        state = j.state.upper()
        if state not in SLURM_ALIVE:
            waiting = state in SLURM_WAITING
            severity = Severity.INFO if waiting or snap.state in TERMINAL_STATES else Severity.ERROR
            out.append(Finding(Kind.SLURM_JOB, severity,
                               f"Slurm job {j.job_id} is {j.state}" + (f" ({j.reason})" if j.reason else "")
                               + (": the run waits for its allocation" if waiting else ""),
                               data={"job_id": j.job_id, "state": j.state, "reason": j.reason}))
    outages = [e for e in snap.events if e.kind == "store_unreachable"]  # newest first; one per process
    if outages:
        out.append(Finding(Kind.STORE_UNREACHABLE, Severity.INFO if snap.state in TERMINAL_STATES else Severity.WARNING,
                           f"the run store was unreachable ({_plural(len(outages), 'report')} by the processes "
                           f"that waited), latest {_dur(outages[0].age_s)} ago: {outages[0].message}",
                           data={"reports": len(outages)}))
    return out


# ---- trainer side ----------------------------------------------------------------------------------
def _trainer_side(snap: Snapshot) -> tuple[str, list[Finding]]:
    lim = snap.limits
    out: list[Finding] = []
    if snap.state in TERMINAL_STATES:
        return f"nothing: the run is over ({snap.state})", out
    if snap.version >= lim.num_steps:
        return f"all {lim.num_steps} steps are trained; the run ends once its evaluations are done", out
    actors = [r for r in snap.ranks if r.role == "actor"]
    live_actors = [r for r in actors if _is_healthy(r, lim)]
    if actors and not live_actors:
        a = actors[0]
        state = "dead" if a.state == "dead" else (f"silent for {_dur(a.heartbeat_age_s)}"
                                                   if _is_live(a) else a.state)
        out.append(Finding(Kind.ACTOR_DOWN, Severity.ERROR,
                           f"actor rank {a.rank} is {state}: nobody trains step {snap.version} -> "
                           f"{snap.version + 1} (see logs/rank{a.rank}.log)", rank=a.rank))
        return f"no live actor: rank {a.rank} is {state}", out
    need = snap.fetch_groups or lim.groups_ideal
    train = [g for g in snap.groups if g.kind == "train"]
    claimed = sum(1 for g in train if g.state == "claimed")
    ready = sum(1 for g in train if g.state == "ready")
    step = f"step {snap.version} -> {snap.version + 1}"
    if claimed >= need:
        actor = live_actors[0] if live_actors else None
        since = f" for {_dur(actor.claimed_age_s)}" if actor and actor.claimed_age_s is not None else ""
        text = f"{step}: the trainer holds its {_plural(need, 'group')} and is training{since}"
        if snap.ra2p_mode == "decoupled":
            refs = [r for r in snap.ranks if r.role == "ref"]
            down = [r for r in refs if not _is_healthy(r, lim)]
            for r in down:
                out.append(Finding(Kind.REF_DOWN, Severity.ERROR,
                                   f"ref rank {r.rank} of the decoupled {step} is "
                                   f"{'dead' if r.state == 'dead' else 'silent for ' + _dur(r.heartbeat_age_s)}: "
                                   "the actor waits for its ref log-probabilities", rank=r.rank))
            if down:
                text += f", waiting for ref {_plural_word(len(down), 'rank')} {_list([r.rank for r in down])}"
        return text, out
    missing = need - claimed - ready
    if missing <= 0:
        return (f"{step}: the trainer holds {claimed} of {need} groups; {ready} more are ready and about to "
                "be claimed"), out
    incomplete = sorted((g for g in train if g.state == "open"), key=lambda g: (g.size - g.num_done, g.group_id))
    waited = incomplete[:missing]
    text = f"{step}: the trainer holds {claimed} of {need} groups ({ready} ready) and waits for {missing} more"
    if not waited:
        return text + "; no training group is in flight (the control plane feeds none: is it running? see "\
                      "logs/control.log)", out
    done = sum(g.num_done for g in waited)
    size = sum(g.size for g in waited)
    tasks = [t for g in waited for t in g.unfinished]
    pending = [t for t in tasks if t.state == "pending"]
    running = [t for t in tasks if t.state == "running"]
    text += f": {_plural(len(waited), 'incomplete group')} ({done} of {size} tasks done"
    text += f", {len(running)} running, {len(pending)} not started)" if tasks else ")"
    slowest = max(running, key=lambda t: (_task_age(t), -t.task_id), default=None)
    if slowest is not None:
        text += f"; the slowest task {_task_words(slowest)}"
        if _task_age(slowest) >= lim.slow_task_s:
            out.append(Finding(Kind.SLOW_TASK, Severity.WARNING,
                               f"task {slowest.task_id} (group {slowest.group_id}) {_task_words(slowest)}, "
                               f"and the trainer waits for its group", rank=slowest.owner_rank,
                               data={"task_id": slowest.task_id, "group_id": slowest.group_id,
                                     "running_s": _round(slowest.running_s), "turn": slowest.turn,
                                     "phase": slowest.phase, "phase_s": _round(slowest.phase_s),
                                     "env_server": slowest.env_server}))
    rollout_live = [r for r in snap.ranks if r.role == "rollout" and _is_healthy(r, lim)]
    if pending and not rollout_live:
        out.append(Finding(Kind.NO_ROLLOUT, Severity.ERROR,
                           f"{_plural(len(pending), 'task')} of the groups the trainer waits for "
                           "are pending and no live rollout rank can run them",
                           data={"pending_tasks": len(pending)}))
    return text, out


def _task_age(t: TaskView) -> float:
    """How long the task has been stuck where it is: its current phase if known, else since its claim."""
    if t.phase_s is not None:
        return t.phase_s
    return t.running_s or 0.0


def _task_words(t: TaskView) -> str:
    where = f"on rank {t.owner_rank}" if t.owner_rank is not None else "unowned"
    if t.phase == "env" and t.phase_s is not None:
        server = f" on env server {t.env_server}" if t.env_server else ""
        turn = f" {t.turn}" if t.turn is not None else ""
        text = f"has been in environment turn{turn} for {_dur(t.phase_s)}{server} ({where})"
    elif t.phase is not None and t.phase_s is not None:
        turn = f" (turn {t.turn})" if t.turn is not None else ""
        text = f"has been in phase {t.phase}{turn} for {_dur(t.phase_s)} {where}"
    else:
        text = f"has been running {where} for {_dur(t.running_s)}"
    if t.attempts > 1:
        text += f", attempt {t.attempts}"
    return text


# ---- rollout side ----------------------------------------------------------------------------------
def _rollout_side(snap: Snapshot) -> tuple[str, list[Finding]]:
    lim = snap.limits
    out: list[Finding] = []
    if snap.state in TERMINAL_STATES:
        return f"nothing: the run is over ({snap.state})", out
    rollout = [r for r in snap.ranks if r.role == "rollout"]
    live = [r for r in rollout if _is_healthy(r, lim)]
    train = [g for g in snap.groups if g.kind == "train"]
    outstanding = len(train)
    pending_train = sum(1 for g in train for t in g.unfinished if t.state == "pending")
    pending_all = sum(1 for g in snap.groups for t in g.unfinished if t.state == "pending")
    if not rollout:
        return "no rank is in the rollout role", out
    if not live:
        return f"no live rollout rank ({_plural(len(rollout), 'rollout rank')} dead or silent)", out
    waiting = [r for r in live if r.running_tasks < lim.max_concurrency and r.rwt_recent_s > 0]
    # Holding no task and recording no wait: the rank's loop does not run (engine start, weight reload, hang).
    silent = [r for r in live if r.running_tasks == 0 and r.rwt_recent_s == 0]
    working = [r for r in live if r.running_tasks > 0]
    text = f"{len(live)} live rollout {_plural_word(len(live), 'rank')}: {len(working)} with tasks"
    if silent:
        text += f", {len(silent)} not claiming (engine starting or reloading?)"
        if pending_all:
            ranks = [r.rank for r in silent]
            up = [r.up_s for r in silent if r.up_s is not None]
            since = f" (up for {_dur(min(up))})" if up else ""
            out.append(Finding(Kind.ROLLOUT_NOT_CLAIMING, Severity.INFO,
                               f"{_plural(len(silent), 'rollout rank')} {_list(ranks)}{since} "
                               f"{'holds' if len(silent) == 1 else 'hold'} no task while {pending_all} are pending "
                               "and recorded no wait: the engine is still starting, reloading weights or hung "
                               f"(see logs/rank{ranks[0]}.log)", rank=ranks[0], data={"ranks": ranks}))
    at_cap = outstanding >= lim.feed_cap_groups
    if waiting and pending_all == 0:
        ranks = [r.rank for r in waiting]
        share = max(r.rwt_recent_s for r in waiting) / lim.rwt_window_s
        data = {"ranks": ranks, "outstanding_groups": outstanding, "feed_cap_groups": lim.feed_cap_groups,
                "rwt_share": round(min(share, 1.0), 3)}
        if at_cap:
            msg = (f"{_plural(len(waiting), 'rollout rank')} {_list(ranks)} "
                   f"{'is' if len(waiting) == 1 else 'are'} held by the staleness bound: {outstanding} training "
                   f"groups are outstanding, the bound allows {lim.feed_cap_groups} ((max_staleness "
                   f"{lim.max_staleness} + 1) x {lim.groups_ideal}); they wait for the trainer to publish "
                   f"version {snap.version + 1} (waited {_pct(share)} of the last {_dur(lim.rwt_window_s)})")
            out.append(Finding(Kind.ROLLOUT_HELD, Severity.INFO, msg, data=data))
            text += f", {len(waiting)} held by the staleness bound"
        elif snap.version >= lim.num_steps or outstanding >= _remaining_groups(snap):
            text += f", {len(waiting)} idle: every remaining training group is fed"
        else:
            msg = (f"{_plural(len(waiting), 'rollout rank')} {_list(ranks)} wait for tasks below the "
                   f"staleness bound ({outstanding} of {lim.feed_cap_groups} groups outstanding): the control "
                   "plane is not feeding (see logs/control.log)")
            out.append(Finding(Kind.ROLLOUT_NO_WORK, Severity.WARNING, msg, data=data))
            text += f", {len(waiting)} without work"
    running = sum(r.running_tasks for r in live)
    text += f"; {running} tasks running, {pending_all} pending ({pending_train} training)"
    return text, out


def _remaining_groups(snap: Snapshot) -> int:
    return max(0, (snap.limits.num_steps - snap.version) * snap.limits.groups_ideal)


# ---- tasks -----------------------------------------------------------------------------------------
def _task_findings(snap: Snapshot) -> list[Finding]:
    out: list[Finding] = []
    by_rank = {r.rank: r for r in snap.ranks}
    orphans: dict[int, list[TaskView]] = {}
    for g in snap.groups:
        for t in g.unfinished:
            owner = by_rank.get(t.owner_rank) if t.owner_rank is not None else None
            if t.state == "running" and owner is not None and (owner.role != "rollout" or owner.state == "stopped"):
                orphans.setdefault(owner.rank, []).append(t)
    for r, ts in sorted(orphans.items()):
        owner = by_rank[r]
        now_is = f"is {owner.role} now" if owner.state != "stopped" else "has stopped"
        out.append(Finding(Kind.ORPHANED_TASKS, Severity.ERROR,
                           f"{_plural(len(ts), 'task')} {_list([t.task_id for t in ts])} (group "
                           f"{_list(sorted({t.group_id for t in ts}))}) {'is' if len(ts) == 1 else 'are'} still "
                           f"running on rank {r}, which {now_is}: nobody plays {'it' if len(ts) == 1 else 'them'}, "
                           "and the store returns them only when the rank dies (its release at the role change "
                           "missed them)", rank=r, data={"tasks": [t.task_id for t in ts]}))
    retried = [t for g in snap.groups for t in g.unfinished if t.attempts > 1 and t.last_error]
    if retried:
        worst = max(retried, key=lambda t: (t.attempts, t.task_id))
        out.append(Finding(Kind.TASK_RETRIED, Severity.WARNING,
                           f"{_plural(len(retried), 'unfinished task')} failed before and "
                           f"{'is' if len(retried) == 1 else 'are'} retried; task {worst.task_id} is on attempt "
                           f"{worst.attempts}, last error: {worst.last_error}",
                           data={"tasks": [t.task_id for t in retried]}))
    if snap.failed_groups:
        out.append(Finding(Kind.GROUPS_FAILED, Severity.INFO if snap.state in TERMINAL_STATES else Severity.WARNING,
                           f"{_plural(snap.failed_groups, 'group')} failed for good (a task ran out of attempts, or "
                           "it was dropped as too stale) and will never be trained",
                           data={"failed_groups": snap.failed_groups}))
    stale = [e for e in snap.events if e.kind == "stale_dropped"]
    if stale:
        out.append(Finding(Kind.STALE_DROPPED, Severity.INFO, f"latest staleness drop ({_dur(stale[0].age_s)} ago): "
                           f"{stale[0].message}"))
    restarted = [e for e in snap.events if e.kind == "restarted"]  # newest first
    if restarted:
        out.append(Finding(Kind.RESTARTED, Severity.INFO if snap.state in TERMINAL_STATES else Severity.WARNING,
                           f"{_plural(len(restarted), 'restart')} of processes that died, latest "
                           f"{_dur(restarted[0].age_s)} ago: {restarted[0].message}",
                           rank=restarted[0].rank, data={"restarts": len(restarted)}))
    return out


# ---- words -----------------------------------------------------------------------------------------
def _engine_findings(snap: Snapshot) -> list[Finding]:
    x, limit = snap.on_policy_mismatch, snap.limits.max_on_policy_mismatch
    if x is None or not x > limit:
        return []
    return [Finding(Kind.ENGINE_MISMATCH, Severity.WARNING,
                    f"the engine's log-probabilities differ from the trainer's by {x:.2g} nats a token on tokens "
                    f"sampled with the weights being trained (monitor.max_on_policy_mismatch {limit:g}): the engine "
                    "does not serve the published weights, or computes them in a lower precision",
                    data={"logprob_mismatch_on_policy": x, "limit": limit})]


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "an unknown time"
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _pct(share: float) -> str:
    return f"{100 * min(max(share, 0.0), 1.0):.0f}%"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _plural(n: int, word: str) -> str:
    return f"{n} {_plural_word(n, word)}"


def _plural_word(n: int, word: str) -> str:
    return word if n == 1 else word + "s"


def _list(items: list[int]) -> str:
    return ", ".join(str(i) for i in items)
