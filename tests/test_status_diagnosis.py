"""`tiderl status` diagnosis and `--check` on real run stores with a known story (back-dated times)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy import update

from tiderl.cli import main
from tiderl.config import load_job
from tiderl.rundir import create_run
from tiderl.store import FinishedTrajectory, MetricPoint, NewGroup, RankReport, RunStore, Role, RunState, TaskKind
from tiderl.store.schema import ranks, runs, tasks, versions

ROOT = Path(__file__).resolve().parents[1]
SETS = ["trainer.groups_min=1", "trainer.groups_ideal=2", "rollout.group_size=2", "rollout.max_staleness=1",
        "rollout.max_concurrency=4", "launch.num_ranks=4", "monitor.stall_after_s=300", "monitor.slow_task_s=60"]


def _finish(store: RunStore, rank: int, claims: list) -> None:
    store.report(RankReport(rank=rank, role=Role.ROLLOUT, finished=[
        FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1, -1],
                           token_versions=[-1, 0, 0], num_turns=1, reward=float(i % 2), success=bool(i % 2))
        for i, c in enumerate(claims)]))


def _backdate(store: RunStore, seconds: float) -> None:
    """Make the whole story `seconds` old: the run, version 0 and the heartbeats."""
    def write(c) -> None:  # noqa: ANN001
        c.execute(update(runs).values(created_at=runs.c.created_at - seconds, updated_at=runs.c.updated_at - seconds))
        c.execute(update(versions).values(created_at=versions.c.created_at - seconds))
        c.execute(update(tasks).where(tasks.c.claimed_at.is_not(None)).values(claimed_at=tasks.c.claimed_at - seconds))

    store.tx.write(write)


def _set_heartbeat_age(store: RunStore, rank: int, age_s: float) -> None:
    store.tx.write(lambda c: c.execute(update(ranks).where(ranks.c.rank == rank).values(
        heartbeat_at=time.time() - age_s)))


def _base(run_dir: Path) -> RunStore:
    """Ranks 0 actor, 1-2 rollout, 3 ref; version 0 planned (fetch 2 groups, decoupled); run running."""
    _, s = create_run(load_job(ROOT / "jobs" / "quickstart.yaml", SETS), run_dir)
    s.register_initial_version("weights/v0", "c0")
    roles = {0: Role.ACTOR, 1: Role.ROLLOUT, 2: Role.ROLLOUT, 3: Role.REF}
    for r, role in roles.items():
        s.register_rank(r, role)
    s.plan_roles(0, roles, ra2p_mode="decoupled", fetch_groups=2)
    s.set_run_state(RunState.RUNNING)
    return s


def _status(run_dir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    code = main(["status", str(run_dir), "--json", "--no-probe", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_stuck_task_stalls_the_run_and_is_the_culprit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _base(tmp_path / "r")
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.TRAIN, 2, 2)])
    first = s.claim_tasks(1, 3)  # group 1 whole, and one task of group 2
    _finish(s, 1, first[:2])  # group 1 complete and ready; task 3 stays running on rank 1
    s.claim_tasks(2, 1)  # the last task of group 2 runs on rank 2
    _backdate(s, 400.0)
    for r in range(4):
        s.heartbeat(r)
    code, doc = _status(tmp_path / "r", capsys, "--check")
    assert code == 1
    d = doc["diagnosis"]
    assert d["is_stalled"] and d["culprit"]["kind"] == "slow_task"
    assert "waits for 1 more" in d["trainer"] and "running on rank" in d["trainer"]
    assert d["culprit"]["data"]["running_s"] >= 399
    assert {"state", "version", "goodput_tok_s", "rwt_s", "twt_s", "ranks", "steps"} <= set(doc)
    # Raising the limit on the command line: no longer stalled, exit 0 (the ranks beat again first: on a
    # loaded machine the first check can outlast the heartbeat timeout).
    for r in range(4):
        s.heartbeat(r)
    code, doc = _status(tmp_path / "r", capsys, "--check", "--stall-after-s", "3600")
    assert code == 0 and not doc["diagnosis"]["is_stalled"]


def test_dead_and_silent_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _base(tmp_path / "r")
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    s.claim_tasks(2, 2)
    _set_heartbeat_age(s, 2, 45.0)
    result = s.reclaim_expired(30.0)  # rank 2 is declared dead; its two tasks go back to pending
    assert result.dead_ranks == [2] and result.tasks_returned == 2
    _set_heartbeat_age(s, 1, 9.0)  # rank 1: 4 heartbeats missed (heartbeat_s 2), not yet dead
    code, doc = _status(tmp_path / "r", capsys)
    assert code == 0
    findings = {f["kind"]: f for f in doc["diagnosis"]["findings"]}
    assert findings["rank_dead"]["rank"] == 2 and "declared dead" in findings["rank_dead"]["message"]
    assert findings["rank_silent"]["rank"] == 1 and findings["rank_silent"]["data"]["missed_heartbeats"] == 4
    # No live rollout rank is left for the pending tasks of the group the trainer waits for.
    assert findings["no_rollout"]["data"]["pending_tasks"] == 2


def test_staleness_held_rollout_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _base(tmp_path / "r")
    s.add_groups([NewGroup(TaskKind.TRAIN, i, 2) for i in range(4)])  # (1 + 1) x 2: the feed is at its bound
    claims = s.claim_tasks(1, 8)
    _finish(s, 1, claims[:4])  # two groups ready; rank 1 still runs four tasks
    s.report(RankReport(rank=2, role=Role.ROLLOUT, metrics=[MetricPoint("rwt_s", 0.25, 0, "rollout")] * 80))
    code, doc = _status(tmp_path / "r", capsys)
    held = [f for f in doc["diagnosis"]["findings"] if f["kind"] == "rollout_held"]
    assert len(held) == 1 and held[0]["data"]["ranks"] == [2]
    assert held[0]["data"]["outstanding_groups"] == 4 and held[0]["data"]["feed_cap_groups"] == 4
    assert "held by the staleness bound" in doc["diagnosis"]["rollout"]


def test_text_output_shows_the_diagnosis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _base(tmp_path / "r")
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    assert main(["status", str(tmp_path / "r"), "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "diagnosis (" in out and "  trainer: step 0 -> 1: the trainer holds 0 of 2 groups" in out
    assert main(["status", str(tmp_path / "r"), "--no-probe", "--check"]) == 0
    assert capsys.readouterr().out.startswith("OK: run quickstart at version 0 (running)")


def test_failed_run_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _base(tmp_path / "r")
    s.set_run_state(RunState.FAILED, "rank1 exited with code 1")
    assert main(["status", str(tmp_path / "r"), "--check"]) == 1
    assert capsys.readouterr().out.startswith("FAILED: run quickstart at version 0 (failed): rank1 exited")
    s.set_run_state(RunState.FINISHED, "done")
    assert main(["status", str(tmp_path / "r"), "--check"]) == 0


def test_env_server_that_does_not_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    _base(tmp_path / "r")
    with socket.socket() as sock:  # a port nobody listens on: bound, never accepting
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        (tmp_path / "r" / "env_urls.json").write_text(json.dumps([url]))
        assert main(["status", str(tmp_path / "r"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    down = [f for f in doc["diagnosis"]["findings"] if f["kind"] == "env_server_down"]
    assert [f["data"]["url"] for f in down] == [url]


def test_status_probes_a_token_protected_server_with_the_runs_token(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    from tiderl.envs.launch import ensure_run_token, server_argv, wait_for_url

    config = load_job(ROOT / "jobs" / "quickstart.yaml", SETS)
    _base(tmp_path / "r")
    token_file = ensure_run_token(tmp_path / "r")  # what the launcher makes for servers it starts
    assert (token_file.stat().st_mode & 0o777) == 0o600
    proc = subprocess.Popen(server_argv(config.env, tmp_path / "port", token_file=token_file),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = wait_for_url(tmp_path / "port", proc)
        (tmp_path / "r" / "env_urls.json").write_text(json.dumps([url]))
        assert main(["status", str(tmp_path / "r"), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert not [f for f in doc["diagnosis"]["findings"] if f["kind"] == "env_server_down"]
        token_file.write_text("another\n")  # a wrong token: the server is up but refuses
        assert main(["status", str(tmp_path / "r"), "--json"]) == 0
        down = [f for f in json.loads(capsys.readouterr().out)["diagnosis"]["findings"]
                if f["kind"] == "env_server_down"]
        assert down and "401" in down[0]["message"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(tmp_path / "nothing"), "--check"]) == 2
    assert "no run store" in capsys.readouterr().err


def test_watch_redraws_until_interrupted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _base(tmp_path / "r")
    draws = []

    def sleep(seconds: float) -> None:
        draws.append(seconds)
        if len(draws) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("tiderl.observe_cli.status.time.sleep", sleep)
    assert main(["status", str(tmp_path / "r"), "--no-probe", "--watch", "5"]) == 0
    assert draws == [5.0, 5.0] and capsys.readouterr().out.count("diagnosis (") == 2
    assert main(["status", str(tmp_path / "r"), "--watch", "0"]) == 2
    assert "--watch: expected a positive number of seconds" in capsys.readouterr().err


def test_json_watch_is_json_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _base(tmp_path / "r")
    draws = []

    def sleep(seconds: float) -> None:
        draws.append(seconds)
        if len(draws) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("tiderl.observe_cli.status.time.sleep", sleep)
    assert main(["status", str(tmp_path / "r"), "--no-probe", "--json", "--watch", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    docs = [json.loads(line) for line in lines]  # every line is one JSON document
    assert len(docs) == 3 and all(d["version"] == 0 and d["at"] > 0 for d in docs)


def test_control_plane_heartbeat_reaches_the_diagnosis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _base(tmp_path / "r")
    s.reclaim_expired(30.0, control_tick=True)
    code, doc = _status(tmp_path / "r", capsys, "--check")
    assert code == 0 and "control_down" not in [f["kind"] for f in doc["diagnosis"]["findings"]]
    s.tx.write(lambda c: c.execute(update(runs).values(control_seen_at=runs.c.control_seen_at - 120)))
    for r in range(4):
        s.heartbeat(r)
    code, doc = _status(tmp_path / "r", capsys)
    down = [f for f in doc["diagnosis"]["findings"] if f["kind"] == "control_down"]
    assert len(down) == 1 and down[0]["data"]["control_age_s"] >= 119
