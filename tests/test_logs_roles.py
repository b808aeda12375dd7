"""`tiderl logs`: a rank's line carries the role the rank had when it wrote it, not its role now."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path

from tiderl.config import load_job
from tiderl.observe.logs import Cursor, read_lines
from tiderl.rundir import create_run
from tiderl.store import Role

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 12, 1, 14, 0)

# As tiderl.run.rank writes them: a ref rank that ERS moved to rollout at version 2, then a restart.
RANK3 = (
    "2026-12-01 13:00:00,000 rank3 INFO tiderl.rank: ===== rank 3 starts: pid 11 on n1, run at version 0 =====\n"
    "2026-12-01 13:00:01,000 rank3 INFO tiderl.rank: rank 3: role ref from version 0\n"
    "2026-12-01 13:00:05,000 rank3 INFO tiderl.run.trainer_role: rank 3: ref logprobs for version 1\n"
    "Traceback (most recent call last):\n"
    "RuntimeError: retried\n"
    "2026-12-01 13:00:09,000 rank3 INFO tiderl.rank: rank 3: role rollout from version 2\n"
    "2026-12-01 13:00:10,000 rank3 INFO tiderl.run.rollout_role: rank 3: 8 tasks claimed\n"
    "2026-12-01 13:00:20,000 rank3 INFO tiderl.rank: ===== rank 3 starts: pid 12 on n1, run at version 2 =====\n"
    "2026-12-01 13:00:21,000 rank3 INFO tiderl.rank: rank 3: role rollout from version 2\n"
    "2026-12-01 13:00:22,000 rank3 INFO tiderl.run.rollout_role: rank 3: engine up\n"
)


def test_read_lines_tracks_the_role_line_by_line() -> None:
    lines, cursor = read_lines(RANK3.splitlines(), Cursor(), NOW)
    assert [line.role for line in lines] == [None, "ref", "ref", "ref", "ref", "rollout", "rollout", None, "rollout",
                                             "rollout"]
    assert cursor.role == "rollout" and cursor.roles_announced
    # Read in two pieces (as `-f` does), the role carries over from the first.
    head, cursor = read_lines(RANK3.splitlines()[:3], Cursor(), NOW)
    tail, _ = read_lines(RANK3.splitlines()[3:5], cursor, NOW)
    assert [line.role for line in head + tail] == [None, "ref", "ref", "ref", "ref"]


def test_a_line_written_as_ref_is_prefixed_ref_while_the_rank_is_rollout_now(tmp_path: Path) -> None:
    paths, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=4"]), tmp_path / "run")
    store.register_rank(3, Role.ROLLOUT)  # its role now
    store.register_rank(0, Role.ACTOR)
    store.close()
    (paths.logs / "rank3.log").write_text(RANK3)
    (paths.logs / "rank0.log").write_text("2026-12-01 13:00:02,000 rank0 INFO x: a file that announces no role\n")
    out = subprocess.run([sys.executable, "-m", "tiderl", "logs", str(paths.root), "-n", "50"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    prefixes = [line.split("]")[0] + "]" for line in out.stdout.splitlines()]
    assert prefixes == ["[rank3]", "[rank3 ref]", "[rank0 actor]", "[rank3 ref]", "[rank3 ref]", "[rank3 ref]",
                        "[rank3 rollout]", "[rank3 rollout]", "[rank3]", "[rank3 rollout]", "[rank3 rollout]"]
    assert "[rank3 ref] 2026-12-01 13:00:05,000 rank3 INFO tiderl.run.trainer_role: rank 3: ref logprobs" in out.stdout
