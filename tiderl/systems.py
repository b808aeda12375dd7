"""What each `system:` value changes, as data: the four behaviours run on the same code.

Pure: no torch, no database, no processes. The control plane, the ranks and
the launcher read a :class:`SystemBehaviour` and never branch on the system
name themselves.

| system | staleness bound | trainer fetch            | RA2P mode          | ERS |
| ------ | --------------- | ------------------------ | ------------------ | --- |
| sync   | 0 (barrier)     | the whole batch          | colocated          | no  |
| async  | rollout.max_staleness | groups_ideal       | colocated          | no  |
| stream | rollout.max_staleness | as soon as groups_min | vanilla_stream     | no  |
| tiderl | rollout.max_staleness | ERS fetch size     | auto (cost model)  | yes |

A fixed `trainer.ra2p_mode` (anything but `auto`) wins over the table for
sync, async and tiderl; stream is defined by its naive alternation.

Invariants (tests/test_run_systems.py)
1. Every system value of the job config has a behaviour; an unknown name is a clear error.
2. The initial role map has `trainer.actor_ranks` actors (ranks 0..), at least one rollout rank,
   and as many entries as ranks.
3. sync never tolerates staleness; the others use the configured bound.
4. The feed bound keeps at most (staleness + 1) batches of training groups outstanding.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tiderl.policy.ra2p import Ra2pMode
from tiderl.store.types import Role

SYSTEMS = ("sync", "async", "stream", "tiderl")


class UnknownSystemError(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown system {name!r} (known systems: {', '.join(SYSTEMS)})")


class FetchPolicy(str, enum.Enum):
    """How many groups the trainer takes for a step."""

    IDEAL = "ideal"
    """trainer.groups_ideal, waiting for them."""
    MIN = "min"
    """As soon as trainer.groups_min are ready."""
    ERS = "ers"
    """The fetch size ERS planned for the step."""


@dataclass(frozen=True, slots=True)
class SystemBehaviour:
    name: str
    max_staleness: int
    uses_ers: bool
    fetch_policy: FetchPolicy
    ra2p_mode: Ra2pMode | None
    """A fixed RA2P mode, or None: the mode ERS plans with the RA2P cost model (`auto`)."""
    spare_role: Role  # role of the ranks that are neither actor nor initial rollout


def behaviour(system: str, *, max_staleness: int, ra2p_mode: str) -> SystemBehaviour:
    """The behaviour of `system` given `rollout.max_staleness` and `trainer.ra2p_mode`."""
    configured = None if ra2p_mode == "auto" else Ra2pMode.parse(ra2p_mode)
    fixed = configured or Ra2pMode.COLOCATED
    # A fixed decoupled mode needs dedicated ref ranks; otherwise spare ranks stay idle.
    spare = Role.REF if fixed is Ra2pMode.DECOUPLED else Role.IDLE
    if system == "sync":
        return SystemBehaviour("sync", 0, False, FetchPolicy.IDEAL, fixed, spare)
    if system == "async":
        return SystemBehaviour("async", max_staleness, False, FetchPolicy.IDEAL, fixed, spare)
    if system == "stream":
        return SystemBehaviour("stream", max_staleness, False, FetchPolicy.MIN, Ra2pMode.VANILLA_STREAM, Role.IDLE)
    if system == "tiderl":
        return SystemBehaviour("tiderl", max_staleness, True, FetchPolicy.ERS, configured, Role.REF)
    raise UnknownSystemError(system)


def initial_roles(num_ranks: int, rollout_fraction: float, spare: Role, num_actors: int = 1) -> dict[int, Role]:
    """Ranks 0..num_actors-1 are the (data-parallel) actors; the next ranks roll out; the rest
    take the spare role."""
    if num_ranks < num_actors + 1:
        raise ValueError(f"launch.num_ranks: a run needs {num_actors} actor and a rollout rank, "
                         f"got {num_ranks} ranks")
    num_rollout = min(num_ranks - num_actors, max(1, round(rollout_fraction * num_ranks)))
    roles = {r: Role.ACTOR for r in range(num_actors)}
    for rank in range(num_actors, num_ranks):
        roles[rank] = Role.ROLLOUT if rank < num_actors + num_rollout else spare
    return roles


def feed_allowance(outstanding_groups: int, batch_groups: int, max_staleness: int) -> int:
    """How many more training groups the feeder may create now.

    Groups created but not yet trained are at most (staleness + 1) batches: a
    group generated now is then trained within `max_staleness` versions in
    the steady state (the trainer's stale filter enforces the bound exactly).
    """
    return max(0, (max_staleness + 1) * batch_groups - outstanding_groups)
