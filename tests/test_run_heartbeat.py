"""A rank's heartbeat thread: store errors are retried; it gives up only past the heartbeat timeout."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from tiderl.run.rank import _heartbeats
from tiderl.store.engine import StoreBusyError


class FlakyStore:
    """Fails the beats whose numbers are in `fail` (1-based), counts the ones that got through."""

    def __init__(self, fail: set[int], stopped: threading.Event, stop_after: int) -> None:
        self.fail, self.stopped, self.stop_after = fail, stopped, stop_after
        self.calls = 0
        self.beats = 0

    def beat_age_s(self, rank: int) -> float | None:
        return None  # no report beats for it: every beat is the thread's

    def heartbeat(self, rank: int) -> None:
        self.calls += 1
        if self.calls >= self.stop_after:
            self.stopped.set()
        if self.calls in self.fail:
            raise StoreBusyError("run store sqlite:///run.db: still locked after 8 retries")
        self.beats += 1


def _ctx(store: FlakyStore, timeout_s: float) -> SimpleNamespace:
    launch = SimpleNamespace(heartbeat_s=0.001, heartbeat_timeout_s=timeout_s)
    return SimpleNamespace(rank=3, store=store, config=SimpleNamespace(launch=launch))


def test_a_busy_store_does_not_end_the_heartbeats() -> None:
    stopped = threading.Event()
    store = FlakyStore({2, 3, 4}, stopped, stop_after=8)
    clock = iter(float(t) for t in range(1000))  # one "second" per reading: 3 failures < 30 s timeout
    gave_up = []
    _heartbeats(_ctx(store, 30.0), stopped, on_give_up=lambda: gave_up.append(1), clock=lambda: next(clock))
    assert store.calls >= 8 and store.beats == store.calls - 3 and not gave_up


def test_it_gives_up_once_nothing_got_through_for_the_timeout() -> None:
    stopped = threading.Event()
    store = FlakyStore(set(range(2, 100)), stopped, stop_after=100)
    now = [0.0]

    def clock() -> float:
        now[0] += 4.0
        return now[0]

    gave_up = []
    _heartbeats(_ctx(store, 30.0), stopped, on_give_up=lambda: gave_up.append(store.calls), clock=clock)
    assert gave_up and 5 <= gave_up[0] <= 10  # ~30 s of 4 s failures after the last good beat


def test_a_rank_declared_dead_while_away_is_told_and_leaves_a_fresh_start_is_not(tmp_path) -> None:
    import os

    import pytest

    from tiderl.roles import Role
    from tiderl.store import ClaimRequest, NewGroup, RankDeclaredDeadError, RankReport, RunStore, TaskKind

    s = RunStore(f"sqlite:///{tmp_path / 'run.db'}")
    s.create_schema()
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    s.register_rank(1, Role.ROLLOUT)  # this process
    s.declare_dead(1, "no heartbeat for 30 s")
    with pytest.raises(RankDeclaredDeadError, match="rank 1 .*declared dead"):
        s.heartbeat(1)
    with pytest.raises(RankDeclaredDeadError):  # nor does it claim: the whole tick is refused
        s.report(RankReport(rank=1, claim=ClaimRequest(limit=2)))
    assert s.buffer_state().tasks_pending == 2
    # A fresh start of the rank (another process) beats before it registers: not told, still dead.
    s.register_rank(2, Role.ROLLOUT, pid=os.getpid() + 1)
    s.declare_dead(2, "exited")
    s.heartbeat(2)
    # Its heartbeat thread leaves at once.
    stopped, dead, gave_up = threading.Event(), threading.Event(), []
    ctx = SimpleNamespace(rank=1, store=s, config=SimpleNamespace(
        launch=SimpleNamespace(heartbeat_s=0.001, heartbeat_timeout_s=60.0)))
    _heartbeats(ctx, stopped, on_give_up=lambda: gave_up.append(1), declared_dead=dead)
    assert gave_up == [1] and dead.is_set()


def test_a_rank_whose_reports_beat_does_not_beat_again(tmp_path) -> None:
    from tiderl.roles import Role
    from tiderl.store import RankReport, RunStore

    s = RunStore(f"sqlite:///{tmp_path / 'run.db'}")
    s.create_schema()
    s.register_rank(1, Role.ROLLOUT)
    assert s.beat_age_s(1) is None
    s.report(RankReport(rank=1, role=Role.ROLLOUT))
    assert 0 <= s.beat_age_s(1) < 1.0

    class Counting:
        beats = 0

        def beat_age_s(self, rank: int) -> float:
            return 0.0  # a report just beat

        def heartbeat(self, rank: int) -> None:
            self.beats += 1

    stopped, store = threading.Event(), Counting()
    ctx = _ctx(store, 30.0)  # type: ignore[arg-type]
    t = threading.Thread(target=_heartbeats, args=(ctx, stopped))
    t.start()
    stopped.wait(0.05)
    stopped.set()
    t.join()
    assert store.beats == 0


def test_a_rank_declared_dead_leaves_with_code_75_and_closes_its_engine(monkeypatch) -> None:
    """`rank.main`'s way out: state recorded, engine closed, exit code 75 (the chaos campaign of 2026-12-02
    found it raising AttributeError there instead, leaving its vLLM engine up and the rank hanging)."""
    import signal
    from pathlib import Path

    from tiderl.run import rank as rank_mod
    from tiderl.store import RankDeclaredDeadError
    from tiderl.store.types import RankState, RunState

    calls: list[tuple[str, object]] = []
    store = SimpleNamespace(position=lambda: (RunState.RUNNING, 3), beat_age_s=lambda r: 0.0,
                            heartbeat=lambda r: None, close=lambda: calls.append(("store_closed", None)),
                            set_rank_state=lambda r, s: calls.append(("state", s)),
                            record_event=lambda *a, **k: calls.append(("event", a[1])))
    engine = SimpleNamespace(close=lambda: calls.append(("engine_closed", None)))
    launch = SimpleNamespace(heartbeat_s=60.0, heartbeat_timeout_s=120.0)
    server = SimpleNamespace(address="node:1", close=lambda: calls.append(("weights_closed", None)))
    ctx = SimpleNamespace(rank=2, store=store, engine=engine, weight_server=server, config=SimpleNamespace(launch=launch),
                          paths=SimpleNamespace(root=Path("/nonexistent"), weight_server=Path("/nonexistent/ws.json")))

    async def serve(ctx: object) -> None:
        raise RankDeclaredDeadError("rank 2 was declared dead while away")

    monkeypatch.setattr(rank_mod.RankContext, "open", classmethod(lambda cls, run_dir, rank: ctx))
    monkeypatch.setattr(rank_mod, "serve", serve)
    monkeypatch.setattr("tiderl.observe.serve_process_metrics", lambda *a, **k: None)
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = rank_mod.main(["/nonexistent", "2"])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == rank_mod.EXIT_DECLARED_DEAD == 75
    assert ("state", RankState.DEAD) in calls and ("event", "rank_left") in calls
    assert calls[-3:] == [("weights_closed", None), ("engine_closed", None), ("store_closed", None)]
