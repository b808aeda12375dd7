"""Latency profiles and the session table's timing rules (pure, no HTTP)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from tiderl.envs.hilo import HiloEnv
from tiderl.config.latency import LatencySpecError, parse_latency
from tiderl.envs.protocol import ErrorCode, ProtocolError
from tiderl.envs.sessions import SessionState, SessionTable


def test_none_and_fixed() -> None:
    rng = random.Random(0)
    assert parse_latency("none").sample_s(rng) == 0.0
    fixed = parse_latency("fixed:0.25")
    assert {fixed.sample_s(rng) for _ in range(10)} == {0.25}


def test_lognormal_matches_mean_and_p99() -> None:
    profile = parse_latency("lognormal:0.1:0.5")
    rng = random.Random(1)
    samples = sorted(profile.sample_s(rng) for _ in range(40_000))
    assert statistics.fmean(samples) == pytest.approx(0.1, rel=0.05)
    assert samples[int(0.99 * len(samples))] == pytest.approx(0.5, rel=0.1)
    assert profile.mean_s == pytest.approx(0.1)


def test_benchmark_job_heavy_tail() -> None:
    """jobs/bench-latency.yaml's delay: mean 0.5 s, p99 4 s (8x the mean, a heavy tail close to the
    15x a lognormal allows), read from the job file as the env servers get it."""
    from tiderl.config import load_job

    job = load_job(Path(__file__).resolve().parents[1] / "jobs" / "bench-latency.yaml")
    profile = parse_latency(job.env.latency)
    assert profile.kind == "lognormal" and profile.mean_s == pytest.approx(0.5)
    rng = random.Random(2)
    samples = sorted(profile.sample_s(rng) for _ in range(100_000))
    assert statistics.fmean(samples) == pytest.approx(0.5, rel=0.05)
    assert samples[int(0.99 * len(samples))] == pytest.approx(4.0, rel=0.1)
    assert statistics.median(samples) < 0.3  # most steps are quick; the mean is the tail's


def test_recorded_file(tmp_path: Path) -> None:
    path = tmp_path / "delays.txt"
    path.write_text("# recorded\n0.1\n\n0.3  # slow one\n")
    profile = parse_latency(f"file:{path}")
    rng = random.Random(0)
    assert {profile.sample_s(rng) for _ in range(100)} == {0.1, 0.3}


@pytest.mark.parametrize(
    "spec", ["", "fast", "fixed:", "fixed:-1", "fixed:abc", "lognormal:0.1", "lognormal:0.5:0.1",
             "lognormal:0.01:1", "file:/nonexistent/delays", "none:3"]
)
def test_bad_specs_say_what_is_expected(spec: str) -> None:
    with pytest.raises(LatencySpecError, match="latency|lognormal"):
        parse_latency(spec)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_table(max_sessions: int = 4, idle_timeout_s: float = 10.0) -> tuple[SessionTable, FakeClock]:
    clock = FakeClock()
    return SessionTable(max_sessions=max_sessions, idle_timeout_s=idle_timeout_s, clock=clock), clock


def add(table: SessionTable) -> str:
    table.reserve()
    return table.add("hilo", HiloEnv(), seed=0).session_id


def test_capacity_counts_live_and_starting_sessions() -> None:
    table, _ = make_table(max_sessions=2)
    add(table)
    table.reserve()  # a start in progress holds a slot
    with pytest.raises(ProtocolError) as info:
        table.reserve()
    assert info.value.code is ErrorCode.AT_CAPACITY
    table.release()
    add(table)
    assert table.counts()["capacity_left"] == 0


def test_paused_session_is_never_idle_and_resume_restarts_the_clock() -> None:
    table, clock = make_table(idle_timeout_s=10.0)
    sid = add(table)
    session = table.get(sid)
    table.pause(session)
    clock.now_s = 1000.0
    assert table.idle_sessions() == []
    table.resume(session)
    assert session.state is SessionState.ACTIVE
    clock.now_s = 1009.0
    assert table.idle_sessions() == []
    clock.now_s = 1011.0
    assert table.idle_sessions() == [session]


def test_busy_sessions_are_not_reaped() -> None:
    table, clock = make_table()
    session = table.get(add(table))
    session.is_busy = True
    clock.now_s = 100.0
    assert table.idle_sessions() == []


def test_ended_sessions_are_remembered_with_their_reason() -> None:
    table, _ = make_table()
    table.max_ended_kept = 2
    ids = [add(table) for _ in range(3)]
    for sid in ids:
        table.remove(table.get(sid), "reaped")
    with pytest.raises(ProtocolError, match="reaped") as info:
        table.get(ids[2])
    assert info.value.code is ErrorCode.SESSION_ENDED
    with pytest.raises(ProtocolError) as info:
        table.get(ids[0])  # forgotten: the oldest record was dropped
    assert info.value.code is ErrorCode.UNKNOWN_SESSION
    assert table.counts()["num_reaped"] == 3


def test_resume_returns_to_done_state() -> None:
    table, _ = make_table()
    session = table.get(add(table))
    session.state = SessionState.DONE
    table.pause(session)
    table.resume(session)
    assert session.state is SessionState.DONE


def test_a_keyed_delay_is_the_same_for_the_same_key_and_spread_like_the_profile() -> None:
    profile = parse_latency("lognormal:0.1:0.5")
    assert profile.keyed_s(0, "hilo", 3, 0, 2) == profile.keyed_s(0, "hilo", 3, 0, 2)
    keys = [(0, "hilo", seed, ordinal, step) for seed in range(100) for ordinal in range(8) for step in range(25)]
    samples = sorted(profile.keyed_s(*k) for k in keys)
    assert len(set(samples)) == len(keys)
    assert statistics.fmean(samples) == pytest.approx(0.1, rel=0.05)
    assert samples[int(0.99 * len(samples))] == pytest.approx(0.5, rel=0.1)
    assert parse_latency("fixed:0.25").keyed_s(1, 2) == 0.25 and parse_latency("none").keyed_s(1) == 0.0


def test_the_sessions_of_one_seed_are_told_apart_by_their_ordinal() -> None:
    table, _ = make_table(max_sessions=8)
    ordinals = []
    for seed in (4, 4, 5, 4):
        table.reserve()
        ordinals.append(table.add("hilo", HiloEnv(), seed=seed).seed_ordinal)
    assert ordinals == [0, 1, 0, 2]
    table.max_ended_kept = 1  # only the seed started last is remembered
    table.reserve()
    table.add("hilo", HiloEnv(), seed=6)
    table.reserve()
    assert table.add("hilo", HiloEnv(), seed=4).seed_ordinal == 0
