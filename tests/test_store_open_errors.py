"""A damaged or empty run.db: every command that opens the store exits 2 with one line naming the file
and what to do (real SQLite files, the real command line)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from attack_store import CASES, corrupt_pages, make_run, run_case, tiderl  # noqa: E402

COMMANDS = [["status"], ["status", "--check"], ["report"], ["logs"], ["run", "--resume"], ["cancel"]]


@pytest.fixture(scope="module")
def corrupt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("corrupt") / "run"
    make_run(run_dir)
    corrupt_pages(run_dir / "run.db")
    return run_dir


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != ["cancel"]], ids=" ".join)
def test_corruption_inside_the_pages_is_one_line_and_exit_2(corrupt_run: Path, command: list[str]) -> None:
    code, _, err, _ = tiderl(*command, str(corrupt_run), *(["--out", str(corrupt_run.parent / "rep")]
                                                           if command == ["report"] else []))
    db = corrupt_run / "run.db"
    assert code == 2, err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "corrupt" in line]
    assert line.startswith(f"tiderl {command[0]}: {db} is corrupt (database disk image is malformed): restore")
    assert f"sqlite3 {db} .recover" in line


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_empty_run_db_is_one_line_and_exit_2(tmp_path: Path, command: list[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.db").write_bytes(b"")
    code, _, err, _ = tiderl(*command, str(run_dir))
    assert code == 2, err
    assert "Traceback" not in err and "NoSuchTable" not in err
    assert err.strip() == (f"tiderl {command[0]}: {run_dir}: run store {run_dir / 'run.db'}: no run recorded yet "
                           "(no tables: the run is being created, or its creation stopped before it wrote them); "
                           "if no run is being created there, this directory holds no run to open: create the run "
                           "again in another directory")


def test_damage_found_after_opening_is_reported_by_the_cli_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # In-process: the store opens (its run row reads), the damage is met by a later query.
    from tiderl.cli import main

    run_dir = tmp_path / "run"
    make_run(run_dir)
    corrupt_pages(run_dir / "run.db", ("metrics", "versions"))
    assert main(["status", str(run_dir), "--json", "--no-probe"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run_dir / 'run.db'} is corrupt" in err


def test_the_store_attack_cases_are_blocked() -> None:
    wanted = {"corrupt_store", "empty_store"}
    results = [run_case(c) for c in CASES if c.__name__ in wanted]
    assert {r["case"] for r in results} == wanted
    for r in results:
        assert r["blocked"], r["evidence"]
