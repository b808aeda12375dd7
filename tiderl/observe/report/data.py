"""Everything a report draws, read from the run store once into plain Python series."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tiderl.observe.status import CTB_LEVELS, CTB_SUMS, steady_of
from tiderl.store.types import RunRecord

# Metrics the figures read (names as the ranks record them).
WAIT_METRICS = ("rwt_s", "twt_s")
CACHE_METRICS = ("prefix_cache_queries", "prefix_cache_hits", "kv_usage")
MISMATCH_METRICS = ("logprob_mismatch_on_policy", "logprob_mismatch_stale")  # tiderl.trainer.step.MISMATCH_KEYS
# The actor's step metrics the training-curves figure draws (recorded at the step's version v: it published v + 1).
TRAINER_CURVES = ("pg_loss", "kl", "entropy", "grad_norm", "lr", "response_tokens_mean", "clip_frac")


@dataclass
class RoleSpan:
    rank: int
    role: str  # rollout, actor, ref, idle, or "dead"
    start_s: float  # seconds since the run started
    end_s: float


@dataclass
class ReportData:
    info: RunRecord
    t0: float  # run start (Unix seconds); every `*_s` time below is relative to it
    end_s: float  # the run's end, or now
    versions: list[dict[str, Any]]  # published versions > 0 with `t_s` (publish time since start)
    evals: list[dict[str, Any]]
    waits: list[dict[str, Any]]  # rwt_s / twt_s points with `t_s`
    cache: list[dict[str, Any]]  # prefix-cache and KV-usage points with `t_s`
    staleness: list[dict[str, Any]]
    roles: list[RoleSpan] = field(default_factory=list)
    ctb: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per weights version the rollout ranks held: the sum of each CTB_SUMS metric over the ranks and the
    mean of each CTB_LEVELS metric over its points (a name absent: never recorded at that version)."""
    trainer: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """The actor's step metrics (TRAINER_CURVES): (the version the step published, value), ascending."""
    mismatch: dict[str, list[float]] = field(default_factory=dict)
    """Each step's engine log-prob mismatch, on-policy and stale tokens apart (MISMATCH_METRICS)."""
    steady: Any = None
    """The run's steady-state goodput and start-up (tiderl.store.step_figures.SteadyGoodput)."""
    holding: dict[str, Any] = field(default_factory=dict)
    """Where the trained groups created from version `from_version`'s publication on spent their time in
    flight (RunReader.group_holding): from version 1 (the start-up left out), or from version 0 where no
    group created after version 1 was trained (a run of a step or two)."""

    @property
    def consumed_tokens(self) -> int:
        return sum(v["consumed_tokens"] or 0 for v in self.versions)


def load(store: Any, *, now: float | None = None) -> ReportData:
    info = store.run_info()
    t0 = info.created_at
    end = info.finished_at or (now if now is not None else time.time())
    versions = [v | {"t_s": v["created_at"] - t0} for v in store.measure.version_rows() if v["version"] > 0]
    publish_s = {0: 0.0} | {v["version"]: v["t_s"] for v in versions}
    points = [p | {"t_s": p["ts"] - t0}
              for p in store.reader.metric_rows(tuple(dict.fromkeys(WAIT_METRICS + CACHE_METRICS + CTB_SUMS + CTB_LEVELS
                                                             + MISMATCH_METRICS + TRAINER_CURVES)))]
    dead = [e | {"t_s": e["ts"] - t0} for e in store.recent_events(10_000, kinds=["rank_dead"])]
    evals = [e | {"t_s": (e["finished_at"] - t0) if e["finished_at"] else None} for e in store.reader.eval_rows()]
    return ReportData(
        info=info, t0=t0, end_s=end - t0, versions=versions, evals=evals,
        waits=[p for p in points if p["name"] in WAIT_METRICS],
        cache=[p for p in points if p["name"] in CACHE_METRICS],
        staleness=store.reader.staleness_counts(), ctb=ctb_by_version(points), holding=group_holding(store),
        mismatch={n: [float(p["value"]) for p in points if p["name"] == n] for n in MISMATCH_METRICS},
        steady=steady_of(store),
        trainer={n: sorted((int(p["version"]) + 1, float(p["value"])) for p in points
                           if p["name"] == n and p["role"] == "actor" and p["version"] is not None)
                 for n in TRAINER_CURVES},
        roles=role_spans(store.reader.control_rows(), publish_s, dead, end - t0,
                         restarted_s={r.rank: r.started_at - t0 for r in store.ranks()}))


def group_holding(store: Any) -> dict[str, Any]:
    """The store's group holding from version 1 on, or over the whole run where that has no group."""
    for version in (1, 0):
        held = store.reader.group_holding(version)
        if held["groups"]:
            return held | {"from_version": version}
    return held | {"from_version": 0}


def ctb_by_version(points: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """The CTB figures of each weights version (see ReportData.ctb), ascending by version."""
    sums: dict[int, dict[str, float]] = {}
    levels: dict[tuple[int, str], list[float]] = {}
    for p in points:
        if p["version"] is None:
            continue
        v = int(p["version"])
        if p["name"] in CTB_SUMS:
            row = sums.setdefault(v, {})
            row[p["name"]] = row.get(p["name"], 0.0) + float(p["value"])
        elif p["name"] in CTB_LEVELS:
            levels.setdefault((v, p["name"]), []).append(float(p["value"]))
    for (v, name), values in levels.items():
        sums.setdefault(v, {})[name] = sum(values) / len(values)
    return dict(sorted(sums.items()))


def role_spans(control: list[dict[str, Any]], publish_s: dict[int, float], dead_events: list[dict[str, Any]],
               end_s: float, restarted_s: dict[int, float] | None = None) -> list[RoleSpan]:
    """Each rank's role over time: the role planned for version v holds from v's publication (the sync
    boundary) until the rank's next planned change; a rank declared dead is `dead` until its next planned
    change or its restart (`restarted_s`: its latest start, e.g. by a resume), whichever comes first.
    Plans of versions never published (the run ended first) are ignored."""
    restarted_s = restarted_s or {}
    by_rank: dict[int, list[tuple[float, str]]] = {}
    for row in control:
        start = publish_s.get(row["version"])
        if start is None:
            continue
        changes = by_rank.setdefault(row["rank"], [])
        if not changes or changes[-1][1] != row["role"]:
            changes.append((start, row["role"]))
    for e in sorted(dead_events, key=lambda e: e["t_s"]):
        changes = by_rank.get(e["rank"])
        if not changes:
            continue
        before = [role for t, role in changes if t <= e["t_s"] and role != "dead"]
        changes.append((e["t_s"], "dead"))
        back = restarted_s.get(e["rank"])
        if before and back is not None and back > e["t_s"]:
            changes.append((back, before[-1]))
    spans = []
    for rank, changes in sorted(by_rank.items()):
        changes.sort(key=lambda c: c[0])
        for (start, role), nxt in zip(changes, changes[1:] + [(end_s, "")]):
            if min(nxt[0], end_s) > start:
                spans.append(RoleSpan(rank, role, start, min(nxt[0], end_s)))
    return spans
