"""The Slurm command layer: with a stand-in runner (unit), and on the real dev cluster (marked `slurm`).

The `slurm` tests need slurm/dev-cluster-start.sh to have run (tools/slurm_tests.sh
does that); they skip without a cluster unless TIDERL_REQUIRE_SLURM=1, then fail.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import UncompletedJobError

from slurm_fakes import FakeRunner

from tiderl.config.schema import build
from tiderl.config.slurm import SlurmConfig
from tiderl.slurm.cluster import SlurmCluster, SlurmCommandError, SlurmError, SlurmUnavailable, subprocess_runner
from tiderl.slurm.sbatch import make_sbatch_script
from tiderl.slurm.states import JobState

# --- unit: a stand-in runner ---------------------------------------------------------------


def test_submit_passes_script_and_parses_job_id(tmp_path: Path) -> None:
    runner = FakeRunner({"sbatch": "812;tiderl-dev\n"})
    assert SlurmCluster(runner).submit(tmp_path / "run.sbatch") == "812"
    assert runner.calls == [["sbatch", "--parsable", str(tmp_path / "run.sbatch")]]


def test_queue_and_accounting_ask_for_the_parsed_format() -> None:
    runner = FakeRunner({
        "squeue": "5|RUNNING\n",
        "sacct": "JobID|JobName|State|ExitCode|Elapsed|NodeList\n5|j|RUNNING|0:0|00:00:03|dev1\n",
    })
    cluster = SlurmCluster(runner)
    assert cluster.queue(["5", "6"]) == {"5": JobState.RUNNING}
    assert cluster.state("5") is JobState.RUNNING
    assert runner.calls[0] == ["squeue", "--noheader", "--format=%i|%T", "--jobs=5,6"]
    assert runner.calls[1][:2] == ["sacct", "--parsable2"]
    assert "--jobs=5" in runner.calls[1]


def test_queue_of_jobs_gone_from_the_queue_is_empty() -> None:
    gone = SlurmCommandError(["squeue"], 1, "slurm_load_jobs error: Invalid job id specified\n")
    assert SlurmCluster(FakeRunner({"squeue": gone})).queue(["99"]) == {}
    other = SlurmCommandError(["squeue"], 1, "slurm_load_jobs error: Unable to contact slurm controller\n")
    with pytest.raises(SlurmCommandError, match="Unable to contact"):
        SlurmCluster(FakeRunner({"squeue": other})).queue(["99"])


def test_state_of_a_job_sacct_does_not_know_yet_is_none() -> None:
    assert SlurmCluster(FakeRunner({"sacct": "JobID|State\n"})).state("7") is None


def test_cancel_and_signal_and_requeue_argv() -> None:
    runner = FakeRunner({"scancel": "", "scontrol": ""})
    cluster = SlurmCluster(runner)
    cluster.cancel(["3", "4"])
    cluster.cancel(["3"], signal="USR2")
    cluster.requeue(["3"])
    cluster.cancel([])
    assert runner.calls == [["scancel", "3", "4"], ["scancel", "--signal=USR2", "3"], ["scontrol", "requeue", "3"]]


def test_ping_reports_a_silent_controller() -> None:
    down = SlurmCommandError(["scontrol", "ping"], 1, "", "Slurmctld(primary) at vm is DOWN\n")
    with pytest.raises(SlurmUnavailable, match="does not answer: `scontrol ping` exited 1: Slurmctld.* DOWN"):
        SlurmCluster(FakeRunner({"scontrol": down})).ping()
    with pytest.raises(SlurmUnavailable, match="DOWN"):
        SlurmCluster(FakeRunner({"scontrol": "Slurmctld(primary) at vm is DOWN\n"})).ping()


def test_wait_times_out_with_the_last_state() -> None:
    runner = FakeRunner({"sacct": "JobID|State\n5|PENDING\n"})
    with pytest.raises(SlurmError, match="job 5: still PENDING after 0 s"):
        SlurmCluster(runner).wait("5", timeout_s=0.0, poll_s=0.0)


def test_subprocess_runner_errors_are_named() -> None:
    with pytest.raises(SlurmUnavailable, match="not found"):
        subprocess_runner(["tiderl-no-such-slurm-command"])
    with pytest.raises(SlurmCommandError, match="exited 3: oops") as info:
        subprocess_runner(["sh", "-c", "echo oops >&2; exit 3"])
    assert info.value.returncode == 3
    with pytest.raises(SlurmCommandError, match="exited 1: said on stdout") as info:
        subprocess_runner(["sh", "-c", "echo said on stdout; exit 1"])
    assert info.value.stdout == "said on stdout\n"
    assert subprocess_runner(["sh", "-c", "echo 12"]) == "12\n"


# --- integration: the real dev cluster -------------------------------------------------------

JOB_TIMEOUT_S = 90.0


def _executor(folder: Path) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(timeout_min=5, cpus_per_task=1, mem_gb=1, slurm_signal_delay_s=30)
    return executor


@pytest.mark.slurm
def test_submitit_job_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "written.txt"
    # A function of the standard library, so the job unpickles it without this test module on its path.
    job = _executor(tmp_path / "submitit").submit(functools.partial(out.write_text, "done on slurm"))
    assert job.result() == len("done on slurm")
    assert out.read_text() == "done on slurm"
    assert slurm_cluster.wait(job.job_id, timeout_s=JOB_TIMEOUT_S) is JobState.COMPLETED
    # submitit reads the same state from sacct.
    assert job.watcher.get_state(job.job_id, mode="force") == "COMPLETED"


@pytest.mark.slurm
@pytest.mark.slow
def test_cancelled_job_reads_cancelled(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = _executor(tmp_path / "submitit").submit(time.sleep, 300)
    slurm_cluster.wait(job.job_id, timeout_s=JOB_TIMEOUT_S, until=lambda s: s is JobState.RUNNING)
    assert slurm_cluster.queue([job.job_id]) == {job.job_id: JobState.RUNNING}
    slurm_cluster.cancel([job.job_id])
    assert slurm_cluster.wait(job.job_id, timeout_s=JOB_TIMEOUT_S) is JobState.CANCELLED
    assert job.watcher.get_state(job.job_id, mode="force").startswith("CANCELLED")
    assert job.done(force_check=True)
    # With accounting, waiting on a cancelled job ends (without it, it never would).
    with pytest.raises(UncompletedJobError):
        job.result()


@pytest.mark.slurm
@pytest.mark.slow
def test_requeued_job_waits_in_the_queue_again(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "sleep.sbatch"
    config = build(SlurmConfig, {"time_min": 5, "signal_delay_s": 0, "mem_gb": 1}, "test", "slurm")
    script.write_text(make_sbatch_script(config, name="tiderl-requeue", log_dir=tmp_path, num_tasks_per_node=1,
                                         command=["sleep", "300"]))
    job_id = slurm_cluster.submit(script)
    slurm_cluster.wait(job_id, timeout_s=JOB_TIMEOUT_S, until=lambda s: s is JobState.RUNNING)
    slurm_cluster.requeue([job_id])
    # The new attempt is held back before it may start again; sacct shows that attempt.
    slurm_cluster.wait(job_id, timeout_s=JOB_TIMEOUT_S, until=lambda s: s is JobState.PENDING)
    assert slurm_cluster.queue([job_id]) == {job_id: JobState.PENDING}
    slurm_cluster.cancel([job_id])
    assert slurm_cluster.wait(job_id, timeout_s=JOB_TIMEOUT_S) is JobState.CANCELLED


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize(("num_nodes", "num_tasks_per_node"), [(1, 2), (2, 1)])
def test_generated_sbatch_script_runs_one_multi_task_step(
    slurm_cluster: SlurmCluster, tmp_path: Path, num_nodes: int, num_tasks_per_node: int
) -> None:
    if len(slurm_cluster.node_names()) < num_nodes:
        pytest.skip(f"needs a dev cluster of {num_nodes} nodes (slurm/dev-cluster-start.sh --nodes {num_nodes})")
    config = build(
        SlurmConfig,
        {"nodes": num_nodes, "time_min": 5, "signal_delay_s": 60, "mem_gb": 1,
         "setup": [f"export TIDERL_PROBE={tmp_path}/task"]},
        "test", "slurm",
    )
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    # Each task of the step writes its global rank: what the rank step will learn from Slurm.
    probe = (
        "import os; e = os.environ; "
        "open(e['TIDERL_PROBE'] + e['SLURM_PROCID'], 'w').write(e['SLURM_NTASKS'] + ' ' + e['SLURM_JOB_NAME'])"
    )
    script = tmp_path / "run.sbatch"
    script.write_text(make_sbatch_script(
        config, name="tiderl-probe", log_dir=log_dir, num_tasks_per_node=num_tasks_per_node,
        command=[sys.executable, "-c", probe],
    ))
    job_id = slurm_cluster.submit(script)
    assert slurm_cluster.wait(job_id, timeout_s=JOB_TIMEOUT_S) is JobState.COMPLETED
    assert sorted(p.name for p in tmp_path.glob("task*")) == ["task0", "task1"]
    assert (tmp_path / "task1").read_text() == "2 tiderl-probe"
    assert (log_dir / f"slurm-{job_id}.out").exists()
    records = slurm_cluster.accounting([job_id])
    step = records[f"{job_id}.0"]
    assert step.state is JobState.COMPLETED
    if num_nodes == 2:
        assert step.nodes != records[f"{job_id}.batch"].nodes  # the step spans both nodes, the batch runs on one


ROOT = Path(__file__).resolve().parents[1]


def test_slurm_scripts_parse() -> None:
    for script in ["dev-cluster-start.sh", "dev-cluster-stop.sh", "run.sbatch"]:
        done = subprocess.run(["bash", "-n", str(ROOT / "slurm" / script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


@pytest.mark.slurm
def test_second_start_changes_nothing(slurm_cluster: SlurmCluster) -> None:
    state_dir = Path(os.environ["SLURM_CONF"]).parents[1]
    if not (state_dir / "etc" / "num_nodes").is_file():
        pytest.skip(f"SLURM_CONF points at a cluster that slurm/dev-cluster-start.sh did not make: {state_dir}")
    pids = {p.name: p.read_text() for p in (state_dir / "run").glob("*.pid")}
    num_nodes = (state_dir / "etc" / "num_nodes").read_text().strip()
    done = subprocess.run(
        ["bash", str(ROOT / "slurm" / "dev-cluster-start.sh"), "--nodes", num_nodes],
        capture_output=True, text=True, env={**os.environ, "TIDERL_SLURM_DIR": str(state_dir)}, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"export SLURM_CONF={state_dir}/etc/slurm.conf\n"
    assert "already running" in done.stderr
    assert {p.name: p.read_text() for p in (state_dir / "run").glob("*.pid")} == pids


@pytest.mark.slurm
def test_run_template_is_accepted_by_sbatch(slurm_cluster: SlurmCluster) -> None:
    # --test-only: sbatch checks the directives against the cluster and schedules nothing.
    done = subprocess.run(
        ["sbatch", "--test-only", str(ROOT / "slurm" / "run.sbatch"), "jobs/quickstart.yaml"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "to start at" in done.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_start_after_a_killed_cluster_gives_a_clean_one(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # A cluster whose daemons were killed (a machine's session ended, an OOM) leaves saved jobs
    # that would hold the nodes and job processes that would run on. The next start must give a
    # cluster with idle nodes and end those processes. A second cluster, on ports of its own.
    state_dir = tmp_path / "slurm"
    env = {**os.environ, "TIDERL_SLURM_DIR": str(state_dir), "TIDERL_SLURM_PORT_BASE": "6917",
           "SLURM_CONF": str(state_dir / "etc" / "slurm.conf")}
    start = ["bash", str(ROOT / "slurm" / "dev-cluster-start.sh"), "--nodes", "1"]
    try:
        done = subprocess.run(start, capture_output=True, text=True, env=env, timeout=180)
        assert done.returncode == 0, done.stderr
        marker = f"tiderl-leftover-{os.getpid()}"
        job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", f"bash -c 'exec -a {marker} sleep 600'"],
                             capture_output=True, text=True, env=env, timeout=60, check=True).stdout.strip()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, f"job {job} never started"
            time.sleep(0.5)
        for pid_file in (state_dir / "run").glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        done = subprocess.run(start, capture_output=True, text=True, env=env, timeout=180)
        assert done.returncode == 0, done.stderr
        assert "already running" not in done.stderr
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=env, timeout=60)
        assert nodes.stdout.split() == ["idle"]
        assert subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=env, timeout=60).stdout == ""
        assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0
    finally:
        subprocess.run(["bash", str(ROOT / "slurm" / "dev-cluster-stop.sh"), "--purge"], env=env, timeout=120)
