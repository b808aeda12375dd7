"""The `system:` behaviour table (tiderl/systems.py): one test per invariant."""

from __future__ import annotations

import typing

import pytest

from tiderl.config.job import System
from tiderl.policy.ra2p import Ra2pMode
from tiderl.systems import (SYSTEMS, FetchPolicy, UnknownSystemError, behaviour, evaluation_due, feed_allowance,
                            initial_roles, oldest_trainable_version)
from tiderl.store.types import Role


def test_every_config_system_has_a_behaviour_and_unknown_names_fail() -> None:
    assert set(typing.get_args(System)) == set(SYSTEMS)
    for name in SYSTEMS:
        assert behaviour(name, max_staleness=2, ra2p_mode="auto").name == name
    with pytest.raises(UnknownSystemError, match="verl"):
        behaviour("verl", max_staleness=1, ra2p_mode="auto")


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])
def test_initial_roles_have_one_actor_and_a_rollout_rank(num_ranks: int, fraction: float) -> None:
    roles = initial_roles(num_ranks, fraction, Role.REF)
    assert sorted(roles) == list(range(num_ranks))
    assert [r for r, x in roles.items() if x is Role.ACTOR] == [0]
    assert any(x is Role.ROLLOUT for x in roles.values())
    with pytest.raises(ValueError, match="num_ranks"):
        initial_roles(1, fraction, Role.REF)


def test_initial_roles_with_data_parallel_actors() -> None:
    roles = initial_roles(6, 0.34, Role.REF, num_actors=2)
    assert [roles[r] for r in range(6)] == [Role.ACTOR, Role.ACTOR, Role.ROLLOUT, Role.ROLLOUT, Role.REF, Role.REF]
    roles = initial_roles(3, 1.0, Role.IDLE, num_actors=2)
    assert list(roles.values()) == [Role.ACTOR, Role.ACTOR, Role.ROLLOUT]
    with pytest.raises(ValueError, match="num_ranks"):
        initial_roles(2, 0.5, Role.REF, num_actors=2)


def test_sync_never_tolerates_staleness() -> None:
    assert behaviour("sync", max_staleness=3, ra2p_mode="auto").max_staleness == 0
    for name in ("async", "stream", "tiderl"):
        assert behaviour(name, max_staleness=3, ra2p_mode="auto").max_staleness == 3


def test_modes_and_ers_per_system() -> None:
    assert behaviour("tiderl", max_staleness=1, ra2p_mode="auto").uses_ers
    assert not any(behaviour(n, max_staleness=1, ra2p_mode="auto").uses_ers for n in ("sync", "async", "stream"))
    assert behaviour("stream", max_staleness=1, ra2p_mode="colocated").ra2p_mode == "vanilla_stream"
    assert behaviour("async", max_staleness=1, ra2p_mode="auto").ra2p_mode == "colocated"
    fixed = behaviour("async", max_staleness=1, ra2p_mode="decoupled")
    assert fixed.ra2p_mode is Ra2pMode.DECOUPLED and fixed.spare_role is Role.REF
    # One name per concept: the modes are the policy's enum, None where ERS plans the mode (auto).
    assert behaviour("tiderl", max_staleness=1, ra2p_mode="auto").ra2p_mode is None
    assert behaviour("tiderl", max_staleness=1, ra2p_mode="colocated").ra2p_mode is Ra2pMode.COLOCATED
    assert [behaviour(n, max_staleness=1, ra2p_mode="auto").fetch_policy for n in SYSTEMS] == [
        FetchPolicy.IDEAL, FetchPolicy.IDEAL, FetchPolicy.MIN, FetchPolicy.ERS]
    with pytest.raises(ValueError, match="unknown RA2P mode 'sideways'"):
        behaviour("async", max_staleness=1, ra2p_mode="sideways")


def test_the_store_hands_back_the_planned_mode_as_the_enum(tmp_path) -> None:
    from pathlib import Path

    from tiderl.config import load_job
    from tiderl.rundir import create_run

    _, store = create_run(load_job(Path(__file__).resolve().parents[1] / "jobs" / "quickstart.yaml", []),
                          tmp_path / "run")
    store.plan_roles(0, {0: Role.ACTOR, 1: Role.REF}, ra2p_mode=Ra2pMode.DECOUPLED, fetch_groups=2)
    plan = store.plan_at(0)
    assert plan is not None and plan.ra2p_mode is Ra2pMode.DECOUPLED and plan.fetch_groups == 2
    with pytest.raises(ValueError, match="unknown RA2P mode"):
        store.plan_roles(1, {0: Role.ACTOR}, ra2p_mode="sideways")


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_feed_bound_keeps_at_most_staleness_plus_one_batches(staleness: int) -> None:
    batch = 4
    outstanding = 0
    for _ in range(10):
        outstanding += feed_allowance(outstanding, batch, staleness)
        assert outstanding == (staleness + 1) * batch
        outstanding -= 3  # a step consumed some groups
    assert feed_allowance(100, batch, staleness) == 0


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_5_step_v_trains_nothing_older_than_v_minus_staleness(staleness: int) -> None:
    for version in range(6):
        bound = oldest_trainable_version(version, staleness)
        assert version - bound == staleness  # the newest `staleness + 1` versions are trainable, no older one


def test_6_an_evaluation_round_plays_every_nth_version_from_0_to_the_last() -> None:
    assert [v for v in range(-2, 14) if evaluation_due(v, 4, 3, 10)] == [0, 4, 8]
    assert [v for v in range(13) if evaluation_due(v, 4, 3, 12)] == [0, 4, 8, 12]  # the final version's too
    assert not any(evaluation_due(v, 0, 3, 10) for v in range(11))  # every 0: never
    assert not any(evaluation_due(v, 4, 0, 10) for v in range(11))  # a round without groups: never
