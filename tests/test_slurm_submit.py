"""`tiderl submit`, `tiderl cancel` and a requeue, on the real dev cluster (marked `slurm`).

Each test submits a short real run (real submitit, real Slurm job and srun step,
real `tiderl` control plane, env server and trainer ranks; the rollout ranks' engine
is the tests' scripted one, tests/fake_engine.py: vLLM's own start and serving are
tested by tests/test_run_e2e.py and tests/test_rollout_vllm.py) and checks the run
store afterwards. They need slurm/dev-cluster-start.sh to have run; they
skip without a cluster unless TIDERL_REQUIRE_SLURM=1, then fail.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fake_engine import SCRIPTED_ENGINE, scripted_run_env
from run_checks import check_run
from tiderl.slurm.cluster import SlurmCluster
from tiderl.slurm.cancel import live_job_ids
from tiderl.slurm.runjobs import recorded_jobs, slurm_jobs_of_run
from tiderl.slurm.states import JobState
from tiderl.store import RankState, Role, RunRecord, RunStore

ROOT = Path(__file__).resolve().parents[1]
# A short run: 2 ranks (actor + rollout) on one node of the dev cluster.
SHORT = ["trainer.groups_min=1", "trainer.groups_ideal=2", "rollout.group_size=4", "rollout.eval_every_steps=0",
         "rollout.max_concurrency=8", "launch.num_ranks=2", "system=async", "slurm.time_min=30",
         "slurm.mem_gb=2", "slurm.signal_delay_s=60", f"rollout.engine={SCRIPTED_ENGINE}"]
RUN_TIMEOUT_S = 900.0  # a loaded 2-core machine: Slurm's job start, the ranks' imports, the warm-started model


@pytest.fixture
def run_dir(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[Path]:
    """The test's run directory; whatever job of it still runs when the test ends (failed) is cancelled."""
    path = tmp_path / "run"
    yield path
    live = live_job_ids(slurm_jobs_of_run(path, slurm_cluster))
    if live:
        slurm_cluster.cancel(live)


def tiderl(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    # The batch job inherits this environment (sbatch exports it): its ranks import the scripted engine.
    return subprocess.run([sys.executable, "-m", "tiderl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env=scripted_run_env())


def submit(run_dir: Path, steps: int, *extra: str, wait: bool = False) -> subprocess.CompletedProcess[str]:
    sets = [a for s in SHORT + [f"trainer.num_steps={steps}", *extra] for a in ("--set", s)]
    return tiderl("submit", "jobs/quickstart.yaml", *sets, "--run-dir", str(run_dir),
                  *(["--wait"] if wait else []), timeout_s=RUN_TIMEOUT_S if wait else 120)


def run_info(run_dir: Path) -> RunRecord:
    store = RunStore.for_run_dir(run_dir)
    try:
        return store.run_info()
    finally:
        store.close()


def wait_for(what: str, check, timeout_s: float, poll_s: float = 1.0,  # type: ignore[no-untyped-def]
             explain=None) -> None:
    """Poll `check` until it holds; past `timeout_s`, fail with `explain()` (what the cluster and the run said)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s" + (f"\n{explain()}" if explain else ""))
        time.sleep(poll_s)


def job_story(slurm_cluster: SlurmCluster, job_id: str, run_dir: Path) -> str:
    """What Slurm says of the job (queue state and reason, accounting of every attempt) and the run's logs."""
    parts = [f"queue: {slurm_cluster.queue_reasons([job_id])}", f"accounting: {slurm_cluster.accounting([job_id])}"]
    try:
        parts.append(f"run: {run_info(run_dir)}")
    except Exception as e:  # the story is told on a failure already: a store that cannot be read is part of it
        parts.append(f"run store: {type(e).__name__}: {e}")
    return "\n".join(parts + [logs_of(run_dir)])


def logs_of(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*")))


@pytest.mark.slurm
def test_submit_refuses_what_the_partition_can_never_give(slurm_cluster: SlurmCluster, run_dir: Path) -> None:
    """More CPUs a node than any node of the dev cluster has: refused before sbatch, naming the fields,
    nothing created."""
    most = max(n.cpus for n in slurm_cluster.partition_nodes(slurm_cluster.partitions()[0].name))
    out = submit(run_dir, 2, f"slurm.cpus_per_task={most + 1}")
    assert out.returncode == 2, out.stderr
    assert "slurm.cpus_per_task" in out.stderr and "nothing submitted" in out.stderr, out.stderr
    assert not run_dir.exists()


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_wait_stops_on_a_pending_reason_that_waiting_cannot_resolve(slurm_cluster: SlurmCluster,
                                                                    run_dir: Path) -> None:
    """A job that asks for more nodes than the partition has (submitted past the check) pends for good
    (PartitionConfig on the dev cluster, PartitionNodeLimit on others): following it stops with a
    non-zero exit and leaves the job as it is."""
    import io

    from tiderl.config import load_job
    from tiderl.rundir import create_run
    from tiderl.slurm.cli import EXIT_NOT_FINISHED, follow, submit_run
    from tiderl.slurm.submit import run_parameters

    nodes = len(slurm_cluster.node_names()) + 1
    config = load_job(ROOT / "jobs" / "quickstart.yaml", SHORT + [f"slurm.nodes={nodes}",
                                                                 f"launch.num_ranks={2 * nodes}"])
    _, store = create_run(config, run_dir)
    store.close()
    job_id, _ = submit_run(run_dir, run_parameters(config, run_dir))
    out = io.StringIO()
    assert follow(run_dir, job_id, out=out, poll_s=0.5) == EXIT_NOT_FINISHED
    said = out.getvalue()
    assert "cannot start" in said and ("PartitionConfig" in said or "PartitionNodeLimit" in said), said
    assert slurm_cluster.queue([job_id]) == {job_id: JobState.PENDING}  # left as it is (the fixture cancels it)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_submit_wait_runs_to_the_end(slurm_cluster: SlurmCluster, run_dir: Path) -> None:
    out = submit(run_dir, 2, wait=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs_of(run_dir)
    [job] = recorded_jobs(run_dir)
    assert out.stdout.startswith(f"job {job['job_id']}\nrun dir {run_dir}\n")
    assert f"job {job['job_id']} COMPLETED, run finished" in out.stdout
    assert slurm_cluster.wait(job["job_id"], timeout_s=60) is JobState.COMPLETED
    records = slurm_cluster.accounting([job["job_id"]])
    # The ranks ran as one step of two tasks beside the batch step.
    assert records[f"{job['job_id']}.0"].state is JobState.COMPLETED
    assert run_info(run_dir).state == "finished"
    assert check_run(run_dir, max_staleness=1)["versions"] == 2
    assert slurm_jobs_of_run(run_dir) == [{"job_id": job["job_id"], "state": "COMPLETED", "reason": None}]
    rank0 = tiderl("logs", str(run_dir), "--rank", "0", "-n", "5")
    assert rank0.returncode == 0 and rank0.stdout.startswith("[rank0 actor] ")
    assert "role actor from version 0" in (run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.slurm
def test_cancel_ends_the_job_and_marks_the_run(slurm_cluster: SlurmCluster, run_dir: Path) -> None:
    out = submit(run_dir, 50)
    assert out.returncode == 0, out.stderr
    [job] = recorded_jobs(run_dir)
    # Cancel once the job runs the run (env server and control plane up, ranks starting).
    wait_for("the run running", lambda: run_info(run_dir).state == "running", 300)
    cancel = tiderl("cancel", str(run_dir))
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert f"job {job['job_id']} CANCELLED" in cancel.stdout
    assert slurm_cluster.wait(job["job_id"], timeout_s=60) is JobState.CANCELLED
    info = run_info(run_dir)
    assert (info.state, info.message) == ("cancelled", "cancelled by `tiderl cancel`")
    # Cancelling again changes nothing and says so.
    again = tiderl("cancel", str(run_dir))
    assert again.returncode == 0 and "already cancelled" in again.stdout


@pytest.mark.slurm
@pytest.mark.timeout(1500)
def test_time_limit_signal_requeues_and_the_next_attempt_resumes(slurm_cluster: SlurmCluster, run_dir: Path) -> None:
    out = submit(run_dir, 50)
    assert out.returncode == 0, out.stderr
    [job] = recorded_jobs(run_dir)
    job_id = job["job_id"]
    batch_log = run_dir / "logs" / f"slurm-{job_id}.out"
    wait_for("the run running", lambda: run_info(run_dir).state == "running", 300)
    # What `--signal=B:USR2@N` sends before the time limit: SIGUSR2 to the batch step only.
    slurm_cluster.cancel([job_id], signal="USR2", batch_only=True)
    # The run's processes stop, submitit requeues the job, the next attempt resumes the same run.
    # On a loaded 2-core machine the stop (every child, vLLM's engine cores) and the requeue take minutes.
    wait_for("a second attempt", lambda: batch_log.exists() and "(resumed)" in batch_log.read_text(), 600,
             explain=lambda: job_story(slurm_cluster, job_id, run_dir))
    log = batch_log.read_text()
    assert log.count(f"tiderl: job {job_id} on ") == 2, log
    assert "stopped by Slurm (SIGUSR2)" in log
    assert f"Requeued job {job_id}" in log  # submitit's handler did it, after the run's processes stopped
    wait_for("the resumed run", lambda: (run_info(run_dir).state, run_info(run_dir).message) ==
             ("running", "resumed"), 300, explain=lambda: job_story(slurm_cluster, job_id, run_dir))
    assert tiderl("cancel", str(run_dir)).returncode == 0
    assert slurm_cluster.wait(job_id, timeout_s=60) is JobState.CANCELLED


def trajectories(run_dir: Path) -> dict[int, str]:
    from sqlalchemy import select

    from tiderl.store.schema import trajectories as table

    store = RunStore.for_run_dir(run_dir)
    try:
        with store.engine.connect() as c:
            return {r.id: r.state for r in c.execute(select(table.c.id, table.c.state))}
    finally:
        store.close()


def reached(run_dir: Path, version: int) -> bool:
    info = run_info(run_dir)
    assert info.state in ("starting", "running"), f"the run ended before version {version}: {info}"
    return info.version >= version


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_requeued_job_resumes_the_run_losing_nothing(slurm_cluster: SlurmCluster, run_dir: Path) -> None:
    steps = 4
    # Env steps of 1 s keep the run going for a while after its first step, so the requeue lands mid-run.
    out = submit(run_dir, steps, "trainer.checkpoint_every=1", "env.latency=fixed:1.0")
    assert out.returncode == 0, out.stderr
    [job] = recorded_jobs(run_dir)
    job_id = job["job_id"]
    wait_for("version 1", lambda: reached(run_dir, 1), RUN_TIMEOUT_S, poll_s=2)
    slurm_cluster.requeue([job_id])
    # Slurm ends the running attempt (SIGTERM to every process of the job), holds the job back, starts it again.
    slurm_cluster.wait(job_id, timeout_s=120, until=lambda s: s is JobState.PENDING)
    requeued_at = run_info(run_dir).version
    assert requeued_at < steps, f"the run reached version {requeued_at} before the requeue"
    before = trajectories(run_dir)
    final = slurm_cluster.wait(job_id, timeout_s=RUN_TIMEOUT_S)
    assert final is JobState.COMPLETED, logs_of(run_dir)
    info = run_info(run_dir)
    assert info.state == "finished", info
    # Exactly once across the requeue, and every trajectory finished before it is still there.
    assert check_run(run_dir, max_staleness=1)["versions"] == steps
    after = trajectories(run_dir)
    assert set(before) <= set(after)
    assert all(after[t] == "consumed" for t, state in before.items() if state == "consumed")
    batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert batch_log.count(f"tiderl: job {job_id} on ") == 2, batch_log
    assert "(resumed)" in batch_log


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_killed_ranks_are_restarted_in_their_tasks_and_the_job_finishes(slurm_cluster: SlurmCluster,
                                                                        run_dir: Path) -> None:
    import os
    import signal

    # An actor and a rollout rank, each the task of one srun step. The rollout rank is SIGKILLed mid-run:
    # its task's supervisor restarts it while the step and the actor carry on. Then the actor is: its
    # supervisor restarts the trainer group (the actor alone here) in a new generation.
    out = submit(run_dir, 5, "env.latency=fixed:1.0")
    assert out.returncode == 0, out.stderr
    wait_for("version 1", lambda: (run_dir / "run.db").exists() and run_info(run_dir).version >= 1,
             RUN_TIMEOUT_S)

    def pid_of(role: Role) -> tuple[int, int]:
        store = RunStore.for_run_dir(run_dir)
        try:
            r = next(r for r in store.ranks() if r.role is role and r.pid and r.state is RankState.RUNNING)
            return r.rank, r.pid  # type: ignore[return-value]
        finally:
            store.close()

    victim, pid = pid_of(Role.ROLLOUT)
    os.kill(pid, signal.SIGKILL)
    killed_at = run_info(run_dir).version
    wait_for("a version after the rollout rank's restart",
             lambda: run_info(run_dir).version > killed_at or run_info(run_dir).state != "running", RUN_TIMEOUT_S)
    actor, pid = pid_of(Role.ACTOR)
    assert run_info(run_dir).version < 4, "the run ended before the actor could be killed in it"
    os.kill(pid, signal.SIGKILL)
    wait_for("the run ended", lambda: run_info(run_dir).state in ("finished", "failed", "cancelled"),
             RUN_TIMEOUT_S)
    assert run_info(run_dir).state == "finished", logs_of(run_dir)
    assert check_run(run_dir, max_staleness=1)["versions"] == 5
    store = RunStore.for_run_dir(run_dir)
    try:
        restarted = store.recent_events(50, kinds=["restarted"])
        group = store.recent_events(50, kinds=["trainer_restarted"])
        generation = store.trainer_generation()
    finally:
        store.close()
    assert [e["rank"] for e in restarted] == [victim]
    assert [e["rank"] for e in group] == [actor] and generation.number == 1 and actor in generation.members
    [job] = recorded_jobs(run_dir)
    assert slurm_cluster.wait(job["job_id"], timeout_s=120) is JobState.COMPLETED
