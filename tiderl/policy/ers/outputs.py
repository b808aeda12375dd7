"""What the ERS planner hands back: the plan of the next version (:class:`ErsPlan`: role map, RA2P
mode, fetch size, the moves and their :class:`ErsReason`), and the two helpers every stage builds one
with (:func:`move_roles`, :func:`finish_plan`).

Pure: no torch, no database, no HTTP, no processes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.policy.ra2p import Ra2pMode
from tiderl.roles import Role

__all__ = ["ErsPlan", "ErsReason", "RoleMove", "finish_plan", "mode_of", "move_roles"]


class ErsReason(enum.Enum):
    DISABLED = "disabled"
    COLD_START = "cold_start"
    EVALUATION = "evaluation"
    EVALUATION_END = "evaluation_end"
    """The evaluation is over: the ref and idle ranks its preemptive rule sent to rollout go back."""
    CONSUMPTION_DEFICIT = "consumption_deficit"
    GENERATION_DEFICIT = "generation_deficit"
    STEADY = "steady"
    RATE_TO_ROLLOUT = "rate_to_rollout"
    RATE_TO_TRAINER = "rate_to_trainer"
    RATE_REBALANCE = "rate_rebalance"
    RATE_REPARTITION = "rate_repartition"
    """The trainer's ranks divided anew between actor and ref (the rollout side as it is)."""
    RATE_TO_IDLE = "rate_to_idle"
    """A rollout rank left idle: on a shared host it slowed the others more than it added."""
    ENGINE_START = "engine_start"
    """Idle ranks the rules sent to rollout start their engines first (engines on demand); nothing moves."""


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
    warm: tuple[int, ...] = ()
    """Idle ranks asked to start their engine (engines on demand, invariant 14)."""


def mode_of(roles: Sequence[Role]) -> Ra2pMode:
    return Ra2pMode.DECOUPLED if Role.REF in roles else Ra2pMode.COLOCATED


def move_roles(roles: tuple[Role, ...], src: Role, dst: Role, count: int, lowest_first: bool = False) -> tuple[Role, ...]:
    new = list(roles)
    order = range(len(new)) if lowest_first else reversed(range(len(new)))
    for rank in order:
        if count <= 0:
            break
        if new[rank] is src:
            new[rank] = dst
            count -= 1
    return tuple(new)


def finish_plan(old: tuple[Role, ...], new: tuple[Role, ...], fetch: int, reason: ErsReason) -> ErsPlan:
    moves = tuple(RoleMove(i, a, b) for i, (a, b) in enumerate(zip(old, new)) if a is not b)
    return ErsPlan(new, mode_of(new), fetch, moves, reason)
