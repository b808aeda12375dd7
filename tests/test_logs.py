"""`tiderl logs`: which files, which prefixes, timestamps, noise, merging (pure), and the command on a run
directory with real log files."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from tiderl.config import load_job
from tiderl.observe.logs import (
    Cursor,
    LogFile,
    LogLine,
    classify,
    is_engine_chatter,
    last_segment,
    merge_by_time,
    parse_timestamp,
    ranks_text,
    read_lines,
    select,
    selection_problem,
    shown,
    split_lines,
)
from tiderl.roles import Role
from tiderl.rundir import create_run, open_run
from tiderl.store.types import RunState

ROOT = Path(__file__).resolve().parents[1]


def test_classify_orders_and_ignores_other_files() -> None:
    names = ["rank10.log", "slurm-7.err", "rank2.log", "env0.log", "control.log", "notes.txt", "ranks-srun.log",
             "slurm-7.out", "rank2.log.tmp"]
    assert [f.name for f in classify(names)] == [
        "control.log", "env0.log", "rank2.log", "rank10.log", "ranks-srun.log", "slurm-7.err", "slurm-7.out"]
    assert classify(["rank3.log"]) == [LogFile("rank3.log", "rank", 3)]


def test_prefixes_name_rank_and_role() -> None:
    roles = {1: "rollout"}
    assert LogFile("rank1.log", "rank", 1).prefix(roles) == "rank1 rollout"
    assert LogFile("rank2.log", "rank", 2).prefix(roles) == "rank2"
    assert LogFile("env0.log", "env", 0).prefix(roles) == "env0"
    assert LogFile("control.log", "control").prefix(roles) == "control"
    assert LogFile("slurm-7.err", "slurm", 7).prefix(roles) == "slurm 7 err"
    assert LogFile("slurm-7.out", "slurm", 7).prefix(roles) == "slurm 7"


def test_select_by_rank_role_control() -> None:
    files = classify(["control.log", "env0.log", "rank0.log", "rank1.log", "rank2.log"])
    roles = {0: "actor", 1: "rollout", 2: "rollout"}
    assert [f.name for f in select(files, rank=1)] == ["rank1.log"]
    assert [f.name for f in select(files, role="rollout", roles=roles)] == ["rank1.log", "rank2.log"]
    assert [f.name for f in select(files, control=True)] == ["control.log"]
    assert select(files) == files
    assert select(files, rank=9) == []


def test_split_lines_keeps_a_line_still_being_written() -> None:
    assert split_lines("a\nb\nc") == (["a", "b"], "c")
    assert split_lines("a\n") == (["a"], "")
    assert split_lines("") == ([], "")
    assert split_lines(b"a\nb") == ([b"a"], b"b")


# Lines as the project's processes and vLLM write them (from a quickstart run's logs/).
PROJECT = "2026-12-01 10:58:08,192 rank1 INFO tiderl.rank: rank 1: role rollout from version 0"
CONTROL = "2026-12-01 10:58:07,202 control INFO tiderl.control: version 0: ERS cold_start moves rank 3 ref->rollout"
ENV = "2026-12-01 10:58:07,500 tiderl.envs.server INFO serving hilo"
VLLM_VIA_LOGGING = "2026-12-01 10:58:38,020 rank1 INFO vllm.triton_utils.importing: Triton is installed but 0 active"
VLLM_WARNING_VIA_LOGGING = "2026-12-01 10:58:38,020 rank1 WARNING vllm.triton_utils.importing: Triton is installed"
VLLM_INFO = "(EngineCore pid=10940) INFO 12-01 11:01:02 [core.py:1454] [shutdown] EngineCore: trigger received signal"
VLLM_WARNING = "(MainProcess pid=10734) WARNING 12-01 11:01:07 [utils.py:648] [shutdown] Process manager: force killing"
VLLM_BARE = "INFO 12-01 13:29:15 [file.py:12] Using max model len 512"
SUBMITIT = "submitit INFO (2026-12-01 13:20:01,757) - Starting with JobEnvironment(job_id=18)"
SLURM = "[2026-12-01T13:29:16.353] error: *** STEP 812.0 CANCELLED ***"
NOW = datetime(2026, 12, 1, 14, 0)


def test_timestamps_of_every_format_the_run_writes() -> None:
    assert parse_timestamp(PROJECT, NOW) == datetime(2026, 12, 1, 10, 58, 8, 192000)
    assert parse_timestamp(CONTROL, NOW) == datetime(2026, 12, 1, 10, 58, 7, 202000)
    assert parse_timestamp(VLLM_INFO, NOW) == datetime(2026, 12, 1, 11, 1, 2)
    assert parse_timestamp(VLLM_BARE, NOW) == datetime(2026, 12, 1, 13, 29, 15)
    assert parse_timestamp(SUBMITIT, NOW) == datetime(2026, 12, 1, 13, 20, 1, 757000)
    assert parse_timestamp(SLURM, NOW) == datetime(2026, 12, 1, 13, 29, 16, 353000)
    for untimed in ["Traceback (most recent call last):", '  File "x.py", line 3, in f', "", "step 1",
                    "Loading weights: 100%|##| 38/38 [00:00<00:00, 2997.62it/s]", "2026-13-01 10:00:00,000 x"]:
        assert parse_timestamp(untimed, NOW) is None


def test_vllm_timestamps_without_a_year_never_land_in_the_future() -> None:
    new_year = datetime(2027, 1, 1, 0, 0, 5)
    assert parse_timestamp("INFO 12-31 23:59:59 [core.py:1] x", new_year) == datetime(2026, 12, 31, 23, 59, 59)
    assert parse_timestamp("INFO 01-01 00:00:01 [core.py:1] x", new_year) == datetime(2027, 1, 1, 0, 0, 1)


def test_engine_chatter_is_vllms_debug_and_info_only() -> None:
    assert is_engine_chatter(VLLM_INFO)
    assert is_engine_chatter(VLLM_BARE)
    assert is_engine_chatter(VLLM_VIA_LOGGING)
    assert is_engine_chatter("2026-12-01 10:58:07,500 vllm.config DEBUG resolved")  # env servers' format
    for kept in [VLLM_WARNING, VLLM_WARNING_VIA_LOGGING, "ERROR 12-01 13:29:15 [core.py:9] EngineCore died",
                 PROJECT, CONTROL, ENV, SUBMITIT, SLURM, "step 1", "2026-12-01 10:58:07,500 tiderl.envs INFO vllm"]:
        assert not is_engine_chatter(kept), kept


def test_a_progress_bar_shows_its_last_redraw() -> None:
    bar = "\rLoading weights:   0%|    | 0/38 [00:00<?, ?it/s]\rLoading weights: 100%|####| 38/38 [00:00<00:00]"
    assert last_segment(bar) == "Loading weights: 100%|####| 38/38 [00:00<00:00]"
    assert last_segment(VLLM_INFO + "\r") == VLLM_INFO  # vLLM ends some lines with a carriage return
    assert last_segment("done\r    \r") == "done"  # a bar cleared with blanks (tqdm leave=False)
    assert last_segment("\r") == ""
    assert last_segment("plain") == "plain"


def test_unstamped_lines_keep_the_time_and_fate_of_the_line_before() -> None:
    raw = ["early, before any timestamp", PROJECT, "  continued", VLLM_INFO, "\rLoading shards: 100% 1/1", "",
           "2026-12-01 10:58:07,000 rank1 INFO tiderl.rank: stamped earlier than the line before"]
    lines, cursor = read_lines(raw, Cursor(), NOW)
    at_project, at_vllm = datetime(2026, 12, 1, 10, 58, 8, 192000), datetime(2026, 12, 1, 11, 1, 2)
    r = "rollout"  # PROJECT is the rank announcing its role: the lines from it on carry it
    assert lines == [LogLine(None, "early, before any timestamp"), LogLine(at_project, PROJECT, role=r),
                     LogLine(at_project, "  continued", role=r), LogLine(at_vllm, VLLM_INFO, True, r),
                     LogLine(at_vllm, "Loading shards: 100% 1/1", True, r), LogLine(at_vllm, "", True, r),
                     LogLine(at_vllm, raw[-1], role=r)]  # times never go back within a file
    assert cursor == Cursor(at_vllm, False, False, r, True)
    # A cursor carries over to the next read (following): a continuation stays with its line.
    more, _ = read_lines(["  more"], Cursor(at_vllm, True, False), NOW)
    assert more == [LogLine(at_vllm, "  more", True)]


def test_a_traceback_under_engine_chatter_is_shown() -> None:
    raw = [VLLM_INFO, "leftover chatter", "Traceback (most recent call last):", '  File "rank.py", line 9, in main',
           "RuntimeError: engine died", VLLM_INFO, "hidden again"]
    lines, _ = read_lines(raw, Cursor(), NOW)
    assert [line.text for line in shown(lines, engine=False)] == raw[2:5]
    assert [line.text for line in shown(lines, engine=True)] == raw
    assert [line.text for line in shown(lines, engine=False, last=2)] == raw[3:5]
    assert shown(lines, engine=False, last=0) == []


def test_merge_interleaves_files_by_time_and_keeps_each_files_order() -> None:
    control, _ = read_lines(["2026-12-01 13:29:15,100 control INFO tiderl.control: c1",
                             "2026-12-01 13:29:17,000 control INFO tiderl.control: c2"], Cursor(), NOW)
    rank, _ = read_lines(["2026-12-01 13:29:16,000 rank1 INFO tiderl.rank: r1", "Traceback (most recent call last):",
                          "RuntimeError: boom", "2026-12-01 13:29:18,000 rank1 INFO tiderl.rank: r2"], Cursor(), NOW)
    env, _ = read_lines(["serving hilo (no timestamp)"], Cursor(), NOW)
    tie, _ = read_lines(["2026-12-01 13:29:17,000 rank2 INFO tiderl.rank: same time as c2"], Cursor(), NOW)
    merged = merge_by_time([control, rank, env, tie])
    assert [(i, line.text.rsplit(": ", 1)[-1]) for i, line in merged] == [
        (2, "serving hilo (no timestamp)"), (0, "c1"), (1, "r1"), (1, "Traceback (most recent call last):"),
        (1, "boom"), (0, "c2"), (3, "same time as c2"), (1, "r2")]
    assert merge_by_time([]) == []


def test_impossible_selections_name_what_the_run_has() -> None:
    roles = {0: "actor", 1: "rollout", 2: "rollout", 3: "rollout"}
    assert selection_problem(rank=9, role=None, num_ranks=4, roles=roles, follow=False) == \
        "rank 9: the run has ranks 0-3"
    assert selection_problem(rank=9, role=None, num_ranks=4, roles=roles, follow=True) == \
        "rank 9: the run has ranks 0-3"
    assert selection_problem(rank=1, role=None, num_ranks=1, roles={}, follow=False) == "rank 1: the run has rank 0"
    assert selection_problem(rank=3, role=None, num_ranks=4, roles={}, follow=False) is None
    assert selection_problem(rank=9, role=None, num_ranks=None, roles=roles, follow=False) is None
    assert selection_problem(rank=None, role="ref", num_ranks=4, roles=roles, follow=False) == \
        "role ref: no rank holds it now (actor: rank 0; rollout: ranks 1-3)"
    # ERS may move a rank to it while following; before any rank registered there is nothing to judge.
    assert selection_problem(rank=None, role="ref", num_ranks=4, roles=roles, follow=True) is None
    assert selection_problem(rank=None, role="ref", num_ranks=4, roles={}, follow=False) is None
    assert selection_problem(rank=None, role="rollout", num_ranks=4, roles=roles, follow=False) is None
    assert ranks_text([5, 1, 2]) == "ranks 1-2, 5"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    paths, store = create_run(load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=2"]), tmp_path / "run")
    store.register_rank(0, Role.ACTOR)
    store.register_rank(1, Role.ROLLOUT)
    store.close()
    (paths.logs / "control.log").write_text("planned v1\nplanned v2\n")
    (paths.logs / "rank0.log").write_text("step 1\n")
    (paths.logs / "rank1.log").write_text("".join(f"line {i}\n" for i in range(30)) + "partial")
    (paths.logs / "slurm-12.out").write_text("submitit INFO starting\n")
    return paths.root


def tiderl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_logs_of_one_rank_are_prefixed_with_its_role(run_dir: Path) -> None:
    out = tiderl("logs", str(run_dir), "--rank", "1", "-n", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[rank1 rollout] line 28\n[rank1 rollout] line 29\n[rank1 rollout] partial\n"


def test_logs_by_role_and_control_and_all(run_dir: Path) -> None:
    assert tiderl("logs", str(run_dir), "--role", "actor").stdout == "[rank0 actor] step 1\n"
    assert tiderl("logs", str(run_dir), "--control", "-n", "1").stdout == "[control] planned v2\n"
    everything = tiderl("logs", str(run_dir), "-n", "1").stdout.splitlines()
    assert everything == ["[control] planned v2", "[rank0 actor] step 1", "[rank1 rollout] partial",
                          "[slurm 12] submitit INFO starting"]


STAMPED = {
    "control.log": "2026-12-01 13:29:15,100 control INFO tiderl.control: version 0 planned\n"
                   "2026-12-01 13:29:18,000 control INFO tiderl.control: run finished at version 1\n",
    "rank0.log": "2026-12-01 13:29:16,000 rank0 INFO tiderl.rank: rank 0: role actor from version 0\n"
                 "\rLoading weights:   0%|  | 0/38\rLoading weights: 100%|##| 38/38\n"
                 "2026-12-01 13:29:17,500 rank0 INFO tiderl.run.trainer_role: rank 0: version 1 published\n",
    "rank1.log": "2026-12-01 13:29:15,500 rank1 INFO tiderl.rank: rank 1: role rollout from version 0\n"
                 "(EngineCore pid=7) INFO 12-01 13:29:16 [core.py:133] Initializing a V1 LLM engine\r\n"
                 "\rLoading safetensors checkpoint shards: 100% Completed | 1/1\n\n"
                 "(MainProcess pid=6) WARNING 12-01 13:29:17 [utils.py:648] [shutdown] force killing\n"
                 "(MainProcess pid=6) INFO 12-01 13:29:19 [core_client.py:777] [shutdown] MPClient: complete\n"
                 "Traceback (most recent call last):\n"
                 '  File "rank.py", line 9, in main\n'
                 "RuntimeError: engine died\n",
}


@pytest.fixture
def stamped_run(run_dir: Path) -> Path:
    """The run with logs as its processes write them. vLLM's stamps have no year: the files' mtime gives it."""
    logs = run_dir / "logs"
    (logs / "slurm-12.out").unlink()
    written = datetime(2026, 12, 1, 13, 30).timestamp()
    for name, text in STAMPED.items():
        (logs / name).write_text(text, newline="")
        os.utime(logs / name, (written, written))
    return run_dir


def test_logs_merge_all_files_by_time_without_engine_chatter(stamped_run: Path) -> None:
    out = tiderl("logs", str(stamped_run))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "[control] 2026-12-01 13:29:15,100 control INFO tiderl.control: version 0 planned",
        "[rank1 rollout] 2026-12-01 13:29:15,500 rank1 INFO tiderl.rank: rank 1: role rollout from version 0",
        "[rank0 actor] 2026-12-01 13:29:16,000 rank0 INFO tiderl.rank: rank 0: role actor from version 0",
        "[rank0 actor] Loading weights: 100%|##| 38/38",
        "[rank1 rollout] (MainProcess pid=6) WARNING 12-01 13:29:17 [utils.py:648] [shutdown] force killing",
        "[rank0 actor] 2026-12-01 13:29:17,500 rank0 INFO tiderl.run.trainer_role: rank 0: version 1 published",
        "[control] 2026-12-01 13:29:18,000 control INFO tiderl.control: run finished at version 1",
        "[rank1 rollout] Traceback (most recent call last):",
        '[rank1 rollout]   File "rank.py", line 9, in main',
        "[rank1 rollout] RuntimeError: engine died",
    ]
    assert "\r" not in out.stdout


def test_logs_with_engine_lines_and_by_file(stamped_run: Path) -> None:
    engine = tiderl("logs", str(stamped_run), "--rank", "1", "--engine").stdout.splitlines()
    assert engine[1:4] == ["[rank1 rollout] (EngineCore pid=7) INFO 12-01 13:29:16 [core.py:133] Initializing a V1 "
                           "LLM engine", "[rank1 rollout] Loading safetensors checkpoint shards: 100% Completed | 1/1",
                           "[rank1 rollout] "]
    assert len(engine) == 9
    by_file = tiderl("logs", str(stamped_run), "--by-file", "-n", "1").stdout.splitlines()
    assert by_file == [
        "[control] 2026-12-01 13:29:18,000 control INFO tiderl.control: run finished at version 1",
        "[rank0 actor] 2026-12-01 13:29:17,500 rank0 INFO tiderl.run.trainer_role: rank 0: version 1 published",
        "[rank1 rollout] RuntimeError: engine died"]


def test_impossible_and_unwritten_selections(run_dir: Path) -> None:
    out = tiderl("logs", str(run_dir), "--rank", "9")
    assert (out.returncode, out.stderr, out.stdout) == (2, "tiderl logs: rank 9: the run has ranks 0-1\n", "")
    out = tiderl("logs", str(run_dir), "--role", "ref")
    assert out.returncode == 2
    assert out.stderr == "tiderl logs: role ref: no rank holds it now (actor: rank 0; rollout: rank 1)\n"
    (run_dir / "logs" / "rank1.log").unlink()
    out = tiderl("logs", str(run_dir), "--rank", "1")
    assert out.returncode == 1 and "rank 1's log not written yet" in out.stderr


def test_negative_line_counts_are_refused(run_dir: Path) -> None:
    out = tiderl("logs", str(run_dir), "-n", "-1")
    assert out.returncode == 2 and "argument -n/--lines: must be 0 or more, got -1" in out.stderr
    assert tiderl("logs", str(run_dir), "--rank", "-1").returncode == 2


def test_a_closed_pipe_ends_quietly(run_dir: Path) -> None:
    (run_dir / "logs" / "rank1.log").write_text("".join(f"line {i:06d} of a long log\n" for i in range(20_000)))
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "logs", str(run_dir), "--rank", "1", "-n", "20000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "[rank1 rollout] line 000000 of a long log\n"
        proc.stdout.close()  # `| head -1`: more than a pipe buffer is still to write
        assert proc.wait(timeout=60) == 141
        assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        proc.kill()


def test_following_into_a_closed_pipe_ends_quietly_without_new_lines(run_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "logs", str(run_dir), "--control", "-n", "1", "-f"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "[control] planned v2\n"
        proc.stdout.close()  # the run goes on and writes nothing: only the closed pipe can end it
        assert proc.wait(timeout=30) == 141
        assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        proc.kill()


def test_follow_prints_what_is_written_until_the_run_ends(run_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tiderl", "logs", str(run_dir), "--control", "-n", "1", "-f"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Its first line says it has read what was there: what is written now is new to it.
        assert proc.stdout is not None and proc.stdout.readline() == "[control] planned v2\n"
        with open(run_dir / "logs" / "control.log", "a") as log:
            log.write("planned v3\nhalf a li")
        # A rank log that appears while following, under --control, is not shown.
        (run_dir / "logs" / "rank2.log").write_text("not shown\n")
        with open(run_dir / "logs" / "control.log", "a") as log:
            log.write("ne\n")
        _, store = open_run(run_dir)
        store.set_run_state(RunState.FINISHED, "done")
        store.close()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out == "[control] planned v3\n[control] half a line\n"


def test_logs_of_a_directory_without_a_run(tmp_path: Path) -> None:
    out = tiderl("logs", str(tmp_path))
    assert out.returncode == 2 and "no run store" in out.stderr
