"""Attacks on the run's files and the job config, as an ordinary local user would try them: each case
runs the real `tiderl` command line on real files and says whether the attack was blocked.

`CASES` is a list of zero-argument callables, each returning {"case": name, "blocked": bool,
"evidence": str}; `tools/attack.py` runs them with the env-server cases. On its own:

    python tools/attack_store.py            # one JSON line per case; exit 1 if any case was not blocked
    python tools/attack_store.py --case corrupt_store

Cases:
- alias_bomb: six levels of YAML anchors in `env.options` (millions of values from a dozen lines):
  `tiderl config`, `run` and `submit` must exit 2 quickly, naming the file, creating nothing.
- corrupt_store: pages of run.db overwritten: `status`, `status --check`, `report`, `logs` and
  `run --resume` exit 2 with one line naming the file and what to do, no traceback.
- empty_store: an empty run.db: the same commands exit 2 with one line, no traceback.
- run_name_traversal: `--set name=../../x` must exit 2 before anything is created.
- file_modes_umask_002: a run created under umask 002: its files 0600, its directories 0700,
  and what its processes write later too.
- tampered_base_model: the base model (version 0) changed after the run's first launch: a resume
  is refused, naming the model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "jobs" / "quickstart.yaml"
COMMAND_TIMEOUT_S = 60.0

BOMB_OPTIONS = """    a: &a ["x","x","x","x","x","x","x","x","x"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
"""


def tiderl(*args: str, umask: int | None = None, timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, str, str, float]:
    """`python -m tiderl ARGS` in a child process: (exit code, stdout, stderr, seconds). A command that
    runs past `timeout_s` is killed and reported as exit 124."""
    started = time.monotonic()
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    try:
        proc = subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, preexec_fn=preexec)
    except subprocess.TimeoutExpired as e:
        return 124, str(e.stdout or ""), str(e.stderr or ""), time.monotonic() - started
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started


def python(code: str, *args: str, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    """A Python snippet in a child process (so that a umask or a run created stays out of this one)."""
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, preexec_fn=preexec, check=True)


MAKE_RUN = """
import sys
from pathlib import Path
from tiderl.config import load_job
from tiderl.rundir import create_run, model_checksum
from tiderl.store.types import RunState
run_dir, state, model = Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
_, store = create_run(load_job(sys.argv[4] if len(sys.argv) > 4 else "jobs/quickstart.yaml"), run_dir)
if model:
    store.register_initial_version(model, model_checksum(Path(model)))
else:
    store.register_initial_version("weights/v0", "0")
store.set_run_state(RunState(state))
store.close()
"""


def make_run(run_dir: Path, state: str = "cancelled", model: Path | None = None, umask: int | None = None) -> None:
    python(MAKE_RUN, str(run_dir), state, str(model or ""), umask=umask)


def corrupt_pages(db: Path, tables: tuple[str, ...] = ("metrics", "trajectories", "versions", "ranks", "tasks")) -> None:
    """Overwrite the root pages of `tables` with garbage: the file still opens, its run row still reads,
    and the damage is found by the first query that reaches those pages."""
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = con.execute("PRAGMA page_size").fetchone()[0]
    marks = ",".join("?" * len(tables))
    pages = [r[0] for r in con.execute(f"SELECT rootpage FROM sqlite_master WHERE name IN ({marks})", tables)]
    con.close()
    with open(db, "r+b") as f:
        for page in pages:
            f.seek((page - 1) * page_size)
            f.write(b"\xff" * page_size)


def _one_line_exit_2(label: str, result: tuple[int, str, str, float], must: tuple[str, ...]) -> tuple[bool, str]:
    code, _, err, seconds = result
    lines = [line for line in err.splitlines() if line.startswith(("tiderl ", "Traceback")) or "Error" in line]
    error_lines = [line for line in lines if not line.startswith("tiderl report: ") or "corrupt" in line
                   or "no run" in line]
    ok = (code == 2 and "Traceback" not in err and len(error_lines) == 1
          and all(m in error_lines[0] for m in must))
    said = error_lines[0] if error_lines else (err.strip().splitlines() or [""])[-1]
    return ok, f"{label}: exit {code} in {seconds:.1f} s: {said[:200]}"


def _store_commands(run_dir: Path) -> list[tuple[str, list[str]]]:
    return [("status", ["status", str(run_dir), "--no-probe"]),
            ("status --check", ["status", str(run_dir), "--check", "--no-probe"]),
            ("report", ["report", str(run_dir), "--out", str(run_dir.parent / "report")]),
            ("logs", ["logs", str(run_dir)])]


# ---- cases ------------------------------------------------------------------------------------------


def alias_bomb() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tiderl-attack-") as tmp:
        job = Path(tmp) / "bomb.yaml"
        job.write_text(f"name: bomb\nlaunch:\n  runs_dir: {tmp}/runs\nenv:\n  name: hilo\n  options:\n"
                       + BOMB_OPTIONS)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        results = [("config", tiderl("config", str(job))),
                   ("run", tiderl("run", str(job))),
                   ("submit", tiderl("submit", str(job)))]
        peak_mib = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
        checks = [_one_line_exit_2(name, r, (str(job), "aliases expand")) for name, r in results]
        fast = all(r[3] < 10 for _, r in results)
        created = (Path(tmp) / "runs").exists()
    blocked = all(ok for ok, _ in checks) and fast and not created and peak_mib < 1024
    return {"case": "alias_bomb", "blocked": blocked,
            "evidence": "; ".join(e for _, e in checks) + f"; runs_dir created: {created}; "
                        f"largest child RSS {peak_mib:.0f} MiB"}


def _store_case(name: str, damage: Callable[[Path], None], must: tuple[str, ...]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tiderl-attack-") as tmp:
        run_dir = Path(tmp) / "run"
        make_run(run_dir)
        damage(run_dir / "run.db")
        checks = [_one_line_exit_2(label, tiderl(*argv), must) for label, argv in _store_commands(run_dir)]
        checks.append(_one_line_exit_2("run --resume", tiderl("run", "--resume", str(run_dir)), must))
    return {"case": name, "blocked": all(ok for ok, _ in checks), "evidence": "; ".join(e for _, e in checks)}


def corrupt_store() -> dict[str, Any]:
    def damage(db: Path) -> None:
        corrupt_pages(db)

    result = _store_case("corrupt_store", damage, ("run.db is corrupt", "restore"))
    return result


def empty_store() -> dict[str, Any]:
    def damage(db: Path) -> None:
        for suffix in ("-wal", "-shm"):
            db.with_name(db.name + suffix).unlink(missing_ok=True)
        db.write_bytes(b"")

    return _store_case("empty_store", damage, ("run.db", "no run recorded"))


def run_name_traversal() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tiderl-attack-") as tmp:
        runs = Path(tmp) / "a" / "b" / "runs"
        escape = Path(tmp) / "escaped"
        checks = []
        for name in ("../../../escaped", "..", "a/b", ""):
            result = tiderl("run", str(QUICKSTART), "--set", f"name={name}", "--set", f"launch.runs_dir={runs}")
            checks.append(_one_line_exit_2(f"name={name!r}", result, ("name",)))
        created = [str(p.relative_to(tmp)) for p in Path(tmp).rglob("*")]
    blocked = all(ok for ok, _ in checks) and not created and not escape.exists()
    return {"case": "run_name_traversal", "blocked": blocked,
            "evidence": "; ".join(e for _, e in checks) + f"; created under the temporary directory: {created}"}


LATER_WRITES = """
import subprocess, sys
from pathlib import Path
from tiderl.paths import RunPaths, atomic_write_text
from tiderl.run.launcher import prepare
launch = prepare(Path("jobs/quickstart.yaml"), [], Path(sys.argv[1]), None)  # as `tiderl run` starts
paths = launch.paths
launch.store.close()
atomic_write_text(paths.root / "summary.md", "# run\\n")
open(paths.rank_log(0), "a").close()  # as the launcher opens a rank's log
(paths.weights / "v1").mkdir()  # as the trainer publishes a version
subprocess.run([sys.executable, "-c", "open(%r, 'w').close()" % str(paths.ckpt / "child.txt")], check=True)
"""


def file_modes_umask_002() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tiderl-attack-") as tmp:
        run_dir = Path(tmp) / "run"
        python(LATER_WRITES, str(run_dir), umask=0o002)
        modes = {str(p.relative_to(tmp)): (p.is_dir(), stat.S_IMODE(p.stat().st_mode))
                 for p in [run_dir, *run_dir.rglob("*")]}
    wrong = {p: oct(m) for p, (is_dir, m) in modes.items() if m != (0o700 if is_dir else 0o600)}
    return {"case": "file_modes_umask_002", "blocked": len(modes) > 5 and not wrong,
            "evidence": f"{len(modes)} paths of a run made under umask 002; not 0600 (files) or 0700 "
                        f"(directories): {wrong or 'none'}"}


def tampered_base_model() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tiderl-attack-") as tmp:
        model = Path(tmp) / "base-model"
        model.mkdir()
        weights = model / "model.safetensors"
        weights.write_bytes(os.urandom(4096))
        run_dir = Path(tmp) / "run"
        make_run(run_dir, "cancelled", model)
        data = bytearray(weights.read_bytes())
        data[100] ^= 0xFF  # one byte of the base model changed after the run's first launch
        weights.write_bytes(bytes(data))
        ok, evidence = _one_line_exit_2("run --resume", tiderl("run", "--resume", str(run_dir)),
                                        ("base model", str(model), "refused"))
    return {"case": "tampered_base_model", "blocked": ok, "evidence": evidence}


CASES: list[Callable[[], dict[str, Any]]] = [alias_bomb, corrupt_store, empty_store, run_name_traversal,
                                             file_modes_umask_002, tampered_base_model]


def run_case(case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A case's result; a case that itself fails is reported as not blocked, with its error."""
    try:
        return case()
    except Exception as e:  # the attack tool reports every case, whatever one of them does
        return {"case": case.__name__, "blocked": False, "evidence": f"the case failed: {type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=[c.__name__ for c in CASES],
                        help="Run only this case (repeatable); default: all.")
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if args.case is None or c.__name__ in args.case]
    results = []
    for case in chosen:
        result = run_case(case)
        results.append(result)
        print(json.dumps(result), flush=True)
    return 0 if all(r["blocked"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
