"""Will the partition ever run this job? The check `tiderl submit` makes before `sbatch`, and the
pending reasons that waiting cannot resolve.

Pure: text in (what `scontrol show partition --oneliner` and `sinfo` print), findings out;
`tiderl.slurm.cluster.SlurmCluster` runs the commands. A job Slurm accepts but can never start sits
in PENDING for good (reasons such as `PartitionNodeLimit` or `PartitionConfig`), and a user who
waits with `--wait` waits forever; the check says which `slurm:` field to change before anything
is submitted, and :func:`cannot_start` lets the wait stop on such a reason.

Invariants (tests/test_slurm_fit.py)
1. A request within every limit the partition states gives no finding; each limit it exceeds gives
   one finding that names the job's field (`slurm.nodes`, `slurm.cpus_per_task`, `launch.num_ranks`,
   `slurm.mem_gb`, `slurm.gpus_per_node`, `slurm.time_min`) and the partition's figure.
2. A limit the partition does not state (UNLIMITED, INFINITE, a missing key) never gives a finding.
3. Node resources count only the nodes that could take the job: `nodes` nodes must each hold one
   node's share of the request (tasks x CPUs, memory, GPUs).
4. A partition that is DOWN, INACTIVE or DRAIN gives a finding (nothing starts there until an
   administrator acts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["NodeInfo", "PartitionInfo", "SlurmRequest", "UNRESOLVABLE_REASONS", "cannot_start", "gres_gpus",
           "misfits", "parse_nodes", "parse_partitions", "parse_time_min", "NODE_FORMAT"]

NODE_FORMAT = "%N|%c|%m|%G"
"""`sinfo --noheader --Node --format=...`: node name, CPUs, memory (MB), generic resources."""

# Pending reasons that no amount of waiting resolves: the request exceeds what the partition, account
# or QOS can ever give, or names something that does not exist (from Slurm's squeue(1) reason codes).
UNRESOLVABLE_REASONS = frozenset({
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "PartitionDown", "PartitionInactive",
    "InvalidAccount", "InvalidQOS", "BadConstraints", "DependencyNeverSatisfied",
    "AssocMaxWallDurationPerJobLimit", "QOSMaxWallDurationPerJobLimit",
    "AssocMaxNodePerJobLimit", "QOSMaxNodePerJobLimit", "AssocMaxCpuPerJobLimit", "QOSMaxCpuPerJobLimit",
    "AssocMaxGRESPerJob", "QOSMaxGRESPerJob", "QOSMinGRES", "AccountNotAllowed", "QOSNotAllowed",
})
UNUSABLE_STATES = ("DOWN", "INACTIVE", "DRAIN")


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    name: str
    state: str
    default: bool
    max_nodes: int | None
    """None: UNLIMITED."""
    max_time_min: int | None
    """None: UNLIMITED / INFINITE."""
    total_nodes: int | None
    max_cpus_per_node: int | None
    max_mem_per_node_mb: int | None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    cpus: int
    mem_mb: int
    gpus: int


@dataclass(frozen=True, slots=True)
class SlurmRequest:
    """One job's request, as `tiderl submit` makes it (tiderl.slurm.submit.executor_parameters)."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    mem_gb: int
    gpus_per_node: int
    time_min: int
    partition: str | None


def _limit(value: str | None) -> int | None:
    if value is None or value.upper() in ("UNLIMITED", "INFINITE", "NONE", "N/A"):
        return None
    digits = re.match(r"\d+", value)
    return int(digits.group()) if digits else None


def parse_time_min(text: str | None) -> int | None:
    """A Slurm time limit in minutes: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`;
    None for UNLIMITED / INFINITE / NONE. Seconds round up (a limit of 30 s holds no job of a minute)."""
    if text is None or text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        h, m, s = parts
    elif len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = 0, parts[0], 0
    return (int(days or 0) * 24 + h) * 60 + m + (1 if s else 0)


def parse_partitions(text: str) -> list[PartitionInfo]:
    """`scontrol show partition --oneliner` -> one PartitionInfo per line."""
    out = []
    for line in text.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "PartitionName" not in fields:
            continue
        out.append(PartitionInfo(
            name=fields["PartitionName"], state=fields.get("State", "UP").upper(),
            default=fields.get("Default", "NO").upper() == "YES",
            max_nodes=_limit(fields.get("MaxNodes")), max_time_min=parse_time_min(fields.get("MaxTime")),
            total_nodes=_limit(fields.get("TotalNodes")), max_cpus_per_node=_limit(fields.get("MaxCPUsPerNode")),
            max_mem_per_node_mb=_limit(fields.get("MaxMemPerNode"))))
    return out


def gres_gpus(text: str) -> int:
    """GPUs in a node's generic resources (`gpu:8`, `gpu:h100:4(S:0-1)`, `gpu:a100:2,shard:4`; `(null)`: 0)."""
    total = 0
    for item in text.split(","):
        parts = item.strip().split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_nodes(text: str) -> list[NodeInfo]:
    """`sinfo --noheader --Node --format=NODE_FORMAT` -> one NodeInfo per node (a node listed twice, in two
    partitions, once). Memory `24105+` (a range over nodes) reads as its lower end."""
    seen: dict[str, NodeInfo] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or parts[0] in seen:
            continue
        name, cpus, mem, gres = parts
        seen[name] = NodeInfo(name, _limit(cpus) or 0, _limit(mem) or 0, gres_gpus(gres))
    return list(seen.values())


def misfits(req: SlurmRequest, partition: PartitionInfo, nodes: list[NodeInfo]) -> list[str]:
    """What of `req` the partition can never give, each naming the field to change (see the invariants)."""
    p = partition.name
    out = []
    if partition.state in UNUSABLE_STATES:
        out.append(f"partition {p} is {partition.state}: no job starts there until an administrator brings it UP "
                   "(slurm.partition picks another)")
    if partition.max_nodes is not None and req.nodes > partition.max_nodes:
        out.append(f"slurm.nodes={req.nodes}, but partition {p} allows at most {partition.max_nodes} node(s) a job")
    if partition.total_nodes is not None and req.nodes > partition.total_nodes:
        out.append(f"slurm.nodes={req.nodes}, but partition {p} has {partition.total_nodes} node(s)")
    if partition.max_time_min is not None and req.time_min > partition.max_time_min:
        out.append(f"slurm.time_min={req.time_min}, but partition {p} allows at most {partition.max_time_min} "
                   "minutes a job")
    cpus = req.tasks_per_node * req.cpus_per_task
    if partition.max_cpus_per_node is not None and cpus > partition.max_cpus_per_node:
        out.append(f"{req.tasks_per_node} ranks a node (launch.num_ranks / slurm.nodes) x slurm.cpus_per_task="
                   f"{req.cpus_per_task} = {cpus} CPUs a node, but partition {p} gives a job at most "
                   f"{partition.max_cpus_per_node} a node")
    mem_mb = req.mem_gb * 1024
    if partition.max_mem_per_node_mb is not None and mem_mb > partition.max_mem_per_node_mb:
        out.append(f"slurm.mem_gb={req.mem_gb}, but partition {p} gives a job at most "
                   f"{partition.max_mem_per_node_mb} MB a node")
    if nodes:
        fitting = [n for n in nodes if n.cpus >= cpus and n.mem_mb >= mem_mb and n.gpus >= req.gpus_per_node]
        if len(fitting) < req.nodes <= len(nodes):
            out += _node_findings(req, p, nodes, cpus, mem_mb)
    return out


def _node_findings(req: SlurmRequest, p: str, nodes: list[NodeInfo], cpus: int, mem_mb: int) -> list[str]:
    """Which per-node resource leaves too few nodes (each alone, so that the finding names its field)."""
    def best(values: list[int]) -> int:  # what the `req.nodes` best nodes all have
        return sorted(values, reverse=True)[req.nodes - 1]

    where = f"partition {p}'s largest node has" if req.nodes == 1 else \
        f"partition {p}'s {req.nodes} largest nodes have at most"
    out = []
    if best([n.cpus for n in nodes]) < cpus:
        out.append(f"{req.tasks_per_node} ranks a node (launch.num_ranks / slurm.nodes) x slurm.cpus_per_task="
                   f"{req.cpus_per_task} = {cpus} CPUs a node, but {where} {best([n.cpus for n in nodes])} CPUs: "
                   "lower launch.num_ranks or slurm.cpus_per_task, or raise slurm.nodes")
    if best([n.mem_mb for n in nodes]) < mem_mb:
        out.append(f"slurm.mem_gb={req.mem_gb} ({mem_mb} MB a node), but {where} "
                   f"{best([n.mem_mb for n in nodes])} MB")
    if best([n.gpus for n in nodes]) < req.gpus_per_node:
        out.append(f"slurm.gpus_per_node={req.gpus_per_node}, but {where} {best([n.gpus for n in nodes])} GPU(s)")
    if not out:  # each resource alone fits somewhere, but no node has them all
        out.append(f"no {req.nodes} node(s) of partition {p} have {cpus} CPUs, {mem_mb} MB and "
                   f"{req.gpus_per_node} GPU(s) together")
    return out


def cannot_start(reason: str | None) -> bool:
    """A pending reason that waiting cannot resolve (UNRESOLVABLE_REASONS)."""
    return reason is not None and reason.split(",")[0].strip() in UNRESOLVABLE_REASONS
