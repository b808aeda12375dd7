"""The heartbeat watch (`watch_verdict`): a watcher that was itself away does not declare the ranks dead.

The chaos campaign's `rollout_stop` trial at seed 2 (2026-12-02) had every rank declared dead in one
watch: the whole machine stalled ~20 s (no write reached the store, the ranks' logs and an outside
`uptime` logger paused alike), and the control plane's first watch after it found every beat 20 s old.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tiderl.config import load_job
from tiderl.run.control import ControlPlane
from tiderl.rundir import create_run
from tiderl.store import RankDeclaredDeadError, RunStore
from tiderl.store import control_side, rank_side, runstore, trainer_side
from tiderl.store.watch import MASS_GRACE_FRACTION, WatchState, watch_verdict
from tiderl.store.types import RankState, Role

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 10.0


def _watch_every(beats: dict[int, float], start: float, end: float, state: WatchState,
                 step: float = 1.0) -> tuple[list[tuple[float, list[int]]], WatchState]:
    """Watches at start, start + step, ... up to end; returns the (time, declared) of each watch that declared."""
    out = []
    t = start
    while t <= end + 1e-9:
        dead, state, _ = watch_verdict(beats, t, TIMEOUT, state)
        if dead:
            out.append((t, dead))
            for r in dead:
                beats.pop(r)
        t += step
    return out, state


# ---- the decision, with hand-made times ---------------------------------------------------------

def test_a_watcher_that_was_away_gives_every_rank_a_fresh_timeout() -> None:
    # Watching every second, every rank beating every 2 s until 100; then the watcher (and the ranks)
    # stall 20 s: at its wake-up every beat is 20 s old, past the 10 s timeout.
    state = WatchState()
    for t in range(90, 101):
        _, state, _ = watch_verdict({r: float(t - t % 2) for r in range(4)}, float(t), TIMEOUT, state)
    beats = {r: 100.0 for r in range(4)}
    dead, state, note = watch_verdict(beats, 120.0, TIMEOUT, state)
    assert dead == [] and "20 s after the previous one" in note and state.since == 120.0
    # The ranks come back and beat: nobody is ever declared.
    for t in range(121, 140):
        beats = {r: float(t) for r in range(4)}
        dead, state, note = watch_verdict(beats, float(t), TIMEOUT, state)
        assert dead == [] and note == ""
    # One that does not come back has its fresh timeout counted from the wake-up, not from its beat.
    beats = {0: 100.0, 1: 1e9, 2: 1e9, 3: 1e9}
    declared, _ = _watch_every(beats, 120.0, 135.0, WatchState(last_at=100.0, since=90.0))
    assert declared == [(131.0, [0])]  # 120 + 10, at the first watch past it


def test_a_rank_silent_while_the_watcher_watched_is_declared_within_the_timeout_and_one_watch() -> None:
    state = WatchState(last_at=49.0, since=0.0)  # watching since 0, every second
    for last_beat in (50.0, 50.3, 50.99):
        beats = {0: 1e9, 1: last_beat, 2: 1e9, 3: 1e9}  # the others keep beating
        declared, _ = _watch_every(beats, 50.0, 70.0, state)
        assert len(declared) == 1 and declared[0][1] == [1]
        t = declared[0][0]
        assert last_beat + TIMEOUT < t <= last_beat + TIMEOUT + 1.0


def test_short_gaps_of_a_slow_tick_keep_the_watch_continuous() -> None:
    # Watches 2.5 s apart (a slow tick under load; below WATCH_GAP_MIN_S and half the timeout): still one stretch.
    declared, state = _watch_every({0: 0.0, 1: 1e9, 2: 1e9}, 1.0, 20.0, WatchState(last_at=0.0, since=0.0), step=2.5)
    assert declared == [(11.0, [0])] and state.since == 0.0


def test_a_new_watcher_and_a_clock_that_went_back_start_afresh() -> None:
    # A restarted control plane: every beat old at its first watch; it gives a fresh timeout.
    dead, state, _ = watch_verdict({0: 0.0, 1: 500.0}, 505.0, TIMEOUT, WatchState())
    assert dead == [] and state.since == 505.0
    dead, state, _ = watch_verdict({0: 0.0, 1: 505.5}, 515.5, TIMEOUT, WatchState(last_at=514.5, since=505.0))
    assert dead == [0]
    # The watcher's clock stepped back 60 s: no stretch of watching can be trusted across it.
    dead, state, _ = watch_verdict({0: 0.0, 1: 1e9}, 455.0, TIMEOUT, WatchState(last_at=515.0, since=0.0))
    assert dead == [] and state.since == 455.0


def test_most_ranks_silent_at_once_are_held_back_then_declared_if_still_silent() -> None:
    grace = MASS_GRACE_FRACTION * TIMEOUT
    beats = {0: 1e9, 1: 50.0, 2: 50.0, 3: 50.0}  # three of four silent since 50, the watcher watching throughout
    state = WatchState(last_at=49.0, since=0.0)
    seen = []
    t = 50.0
    while t < 80.0 and not seen:
        dead, state, note = watch_verdict(beats, t, TIMEOUT, state)
        if note:
            assert "3 of 4" in note and t == 61.0
        if dead:
            seen = [(t, dead)]
        t += 1.0
    assert seen == [(61.0 + grace, [1, 2, 3])]


def test_ranks_that_beat_again_within_the_grace_are_not_declared() -> None:
    beats = {0: 1e9, 1: 50.0, 2: 50.0, 3: 50.0}
    dead, state, note = watch_verdict(beats, 61.0, TIMEOUT, WatchState(last_at=60.0, since=0.0))
    assert dead == [] and note and state.held_at == 61.0
    beats.update({1: 62.0, 2: 62.5})  # two come back; rank 3 alone is silent: an ordinary dead rank
    dead, state, _ = watch_verdict(beats, 63.0, TIMEOUT, state)
    assert dead == [3] and state.held_at is None
    # Two ranks of two silent: "most" as well.
    dead, state, note = watch_verdict({0: 50.0, 1: 50.0}, 61.0, TIMEOUT, WatchState(last_at=60.0, since=0.0))
    assert dead == [] and note


# ---- the real watch: the control plane's tick against a real store, on a hand-driven clock ------------

class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def module(self) -> SimpleNamespace:
        return SimpleNamespace(time=lambda: self.t, monotonic=lambda: self.t, sleep=lambda s: None)


@pytest.fixture
def plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ControlPlane, RunStore, Clock]:
    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=4", "system=async",
                                                          f"launch.heartbeat_timeout_s={TIMEOUT}",
                                                          "rollout.eval_every_steps=0"])
    _, store = create_run(config, tmp_path / "run")
    store.register_initial_version("model", "0")
    clock = Clock(2_000_000_000.0)
    # The store's wall clock (beats, watches) and the control plane's watch interval run on `clock`.
    for module in (runstore, rank_side, trainer_side, control_side):
        monkeypatch.setattr(module, "time", clock.module())
    monkeypatch.setattr("tiderl.run.control.time", clock.module())
    for r, role in enumerate((Role.ACTOR, Role.ROLLOUT, Role.ROLLOUT, Role.REF)):
        store.register_rank(r, role)
    return ControlPlane(config, store), store, clock


def _run(plane: ControlPlane, store: RunStore, clock: Clock, seconds: float, beating: set[int]) -> None:
    """`seconds` of ticks every 0.2 s; the ranks in `beating` beat every 2 s (their heartbeat thread)."""
    end = clock.t + seconds
    while clock.t < end - 1e-9:
        clock.t = round(clock.t + 0.2, 6)
        if round(clock.t * 5) % 10 == 0:
            for r in sorted(beating):
                store.heartbeat(r)
        plane.tick()


def _states(store: RunStore) -> dict[int, str]:
    return {r.rank: r.state.value for r in store.ranks()}


def _beat_at(store: RunStore, rank: int) -> float:
    return next(r.heartbeat_at for r in store.ranks() if r.rank == rank)


def test_a_stalled_watcher_declares_no_rank_dead(plane: tuple[ControlPlane, RunStore, Clock]) -> None:
    cp, store, clock = plane
    _run(cp, store, clock, 15.0, {0, 1, 2, 3})
    # Everything stalls 25 s (a paused machine: the ranks' beats and the control plane's watch alike).
    clock.t += 25.0
    assert all(clock.t - _beat_at(store, r) > TIMEOUT for r in range(4))  # every beat looks old
    cp.tick()
    assert set(_states(store).values()) == {RankState.RUNNING.value}
    held = store.recent_events(10, kinds=["watch_held"])
    assert len(held) == 1 and "gets a fresh timeout" in held[0]["message"]
    _run(cp, store, clock, 30.0, {0, 1, 2, 3})
    assert set(_states(store).values()) == {RankState.RUNNING.value}
    assert store.recent_events(10, kinds=["rank_dead"]) == []


def test_a_truly_dead_rank_is_still_declared_within_the_timeout_and_one_watch(
        plane: tuple[ControlPlane, RunStore, Clock]) -> None:
    cp, store, clock = plane
    _run(cp, store, clock, 15.0, {0, 1, 2, 3})
    last_beat = _beat_at(store, 2)
    while _states(store)[2] == RankState.RUNNING.value:
        _run(cp, store, clock, 0.2, {0, 1, 3})
        assert clock.t <= last_beat + TIMEOUT + 1.0 + 0.2  # one watch interval (WATCH_S), one 0.2 s tick
    assert clock.t > last_beat + TIMEOUT
    assert _states(store) == {0: "running", 1: "running", 2: RankState.DEAD.value, 3: "running"}
    # The rank's own process, back, is told so at its next beat (it then leaves with exit code 75).
    with pytest.raises(RankDeclaredDeadError):
        store.heartbeat(2)
