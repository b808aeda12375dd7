"""An incremental reader of a run's metric points that yields each point once, whatever order the
commits that wrote them became visible in.

A metric row's id is drawn when it is inserted, and it becomes visible when its transaction commits.
On SQLite the writers take turns (one write lock per database), so ids become visible in their order
and "every id above the last one read" is the whole news. On PostgreSQL the ranks' reports commit
without taking turns (tiderl.store.rank_side): a report that drew id 9 may commit just after one that
drew id 10, and a reader that had moved on to "above 10" would never see 9. The cursor therefore keeps
re-reading above the highest id it knows settled, passes over the ids it already returned, and counts
an id as settled once a read that saw a larger one is ``settle_s`` old: a report draws its metric ids in
its last statements (after the ones that may wait on a row lock) and commits milliseconds later, so an
id not visible ``settle_s`` after a larger one was is one that rolled back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

SETTLE_S = 5.0  # PostgreSQL: how long an id below a visible one may still become visible
READ_LIMIT = 50_000


class MetricCursor:
    """Reads the points of `names` (`RunReader.metric_rows_after`) once each, in the order they become visible."""

    def __init__(self, names: Sequence[str], *, settled: int = 0, seen: Sequence[int] = (),
                 settle_s: float = SETTLE_S) -> None:
        self.names = list(names)
        self.settled = settled  # every id up to this one was returned, or will never be visible
        self.seen = set(seen)  # ids above `settled` returned already
        self.settle_s = settle_s
        self._marks: deque[tuple[float, int]] = deque()  # (monotonic time of a read, highest id it saw)

    def read(self, reader: Any) -> list[dict[str, Any]]:
        """The points that became visible since the last read (id, ts, version, rank, role, name, value), read
        through `reader` (a store's `RunReader`, `store.reader`)."""
        settle_s = self.settle_s if reader.dialect == "postgresql" else 0.0
        new: list[dict[str, Any]] = []
        after, top = self.settled, self.settled
        while True:
            rows = reader.metric_rows_after(after, self.names, limit=READ_LIMIT)
            new += [r for r in rows if r["id"] not in self.seen]
            if rows:
                after = top = max(top, rows[-1]["id"])
            if len(rows) < READ_LIMIT:
                break
        now = time.monotonic()
        if settle_s <= 0:
            self.settled, self.seen = top, set()
            return new
        self.seen.update(r["id"] for r in new)
        self._marks.append((now, top))
        while self._marks and self._marks[0][0] <= now - settle_s:
            self.settled = max(self.settled, self._marks.popleft()[1])
        self.seen = {i for i in self.seen if i > self.settled}
        return new

    def state(self) -> dict[str, Any]:
        """What a reader that resumes needs (`MetricCursor(names, **state)`)."""
        return {"settled": self.settled, "seen": sorted(self.seen)}
