"""`monitor:` section: stall detection for `tiderl status` and the control plane's Prometheus endpoint."""

from __future__ import annotations

from tiderl.config.schema import option, section


@section
class MonitorConfig:
    stall_after_s: float = option(
        900.0,
        gt=0,
        help="A running run that has published no new weights version for this long is stalled: "
        "`tiderl status` says so, names the likely culprit and `--check` exits 1. Leave room for the "
        "engines' start-up (minutes on a loaded machine) and for the slowest step.",
    )
    slow_task_s: float = option(
        300.0,
        gt=0,
        help="A task running this long on one rank is named in the diagnosis as a slow task.",
    )
    max_on_policy_mismatch: float = option(
        1e-3,
        gt=0,
        help="`tiderl status` warns when the last step's on-policy log-prob mismatch (the mean |trainer - engine| "
        "log-probability of the tokens sampled with the weights being trained) passes this many nats: the engine "
        "then does not serve the published weights. fp32 on CPU measures ~1e-6 (docs/RESULTS.md); bf16 engines "
        "differ more (raise it there).",
    )
    metrics_port: int | None = option(
        None,
        ge=0,
        help="Port of the control plane's Prometheus endpoint (`/metrics`); 0 picks a free port "
        "(written to RUN_DIR/metrics/control.url); null: no endpoint.",
    )
    metrics_host: str = option(
        "0.0.0.0", help="Address the Prometheus endpoint listens on (0.0.0.0: every interface of the node)."
    )
    tensorboard: bool = option(
        True,
        help="Write the run's per-step figures (reward, success, KL, clip fraction, log-prob mismatch, goodput, "
        "RWT/TWT, roles, evaluations) as TensorBoard event files in RUN_DIR/tensorboard/ "
        "(`tensorboard --logdir RUN_DIR/tensorboard`), every `metrics_interval_s`.",
    )
    wandb: bool = option(
        False,
        help="Also log those figures to Weights & Biases in offline mode, under RUN_DIR/wandb/ (upload later: "
        "`wandb sync` on the offline run it holds), when the `wandb` package is installed (it is not a "
        "dependency: `pip install wandb`).",
    )
    metrics_interval_s: float = option(
        2.0, gt=0, help="Seconds between two refreshes of the Prometheus metrics from the run store."
    )
