"""Slurm as text: sbatch scripts from the `slurm:` section, squeue/sacct output parsed; literal strings only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tiderl.config import ConfigError, load_job
from tiderl.config.schema import build
from tiderl.config.slurm import SlurmConfig
from tiderl.slurm.sbatch import (
    MIN_CPUS_PER_GPU_TASK,
    MIN_MEM_GB_PER_GPU,
    SlurmScriptError,
    job_name,
    make_sbatch_script,
    ranks_per_node,
    resource_warnings,
    run_command,
    sbatch_directives,
)
from tiderl.slurm.states import (
    JobRecord,
    JobState,
    SlurmOutputError,
    parse_sacct,
    parse_sbatch_parsable,
    parse_sinfo_nodes,
    parse_squeue,
    sbatch_cluster,
)

DATA = Path(__file__).parent / "data"


def slurm(**fields: object) -> SlurmConfig:
    return build(SlurmConfig, fields, "job.yaml", "slurm")


# --- sbatch script ---------------------------------------------------------------------


def test_sbatch_script_matches_saved_file() -> None:
    s = slurm(
        partition="gpu", account="rl-team", qos="high", time_min=240, nodes=2, gpus_per_node=4,
        cpus_per_task=8, mem_gb=256, constraint="h100", mail_user="me@example.org",
        setup=["module load cuda/12.4", "source .venv/bin/activate"], extra_flags=["--exclusive"],
    )
    script = make_sbatch_script(
        s,
        name=job_name(s, "gsm8k"),
        log_dir=Path("runs/gsm8k-1/logs"),
        num_tasks_per_node=ranks_per_node(s, 8),
        command=run_command(Path("jobs/gsm8k.yaml"), Path("runs/gsm8k-1"), overrides=["trainer.lr=1e-6"]),
    )
    assert script == (DATA / "slurm_run_2x4gpu.sbatch").read_text()


def test_default_section_gives_minimal_cpu_directives() -> None:
    flags = sbatch_directives(slurm(), name="tiderl-run", log_dir=Path("/r/logs"), num_tasks_per_node=4)
    assert flags == [
        "--job-name=tiderl-run",
        "--output=/r/logs/slurm-%j.out",
        "--error=/r/logs/slurm-%j.err",
        "--open-mode=append",
        "--nodes=1",
        "--ntasks-per-node=4",
        "--cpus-per-task=1",
        "--mem=8G",
        "--time=60",
        "--requeue",
        "--signal=USR2@120",
    ]


def test_optional_flags_follow_their_fields() -> None:
    flags = sbatch_directives(
        slurm(requeue=False, signal_delay_s=0, job_name="mine"), name="mine", log_dir=Path("l"), num_tasks_per_node=1
    )
    assert "--no-requeue" in flags and "--requeue" not in flags
    assert not any(f.startswith("--signal") for f in flags)
    assert not any(f.startswith(("--gpus-per-node", "--partition", "--mail")) for f in flags)


def test_job_name_defaults_to_run_name() -> None:
    assert job_name(slurm(), "quickstart") == "tiderl-quickstart"
    assert job_name(slurm(job_name="exp7"), "quickstart") == "exp7"


def test_script_quotes_command_arguments() -> None:
    script = make_sbatch_script(
        slurm(), name="n", log_dir=Path("l"), num_tasks_per_node=1,
        command=["python", "-m", "tiderl", "run", "my jobs/a.yaml"], srun_flags=["--ntasks=1"],
    )
    assert script.splitlines()[-1] == (
        "srun --unbuffered --kill-on-bad-exit=1 --ntasks=1 python -m tiderl run 'my jobs/a.yaml'"
    )


def test_empty_command_is_refused() -> None:
    with pytest.raises(SlurmScriptError, match="empty"):
        make_sbatch_script(slurm(), name="n", log_dir=Path("l"), num_tasks_per_node=1, command=[])


def test_run_command_line() -> None:
    assert run_command(Path("j.yaml"), Path("runs/x"), overrides=["a.b=1"], python="/v/bin/python") == [
        "/v/bin/python", "-m", "tiderl", "run", "j.yaml", "--set", "a.b=1", "--run-dir", "runs/x",
    ]


def test_ranks_per_node_one_per_gpu() -> None:
    assert ranks_per_node(slurm(nodes=2, gpus_per_node=4), 8) == 4
    with pytest.raises(SlurmScriptError, match=r"launch.num_ranks \(6\).*slurm.nodes \(2\).*slurm.gpus_per_node \(4\)"):
        ranks_per_node(slurm(nodes=2, gpus_per_node=4), 6)


def test_ranks_per_node_cpu_ranks_spread_evenly() -> None:
    assert ranks_per_node(slurm(nodes=2), 6) == 3
    with pytest.raises(SlurmScriptError, match="multiple of slurm.nodes"):
        ranks_per_node(slurm(nodes=4), 6)


# --- slurm: config validation ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "key", "message"),
    [
        ({"partition": "gpu debug"}, "slurm.partition", "one word"),
        ({"account": "a\nb"}, "slurm.account", "one word"),
        ({"extra_flags": ["exclusive"]}, "slurm.extra_flags", "starting with '-'"),
        ({"setup": ["module load x\nrm -rf /"]}, "slurm.setup", "no line breaks"),
        ({"time_min": 2, "signal_delay_s": 120}, "slurm.signal_delay_s", "shorter than the time limit"),
        ({"gpus_per_node": -1}, "slurm.gpus_per_node", ">= 0"),
    ],
)
def test_bad_slurm_fields_name_the_key(fields: dict, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        slurm(**fields)
    assert info.value.key == key


def test_slurm_section_loads_from_job_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("system: tiderl\nslurm:\n  partition: gpu\n  gpus_per_node: 8\n  setup: [module load cuda]\n")
    config = load_job(job, ["slurm.requeue=false"])
    assert config.slurm.partition == "gpu"
    assert config.slurm.gpus_per_node == 8
    assert config.slurm.setup == ("module load cuda",)
    assert config.slurm.requeue is False


# --- job states ------------------------------------------------------------------------------


def test_job_state_parse_forms() -> None:
    assert JobState.parse("RUNNING") is JobState.RUNNING
    assert JobState.parse("CANCELLED by 0") is JobState.CANCELLED
    assert JobState.parse("CANCELLED+") is JobState.CANCELLED
    assert JobState.parse("OUT_OF_MEMORY") is JobState.OUT_OF_MEMORY
    with pytest.raises(SlurmOutputError, match="unknown Slurm job state 'WEIRD'"):
        JobState.parse("WEIRD")


def test_finished_states() -> None:
    finished = {s for s in JobState if s.is_finished}
    assert {JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED, JobState.TIMEOUT, JobState.NODE_FAIL} <= finished
    assert not {JobState.PENDING, JobState.RUNNING, JobState.REQUEUED, JobState.COMPLETING} & finished
    assert [s for s in JobState if s.is_success] == [JobState.COMPLETED]


def test_parse_sbatch_parsable() -> None:
    assert parse_sbatch_parsable("4242\n") == "4242"
    assert parse_sbatch_parsable("4242;tiderl-dev\n") == "4242"
    with pytest.raises(SlurmOutputError, match="expected a job id"):
        parse_sbatch_parsable("sbatch: error: Batch job submission failed\n")
    with pytest.raises(SlurmOutputError, match="no job id"):
        parse_sbatch_parsable("\n")


def test_sbatch_cluster_from_plain_sbatch_output() -> None:
    assert sbatch_cluster("Submitted batch job 4242\n") is None
    assert sbatch_cluster("Submitted batch job 4242 on cluster alpha\n") == "alpha"
    # sbatch may print site messages (job_submit plugins) before its own line.
    assert sbatch_cluster("sbatch: note: billed to rl\nSubmitted batch job 7 on cluster beta-2\n") == "beta-2"


def test_parse_sinfo_nodes_once_each() -> None:
    assert parse_sinfo_nodes("dev1\ndev2\ndev1\n\n") == ["dev1", "dev2"]
    assert parse_sinfo_nodes("") == []


def test_parse_squeue() -> None:
    out = "17|RUNNING\n18|PENDING\n19_3|COMPLETING\n\n"
    assert parse_squeue(out) == {"17": JobState.RUNNING, "18": JobState.PENDING, "19_3": JobState.COMPLETING}
    assert parse_squeue("") == {}
    with pytest.raises(SlurmOutputError, match=re.escape("squeue line 2: expected JOBID|STATE")):
        parse_squeue("17|RUNNING\n18 PENDING\n")


SACCT_OUT = """\
JobID|JobName|State|ExitCode|Elapsed|NodeList
1|wrap|COMPLETED|0:0|00:00:02|dev1
1.batch|batch|COMPLETED|0:0|00:00:02|dev1
2|tiderl-q|CANCELLED by 0|0:0|00:00:07|dev[1-2]
2.batch|batch|CANCELLED|0:15|00:00:08|dev1
2.0|python|CANCELLED|0:15|00:00:07|dev[1-2]
3|tiderl-q|PENDING|0:0|00:00:00|None assigned
4|boom|FAILED|3:0|00:00:01|dev1
"""


def test_parse_sacct_jobs_and_steps() -> None:
    records = parse_sacct(SACCT_OUT)
    assert records["1"] == JobRecord("1", JobState.COMPLETED, "wrap", 0, 0, "00:00:02", "dev1")
    assert records["2"].state is JobState.CANCELLED and not records["2"].is_step
    assert records["2.0"].is_step and records["2.0"].exit_signal == 15
    assert records["3"].state is JobState.PENDING
    assert (records["4"].state, records["4"].exit_code) == (JobState.FAILED, 3)
    assert [r.job_id for r in records.values() if not r.is_step] == ["1", "2", "3", "4"]


def test_parse_sacct_columns_in_any_order_last_attempt_wins() -> None:
    out = "State|JobID\nREQUEUED|9\nRUNNING|9\n"
    assert parse_sacct(out) == {"9": JobRecord("9", JobState.RUNNING)}
    assert parse_sacct("") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("JobName|ExitCode\nx|0:0\n", "lacks the JobID column"),
        ("JobID|State\n1|COMPLETED|extra\n", "line 2: 3 fields, the header has 2"),
        ("JobID|State|ExitCode\n1|FAILED|bad\n", "ExitCode 'bad' is not CODE:SIGNAL"),
    ],
)
def test_parse_sacct_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(SlurmOutputError, match=message):
        parse_sacct(text)


# --- resources that look CPU-sized for a GPU job -----------------------------------------


def test_cpu_sized_resources_of_a_gpu_job_are_warned_about() -> None:
    warnings = resource_warnings(slurm(gpus_per_node=4, mem_gb=8, cpus_per_task=1))
    assert len(warnings) == 2
    assert warnings[0].startswith("slurm.mem_gb (8) is 2 GB per GPU for slurm.gpus_per_node (4)")
    assert warnings[0].endswith("--mem is per node: 16 or more")
    assert warnings[1].startswith(f"slurm.cpus_per_task (1) is fewer than {MIN_CPUS_PER_GPU_TASK} CPUs")


def test_resource_floors_are_inclusive() -> None:
    # Exactly the floor passes; one GB or one CPU under it warns about that one field only.
    assert resource_warnings(slurm(gpus_per_node=4, mem_gb=4 * MIN_MEM_GB_PER_GPU,
                                   cpus_per_task=MIN_CPUS_PER_GPU_TASK)) == []
    [mem] = resource_warnings(slurm(gpus_per_node=4, mem_gb=4 * MIN_MEM_GB_PER_GPU - 1,
                                    cpus_per_task=MIN_CPUS_PER_GPU_TASK))
    assert mem.startswith("slurm.mem_gb (15) is 3.75 GB per GPU")
    [cpus] = resource_warnings(slurm(gpus_per_node=1, mem_gb=MIN_MEM_GB_PER_GPU, cpus_per_task=1))
    assert cpus.startswith("slurm.cpus_per_task (1)")


def test_cpu_jobs_get_no_resource_warnings() -> None:
    assert resource_warnings(slurm(gpus_per_node=0, mem_gb=1, cpus_per_task=1)) == []
