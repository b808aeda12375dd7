"""`tiderl sim` shows signs of life on stderr while it runs, and names a swap of its two files."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

from tiderl.sim import report
from tiderl.sim.cli import SimProgress
from tiderl.sim.systems import parse_system

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD, CLUSTER = "jobs/sim/hilo-bench.workload.yaml", "jobs/sim/cpu.cluster.yaml"


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", "sim", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_swapped_arguments_say_which_is_which() -> None:
    out = _sim(CLUSTER, WORKLOAD, "--steps", "2")
    assert out.returncode == 2
    assert "unknown key" not in out.stderr
    assert f"{CLUSTER}: this is a cluster file (it has num_gpus), given as the first argument, the workload" in out.stderr
    assert f"tiderl sim {WORKLOAD} {CLUSTER}" in out.stderr


def test_a_line_per_finished_simulation_on_stderr() -> None:
    out = _sim(WORKLOAD, CLUSTER, "--system", "tiderl", "--steps", "3", "--json")
    assert out.returncode == 0, out.stderr
    assert "tiderl sim: 1/1 simulations done (tiderl@" in out.stderr
    assert out.stdout.startswith("{")  # stdout keeps only the JSON


def test_run_many_tells_of_each_result_and_keeps_the_order() -> None:
    systems = [parse_system("tiderl@0.5"), parse_system("sync")]
    heard: list[tuple[int, int, str]] = []
    results = report.run_many(WORKLOAD, CLUSTER, systems, 2, 0, 2, lambda n, total, r: heard.append((n, total, r["system"])))
    assert [n for n, _, _ in heard] == [1, 2] and {t for _, t, _ in heard} == {2}
    assert sorted(s for _, _, s in heard) == sorted(r["system"] for r in results)
    assert results[0]["system"].startswith("tiderl") and results[1]["system"].startswith("sync")


def test_progress_beats_while_nothing_finishes() -> None:
    out = io.StringIO()
    progress = SimProgress(out, every_s=0.2)
    time.sleep(2.5)
    progress.done(1, 1, {"system": "tiderl"})
    lines = out.getvalue().splitlines()
    assert any(line.startswith("tiderl sim: simulating (0 simulations done)") for line in lines)
    assert lines[-1].startswith("tiderl sim: 1/1 simulations done (tiderl)")
