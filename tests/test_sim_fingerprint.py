"""tools/sim_fingerprint.py: a run's goodput and per-step digest, equal for equal runs and apart for a changed
decision (a few steps of the simulator)."""

from __future__ import annotations

import json

import sim_fingerprint


def test_equal_runs_give_equal_digests_and_an_ablated_rule_that_acts_does_not(capsys) -> None:
    for _ in range(2):
        sim_fingerprint.main(["--systems", "tiderl,tiderl~slot_bound", "--pairs", "bench-latency:cpu",
                              "--seeds", "0", "--steps", "12", "--jobs", "1"])
    first, second = (json.loads(line)["runs"] for line in capsys.readouterr().out.splitlines())
    assert first == second  # the simulator is deterministic: a refactor must keep every digest
    kept, ablated = first["bench-latency:cpu|tiderl"][0], first["bench-latency:cpu|tiderl~slot_bound"][0]
    assert kept[0] > 0 and len(kept[1]) == 12
    assert kept[1] != ablated[1]  # the slot bound decides within 12 steps here: the digest sees it


def test_the_tree_given_runs_its_own_package(tmp_path) -> None:
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    root = Path(sim_fingerprint.__file__).resolve().parents[1]
    tree = tmp_path / "other"
    shutil.copytree(root / "tiderl", tree / "tiderl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "jobs" / "sim", tree / "jobs" / "sim")
    with (tree / "tiderl" / "__init__.py").open("a") as f:
        f.write("\nimport sys as _sys\nprint('the other tree', file=_sys.stderr)\n")
    done = subprocess.run([sys.executable, str(root / "tools" / "sim_fingerprint.py"), "--systems", "tiderl",
                           "--pairs", "bench-latency:cpu", "--seeds", "0", "--steps", "2", "--jobs", "1",
                           "--tree", str(tree)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "the other tree" in done.stderr and json.loads(done.stdout)["runs"]["bench-latency:cpu|tiderl"]
    # In an interpreter that already runs this checkout's package, another tree cannot be honoured.
    with pytest.raises(SystemExit, match="already runs"):
        sim_fingerprint.main(["--systems", "tiderl", "--pairs", "bench-latency:cpu", "--tree", str(tree)])
