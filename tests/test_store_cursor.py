"""The metric cursor returns every point once whatever order the commits made them visible in."""

from __future__ import annotations

import pytest

from tiderl.store import cursor as cursor_mod
from tiderl.store.cursor import MetricCursor


class Visible:
    """The rows a reader sees (a unit-test stand-in for a store's RunReader)."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self.rows: dict[int, dict] = {}

    def commit(self, *ids: int, name: str = "m") -> None:
        for i in ids:
            self.rows[i] = {"id": i, "name": name, "value": 1.0}

    def metric_rows_after(self, after_id: int, names, *, limit: int) -> list[dict]:
        return [r for i, r in sorted(self.rows.items()) if i > after_id and r["name"] in names][:limit]


def test_an_id_that_becomes_visible_after_a_larger_one_is_still_read_once(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(cursor_mod.time, "monotonic", lambda: clock[0])
    store = Visible("postgresql")
    c = MetricCursor(["m"], settle_s=5.0)
    store.commit(1, 3)  # id 2's report has not committed yet
    assert [r["id"] for r in c.read(store)] == [1, 3]
    clock[0] += 1
    store.commit(2)
    assert [r["id"] for r in c.read(store)] == [2]
    assert c.read(store) == []  # nothing twice
    clock[0] += 10
    store.commit(4)
    assert [r["id"] for r in c.read(store)] == [4]
    assert c.settled >= 3 and all(i > c.settled for i in c.seen)  # ids settled are not kept
    resumed = MetricCursor(["m"], **c.state())
    assert resumed.read(store) == []


def test_other_names_and_sqlite_settle_at_once(monkeypatch) -> None:
    store = Visible("sqlite")
    store.commit(1, 2)
    store.commit(3, name="other")
    c = MetricCursor(["m"])
    assert [r["id"] for r in c.read(store)] == [1, 2]
    assert (c.settled, c.seen) == (2, set())  # one writer at a time: ids become visible in order


def test_a_long_backlog_is_read_past_the_limit(monkeypatch) -> None:
    monkeypatch.setattr(cursor_mod, "READ_LIMIT", 3)
    store = Visible("postgresql")
    store.commit(*range(1, 9))
    c = MetricCursor(["m"])
    assert [r["id"] for r in c.read(store)] == list(range(1, 9))
    assert c.read(store) == []


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_rolled_back_id_does_not_hold_the_cursor(monkeypatch, dialect: str) -> None:
    clock = [0.0]
    monkeypatch.setattr(cursor_mod.time, "monotonic", lambda: clock[0])
    store = Visible(dialect)
    c = MetricCursor(["m"], settle_s=5.0)
    store.commit(1, 3)  # 2 never commits
    c.read(store)
    clock[0] += 6
    c.read(store)
    assert c.settled == 3 and c.seen == set()
