"""tools/attack.py runs its campaign as an ordinary user too (issue 48: as root and as an ordinary user)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="creating the user and its mount namespace needs root, unshare and setpriv")
def test_a_case_runs_as_the_ordinary_user_with_the_interpreter_reachable() -> None:
    parked = set(Path("/tmp").glob("tiderl-attack-*"))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "attack.py"), "--case", "huge_option", "--as", "user"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert set(Path("/tmp").glob("tiderl-attack-*")) <= parked  # its home and the namespace's binds are gone
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(d["case"], d["blocked"]) for d in lines] == [("huge_option", True)]
    assert lines[0]["as"] not in ("root", ""), lines[0]
    assert "bad_options" in lines[0]["evidence"]

