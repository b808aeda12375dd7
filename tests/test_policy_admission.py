"""ERS's adaptive admission (tiderl.policy.admission): its invariants, directly."""

from __future__ import annotations

import itertools

import pytest

from tiderl.policy.admission import BUSY_SHARE, DROP_TOLERANCE, WAIT_TOLERANCE, WINDOW_STEPS, inflight_cap
from tiderl.policy.ers import StepObservation


def obs(dropped_share: float = 0.0, wait_share: float = 0.0, evaluation: bool = False,
        busy: float = 0.95) -> StepObservation:
    return StepObservation(version=5, duration_s=100.0, consumed_tokens=10_000, rollout_ranks=2, actor_ranks=6,
                           ref_ranks=0, produced_tokens=10_000, groups_completed=32,
                           stale_dropped_tokens=round(dropped_share * 10_000), trainer_wait_s=wait_share * 100.0,
                           rollout_busy_rank_s=busy * 2 * 100.0, evaluation=evaluation)


def steps(*a, **k) -> tuple[StepObservation, ...]:
    return (obs(*a, **k),) * WINDOW_STEPS


SHARES = (0.0, 0.01, DROP_TOLERANCE + 0.01, 0.2, 0.5)
WAITS = (0.0, WAIT_TOLERANCE / 2, WAIT_TOLERANCE + 0.01, 0.3, 0.6)


@pytest.mark.parametrize("batch,staleness", [(32, 1), (4, 1), (8, 2), (3, 0), (1, 1)])
@pytest.mark.parametrize("previous", [None, 0, 1, 20, 40, 64, 1000])
def test_1_the_cap_stays_between_one_batch_and_the_staleness_bound(batch, staleness, previous):
    full = (staleness + 1) * batch
    for d, w in itertools.product(SHARES, WAITS):
        cap = inflight_cap(previous, steps(d, w), batch, staleness)
        assert batch <= cap <= full


@pytest.mark.parametrize("previous", [33, 40, 48, 64])
def test_2_one_step_at_most_down_after_drops_up_after_waits(previous):
    batch, step = 32, 4
    for d, w in itertools.product(SHARES, WAITS):
        for busy in (0.3, BUSY_SHARE, 0.99):
            cap = inflight_cap(previous, steps(d, w, busy=busy), batch, 1)
            assert abs(cap - previous) <= step
            if cap < previous:  # only a window that dropped more than it waited, on busy engines
                assert d > DROP_TOLERANCE and d >= w and busy >= BUSY_SHARE
            if cap > previous:  # only a window that waited
                assert w > WAIT_TOLERANCE
    assert inflight_cap(previous, steps(0.3, 0.0), batch, 1) == max(batch, previous - step)
    assert inflight_cap(previous, steps(0.3, 0.0, busy=0.5), batch, 1) == previous  # env-bound: drops cost no engine time
    assert inflight_cap(previous, steps(0.0, 0.3), batch, 1) == min(64, previous + step)
    assert inflight_cap(previous, steps(0.3, 0.2, busy=0.5), batch, 1) == min(64, previous + step)
    assert inflight_cap(previous, steps(0.0, 0.0), batch, 1) == previous  # nothing lost: keep


def test_3_it_starts_at_the_staleness_bound_and_keeps_it_without_a_measured_step():
    assert inflight_cap(None, (), 32, 1) == 64
    assert inflight_cap(48, (), 32, 1) == 48
    # Right after an evaluation step: no change (its waits are the evaluation's) ...
    assert inflight_cap(48, steps(0.0, 0.5) + (obs(0.0, 0.5, evaluation=True),), 32, 1) == 48
    assert inflight_cap(48, steps(0.5, 0.0) + (obs(0.5, 0.0, evaluation=True),), 32, 1) == 48
    # ... and evaluation steps stay out of the window afterwards.
    assert inflight_cap(48, (obs(0.9, 0.0, evaluation=True),) + steps(0.0, 0.0), 32, 1) == 48


def test_the_window_is_the_newest_steps():
    old, new = obs(0.5, 0.0), obs(0.0, 0.0)
    assert inflight_cap(48, (old,) * 5 + (new,) * WINDOW_STEPS, 32, 1) == 48  # the old drops are out of it
    assert inflight_cap(48, (new,) * 5 + (old,) * WINDOW_STEPS, 32, 1) == 44
