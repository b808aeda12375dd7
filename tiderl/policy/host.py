"""Ranks that share one host's compute: the processor-sharing model the ERS
rate planner predicts with and the simulator runs (``ers.host_slots``;
``measured.host_compute_slots`` of a simulated cluster).

Pure: no torch, no database, no HTTP, no processes.

On an accelerator cluster each rank computes on a device of its own, and a
rank's speed does not depend on what the others do (no :class:`HostShare`).
Where ranks are processes on one host's cores (a CPU-only run), each busy
rank runs at ``min(1, slots / demand)`` of its speed alone, where demand is
``rollout_weight`` per busy rollout rank plus one per busy trainer rank: a
further busy process slows every other one, so a rank left idle can raise
goodput. ``slots`` and ``rollout_weight`` are measured
(``tools/calibrate_cpu.py``: ``host_compute_slots`` and ``rollout_busy_cores``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostShare", "shared_speed"]


def shared_speed(slots: float, rollout_weight: float, busy_rollout: float, busy_trainer: float) -> float:
    """Speed of each busy rank (1: as fast as alone) on a host of `slots` (see the module docstring)."""
    demand = busy_rollout * rollout_weight + busy_trainer
    return 1.0 if demand <= slots else slots / demand


@dataclass(frozen=True, slots=True)
class HostShare:
    slots: float
    """Busy trainer ranks the host runs at once at full speed."""
    rollout_weight: float = 1.0
    """A busy rollout rank's demand on the host, against a busy trainer rank's 1."""

    def __post_init__(self) -> None:
        if not self.slots > 0:
            raise ValueError(f"host slots: must be > 0, got {self.slots}")
        if not self.rollout_weight > 0:
            raise ValueError(f"host rollout weight: must be > 0, got {self.rollout_weight}")

    def speed(self, busy_rollout: float, busy_trainer: float = 0.0) -> float:
        """Speed of each busy rank (1: as fast as alone) while these ranks compute at once."""
        return shared_speed(self.slots, self.rollout_weight, busy_rollout, busy_trainer)
