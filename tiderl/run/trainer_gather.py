"""The actor leader's side of a step's data: claiming complete groups from the run store until the step's
fetch is complete (handed out in chunks to a streaming trainer), the readiness RA2P and ERS read from it
(RAS, TPRM), and every trainer rank's wait for data (TWT). Used by tiderl.run.trainer_role."""

from __future__ import annotations

import math
import time

from tiderl.policy.ra2p import ready_at_start, time_per_ready_microbatch_s
from tiderl.run.context import RankContext
from tiderl.store.types import MetricPoint, PlanRecord, RankReport, ReadyTrajectory, Role
from tiderl.systems import oldest_trainable_version

TWT_REPORT_S = 2.0  # while a trainer rank waits for data, its wait goes to the store this often


class DataWait:
    """A trainer rank's wait for data, its TWT: the seconds between `begin` and `end` (a streamed step
    waits between its chunks; the training in between is not waiting), recorded (`twt_s`) every
    `TWT_REPORT_S` while a wait lasts so status and metrics show it, and the rest at `rest`.
    (Heartbeats come from the rank's heartbeat thread.)"""

    def __init__(self, ctx: RankContext, version: int, role: Role) -> None:
        self.ctx, self.version, self.role = ctx, version, role
        self.total = self.unrecorded = 0.0
        self.since: float | None = None
        self.reported_at = time.monotonic()

    def begin(self) -> None:
        self.since = time.monotonic()

    def end(self) -> None:
        self._settle(time.monotonic())
        self.since = None

    def _settle(self, now: float) -> None:
        if self.since is not None:
            self.total += now - self.since
            self.unrecorded += now - self.since
            self.since = now

    @property
    def seconds(self) -> float:
        self._settle(time.monotonic())
        return self.total

    def tick(self) -> None:
        if time.monotonic() - self.reported_at >= TWT_REPORT_S:
            self.ctx.store.report(RankReport(rank=self.ctx.rank, metrics=[self.rest()]))

    def rest(self) -> MetricPoint:
        """The wait since the last record, as a metric point; it counts as recorded from now on."""
        now = time.monotonic()
        self._settle(now)
        point = MetricPoint("twt_s", self.unrecorded, self.version, self.role.value)
        self.unrecorded, self.reported_at = 0.0, now
        return point


class StepGather:
    """The leader's claims for one step: complete groups, fresh under the staleness bound, until the
    fetch (`need` groups) is complete, handed out in chunks (`next`). It measures the step's readiness
    as RA2P defines it: RAS (micro-batches of ready tokens at the step's start) and TPRM (the interval
    at which further micro-batches became ready)."""

    def __init__(self, ctx: RankContext, plan: PlanRecord, need: int, wait: DataWait) -> None:
        self.ctx, self.need, self.wait = ctx, need, wait
        self.version = plan.version
        self.bound = oldest_trainable_version(plan.version, ctx.system.max_staleness)
        self.start = time.monotonic()
        self.claimed: list[ReadyTrajectory] = []
        self.handed = 0  # claimed[:handed] went out in chunks
        self.chunks = 0
        self.groups: set[int] = set()
        self.dropped = 0
        self.ras: int | None = None
        self.arrivals: list[float] = []  # seconds after the step start when another micro-batch became ready
        self.seen_tokens = 0
        self.completed_s: float | None = None

    @property
    def complete(self) -> bool:
        return len(self.groups) >= self.need

    async def next(self, min_tokens: int | None) -> list[ReadyTrajectory]:
        """The claimed trajectories not handed out yet, once they hold `min_tokens` tokens (None: the whole
        fetch) or the fetch is complete. The wait for them is TWT."""
        self.wait.begin()
        try:
            while True:
                self._claim_ready()
                pending = self.claimed[self.handed:]
                if self.complete or (min_tokens is not None and sum(t.num_tokens for t in pending) >= min_tokens):
                    break
                self.wait.tick()
                await self.ctx.bell("finished").wait_async(self.ctx.poll_s)
        finally:
            self.wait.end()
        self.handed = len(self.claimed)
        self.chunks += 1
        return pending

    def _claim_ready(self) -> None:
        cfg = self.ctx.config.trainer
        while not self.complete:
            self.ctx.position()
            buf = self.ctx.store.buffer_state()
            tokens = buf.ready_tokens + sum(t.num_tokens for t in self.claimed)
            if self.ras is None:
                self.ras = tokens // cfg.micro_batch_tokens
                self.seen_tokens = self.ras * cfg.micro_batch_tokens
            while tokens - self.seen_tokens >= cfg.micro_batch_tokens:
                self.seen_tokens += cfg.micro_batch_tokens
                self.arrivals.append(time.monotonic() - self.start)
            if buf.groups_ready <= 0:
                return
            got = self.ctx.store.claim_ready_groups(self.ctx.rank, self.need - len(self.groups))
            stale = sorted({t.group_id for t in got if t.min_version < self.bound})
            if stale:
                self.dropped += self.ctx.store.drop_claimed_groups(
                    self.ctx.rank, stale,
                    f"older than version {self.bound}, the staleness bound of step {self.version}")
            fresh = [t for t in got if t.group_id not in stale]
            self.claimed += fresh
            self.groups.update(t.group_id for t in fresh)
        if self.completed_s is None:
            self.completed_s = time.monotonic() - self.start

    def readiness(self) -> tuple[int, float | None]:
        """The step's RAS and TPRM, once the fetch is complete."""
        cfg = self.ctx.config.trainer
        arrivals = list(self.arrivals)
        done = self.completed_s if self.completed_s is not None else time.monotonic() - self.start
        total = sum(t.num_tokens for t in self.claimed)
        if self.claimed and len(arrivals) < math.ceil(total / cfg.micro_batch_tokens) - (self.ras or 0):
            arrivals.append(done)  # the last, partial micro-batch arrived when the batch was complete
        # Each micro-batch's ready time relative to the step start (<= 0: ready at the start), read by RA2P's own
        # definitions of RAS and TPRM; an arrival is after the start even where the clock's tick rounds it to 0.
        ready = [0.0] * (self.ras or 0) + [max(a, 1e-9) for a in arrivals]
        return ready_at_start(ready), time_per_ready_microbatch_s(ready)
