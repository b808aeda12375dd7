"""Bells: files in the run directory whose replacement wakes the processes that wait on the run store.

A process that waits for something in the store (the control plane for a published version, a rank for
the plan of the next version, the actor for ready groups) polls the store every fraction of a second;
each poll is a query, so the interval cannot be short. The process that makes the change rings a bell
after its commit (a file replaced by rename, no fsync), and the waiter checks the bell's file every
`SLICE_S` between its polls: a stat, not a query, so it reacts within tens of milliseconds instead of a
poll interval. The store stays the truth: a bell only says "look now". A ring that fails (a full disk)
or is not seen (a shared filesystem's attribute cache) costs at most the poll interval, as before.

| bell | rung by | after | woken |
| --- | --- | --- | --- |
| `published` | the actor leader | `RunStore.publish_version` | the control plane (plans, feeds) |
| `planned` | the control plane | `RunStore.plan_roles` | ranks waiting for the next plan |
| `finished` | a rollout rank | a report that finished trajectories | the actor gathering a step |
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)
SLICE_S = 0.02  # how often a waiter looks at a bell's file between its polls of the store


class Bell:
    """One process's view of one bell: `ring` it, or `wait` until it rings (or a timeout)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def ring(self) -> None:
        """Replace the bell's file (a new inode: seen even where mtimes are coarse). Never raises."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(str(time.time_ns()))
            os.replace(tmp, self.path)
        except OSError as e:  # the waiters poll the store anyway: a bell lost costs a poll interval
            log.debug("bell %s not rung: %s", self.path, e)
            with contextlib.suppress(OSError):  # no directory to hold it: nothing was written
                tmp.unlink(missing_ok=True)

    def rang(self) -> bool:
        """Whether the bell rang since this view last looked."""
        stamp = self._stamp()
        changed, self.seen = stamp != self.seen, stamp
        return changed

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the bell rings or `timeout_s` passes; returns whether it rang."""
        deadline = time.monotonic() + timeout_s
        while not self.rang():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(SLICE_S, left))
        return True

    async def wait_async(self, timeout_s: float) -> bool:
        """`wait` for an asyncio loop."""
        deadline = time.monotonic() + timeout_s
        while not self.rang():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(SLICE_S, left))
        return True
