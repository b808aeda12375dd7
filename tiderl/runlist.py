"""The runs under a directory (`launch.runs_dir`, e.g. `runs/`): what `tiderl status runs/` lists, one line each."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tiderl.store.location import POINTER_FILE


def list_runs(parent: Path) -> list[dict[str, Any]]:
    """Each run directory directly under `parent` (name, directory, state, version, last update), the most
    recently updated first; a run directory whose store cannot be read is listed with `error` instead."""
    from tiderl.rundir import RunDirError, open_run

    try:
        children = sorted(p for p in Path(parent).iterdir() if p.is_dir())
    except OSError:
        return []
    runs = []
    for child in children:
        if not ((child / "run.db").is_file() or (child / POINTER_FILE).is_file()):
            continue
        try:
            _, store = open_run(child, read_only=True)
        except RunDirError as e:
            runs.append({"dir": child.name, "name": None, "state": None, "version": None, "updated_at": None,
                         "error": str(e)})
            continue
        try:
            info = store.run_info()
        finally:
            store.close()
        runs.append({"dir": child.name, "name": info.name, "state": info.state.value, "version": info.version,
                     "updated_at": info.updated_at})
    return sorted(runs, key=lambda r: -(r["updated_at"] or 0.0))


def render_runs(runs: list[dict[str, Any]], now: float | None = None) -> str:
    now = time.time() if now is None else now
    width = max(len("run directory"), *(len(r["dir"]) for r in runs))
    lines = [f"{'run directory':<{width}}  {'name':<16}  {'state':<9}  version  last update"]
    for r in runs:
        if r.get("error"):
            lines.append(f"{r['dir']:<{width}}  cannot be read: {r['error']}")
            continue
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated_at"]))
        lines.append(f"{r['dir']:<{width}}  {r['name']:<16}  {r['state']:<9}  {r['version']:>7}  {stamp} "
                     f"({_ago(now - r['updated_at'])} ago)")
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} days"
