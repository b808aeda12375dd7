"""`tiderl submit --dry-run --advise WORKLOAD CLUSTER`: the simulator's advice for a job, its operating point and
the neighbours around it (tiderl.sim.from_job, tiderl.sim.plan_cli.advise_job)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tiderl.cli import main
from tiderl.config import load_job
from tiderl.config.schema import to_dict
from tiderl.sim.advisor import PlanSetting
from tiderl.sim.from_job import job_grid, job_overrides, job_setting, job_settings
from tiderl.sim.spec import load_cluster

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "jobs" / "qwen2.5-7b-h100.yaml"
BENCH = ROOT / "jobs" / "bench-latency.yaml"
H100X8 = ROOT / "jobs" / "sim" / "h100x8.cluster.yaml"
CPU = ROOT / "jobs" / "sim" / "cpu.cluster.yaml"
BENCH_WL = ROOT / "jobs" / "sim" / "bench-latency.workload.yaml"


def with_job(job: Path, cluster: Path, *sets: str) -> tuple[dict, object]:
    config = to_dict(load_job(job, list(sets)))
    doc, _, _, _ = job_settings(yaml.safe_load(cluster.read_text()), {}, config)
    path = Path(__import__("tempfile").mkdtemp()) / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return config, load_cluster(path)


def test_the_job_settings_replace_the_files_values_and_are_listed() -> None:
    config = to_dict(load_job(QWEN))
    cluster, workload, changed, mismatch = job_settings(yaml.safe_load(H100X8.read_text()),
                                                        {"task_types": [{"name": "long", "turns_max": 40}]}, config)
    assert cluster["num_gpus"] == 32 and changed["cluster.num_gpus"] == [8, 32]
    assert cluster["training"]["actor_ranks"] == 8 and cluster["training"]["default_rollout_fraction"] == 0.75
    assert cluster["training"]["min_batch_fraction"] == 0.5
    assert workload["groups_per_step"] == 32 and workload["group_size"] == 8
    assert mismatch == ["workload.task_types[long].turns_max 40 > env.max_turns 30"]


def test_the_grid_is_half_and_twice_the_gpus_and_groups_and_one_staleness_either_side() -> None:
    config, cluster = with_job(QWEN, H100X8)
    assert job_setting(config) == PlanSetting(32, 32, 1)
    assert job_grid(config, cluster) == ([16, 32, 64], [16, 32, 64], [0, 1, 2])
    # 8 GPUs would leave no rollout rank beside the 8 actor ranks
    config, cluster = with_job(QWEN, H100X8, "launch.num_ranks=16", "slurm.nodes=2", "trainer.groups_ideal=1",
                               "trainer.groups_min=1", "rollout.max_staleness=0")
    assert job_grid(config, cluster) == ([16, 32], [1, 2], [0, 1])
    config, cluster = with_job(BENCH, CPU)  # one shared host: its own rank count only
    assert job_grid(config, cluster)[0] == [config["launch"]["num_ranks"]]


def test_the_overrides_run_the_job_at_a_setting() -> None:
    config = to_dict(load_job(QWEN))  # 32 ranks on 4 nodes, 16 of 32 groups at least
    assert job_overrides(config, PlanSetting(32, 32, 1)) == []
    assert job_overrides(config, PlanSetting(64, 16, 2)) == [
        "launch.num_ranks=64", "slurm.nodes=8", "trainer.groups_ideal=16", "trainer.groups_min=8",
        "rollout.max_staleness=2"]
    assert job_overrides(config, PlanSetting(32, 1, 1)) == ["trainer.groups_ideal=1", "trainer.groups_min=1"]


def test_submit_dry_run_prints_the_advice_after_the_script(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = main(["submit", str(BENCH), "--set", "trainer.num_steps=3", "--run-dir", str(run_dir), "--dry-run",
                 "--advise", str(BENCH_WL), str(CPU)])
    out, err = capsys.readouterr()
    assert code == 0, err
    script, advice = out.split("# Advice:", 1)
    assert script.startswith("#!") and "submitit" in script
    assert all(line.startswith("#") for line in advice.splitlines()[1:] if line)  # the script stays a script
    assert "3 steps" in advice and "this job as written: 4 GPUs, 4 groups, staleness 1" in advice
    rows = [line for line in advice.splitlines() if line.startswith("#     4 ")]
    assert len(rows) == 9  # 1 GPU count (a shared host) x 3 groups x 3 staleness
    last = advice.strip().splitlines()[-1]
    assert ("the recommendation is the job as written" in last
            or ("tiderl submit" in last and "--set trainer.num_steps=3" in last)), last
    assert err.count("simulations done") == 9
    assert not run_dir.exists()  # a dry run creates nothing


@pytest.mark.parametrize("argv, named", [
    (["--advise", str(BENCH_WL), str(CPU)], "--advise goes with --dry-run"),
    (["--dry-run", "--advise", str(BENCH_WL), "jobs/sim/nope.cluster.yaml"], "--advise CLUSTER"),
    (["--dry-run", "--advise", str(CPU), str(BENCH_WL)], "this is a cluster file"),
])
def test_bad_advice_arguments_exit_2_before_anything(argv: list[str], named: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    assert main(["submit", str(BENCH), "--run-dir", str(run_dir), *argv]) == 2
    out, err = capsys.readouterr()
    assert named in err and "simulations done" not in err and out == ""
    assert not run_dir.exists()
