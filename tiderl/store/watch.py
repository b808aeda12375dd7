"""The heartbeat watch: whom a watcher may declare dead (pure: the control plane's `reclaim_expired`
reads the beats in its transaction and calls `watch_verdict` with them; no database here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


WATCH_GAP_FRACTION = 0.5  # a watch more than this share of the timeout after the previous one starts afresh,
WATCH_GAP_MIN_S = 3.0  # but not one this close: the control plane watches every second; a slow tick is no gap
MASS_GRACE_FRACTION = 0.5  # most ranks silent at once: declared only if still so this share of the timeout later


@dataclass(frozen=True)
class WatchState:
    """What a heartbeat watcher remembers between two of its watches, all on its own clock: in memory
    (a new watcher, such as a restarted control plane, starts afresh and so gives every rank a fresh
    timeout)."""
    last_at: float | None = None  # its previous watch
    since: float | None = None  # the start of its current stretch of watching without a gap
    held_at: float | None = None  # when it first held back a verdict that most ranks were dead


def watch_verdict(beats: Mapping[int, float], now: float, timeout_s: float,
                  state: WatchState) -> tuple[list[int], WatchState, str]:
    """Which live ranks a heartbeat watch at `now` declares dead: (ranks, the watcher's new state,
    a note when it held back a verdict, else ""). `beats`: each live rank's last heartbeat time.

    Invariant: a rank is declared dead only when (1) it has been silent for more than `timeout_s`
    counted from the later of its last beat and the start of the watcher's current stretch of
    continuous watching (a stretch ends when two watches are more than `WATCH_GAP_FRACTION` x
    `timeout_s` and more than `WATCH_GAP_MIN_S` apart, or the clock went back), and (2) if that
    would declare at least two ranks and more than half of the live ones at once, the verdict held
    at the watches of a grace period (`MASS_GRACE_FRACTION` x `timeout_s`) of continuous watching
    after it was first reached.

    Why: the ranks write their beats, the watcher compares them with its own clock. A watcher that
    was itself away (a starved or paused process or machine, a store lock it waited on) finds every
    beat old when it wakes, although the ranks may have been just as stalled as it was or beating
    into a store it could not read; by (1) it starts a fresh timeout from its wake-up instead. The
    gap is measured between the watcher's own watches, on its own clock, never against a rank's.
    A rank truly gone (one silent, the others beating) under a watcher that watched throughout is
    declared at the first watch past its last beat + `timeout_s`: within the timeout and one watch
    interval."""
    gap = None if state.last_at is None else now - state.last_at
    continuous = gap is not None and 0.0 <= gap <= max(WATCH_GAP_FRACTION * timeout_s, WATCH_GAP_MIN_S)
    since = state.since if continuous and state.since is not None else now
    silent = sorted(r for r, beat in beats.items() if now - max(beat, since) > timeout_s)
    note = ""
    if gap is not None and not continuous:
        old = sorted(r for r, beat in beats.items() if now - beat > timeout_s)
        if old:
            note = (f"the watch resumed {gap:.0f} s after the previous one (the watcher itself was away): ranks "
                    f"{old} look silent past the {timeout_s:.0f} s timeout, but each gets a fresh timeout from now")
    held_at = None
    if len(silent) >= 2 and 2 * len(silent) > len(beats):
        grace = MASS_GRACE_FRACTION * timeout_s
        if state.held_at is None or not continuous:
            held_at = now
            note = (f"ranks {silent} ({len(silent)} of {len(beats)}) look dead at once: held back, declared only "
                    f"if still silent {grace:.0f} s from now")
            silent = []
        elif now - state.held_at < grace:
            held_at, silent = state.held_at, []
    return silent, WatchState(last_at=now, since=since, held_at=held_at), note
