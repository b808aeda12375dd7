"""The plan of the next version (:class:`ErsPlan`) and the helpers every stage builds one with."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.policy.ra2p import Ra2pMode
from tiderl.roles import Role

__all__ = ["ErsPlan", "ErsReason", "RoleMove", "count", "finish_plan", "mode_of", "move_roles"]


class ErsReason(enum.Enum):
    DISABLED = "disabled"
    COLD_START = "cold_start"
    EVALUATION = "evaluation"
    EVALUATION_END = "evaluation_end"  # the ranks an evaluation took go back
    CONSUMPTION_DEFICIT = "consumption_deficit"
    GENERATION_DEFICIT = "generation_deficit"
    STEADY = "steady"
    RATE_TO_ROLLOUT = "rate_to_rollout"
    RATE_TO_TRAINER = "rate_to_trainer"
    RATE_REBALANCE = "rate_rebalance"
    RATE_REPARTITION = "rate_repartition"  # the trainer's ranks divided anew between actor and ref
    RATE_TO_IDLE = "rate_to_idle"  # shared host: a rollout rank slowed the others more than it added
    ENGINE_START = "engine_start"  # idle ranks sent to rollout start their engines first; nothing moves


@dataclass(frozen=True, slots=True)
class RoleMove:
    rank: int
    from_role: Role
    to_role: Role


@dataclass(frozen=True, slots=True)
class ErsPlan:
    roles: tuple[Role, ...]
    mode: Ra2pMode
    fetch_groups: int
    moves: tuple[RoleMove, ...]
    reason: ErsReason
    warm: tuple[int, ...] = ()  # idle ranks asked to start their engine (engines on demand)


def count(roles: Sequence[Role], role: Role) -> int:
    return sum(1 for r in roles if r is role)


def mode_of(roles: Sequence[Role]) -> Ra2pMode:
    return Ra2pMode.DECOUPLED if Role.REF in roles else Ra2pMode.COLOCATED


def move_roles(roles: tuple[Role, ...], src: Role, dst: Role, n: int, lowest_first: bool = False) -> tuple[Role, ...]:
    """`n` ranks of role `src` moved to `dst`, the highest-index first (the lowest with `lowest_first`)."""
    new = list(roles)
    for rank in range(len(new)) if lowest_first else reversed(range(len(new))):
        if n > 0 and new[rank] is src:
            new[rank] = dst
            n -= 1
    return tuple(new)


def finish_plan(old: tuple[Role, ...], new: tuple[Role, ...], fetch: int, reason: ErsReason) -> ErsPlan:
    moves = tuple(RoleMove(i, a, b) for i, (a, b) in enumerate(zip(old, new)) if a is not b)
    return ErsPlan(new, mode_of(new), fetch, moves, reason)
