"""The systems `tiderl sim` compares: each is a choice of policies over the same
mechanics (engine, trainer, staleness bound, weight sync).

| name | rollout scheduler | trainer | roles |
| --- | --- | --- | --- |
| `sync` | vanilla, every GPU | whole batch after the whole rollout (VeRL-like) | all GPUs alternate |
| `async` | vanilla | whole batch, colocated ref/actor (AReaL-like) | fixed split |
| `stream` | vanilla | a micro-batch at a time, swap pair each (StreamRL-like) | fixed split |
| `stream+ra2p` | vanilla | RA2P: aggregation + dispatchers | fixed split |
| `stream+ra2p+ers` | vanilla | RA2P, decoupled when ERS provisions ref ranks | ERS, the paper's rules |
| `stream+ra2p+ers-rate` | vanilla | RA2P, decoupled when ERS provisions ref ranks | ERS, the rate planner |
| `tiderl-paper` | CTB | RA2P | ERS, the paper's rules |
| `tiderl` | CTB | RA2P | ERS (the cluster's `ers.policy`, default the rate planner) |
| `tiderl-noers` | CTB | RA2P | fixed split |

`NAME~RULE` runs an ERS system with one of ERS's rules switched off (an
ablation: tiderl.policy.ers.inputs.ABLATIONS, or a rule with a switch of its
own); `NAME@F` runs a fixed-partition system with rollout fraction F (TideRL
starts from F); a fixed-partition system without `@F` sweeps the cluster's
`rollout_fraction_sweep` and keeps the best goodput.

`run:sync`, `run:async`, `run:stream` and `run:tiderl` are the four `system:`
values of `tiderl run` (tiderl/systems.py), for comparing the simulator
with the real job: `run:sync` and `run:async` wait for a step's whole fetch
before computing, `run:stream` and `run:tiderl` stream it as the real
trainer does (`SystemBehaviour.streams`); `run:sync` is a staleness-0 barrier
on a fixed split (not VeRL's time sharing); `run:stream` trains `groups_min`
groups per step with a swap pair per micro-batch. They schedule rollout with CTB (the project default);
`with_scheduler` gives them a job's `rollout.scheduler`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tiderl.sim.trainer import TrainerKind
from tiderl.systems import behaviour


@dataclass(frozen=True, slots=True)
class System:
    name: str
    trainer: TrainerKind
    ctb: bool = False
    ers: bool = False
    synchronous: bool = False
    sweep: bool = True
    """Fixed-partition system: without @F, sweep the rollout fraction and keep the best."""
    rollout_fraction: float | None = None
    max_staleness: int | None = None
    """Override the cluster's staleness bound (None: the cluster's; `sync`: 0)."""
    fetch_min: bool = False
    """A step trains on B_min groups (the feed still keeps (staleness + 1) x B_ideal groups out)."""
    gather_first: bool = False
    """A step claims its whole fetch before computing anything (the real trainer role)."""
    fixed_refs: int | None = None
    """A fixed partition with this many dedicated ref ranks, RA2P decoupled throughout (None: no ref
    ranks, colocated). The actors are the ranks left after rollout and refs."""
    ers_policy: str | None = None
    """`paper` or `rate`: override the cluster's `ers.policy` (None: the cluster's, by default `rate`)."""
    ablate: tuple[str, ...] = ()
    """ERS rules switched off (`NAME~RULE[~RULE...]`): names of tiderl.policy.ers.inputs.ABLATIONS or of the
    rules with a switch of their own, `ABLATION_SWITCHES`."""

    @property
    def label(self) -> str:
        rules = "".join(f"~{r}" for r in self.ablate)
        if self.rollout_fraction is None or self.synchronous:
            return self.name + rules + (f"+ref{self.fixed_refs}" if self.fixed_refs else "")
        return (f"{self.name}{rules}@{self.rollout_fraction:g}"
                + (f"+ref{self.fixed_refs}" if self.fixed_refs else ""))


def _run_system(name: str, trainer: TrainerKind, **kw: object) -> System:
    """`run:NAME`, the real job's system: whether its trainer streams is the run's own table's."""
    streams = behaviour(name, max_staleness=1, ra2p_mode="auto").streams
    return System(f"run:{name}", trainer, ctb=True, sweep=False, gather_first=not streams, **kw)  # type: ignore[arg-type]


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("sync", TrainerKind.BATCH, synchronous=True, sweep=False),
        System("async", TrainerKind.BATCH),
        System("stream", TrainerKind.STREAM),
        System("stream+ra2p", TrainerKind.RA2P),
        System("stream+ra2p+ers", TrainerKind.RA2P, ers=True, sweep=False, ers_policy="paper"),
        System("stream+ra2p+ers-rate", TrainerKind.RA2P, ers=True, sweep=False, ers_policy="rate"),
        System("tiderl-paper", TrainerKind.RA2P, ctb=True, ers=True, sweep=False, ers_policy="paper"),
        System("tiderl", TrainerKind.RA2P, ctb=True, ers=True, sweep=False),
        System("tiderl-noers", TrainerKind.RA2P, ctb=True),
        _run_system("sync", TrainerKind.BATCH, max_staleness=0),
        _run_system("async", TrainerKind.BATCH),
        _run_system("stream", TrainerKind.STREAM, fetch_min=True),
        _run_system("tiderl", TrainerKind.RA2P, ers=True),
    )
}


def with_scheduler(system: System, scheduler: str) -> System:
    """`system` with the rollout scheduler of a job (`ctb` or `vanilla`)."""
    if scheduler not in ("ctb", "vanilla"):
        raise SimSystemError(f"unknown rollout scheduler {scheduler!r} (known: ctb, vanilla)")
    return replace(system, ctb=scheduler == "ctb")


class SimSystemError(ValueError):
    """`--system` names no system, or gives it a rollout fraction it cannot take."""


ABLATION_SWITCHES = ("evaluation_actors", "adaptive_retention", "preemptive_rollout")
"""ERS rules with an `ers:` switch of their own, ablated through it (`NAME~RULE`)."""


def parse_system(text: str) -> System:
    """`NAME`, `NAME@FRACTION` or `NAME@FRACTION+refR` (a fixed split with R ref ranks, decoupled); an ERS
    system as `NAME~RULE[~RULE...]` with those rules switched off (an ablation), its fraction before or after
    the rules (`tiderl@0.25~valley` or `tiderl~valley@0.25`, the label's order)."""
    from tiderl.policy.ers.inputs import ABLATIONS

    text, *rules = text.split("~")
    if rules and "@" in rules[-1]:  # the label's order: the fraction after the last rule
        rules[-1], at, fraction = rules[-1].partition("@")
        text = f"{text}{at}{fraction}"
    if rules:
        system = parse_system(text)
        known = [*ABLATIONS, *ABLATION_SWITCHES]
        if not system.ers:
            raise SimSystemError(f"{text}~{'~'.join(rules)}: only an ERS system has rules to switch off")
        for rule in rules:
            if rule not in known:
                raise SimSystemError(f"~{rule}: no such ERS rule (known: {', '.join(known)})")
        return replace(system, ablate=tuple(dict.fromkeys(rules)))
    name, sep, frac = text.partition("@")
    frac, plus, refs = frac.partition("+ref")
    if name not in SYSTEMS:
        raise SimSystemError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)}, all)")
    system = SYSTEMS[name]
    if not sep:
        return system
    try:
        value = float(frac)
    except ValueError as e:
        raise SimSystemError(f"{text!r}: the rollout fraction after @ must be a number") from e
    if not 0 < value < 1:
        raise SimSystemError(f"{text!r}: the rollout fraction must lie in (0, 1)")
    if system.synchronous:
        raise SimSystemError(f"{text!r}: `sync` has no rollout fraction (every GPU does both)")
    if not plus:
        return replace(system, rollout_fraction=value)
    if not refs.isdigit() or int(refs) < 1:
        raise SimSystemError(f"{text!r}: the ref ranks after +ref must be a whole number >= 1")
    if not system.sweep or system.trainer is not TrainerKind.RA2P:
        raise SimSystemError(f"{text!r}: dedicated ref ranks need a fixed-partition RA2P system")
    return replace(system, rollout_fraction=value, fixed_refs=int(refs))
