"""The Slurm jobs of a run (`tiderl.slurm.runjobs`): the job list file, and states from literal squeue/sacct text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_fakes import FakeRunner

from tiderl.slurm.cluster import SlurmCluster, SlurmCommandError, SlurmUnavailable
from tiderl.slurm.runjobs import RunJobsError, job_states, jobs_file, record_job, recorded_jobs, slurm_jobs_of_run
from tiderl.slurm.states import JobState, QueueEntry, SlurmOutputError, parse_sacct, parse_squeue_reasons


def test_parse_squeue_reasons() -> None:
    out = "17|RUNNING|None\n18|PENDING|BeginTime\n19|PENDING|Resources\n\n"
    assert parse_squeue_reasons(out) == {
        "17": QueueEntry(JobState.RUNNING, None),
        "18": QueueEntry(JobState.PENDING, "BeginTime"),
        "19": QueueEntry(JobState.PENDING, "Resources"),
    }
    with pytest.raises(SlurmOutputError, match="squeue line 1: expected JOBID|STATE|REASON"):
        parse_squeue_reasons("17|RUNNING\n")


def test_job_states_prefer_the_queue_then_accounting() -> None:
    queue = parse_squeue_reasons("7|PENDING|BeginTime\n")
    accounting = parse_sacct("JobID|State|ExitCode\n7|REQUEUED|0:15\n8|FAILED|3:0\n8.batch|FAILED|3:0\n"
                             "9|COMPLETED|0:0\n10|CANCELLED by 0|0:15\n")
    assert job_states(["7", "8", "9", "10", "11"], queue, accounting) == [
        {"job_id": "7", "state": "PENDING", "reason": "BeginTime"},
        {"job_id": "8", "state": "FAILED", "reason": "exit code 3"},
        {"job_id": "9", "state": "COMPLETED", "reason": None},
        {"job_id": "10", "state": "CANCELLED", "reason": "exit code 0, signal 15"},
        {"job_id": "11", "state": "UNKNOWN", "reason": "neither squeue nor sacct knows the job"},
    ]


def test_a_run_not_submitted_has_no_jobs(tmp_path: Path) -> None:
    assert recorded_jobs(tmp_path) == []
    assert slurm_jobs_of_run(tmp_path) == []


def test_recorded_jobs_accumulate(tmp_path: Path) -> None:
    record_job(tmp_path, "12", job_name="tiderl-a", slurm_conf="/conf/slurm.conf")
    record_job(tmp_path, "15", job_name="tiderl-a", slurm_conf=None)
    jobs = recorded_jobs(tmp_path)
    assert [j["job_id"] for j in jobs] == ["12", "15"]
    assert jobs[0]["slurm_conf"] == "/conf/slurm.conf"
    assert not list(jobs_file(tmp_path).parent.glob("*.tmp"))


def test_malformed_job_list_names_the_file(tmp_path: Path) -> None:
    jobs_file(tmp_path).parent.mkdir()
    jobs_file(tmp_path).write_text(json.dumps({"jobs": [{"id": 3}]}))
    with pytest.raises(RunJobsError, match=r"slurm/jobs.json: not a job list .* `job_id`"):
        slurm_jobs_of_run(tmp_path)


def test_states_come_from_squeue_and_sacct_for_jobs_gone_from_the_queue(tmp_path: Path) -> None:
    record_job(tmp_path, "3", job_name="j", slurm_conf=None)
    record_job(tmp_path, "4", job_name="j", slurm_conf=None)
    runner = FakeRunner({"squeue": "4|RUNNING|None\n", "sacct": "JobID|State|ExitCode\n3|TIMEOUT|0:1\n"})
    assert slurm_jobs_of_run(tmp_path, SlurmCluster(runner)) == [
        {"job_id": "3", "state": "TIMEOUT", "reason": "exit code 0, signal 1"},
        {"job_id": "4", "state": "RUNNING", "reason": None},
    ]
    assert "--jobs=3" in runner.calls[1]  # sacct only for what squeue no longer shows


@pytest.mark.parametrize("error", [
    SlurmUnavailable("`squeue` not found: Slurm's client commands are not installed"),
    SlurmCommandError(["squeue"], 1, "slurm_load_jobs error: Unable to contact slurm controller"),
])
def test_slurm_missing_or_down_reads_unknown(tmp_path: Path, error: Exception) -> None:
    record_job(tmp_path, "3", job_name="j", slurm_conf=None)
    [job] = slurm_jobs_of_run(tmp_path, SlurmCluster(FakeRunner({"squeue": error})))
    assert job["job_id"] == "3" and job["state"] == "UNKNOWN"
    assert job["reason"].startswith("cannot ask Slurm: ")


def test_without_slurm_commands_on_the_path_reads_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record_job(tmp_path, "3", job_name="j", slurm_conf="/nowhere/slurm.conf")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    [job] = slurm_jobs_of_run(tmp_path)
    assert job["state"] == "UNKNOWN" and "`squeue` not found" in job["reason"]
