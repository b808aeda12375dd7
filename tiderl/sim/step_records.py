"""The records a simulation keeps (a part of :class:`tiderl.sim.simulator.Simulation`): one
:class:`StepRecord` per published version (its figures, RA2P's predicted step times, the stale groups
dropped) and the timeline of the roles, from which :mod:`tiderl.sim.metrics` builds the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiderl.policy.ers import Role
from tiderl.policy.ra2p import Ra2pMode, StageTimes, choose_mode, time_per_ready_microbatch_s

if TYPE_CHECKING:
    from tiderl.sim.systems import System
    from tiderl.sim.trainer import SimStepStats


@dataclass(slots=True)
class StepRecord:
    version: int
    end_s: float
    duration_s: float
    rollout_ranks: int
    actor_ranks: int
    ref_ranks: int
    mode: str
    fetch_groups: int
    consumed_tokens: int
    ras: int
    tprm_s: float | None
    compute_s: float
    predicted_decoupled_s: float | None
    predicted_colocated_s: float | None
    twt_gpu_s: float
    eval_block_s: float
    ers_reason: str | None
    ready_groups: int = 0
    hol_s: float = 0.0
    consumed_gen_tokens: int = 0
    rwt_gpu_s: float = 0.0
    stale_dropped_groups: int = 0  # dropped at this step's claims
    inflight_cap: int | None = None  # ERS's adaptive admission for the step (None: the staleness bound's)


class StepRecords:
    """The step records and the role timeline (a mixin of `Simulation`)."""

    system: System
    num_gpus: int
    version: int
    mode: Ra2pMode
    inflight_cap: int | None
    last_publish_s: float
    dropped_groups: int
    dropped_at_record: int
    records: list[StepRecord]
    timeline: list[dict]
    _num: Callable[[Role], int]
    _stage_times: Callable[[], StageTimes]

    def _record_roles(self, t: float) -> None:
        if self.system.synchronous:
            entry = {"version": self.version, "t_s": round(t, 3), "rollout": self.num_gpus,
                     "actor": self.num_gpus, "ref": 0, "mode": "time-shared"}
        else:
            entry = {"version": self.version, "t_s": round(t, 3), "rollout": self._num(Role.ROLLOUT),
                     "actor": self._num(Role.ACTOR), "ref": self._num(Role.REF), "mode": self.mode.value}
        self.timeline.append(entry)

    def _record_step(self, t: float, stats: SimStepStats, block: float) -> None:
        ready = stats.ready_rel_s
        prediction = None
        if ready:
            prediction = choose_mode(ready, self._stage_times(), stats.num_actors, max(1, stats.num_refs))
        self.records.append(
            StepRecord(
                version=self.version,
                end_s=t,
                duration_s=t - self.last_publish_s,
                rollout_ranks=self._num(Role.ROLLOUT) if not self.system.synchronous else self.num_gpus,
                actor_ranks=stats.num_actors,
                ref_ranks=stats.num_refs,
                mode=stats.mode.value,
                fetch_groups=stats.fetch_groups,
                consumed_tokens=stats.consumed_tokens,
                ras=sum(1 for a in ready if a <= 0),
                tprm_s=time_per_ready_microbatch_s(ready),
                compute_s=stats.compute_done_s - stats.start_s,
                predicted_decoupled_s=prediction.decoupled_s if prediction else None,
                predicted_colocated_s=prediction.colocated_s if prediction else None,
                twt_gpu_s=stats.twt_gpu_s + block * (stats.num_actors + stats.num_refs),
                eval_block_s=block,
                ers_reason=None,
                consumed_gen_tokens=stats.consumed_gen_tokens,
                stale_dropped_groups=self.dropped_groups - self.dropped_at_record,
                inflight_cap=self.inflight_cap,
            )
        )
        self.dropped_at_record = self.dropped_groups
