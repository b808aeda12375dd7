"""Prometheus metrics of a run, served by the control plane (`monitor.metrics_port`).

The control plane refreshes one :class:`RunCollector` from the run store every
`monitor.metrics_interval_s` (`MetricsServer.tick`, called from its loop) and
prometheus-client serves the latest refresh at `/metrics`; a scrape never
touches the store. Per-rank quantities carry `rank` and `role` labels (the
role the rank held when the value was recorded). The names are documented in
docs/observability.md.

The vLLM engines' own metrics (`vllm:*`) live in the prometheus-client
registry of each rollout rank's process; `serve_process_metrics` serves that
registry, and every endpoint of the run writes its URL to
`RUN_DIR/metrics/NAME.url` so that one scrape of the control plane
(`tiderl_endpoint_info`) finds the others.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    InfoMetricFamily, Metric)
from prometheus_client.registry import Collector

from tiderl.store.cursor import MetricCursor
from tiderl.store.engine import StoreError
from tiderl.store.types import BufferState

log = logging.getLogger(__name__)
METRICS_DIR = "metrics"  # RUN_DIR/metrics/NAME.url: where each endpoint of the run listens
RUN_STATES = ("starting", "running", "finished", "failed", "cancelled")

# Store metric (recorded as increments) -> (Prometheus counter name without _total, help).
COUNTERS = {
    "rwt_s": ("tiderl_rollout_wait_seconds", "Rollout Wait Time: seconds a rollout rank had free slots and nothing "
              "to claim (staleness bound or full buffer)."),
    "twt_s": ("tiderl_trainer_wait_seconds", "Training Wait Time: seconds a trainer rank waited for ready data."),
    "prefix_cache_queries": ("tiderl_prefix_cache_queries_tokens", "Prompt tokens looked up in the vLLM prefix cache."),
    "prefix_cache_hits": ("tiderl_prefix_cache_hits_tokens", "Prompt tokens found in the vLLM prefix cache."),
    "prompt_tokens": ("tiderl_engine_prompt_tokens", "Prompt tokens the rollout engine prefilled."),
    "generation_tokens": ("tiderl_engine_generation_tokens", "Tokens the rollout engine generated."),
    "preemptions": ("tiderl_engine_preemptions", "Requests the rollout engine preempted for KV-cache space."),
    "ctb_pauses": ("tiderl_ctb_pauses", "Tasks CTB paused (KV budget or priority)."),
    "ctb_resumes": ("tiderl_ctb_resumes", "Paused tasks CTB resumed."),
    "ctb_admitted": ("tiderl_ctb_admitted", "Tasks the rollout scheduler started on a rank."),
    "ctb_prefix_kept": ("tiderl_ctb_prefix_kept_turns", "Turns of resident tasks whose context the prefix cache kept."),
    "ctb_prefix_evicted": ("tiderl_ctb_prefix_evicted_turns", "Turns of resident tasks whose context the prefix "
                           "cache had evicted (re-prefilled)."),
}
# Store metric (a level) -> (Prometheus gauge name, help, scale).
LEVELS = {
    "kv_usage": ("tiderl_kv_cache_usage_ratio", "Share of the rollout engine's KV cache in use (0..1).", 1.0),
    "tasks_resident": ("tiderl_rank_resident_tasks", "Tasks resident on a rollout rank's engine (CTB).", 1.0),
    "tasks_paused": ("tiderl_rank_paused_tasks", "Tasks CTB holds paused on a rollout rank.", 1.0),
    "ctb_budget_tokens": ("tiderl_ctb_budget_tokens", "CTB's KV token budget on a rollout rank (adaptive: as it "
                          "moves).", 1.0),
    "logprob_mismatch_on_policy": ("tiderl_logprob_mismatch_on_policy", "Mean |trainer - engine| log-prob (nats) of "
                                   "the last step's tokens sampled with the weights it trained: the engine's own "
                                   "error (~1e-6 in fp32).", 1.0),
    "entropy": ("tiderl_policy_entropy", "Mean entropy (nats) of the policy over the last step's trained tokens.",
                1.0),
    "pg_loss": ("tiderl_trainer_pg_loss", "Policy-gradient part of the last step's GRPO loss, per trained token.", 1.0),
    "kl": ("tiderl_trainer_kl", "Mean KL(policy || reference) estimate over the last step's trained tokens.", 1.0),
    "grad_norm": ("tiderl_trainer_grad_norm", "Gradient norm of the last step, before clipping.", 1.0),
    "lr": ("tiderl_trainer_learning_rate", "Learning rate of the last step.", 1.0),
    "clip_frac": ("tiderl_trainer_clip_fraction", "Share of the last step's trained tokens whose ratio was clipped.",
                  1.0),
    "response_tokens_mean": ("tiderl_trainer_response_tokens_mean", "Mean response (trained) tokens per sequence of the last "
                             "step.", 1.0),
    "logprob_mismatch_stale": ("tiderl_logprob_mismatch_stale", "Mean |trainer - engine| log-prob (nats) of the last "
                               "step's tokens sampled with older weights: mostly the policy's change since.", 1.0),
}


class RunCollector(Collector):
    """The metric families of one run, rebuilt by `refresh` and served as they were last built."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._families: list[Metric] = []
        self._points = MetricCursor(list(COUNTERS) + list(LEVELS))
        self._totals: dict[tuple[str, str, str], float] = defaultdict(float)  # (name, rank, role) -> sum
        self._levels: dict[tuple[str, str, str], float] = {}  # (name, rank, role) -> latest value

    def describe(self) -> Iterable[Metric]:
        return []  # families are built by refresh; nothing to collect at registration time

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)

    def refresh(self, store: Any, limits: Any, *, now: float | None = None) -> None:
        """Read the store (new metric rows since the last refresh, run, ranks, buffer, steps, diagnosis)."""
        from tiderl.observe.diagnose import diagnose
        from tiderl.observe.status import snapshot

        now = time.time() if now is None else now
        self._read_points(store)
        info = store.run_info()
        steps = store.steps()
        snap = snapshot(store, limits, now=now)
        diag = diagnose(snap)
        fams: list[Metric] = []

        run = InfoMetricFamily("tiderl_run", "The run: name and system.")
        run.add_metric([], {"name": info.name, "system": info.system})
        state = GaugeMetricFamily("tiderl_run_state", "1 for the run's current state.", labels=["state"])
        for s in RUN_STATES:
            state.add_metric([s], 1.0 if info.state.value == s else 0.0)
        fams += [run, state, _gauge("tiderl_version", "Last published weights version.", info.version)]
        end = info.finished_at or now
        consumed = sum(s["consumed_tokens"] or 0 for s in steps)
        fams.append(CounterMetricFamily("tiderl_consumed_tokens", "Generated tokens the trainer consumed (trained).",
                                        value=consumed))
        fams.append(_gauge("tiderl_goodput_tokens_per_second", "Goodput of the whole run: trained generated tokens "
                           "per second of wall time.", consumed / max(end - info.created_at, 1e-9)))
        fams.append(_gauge("tiderl_seconds_since_progress", "Seconds since the last new weights version (or the "
                           "run's start).", snap.since_progress_s))
        fams.append(_gauge("tiderl_stalled", "1 when no version was published for longer than "
                           "monitor.stall_after_s.", 1.0 if diag.is_stalled else 0.0))
        fams += _step_families(steps)
        fams += _eval_families(store.reader.eval_rows())
        fams += self._rank_families(snap)
        fams += self._point_families()
        fams += _buffer_families(store.buffer_state())
        fams.append(_staleness_histogram(store.reader.staleness_counts()))
        findings = GaugeMetricFamily("tiderl_diagnosis_findings", "Findings of the diagnosis (tiderl status), by "
                                     "kind and severity.", labels=["kind", "severity"])
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for f in diag.findings:
            counts[(f.kind.value, f.severity.value)] += 1
        for (kind, severity), n in sorted(counts.items()):
            findings.add_metric([kind, severity], n)
        fams.append(findings)
        fams.append(self._endpoint_family())
        self._families = fams  # one assignment: a scrape sees the old or the new list, never half of one

    # ---- parts -------------------------------------------------------------------------------------
    def _read_points(self, store: Any) -> None:
        for r in self._points.read(store.reader):
            key = (r["name"], _label(r["rank"]), r["role"] or "")
            if r["name"] in COUNTERS:
                self._totals[key] += float(r["value"])
            else:
                self._levels[key] = float(r["value"])

    def _point_families(self) -> list[Metric]:
        fams: list[Metric] = []
        for name, (prom, help_text) in COUNTERS.items():
            fam = CounterMetricFamily(prom, help_text, labels=["rank", "role"])
            for (n, rank, role), value in sorted(self._totals.items()):
                if n == name:
                    fam.add_metric([rank, role], value)
            fams.append(fam)
        rate = GaugeMetricFamily("tiderl_prefix_cache_hit_ratio", "Prefix-cache hits / queries over the run, per "
                                 "rollout rank (0..1).", labels=["rank", "role"])
        for (n, rank, role), queries in sorted(self._totals.items()):
            if n == "prefix_cache_queries" and queries > 0:
                rate.add_metric([rank, role], self._totals.get(("prefix_cache_hits", rank, role), 0.0) / queries)
        fams.append(rate)
        for name, (prom, help_text, scale) in LEVELS.items():
            fam = GaugeMetricFamily(prom, help_text, labels=["rank", "role"])
            for (n, rank, role), value in sorted(self._levels.items()):
                if n == name:
                    fam.add_metric([rank, role], value * scale)
            fams.append(fam)
        return fams

    def _rank_families(self, snap: Any) -> list[Metric]:
        up = GaugeMetricFamily("tiderl_rank_up", "1 when the rank is running and heartbeating, else 0.",
                               labels=["rank", "role", "state"])
        age = GaugeMetricFamily("tiderl_rank_heartbeat_age_seconds", "Seconds since the rank's last heartbeat.",
                                labels=["rank", "role"])
        tasks = GaugeMetricFamily("tiderl_rank_running_tasks", "Store tasks the rank runs.", labels=["rank", "role"])
        for r in snap.ranks:
            healthy = r.state in ("starting", "running") and (r.heartbeat_age_s or 0) <= 2 * snap.limits.heartbeat_s
            up.add_metric([str(r.rank), r.role, r.state], 1.0 if healthy else 0.0)
            age.add_metric([str(r.rank), r.role], r.heartbeat_age_s or 0.0)
            tasks.add_metric([str(r.rank), r.role], r.running_tasks)
        return [up, age, tasks]

    def _endpoint_family(self) -> Metric:
        fam = InfoMetricFamily("tiderl_endpoint", "Prometheus endpoints of the run's processes (control plane, "
                               "ranks with their vLLM metrics).", labels=["process"])
        folder = self.run_dir / METRICS_DIR
        for f in sorted(folder.glob("*.url")) if folder.is_dir() else []:
            fam.add_metric([f.stem], {"url": f.read_text().strip()})
        return fam


def _step_families(steps: list[dict[str, Any]]) -> list[Metric]:
    last = steps[-1] if steps else {}
    fams = [
        _gauge("tiderl_step_goodput_tokens_per_second", "Goodput of the last step: its trained tokens / its "
               "duration.", last.get("goodput_tok_s")),
        _gauge("tiderl_step_duration_seconds", "Duration of the last step.", last.get("duration_s")),
        _gauge("tiderl_step_ras_microbatches", "RAS of the last step: ready micro-batches when it began.",
               last.get("ras")),
        _gauge("tiderl_step_tprm_seconds", "TPRM of the last step: mean interval between later micro-batch "
               "arrivals.", last.get("tprm_s")),
        _gauge("tiderl_step_max_staleness_versions", "Largest staleness among the last step's trajectories.",
               last.get("max_staleness")),
        _gauge("tiderl_step_loss", "GRPO loss of the last step.", last.get("loss")),
    ]
    mode = GaugeMetricFamily("tiderl_step_ra2p_mode", "1 for the RA2P mode of the last step.", labels=["mode"])
    if last.get("ra2p_mode"):
        mode.add_metric([last["ra2p_mode"]], 1.0)
    fams.append(_gauge("tiderl_train_reward_mean", "Mean reward of the last step's trajectories.",
                       last.get("reward_mean")))
    fams.append(_gauge("tiderl_train_success_rate", "Success rate (0..1) of the last step's trajectories.",
                       last.get("success_rate")))
    fams.append(_gauge("tiderl_train_turns_mean", "Mean agent turns per task of the last step's trajectories.",
                       last.get("turns_mean")))
    fams.append(_gauge("tiderl_train_turns_max", "Most agent turns of a task among the last step's trajectories.",
                       last.get("turns_max")))
    envs = last.get("env_figures") or {}
    for key, prom, help_text in (
            ("reward_mean", "tiderl_train_env_reward_mean", "Mean reward of the last step's trajectories of "
             "each environment."),
            ("success_rate", "tiderl_train_env_success_rate", "Success rate (0..1) of the last step's "
             "trajectories of each environment."),
            ("num_trajectories", "tiderl_train_env_trajectories", "Trajectories of each environment the last "
             "step trained.")):
        fam = GaugeMetricFamily(prom, help_text, labels=["env"])
        for env, figures in envs.items():
            fam.add_metric([env], float(figures[key]))
        fams.append(fam)
    return fams + [mode]


def _eval_families(evals: list[dict[str, Any]]) -> list[Metric]:
    done = [e for e in evals if e["success_rate"] is not None]
    if not done:
        return []
    last = done[-1]
    return [_gauge("tiderl_eval_version", "Weights version of the last evaluation (its tasks may still run).",
                   last["eval_version"]),
            _gauge("tiderl_eval_success_rate", "Success rate (0..1) of the last evaluation.", last["success_rate"]),
            _gauge("tiderl_eval_reward_mean", "Mean reward of the last evaluation.", last["reward_mean"])]


def _buffer_families(b: BufferState) -> list[Metric]:
    tasks = GaugeMetricFamily("tiderl_tasks", "Tasks by state.", labels=["state"])
    for s, n in (("pending", b.tasks_pending), ("running", b.tasks_running), ("done", b.tasks_done),
                 ("failed", b.tasks_failed)):
        tasks.add_metric([s], n)
    traj = GaugeMetricFamily("tiderl_trajectories", "Trajectories by state (waiting: for the rest of its group).",
                             labels=["state"])
    for s, n in (("waiting", b.traj_waiting_group), ("ready", b.traj_ready), ("claimed", b.traj_claimed),
                 ("consumed", b.traj_consumed)):
        traj.add_metric([s], n)
    return [tasks, traj, _gauge("tiderl_ready_tokens", "Tokens of ready (trainable) trajectories.", b.ready_tokens),
            _gauge("tiderl_ready_groups", "Complete training groups waiting for the trainer.", b.groups_ready)]


def _staleness_histogram(rows: list[dict[str, Any]]) -> Metric:
    counts = {int(r["staleness"]): int(r["trajectories"]) for r in rows if r["staleness"] is not None}
    top = max([3, *counts])
    buckets, running = [], 0
    for bound in range(top + 1):
        running += counts.get(bound, 0)
        buckets.append((str(float(bound)), running))
    buckets.append(("+Inf", running))
    return HistogramMetricFamily("tiderl_trajectory_staleness_versions", "Staleness of trained trajectories "
                                 "(versions between their oldest weights and the weights trained).",
                                 buckets=buckets, sum_value=float(sum(k * n for k, n in counts.items())))


def _gauge(name: str, help_text: str, value: float | None) -> Metric:
    fam = GaugeMetricFamily(name, help_text)
    if value is not None:
        fam.add_metric([], float(value))
    return fam


def _label(rank: int | None) -> str:
    return "control" if rank is None or rank < 0 else str(rank)


# ---- serving -------------------------------------------------------------------------------------------
def endpoint_url(host: str, port: int) -> str:
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}/metrics"


def _serve(registry: Any, run_dir: Path, name: str, host: str, port: int) -> tuple[Any, str]:
    from tiderl.paths import atomic_write_text

    server, _ = start_http_server(port, addr=host, registry=registry)
    url = endpoint_url(host, server.server_port)
    atomic_write_text(Path(run_dir) / METRICS_DIR / f"{name}.url", url + "\n")
    return server, url


class MetricsServer:
    """The control plane's endpoint: start it, `tick()` it from the loop, `close()` it at the end."""

    def __init__(self, run_dir: Path, store: Any, config: Any) -> None:
        from tiderl.observe.status import limits_of

        self.store = store
        self.interval_s = config.monitor.metrics_interval_s
        self.limits = limits_of(config)
        self.registry = CollectorRegistry()
        self.collector = RunCollector(run_dir)
        self.registry.register(self.collector)
        self._server, self.url = _serve(self.registry, run_dir, "control", config.monitor.metrics_host,
                                        config.monitor.metrics_port)
        self.collector.refresh(store, self.limits)  # after serving: the endpoint lists its own URL
        self._next_at = time.monotonic() + self.interval_s
        log.info("Prometheus metrics at %s", self.url)

    @classmethod
    def start(cls, run_dir: Path, store: Any, config: Any) -> "MetricsServer | None":
        """The endpoint, or None when `monitor.metrics_port` is null."""
        return None if config.monitor.metrics_port is None else cls(run_dir, store, config)

    def tick(self) -> None:
        if time.monotonic() < self._next_at:
            return
        self._next_at = time.monotonic() + self.interval_s
        try:
            self.collector.refresh(self.store, self.limits)
        except StoreError as e:  # the store stayed locked: serve the last refresh, try again next interval
            log.warning("metrics not refreshed: %s", e)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_process_metrics(run_dir: Path, config: Any, rank: int) -> tuple[Any, str] | None:
    """Serve this process's default prometheus-client registry (where vLLM records its `vllm:*` metrics)
    on `monitor.metrics_port + 1 + rank` (port 0: a free port), from a daemon thread. For a rank process;
    the URL is written to RUN_DIR/metrics/rank{R}.url. Returns (server, url); None when the metrics
    endpoint is off (`monitor.metrics_port: null`)."""
    port = config.monitor.metrics_port
    if port is None:
        return None
    return _serve(REGISTRY, run_dir, f"rank{rank}", config.monitor.metrics_host, port + 1 + rank if port else 0)
