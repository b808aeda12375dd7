"""Launcher pieces: the progress line, each rank's environment, reaping what a killed launch left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tiderl.run import procs
from tiderl.run.launcher import rank_env
from tiderl.observe.status import eval_trend, progress_line


def _doc(evals: list[dict]) -> dict:
    return {"version": 3, "goodput_tok_s": 12.4, "steps": [{"reward_mean": 0.5, "success_rate": 0.625}],
            "eval": evals, "ranks": [{"role": "actor"}, {"role": "rollout"}, {"role": "rollout"}],
            "buffer": {"tasks_pending": 4, "tasks_running": 8, "traj_ready": 2}}


def test_progress_line_shows_step_roles_buffer_and_only_complete_evaluations() -> None:
    line = progress_line(_doc([{"success_rate": 0.7, "eval_version": 0, "num_tasks": 32},
                               {"success_rate": 1.0, "eval_version": 5, "num_tasks": 3}]), eval_tasks=32)
    assert line.startswith("v3  reward 0.50  success 0.62")
    assert "eval 0.70@v0" in line and "@v5" not in line
    assert "goodput 12 tok/s" in line and "actor:1 rollout:2" in line
    assert "pending 4 running 8 ready 2" in line
    first = progress_line({**_doc([]), "version": 0, "goodput_tok_s": 0.0, "steps": []})
    assert first.startswith("v0  reward -  success -") and "goodput - " in first  # no step yet: no figure


def test_eval_trend_gives_first_last_whether_beyond_noise_and_a_better_one_between() -> None:
    def ev(version: int, rate: float | None, n: int = 64) -> dict:
        return {"eval_version": version, "success_rate": rate, "num_tasks": n}

    assert eval_trend([ev(0, 0.5)]) is None
    # 32/64 -> 48/64: z = 0.25 / sqrt(0.625 x 0.375 x 2 / 64) = 2.92.
    assert eval_trend([ev(0, 0.5), ev(5, 0.75)]) == (
        "eval success rate: 0.50 at version 0 -> 0.75 at version 5: +0.25, beyond noise (95%, z +2.9, "
        "64 and 64 tasks)")
    # 16/32 -> 20/32: z = 1.01, within noise.
    assert eval_trend([ev(0, 0.5, 32), ev(5, 0.9, 32), ev(10, 0.625, 32), ev(15, None)]) == (
        "eval success rate: 0.50 at version 0 -> 0.62 at version 10: +0.12, within noise (95%, z +1.0, "
        "32 and 32 tasks) (best 0.90 at version 5)")


def test_wilson_interval_and_two_proportion_test_match_hand_values() -> None:
    import pytest

    from tiderl.evalstats import compare, wilson_interval

    low, high = wilson_interval(32, 64)
    assert (round(low, 3), round(high, 3)) == (0.381, 0.619)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    c = compare(32, 64, 48, 64)
    assert c.change == 0.25 and c.z == pytest.approx(2.921, abs=1e-3) and c.beyond_noise
    assert not compare(16, 32, 20, 32).beyond_noise and compare(5, 5, 5, 5).z == 0.0
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_ranks_get_one_thread_and_their_own_core() -> None:
    env = rank_env(3)
    assert env["OMP_NUM_THREADS"] == "1"
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(3 % (os.cpu_count() or 1))


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_leftovers_of_a_killed_launch_are_reaped_and_nothing_else(tmp_path: Path) -> None:
    run_dir, other_dir = tmp_path / "run", tmp_path / "other"
    pid_file, other_pid_file = tmp_path / "grandchild.pid", tmp_path / "other.pid"
    # A "rank" whose own child (think: vLLM's engine core) outlives it when the rank is SIGKILLed.
    script = "sleep 300 & echo $! > {}; wait"
    rank = procs.spawn("rank0", ["bash", "-c", script.format(pid_file)], tmp_path / "rank0.log",
                       env={procs.RUN_DIR_ENV: str(run_dir.resolve())})
    other = procs.spawn("rank0", ["bash", "-c", script.format(other_pid_file)], tmp_path / "other.log",
                        env={procs.RUN_DIR_ENV: str(other_dir.resolve())})
    try:
        deadline = time.time() + 10
        while not (pid_file.exists() and other_pid_file.exists() and pid_file.read_text().strip()
                   and other_pid_file.read_text().strip()):
            assert time.time() < deadline, "the test processes did not start"
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        rank.proc.send_signal(signal.SIGKILL)
        rank.proc.wait()
        assert _alive(grandchild), "the grandchild should have outlived its parent"
        killed = procs.reap_leftovers(Path(run_dir))
        assert killed == [grandchild]
        deadline = time.time() + 5
        while _alive(grandchild):
            assert time.time() < deadline, "the leftover was not killed"
            time.sleep(0.05)
        assert _alive(int(other_pid_file.read_text())), "another run's process was killed"
    finally:
        procs.stop([rank, other], grace_s=2)  # their process groups, the other sleep included


def test_leftovers_with_an_environment_of_their_own_are_reaped_by_their_dead_ranks_session(tmp_path: Path) -> None:
    """vLLM's CPU engine core starts with an environment of its own (no TIDERL_RUN_DIR): what is left in the
    session of a rank that died is reaped when the rank's pid is given; a live rank's session is not."""
    run_dir = tmp_path / "run"
    script = "env -i sleep 300 & echo $! > {}; wait"
    pids = {name: tmp_path / f"{name}.pid" for name in ("dead", "live")}
    # The live one belongs to another run (the resume would reap its tagged processes: they are leftovers too).
    tags = {"dead": run_dir.resolve(), "live": (tmp_path / "other").resolve()}
    ranks = {name: procs.spawn(f"rank-{name}", ["bash", "-c", script.format(pids[name])], tmp_path / f"{name}.log",
                               env={procs.RUN_DIR_ENV: str(tags[name])})
             for name in pids}
    try:
        deadline = time.time() + 10
        while not all(p.exists() and p.read_text().strip() for p in pids.values()):
            assert time.time() < deadline, "the test processes did not start"
            time.sleep(0.05)
        core = {name: int(p.read_text()) for name, p in pids.items()}
        # `$!` is the forked shell until it execs `env -i sleep`: it still holds the tagged environment until then.
        while not all(Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0") for pid in core.values()):
            assert time.time() < deadline, "the test processes did not exec their own environment"
            time.sleep(0.05)
        assert procs.RUN_DIR_ENV.encode() not in Path(f"/proc/{core['dead']}/environ").read_bytes()
        ranks["dead"].proc.send_signal(signal.SIGKILL)
        ranks["dead"].proc.wait()
        assert _alive(core["dead"])
        assert procs.reap_leftovers(run_dir) == []  # untagged: the environment alone does not find it
        killed = procs.reap_leftovers(run_dir, [ranks["dead"].proc.pid, ranks["live"].proc.pid])
        assert killed == [core["dead"]]
        deadline = time.time() + 5
        while _alive(core["dead"]):
            assert time.time() < deadline, "the leftover was not killed"
            time.sleep(0.05)
        assert _alive(core["live"]) and _alive(ranks["live"].proc.pid), "a live rank's session was reaped"
    finally:
        procs.stop(list(ranks.values()), grace_s=2)


def test_resume_of_a_finished_run_says_so_and_changes_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    from tiderl.cli import main
    from tiderl.config import load_job
    from tiderl.rundir import create_run
    from tiderl.store import RunStore
    from tiderl.store.types import RunState

    root = Path(__file__).resolve().parents[1]
    _, store = create_run(load_job(root / "jobs" / "quickstart.yaml", ["trainer.num_steps=3"]), tmp_path / "run")
    store.register_initial_version("model", "0")
    store.set_run_state(RunState.FINISHED)
    before = store.run_info()
    store.close()
    launched = []
    monkeypatch.setattr("tiderl.run.launcher.run_launch", lambda launch, *a, **k: launched.append(launch) or 0)
    assert main(["run", "--resume", str(tmp_path / "run")]) == 0
    assert "finished at version 0 of 3: nothing to resume" in capsys.readouterr().err
    assert launched == []
    store = RunStore.for_run_dir(tmp_path / "run")
    assert store.run_info() == before
    store.set_run_state(RunState.CANCELLED, "interrupted")  # Ctrl-C: resumable
    store.close()
    assert main(["run", "--resume", str(tmp_path / "run")]) == 0
    assert len(launched) == 1 and "resuming" in capsys.readouterr().err


def test_progress_line_says_how_many_engines_are_up_until_all_are() -> None:
    doc = {**_doc([]), "version": 0, "steps": []}
    assert "engines 1/3 up" in progress_line(doc, engines=(1, 3))
    assert "engines" not in progress_line(doc, engines=(3, 3)) and "engines" not in progress_line(doc)


def test_engines_up_counts_this_launchs_engines_of_rollout_ranks(tmp_path: Path) -> None:
    from tiderl.config import load_job
    from tiderl.run.launcher import _mark_ranks_stopped, engines_up
    from tiderl.rundir import create_run
    from tiderl.store.types import RankState, Role

    root = Path(__file__).resolve().parents[1]
    _, store = create_run(load_job(root / "jobs" / "quickstart.yaml"), tmp_path / "run")
    store.register_initial_version("model", "0")
    assert engines_up(store, 0, 0.0) is None  # no plan yet
    store.plan_roles(0, {0: Role.ACTOR, 1: Role.ROLLOUT, 2: Role.ROLLOUT, 3: Role.REF}, ra2p_mode="decoupled",
                     fetch_groups=1)
    store.record_event("rank1", "engine_up", "old launch", rank=1)
    since = time.time() + 0.01
    time.sleep(0.02)
    assert engines_up(store, 0, since) == (0, 2)
    store.record_event("rank2", "engine_up", "rank 2: engine up", rank=2)
    assert engines_up(store, 0, since) == (1, 2)
    for r, role in {0: Role.ACTOR, 1: Role.ROLLOUT}.items():
        store.register_rank(r, role)
    store.set_rank_state(1, RankState.FAILED)
    _mark_ranks_stopped(store)  # after the launch stopped every process
    assert {r.rank: r.state for r in store.ranks()} == {0: "stopped", 1: "failed"}


def test_each_child_log_starts_a_launch_with_a_marker(tmp_path: Path) -> None:
    import sys

    log = tmp_path / "logs" / "env0.log"
    for note in ("launch of run r", "resume of run r at version 3"):
        child = procs.spawn("env0", [sys.executable, "-c", "print('serving')"], log, marker=note)
        child.proc.wait(30)
    lines = log.read_text().splitlines()
    assert lines[0].endswith("env0 INFO tiderl.launcher: ===== launch of run r =====") and lines[1] == "serving"
    assert "===== resume of run r at version 3 =====" in lines[2] and lines[3] == "serving"
    assert lines[0][:4].isdigit() and lines[0][19] == ","  # logging's time format: sorted by `tiderl logs`


def test_a_dead_rollout_rank_is_quarantined_and_restarted_an_actor_is_not(tmp_path: Path) -> None:
    import io
    import sys

    from tiderl.config import load_job
    from tiderl.run.supervise import replace_child as _replace
    from tiderl.rundir import create_run
    from tiderl.store.types import ClaimRequest, NewGroup, RankReport, Role, TaskKind

    root = Path(__file__).resolve().parents[1]
    _, store = create_run(load_job(root / "jobs" / "quickstart.yaml"), tmp_path / "run")
    store.register_initial_version("model", "0")
    store.register_rank(1, Role.ROLLOUT)
    store.register_rank(0, Role.ACTOR)
    store.add_groups([NewGroup(TaskKind.TRAIN, 7, 2)])
    claims = store.report(RankReport(rank=1, role=Role.ROLLOUT, claim=ClaimRequest(limit=2)))
    assert len(claims["claims"]) == 2 and store.buffer_state().tasks_running == 2

    def dead(name: str) -> procs.Child:
        child = procs.spawn(name, [sys.executable, "-c", "raise SystemExit(9)"], tmp_path / f"{name}.log")
        child.proc.wait(30)
        return child

    started: list[str] = []
    fresh = dead("fresh")

    def restart(child: procs.Child) -> procs.Child:
        started.append(child.name)
        return fresh

    out, restarts = io.StringIO(), {}
    assert _replace(store, dead("rank1"), 9, restart, restarts, 2, out) is fresh
    assert started == ["rank1"] and restarts == {"rank1": 1} and "restarting it (1 of 2)" in out.getvalue()
    assert {r.rank: r.state for r in store.ranks()}[1] == "dead"
    assert store.buffer_state().tasks_running == 0 and store.buffer_state().tasks_pending == 2
    assert _replace(store, dead("rank1"), 9, restart, restarts, 2, out) is fresh  # 2 of 2
    assert _replace(store, dead("rank1"), 9, restart, restarts, 2, out) is None  # the limit: the run fails
    assert _replace(store, dead("rank0"), 9, restart, {}, 2, out) is None  # an actor: the run fails
    assert _replace(store, dead("rank1"), 9, None, {}, 2, out) is None  # a launch that cannot restart
    # The control plane and env servers keep nothing outside the store: restarted whatever they did.
    assert _replace(store, dead("control"), 1, restart, restarts, 2, out) is fresh
    assert _replace(store, dead("env0"), -9, restart, restarts, 2, out) is fresh
    assert started[-2:] == ["control", "env0"]
    kinds = [e["kind"] for e in store.recent_events(50, kinds=["restarted"])]
    assert len(kinds) == 4


def test_an_env_server_restarts_on_its_port(tmp_path: Path) -> None:
    from tiderl.config import load_job
    from tiderl.run.launcher import LATENCY_SEEDS_PER_RUN, Launch, restarter, start_env_server, start_local_ranks
    from tiderl.rundir import create_run

    root = Path(__file__).resolve().parents[1]
    config = load_job(root / "jobs" / "quickstart.yaml")
    paths, store = create_run(config, tmp_path / "run")
    launch = Launch(config, paths, store, resumed=False)
    child, url = start_env_server(launch, None, 0)
    try:
        child.proc.kill()
        child.proc.wait(30)
        replacement = restarter(launch, {}, start_local_ranks, [url])(child)
        assert replacement is not None and replacement.exit_code is None
        assert (paths.root / "env0.port").read_text().strip() == url
        # Both draw their injected delays under the run's seed and the server's index.
        for c in (child, replacement):
            argv = list(c.proc.args)
            assert argv[argv.index("--latency-seed") + 1] == str(config.seed * LATENCY_SEEDS_PER_RUN + 0)
    finally:
        procs.stop([c for c in (child, replacement) if c is not None])


def test_an_actor_that_dies_in_a_step_restarts_with_its_trainer_group(tmp_path: Path) -> None:
    import io
    import sys

    from tiderl.config import load_job
    from tiderl.paths import RunPaths
    from tiderl.run.supervise import restart_trainer_group as _restart_trainer_group
    from tiderl.rundir import create_run
    from tiderl.store.types import FinishedTrajectory, NewGroup, RankReport, Role, TaskKind, TrainerGeneration

    root = Path(__file__).resolve().parents[1]
    _, store = create_run(load_job(root / "jobs" / "quickstart.yaml"), tmp_path / "run")
    store.register_initial_version("model", "0")
    for rank, role in [(0, Role.ACTOR), (1, Role.ROLLOUT), (2, Role.REF)]:
        store.register_rank(rank, role, pid=10_000 + rank)  # not this process
    store.add_groups([NewGroup(TaskKind.TRAIN, 7, 2)])
    claims = store.claim_tasks(1, 2)
    store.report(RankReport(rank=1, finished=[FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                                                                  logprobs=[0.0, -0.1, -0.2], token_versions=[-1, 0, 0],
                                                                  reward=float(c.index_in_group), success=True, num_turns=1)
                                               for c in claims]))
    assert len(store.claim_ready_groups(0, 1)) == 2  # the actor holds the step's data
    paths = RunPaths(tmp_path / "run")
    paths.rendezvous_generation(0).mkdir(parents=True)
    paths.data_ready(0, 0).write_text("{}")  # the broken step's marker

    def child(name: str, argv: list[str]) -> procs.Child:
        return procs.spawn(name, [sys.executable, "-c", *argv], tmp_path / f"{name}.log")

    dead = child("rank0", ["raise SystemExit(9)"])
    dead.proc.wait(30)
    ref = child("rank2", ["import time; time.sleep(60)"])
    rollout = child("rank1", ["import time; time.sleep(60)"])
    children = [dead, rollout, ref]
    started: list[str] = []

    def restart(c: procs.Child) -> procs.Child:
        started.append(c.name)
        return child(c.name, ["import time; time.sleep(60)"])

    out, restarts = io.StringIO(), {}
    try:
        assert _restart_trainer_group(store, children, dead, 9, restart, restarts, 2, paths, out)
        assert sorted(started) == ["rank0", "rank2"] and restarts == {"trainer": 1}
        assert ref.proc.poll() is not None and children[1] is rollout and rollout.exit_code is None
        assert children[0].name == "rank0" and children[0].exit_code is None and children[2] is not ref
        assert not paths.rendezvous_generation(0).exists()  # no stale marker for the restarted step
        assert store.trainer_generation() == TrainerGeneration(1, (0, 2))  # the group meets afresh
        assert store.buffer_state().traj_ready == 2  # the step's data is back for the new actor
        assert "restarting the trainer group (rank0, rank2; 1 of 2)" in out.getvalue()
        assert [e["kind"] for e in store.recent_events(20, kinds=["trainer_restarted"])] == ["trainer_restarted"]
        # The limit, a rollout rank and a launch that cannot restart ranks are refused.
        assert not _restart_trainer_group(store, children, dead, 9, restart, {"trainer": 2}, 2, paths, out)
        assert not _restart_trainer_group(store, children, rollout, 9, restart, {}, 2, paths, out)
        assert not _restart_trainer_group(store, children, dead, 9, None, {}, 2, paths, out)
    finally:
        procs.stop(children)


def test_a_child_and_its_own_children_ignore_slurms_time_limit_warning_the_launcher_alone_acts_on_it(
        tmp_path: Path) -> None:
    """A plain sbatch run's `--signal=USR2@N` reaches every process of the step: a rank that died of it made the
    launcher record the run as failed before its own handler stopped the run for the requeue."""
    import sys

    ignored = "print(signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)"
    script = (f"import signal, subprocess, sys; {ignored}; "
              f"subprocess.run([sys.executable, '-c', 'import signal; {ignored}'])")
    child = procs.spawn("rank0", [sys.executable, "-c", script], tmp_path / "rank0.log")
    assert child.proc.wait(timeout=60) == 0
    assert (tmp_path / "rank0.log").read_text().split() == ["True", "True"]
    # ... and SIGUSR2 sent to its process group leaves it running; SIGTERM still ends it.
    sleeper = procs.spawn("env0", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "env0.log")
    time.sleep(1.0)
    os.killpg(sleeper.proc.pid, signal.SIGUSR2)
    time.sleep(0.5)
    assert sleeper.exit_code is None
    procs.stop([sleeper], grace_s=5)
    assert sleeper.exit_code == -signal.SIGTERM
