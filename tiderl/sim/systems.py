"""The systems `tiderl sim` compares: each is a choice of policies over the same
mechanics (engine, trainer, staleness bound, weight sync).

| name | rollout scheduler | trainer | roles |
| --- | --- | --- | --- |
| `sync` | vanilla, every GPU | whole batch after the whole rollout (VeRL-like) | all GPUs alternate |
| `async` | vanilla | whole batch, colocated ref/actor (AReaL-like) | fixed split |
| `stream` | vanilla | a micro-batch at a time, swap pair each (StreamRL-like) | fixed split |
| `stream+ra2p` | vanilla | RA2P: aggregation + dispatchers | fixed split |
| `stream+ra2p+ers` | vanilla | RA2P, decoupled when ERS provisions ref ranks | ERS |
| `tiderl` | CTB | RA2P | ERS |
| `tiderl-noers` | CTB | RA2P | fixed split |

`NAME@F` runs a fixed-partition system with rollout fraction F (TideRL
starts from F); a fixed-partition system without `@F` sweeps the cluster's
`rollout_fraction_sweep` and keeps the best goodput.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tiderl.sim.trainer import TrainerKind


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

    @property
    def label(self) -> str:
        if self.rollout_fraction is None or self.synchronous:
            return self.name
        return f"{self.name}@{self.rollout_fraction:g}"


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("sync", TrainerKind.BATCH, synchronous=True, sweep=False),
        System("async", TrainerKind.BATCH),
        System("stream", TrainerKind.STREAM),
        System("stream+ra2p", TrainerKind.RA2P),
        System("stream+ra2p+ers", TrainerKind.RA2P, ers=True, sweep=False),
        System("tiderl", TrainerKind.RA2P, ctb=True, ers=True, sweep=False),
        System("tiderl-noers", TrainerKind.RA2P, ctb=True),
    )
}


class UnknownSystemError(ValueError):
    """`--system` names no system, or gives it a rollout fraction it cannot take."""


def parse_system(text: str) -> System:
    """`NAME` or `NAME@FRACTION`."""
    name, sep, frac = text.partition("@")
    if name not in SYSTEMS:
        raise UnknownSystemError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)}, all)")
    system = SYSTEMS[name]
    if not sep:
        return system
    try:
        value = float(frac)
    except ValueError as e:
        raise UnknownSystemError(f"{text!r}: the rollout fraction after @ must be a number") from e
    if not 0 < value < 1:
        raise UnknownSystemError(f"{text!r}: the rollout fraction must lie in (0, 1)")
    if system.synchronous:
        raise UnknownSystemError(f"{text!r}: `sync` has no rollout fraction (every GPU does both)")
    return replace(system, rollout_fraction=value)
