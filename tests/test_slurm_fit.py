"""Will the partition ever run the job (tiderl.slurm.fit): one test per invariant, on literal
`scontrol show partition --oneliner` and `sinfo` output."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slurm_fakes import FakeRunner

from tiderl.config import load_job
from tiderl.slurm.cli import fit_findings
from tiderl.slurm.cluster import SlurmCluster
from tiderl.slurm.fit import (SlurmRequest, cannot_start, gres_gpus, misfits, parse_nodes, parse_partitions,
                              parse_time_min)

DEBUG = ("PartitionName=debug AllowGroups=ALL Default=YES QoS=N/A DefaultTime=NONE MaxNodes=UNLIMITED "
         "MaxTime=UNLIMITED MinNodes=0 MaxCPUsPerNode=UNLIMITED Nodes=dev[1-2] State=UP TotalCPUs=4 "
         "TotalNodes=2 DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=4,mem=48210M,node=2")
GPU = ("PartitionName=gpu Default=NO MaxNodes=4 MaxTime=2-00:00:00 Nodes=g[1-8] State=UP TotalCPUs=768 "
       "TotalNodes=8 MaxCPUsPerNode=96 MaxMemPerNode=1024000")
ROOT = Path(__file__).resolve().parents[1]
NODES = "dev1|2|24105|(null)\ndev2|2|24105|(null)\n"
GPU_NODES = "".join(f"g{i}|96|2000000|gpu:h100:8(S:0-1)\n" for i in range(1, 7)) + "g7|96|2000000|gpu:h100:4\n"
FITS = SlurmRequest(nodes=1, tasks_per_node=2, cpus_per_task=1, mem_gb=8, gpus_per_node=0, time_min=60,
                    partition="debug")


def test_the_scontrol_and_sinfo_texts_parse() -> None:
    debug, gpu = parse_partitions(DEBUG + "\n" + GPU + "\n")
    assert (debug.name, debug.default, debug.state, debug.max_nodes, debug.max_time_min, debug.total_nodes,
            debug.max_cpus_per_node, debug.max_mem_per_node_mb) == ("debug", True, "UP", None, None, 2, None, None)
    assert (gpu.default, gpu.max_nodes, gpu.max_time_min, gpu.max_cpus_per_node, gpu.max_mem_per_node_mb) == (
        False, 4, 2 * 24 * 60, 96, 1024000)
    assert [(n.name, n.cpus, n.mem_mb, n.gpus) for n in parse_nodes(NODES + "dev1|2|24105|(null)\n")] == [
        ("dev1", 2, 24105, 0), ("dev2", 2, 24105, 0)]  # a node in two partitions counts once
    assert [n.gpus for n in parse_nodes(GPU_NODES)] == [8] * 6 + [4]
    assert gres_gpus("gpu:a100:2,shard:4") == 2 and gres_gpus("(null)") == 0 and gres_gpus("gpu:8") == 8


@pytest.mark.parametrize(("text", "minutes"), [
    ("30", 30), ("30:00", 30), ("30:01", 31), ("01:30:00", 90), ("2-00:00:00", 2880), ("1-12", 2160),
    ("1-00:30", 1470), ("UNLIMITED", None), ("INFINITE", None)])
def test_slurm_time_limits_in_minutes(text: str, minutes: int | None) -> None:
    assert parse_time_min(text) == minutes


def test_1_a_request_within_every_limit_fits_and_each_excess_names_its_field() -> None:
    (debug,) = parse_partitions(DEBUG)
    nodes = parse_nodes(NODES)
    assert misfits(FITS, debug, nodes) == []
    cases = {"slurm.nodes": replace(FITS, nodes=3),
             "launch.num_ranks": replace(FITS, tasks_per_node=4),  # 4 CPUs a node; the nodes have 2
             "slurm.mem_gb": replace(FITS, mem_gb=64),
             "slurm.gpus_per_node": replace(FITS, gpus_per_node=1)}
    for field, request in cases.items():
        found = misfits(request, debug, nodes)
        assert len(found) == 1 and field in found[0] and "debug" in found[0], (field, found)
    (gpu,) = parse_partitions(GPU)
    gpu_nodes = parse_nodes(GPU_NODES)
    run = SlurmRequest(nodes=4, tasks_per_node=8, cpus_per_task=12, mem_gb=900, gpus_per_node=8, time_min=600,
                       partition="gpu")
    assert misfits(run, gpu, gpu_nodes) == []
    assert "2880 minutes" in " ".join(misfits(replace(run, time_min=3000), gpu, gpu_nodes))
    assert "at most 4 node(s)" in " ".join(misfits(replace(run, nodes=5), gpu, gpu_nodes))
    assert "at most 96" in " ".join(misfits(replace(run, cpus_per_task=16), gpu, gpu_nodes))
    assert "slurm.mem_gb=1200" in " ".join(misfits(replace(run, mem_gb=1200), gpu, gpu_nodes))


def test_2_limits_the_partition_does_not_state_never_give_a_finding() -> None:
    (bare,) = parse_partitions("PartitionName=any State=UP")
    huge = SlurmRequest(nodes=64, tasks_per_node=128, cpus_per_task=8, mem_gb=4096, gpus_per_node=16,
                        time_min=10**6, partition="any")
    assert misfits(huge, bare, []) == []  # no node list either (sinfo printed nothing): nothing to judge


def test_3_the_nodes_must_each_hold_a_nodes_share() -> None:
    (gpu,) = parse_partitions(GPU)
    gpu_nodes = parse_nodes(GPU_NODES)  # six nodes of 8 GPUs, one of 4
    run = SlurmRequest(nodes=4, tasks_per_node=8, cpus_per_task=1, mem_gb=8, gpus_per_node=8, time_min=60,
                       partition="gpu")
    assert misfits(run, gpu, gpu_nodes) == []
    seven = parse_partitions(GPU.replace("MaxNodes=4", "MaxNodes=8"))[0]
    found = misfits(replace(run, nodes=7), seven, gpu_nodes)  # the seventh node has 4 GPUs
    assert found == ["slurm.gpus_per_node=8, but partition gpu's 7 largest nodes have at most 4 GPU(s)"]


def test_4_a_partition_that_is_down_gives_a_finding() -> None:
    for state in ("DOWN", "INACTIVE", "DRAIN"):
        (p,) = parse_partitions(DEBUG.replace("State=UP", f"State={state}"))
        found = misfits(FITS, p, parse_nodes(NODES))
        assert len(found) == 1 and state in found[0] and "slurm.partition" in found[0]


def test_pending_reasons_that_waiting_cannot_resolve() -> None:
    for reason in ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "InvalidAccount", "InvalidQOS",
                   "QOSMaxWallDurationPerJobLimit"):
        assert cannot_start(reason)
    for reason in (None, "Resources", "Priority", "BeginTime", "ReqNodeNotAvail, UnavailableNodes:dev1",
                   "Dependency", "JobHeldUser"):
        assert not cannot_start(reason)


def test_submit_checks_the_named_or_default_partition() -> None:
    job = load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=4"])
    runner = FakeRunner({"scontrol": DEBUG + "\n" + GPU, "sinfo": NODES})
    found = fit_findings(SlurmCluster(runner), job)  # 4 ranks on one node of 2 CPUs: the default partition
    assert len(found) == 1 and "launch.num_ranks" in found[0]
    assert runner.calls[-1][:3] == ["sinfo", "--noheader", "--Node"] and "--partition=debug" in runner.calls[-1]
    fits = load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=2"])
    assert fit_findings(SlurmCluster(FakeRunner({"scontrol": DEBUG, "sinfo": NODES})), fits) == []
    named = load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=2", "slurm.partition=nope"])
    found = fit_findings(SlurmCluster(FakeRunner({"scontrol": DEBUG + "\n" + GPU, "sinfo": NODES})), named)
    assert found == ["slurm.partition=nope: the cluster has no such partition (known: debug, gpu)"]
