"""Observability: what a run is doing, read from its store and its files, for a person or a scraper.

    status.py          the status document (`collect`, `status_document`): state, version, ranks and roles,
                       buffer, goodput, a diagnosis; its rendering, the launcher's progress line and summary
    diagnose.py        who waits for what: a snapshot in, findings out (pure; its records: diagnose_types.py)
    metrics.py         the control plane's Prometheus exporter, and the rollout ranks' own endpoints
    tboard.py          TensorBoard event files (and W&B offline) of the run's steps, written by the control plane
    logs.py            a run's log files: naming, prefixes, timestamps, engine chatter, merging, reading on
    progress.py        one live progress line for a long operation a person waits for
    report/            `tiderl report`'s figures (PNG) and Markdown summary

The commands `tiderl status`, `tiderl report` and `tiderl logs` are `tiderl.observe_cli`: they ask Slurm for
the run's jobs, so they sit above `run/` and `slurm/`, while this package sits below them (the launcher,
the control plane, the ranks and `tiderl submit --wait` use it).

The entry points other packages use are named here and load their module only when first named
(`from tiderl.observe import MetricsServer`), so `import tiderl.observe` loads no SQLAlchemy, matplotlib,
prometheus-client or torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiderl.observe.metrics import MetricsServer, serve_process_metrics
    from tiderl.observe.progress import Progress
    from tiderl.observe.status import collect, progress_line, steady_of, summary
    from tiderl.observe.tboard import TensorBoardLog

_LAZY = {  # name -> the module that defines it
    "collect": "tiderl.observe.status", "progress_line": "tiderl.observe.status",
    "steady_of": "tiderl.observe.status", "summary": "tiderl.observe.status",
    "MetricsServer": "tiderl.observe.metrics", "serve_process_metrics": "tiderl.observe.metrics",
    "TensorBoardLog": "tiderl.observe.tboard",
    "Progress": "tiderl.observe.progress",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["MetricsServer", "Progress", "TensorBoardLog", "collect", "progress_line", "serve_process_metrics",
           "steady_of", "summary"]
