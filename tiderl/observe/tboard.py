"""TensorBoard event files of a run, written by the control plane (`monitor.tensorboard`), and the same
scalars to a Weights & Biases run in offline mode (`monitor.wandb`, when the `wandb` package is installed).

One writer per run: the control plane reads the run store every `monitor.metrics_interval_s` and
writes what is new to `RUN_DIR/tensorboard/` (`tensorboard --logdir RUN_DIR/tensorboard`). The step
of every scalar is the weights version a training step published, so curves of a resumed or restarted
run continue where they were: the versions and metric rows already written are kept in
`RUN_DIR/tensorboard/written.json`, and a restarted control plane carries on from there.

Scalars: `train/` (success rate, reward, turns per task (mean, max), trained tokens, step seconds, RAS, TPRM,
staleness; `reward_mean/ENV` and `success_rate/ENV` of each environment the step trained, written for every step
even when the job plays one environment: `tiderl.store.step_figures`),
`trainer/` (loss, gradient norm, learning rate, response length, policy entropy, KL, clip fraction, log-prob
mismatch, importance weights: the actor's step metrics, ACTOR_METRICS),
`wait/` (RWT and TWT seconds so far: the slope is the waiting), `roles/` (ranks per role of the version's plan),
`eval/` (success rate of each evaluation once all its tasks are in, with its 95% interval) and
`throughput/goodput_tok_s`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tiderl.evalstats import wilson_interval
from tiderl.paths import DISK_FULL_ERRNOS, atomic_write_text
from tiderl.store.cursor import MetricCursor
from tiderl.store.engine import StoreError

log = logging.getLogger(__name__)
TB_DIR = "tensorboard"
STEP_SCALARS = {"success_rate": "train/success_rate", "reward_mean": "train/reward_mean",
                "turns_mean": "train/turns_mean", "turns_max": "train/turns_max",
                "consumed_tokens": "train/consumed_tokens", "duration_s": "train/step_s", "ras": "train/ras",
                "tprm_s": "train/tprm_s", "max_staleness": "train/max_staleness",
                "goodput_tok_s": "throughput/goodput_tok_s"}
ACTOR_METRICS = ("loss", "pg_loss", "grad_norm", "lr", "response_tokens_mean", "entropy", "kl", "clip_frac",
                 "logprob_mismatch_on_policy", "logprob_mismatch_stale", "is_weight_mean", "is_truncated_frac", "staleness_max",
                 "train_s", "chunks")
ENV_SCALARS = ("reward_mean", "success_rate")  # of each environment: train/reward_mean/ENV, train/success_rate/ENV
WAITS = ("rwt_s", "twt_s")


class TensorBoardLog:
    """`tick()` it from the control loop; `close()` it at the end."""

    def __init__(self, run_dir: Path, store: Any, *, interval_s: float, eval_tasks: int,
                 tensorboard: bool = True, wandb: bool = False, run_name: str = "run") -> None:
        self.dir = Path(run_dir) / TB_DIR
        self.store = store
        self.interval_s = interval_s
        self.eval_tasks = eval_tasks
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writers: list[Any] = []
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writers.append(SummaryWriter(log_dir=str(self.dir)))
        if wandb:
            self.writers.append(WandbWriter(Path(run_dir), run_name))
        state = self._load()
        self.version = int(state.get("version", 0))  # steps of versions up to this one are written
        self.points = MetricCursor(ACTOR_METRICS + WAITS, settled=int(state.get("metric_id", 0)),
                                   seen=state.get("metric_seen", []))
        self.evals = set(state.get("evals", []))
        self.waits: dict[str, float] = {n: float(state.get(n, 0.0)) for n in WAITS}
        self._next_at = 0.0

    @classmethod
    def start(cls, run_dir: Path, store: Any, config: Any) -> "TensorBoardLog | None":
        tensorboard, wandb = config.monitor.tensorboard, config.monitor.wandb
        if tensorboard and importlib.util.find_spec("tensorboard") is None:  # torch's SummaryWriter needs it
            log.warning("monitor.tensorboard is on but the tensorboard package is not installed: no event files")
            tensorboard = False
        if wandb and importlib.util.find_spec("wandb") is None:
            log.warning("monitor.wandb is on but the wandb package is not installed (pip install wandb): no W&B run")
            wandb = False
        if not (tensorboard or wandb):
            return None
        r = config.rollout
        return cls(run_dir, store, interval_s=config.monitor.metrics_interval_s,
                   eval_tasks=r.eval_groups * r.eval_group_size,
                   tensorboard=tensorboard, wandb=wandb, run_name=config.name)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        for w in self.writers:
            w.add_scalar(tag, value, step)

    def _load(self) -> dict[str, Any]:
        try:
            return json.loads((self.dir / "written.json").read_text())
        except (OSError, ValueError):
            return {}

    def tick(self, force: bool = False) -> None:
        if not force and time.monotonic() < self._next_at:
            return
        self._next_at = time.monotonic() + self.interval_s
        try:
            self._write()
        except StoreError as e:
            log.warning("TensorBoard not updated: %s", e)
        except OSError as e:
            # A full disk must not end the control plane that hosts this writer: the event files are a
            # view of the store, and the next tick writes what this one could not.
            if e.errno not in DISK_FULL_ERRNOS:
                raise
            log.warning("TensorBoard not updated, the disk is full: %s", e)

    def _write(self) -> None:
        for row in self.points.read(self.store.reader):
            v = row["version"]
            if row["name"] in WAITS:
                self.waits[row["name"]] += float(row["value"])
            elif v is not None:  # the actor's metrics of the step that trained version v: that step published v + 1
                self._scalar(f"trainer/{row['name']}", float(row["value"]), int(v) + 1)
        for s in self.store.steps():
            v = int(s["version"])
            if v <= self.version:
                continue
            for key, tag in STEP_SCALARS.items():
                if s.get(key) is not None:
                    self._scalar(tag, float(s[key]), v)
            for env, figures in (s.get("env_figures") or {}).items():
                for key in ENV_SCALARS:
                    self._scalar(f"train/{key}/{env}", float(figures[key]), v)
            for name, value in self.waits.items():
                self._scalar(f"wait/{name}", value, v)
            plan = self.store.plan_at(v)
            if plan is not None:
                counts: dict[str, int] = defaultdict(int)
                for role in plan.roles.values():
                    counts[role.value] += 1
                for role in ("rollout", "actor", "ref", "idle"):
                    self._scalar(f"roles/{role}", counts.get(role, 0), v)
            self.version = v
        for e in self.store.view("eval_summary"):
            v, n = int(e["eval_version"]), int(e["num_tasks"] or 0)
            if v in self.evals or e["success_rate"] is None or n < self.eval_tasks:
                continue
            low, high = wilson_interval(round(e["success_rate"] * n), n)
            self._scalar("eval/success_rate", float(e["success_rate"]), v)
            self._scalar("eval/success_rate_low95", low, v)
            self._scalar("eval/success_rate_high95", high, v)
            self.evals.add(v)
        for w in self.writers:
            w.flush()
        atomic_write_text(self.dir / "written.json", json.dumps(
            {"version": self.version, "metric_id": self.points.settled, "metric_seen": sorted(self.points.seen),
             "evals": sorted(self.evals)} | self.waits))

    def close(self) -> None:
        self.tick(force=True)
        try:
            for w in self.writers:
                w.close()
        except OSError as e:
            if e.errno not in DISK_FULL_ERRNOS:
                raise
            log.warning("TensorBoard event file not closed cleanly, the disk is full: %s", e)


class WandbWriter:
    """TensorBoard's `add_scalar` to a Weights & Biases run in offline mode, under RUN_DIR/wandb/ (upload later
    with `wandb sync` on the offline run there). Every scalar is plotted against `version`, the weights
    version of its step; the run's id is the run directory's, so a restarted control plane resumes it."""

    def __init__(self, run_dir: Path, name: str) -> None:
        import hashlib

        import wandb

        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(mode="offline", dir=str(run_dir), project="tiderl", name=name, id=run_id,
                              resume="allow")
        self.run.define_metric("version")
        self.run.define_metric("*", step_metric="version")

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value, "version": step})

    def flush(self) -> None:
        """W&B writes its offline files itself."""

    def close(self) -> None:
        self.run.finish()
