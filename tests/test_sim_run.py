"""Whole simulated runs on a scaled-down workload and cluster, and the `tiderl sim` CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sim_helpers import small_dicts, small_specs, write_small

from tiderl.cli import main
from tiderl.config.schema import build
from tiderl.sim.simulator import Simulation
from tiderl.sim.spec import ClusterSpec, WorkloadSpec
from tiderl.sim.systems import SYSTEMS, parse_system

STEPS = 6


def run(name: str, num_gpus: int = 4, seed: int = 0, **cluster_edits) -> dict:
    workload, cluster = small_specs(num_gpus)
    if cluster_edits:
        cluster = dataclasses.replace(cluster, rollout=dataclasses.replace(cluster.rollout, **cluster_edits))
    return Simulation(workload, cluster, parse_system(name), steps=STEPS, seed=seed).run()


@pytest.mark.parametrize("name", ["sync", "async@0.5", "stream@0.5", "stream+ra2p@0.5", "stream+ra2p+ers",
                                  "tiderl", "tiderl-noers@0.25"])
def test_every_system_trains_every_step_on_whole_batches(name):
    r = run(name)
    workload, _ = small_specs()
    assert r["steps"] == STEPS
    # Each step consumes exactly its fetch size: B_ideal, or less under ERS's adaptive retention.
    fetched = [s["fetch_groups"] for s in r["per_step"]]
    assert r["consumed_trajectories"] == sum(fetched) * workload.group_size
    assert all(2 <= f <= workload.groups_per_step for f in fetched)
    assert 0 < r["goodput_tok_s"] <= r["upper_bound_tok_s"]
    assert r["rwt_s"] >= 0 and r["twt_s"] >= 0 and 0 <= r["kv_hit_rate"] <= 1
    for key in ("goodput_tok_s", "upper_bound_tok_s", "rwt_s", "twt_s", "kv_hit_rate", "step_time_s",
                "steps", "roles_timeline"):
        assert key in r


def test_deterministic_for_a_seed():
    a, b = run("tiderl", seed=5), run("tiderl", seed=5)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


def test_sync_is_on_policy_and_async_bounded_at_admission():
    assert run("sync")["max_staleness"] == 0
    for name in ("async@0.5", "stream+ra2p+ers", "tiderl"):
        # Admission bound 1 on groups in flight (also when ERS fetches fewer groups per step);
        # long tails may finish a version later.
        assert 0 < run(name, num_gpus=8)["mean_staleness"] <= 1.5


def test_roles_change_only_at_sync_boundaries():
    r = run("tiderl", num_gpus=8)
    boundaries = {0.0} | {round(s["end_s"], 3) for s in r["per_step"]}
    assert all(e["t_s"] in boundaries for e in r["roles_timeline"])
    for e in r["roles_timeline"]:
        assert e["rollout"] + e["actor"] + e["ref"] == 8
        assert (e["mode"] == "decoupled") == (e["ref"] > 0)


def test_ctb_keeps_contexts_resident_under_kv_pressure():
    # A KV cache that holds a few contexts only: request-level admission thrashes, CTB does not.
    vanilla = run("tiderl-noers@0.25", kv_capacity_tokens=6000)
    assert vanilla["kv_hit_rate"] > 0
    stream = run("stream+ra2p@0.25", kv_capacity_tokens=6000)
    assert vanilla["kv_hit_rate"] > stream["kv_hit_rate"]
    assert stream["rollout"]["prefill_tokens"] > vanilla["rollout"]["prefill_tokens"]


def test_systems_table_lists_each_policy_once():
    assert set(SYSTEMS) == {"sync", "async", "stream", "stream+ra2p", "stream+ra2p+ers", "stream+ra2p+ers-rate",
                            "tiderl", "tiderl-paper", "tiderl-noers", "run:sync", "run:async", "run:stream", "run:tiderl"}
    with pytest.raises(ValueError):
        parse_system("sync@0.5")
    with pytest.raises(ValueError):
        parse_system("nope")


@pytest.mark.slow
def test_cli_json_and_plot(tmp_path, capsys):
    wp, cp = write_small(tmp_path)
    png = tmp_path / "out.png"
    assert main(["sim", str(wp), str(cp), "--system", "async", "--steps", "3", "--json", "--jobs", "1",
                 "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["system"].startswith("async@") and len(out["sweep"]) == 2  # the sweep, best kept
    assert png.stat().st_size > 10_000


@pytest.mark.slow
def test_cli_all_reports_ratios_and_ablation(tmp_path, capsys):
    wp, cp = write_small(tmp_path, num_gpus=8)
    assert main(["sim", str(wp), str(cp), "--system", "all", "--steps", "3", "--json", "--jobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["ratios"]) >= {"tiderl_over_sync", "tiderl_over_async_best", "tiderl_over_stream_best",
                                  "tiderl_over_upper_bound"}
    assert [(row["system"], row["over"]) for row in out["ablation"]] == [
        ("stream@0.5", None), ("stream+ra2p@0.5", "stream@0.5"), ("stream+ra2p+ers@0.5", "stream+ra2p@0.5"),
        ("stream+ra2p+ers-rate@0.5", "stream+ra2p@0.5"), ("tiderl@0.5", "stream+ra2p+ers-rate@0.5"),
        ("tiderl-paper@0.5", "stream+ra2p+ers@0.5")]
    assert set(out) >= {"best_fixed", "bound_tok_s", "bound_term", "systems"}
    assert {"goodput_tok_s", "rwt_s", "twt_s"} <= set(out["systems"]["tiderl@0.5"])
    assert out["systems"]["tiderl@0.5"]["ratio_to_tiderl"] == 1.0


def test_cli_errors(tmp_path, capsys):
    wp, cp = write_small(tmp_path)
    assert main(["sim", str(wp), str(cp), "--system", "nope"]) == 2
    assert "unknown system" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(cp.read_text().replace("num_gpus: 4", "num_gpus: four"))
    assert main(["sim", str(wp), str(bad)]) == 2
    assert f"{bad}: num_gpus" in capsys.readouterr().err


def test_one_seed_plays_out_the_same_in_every_run():
    """CTB keeps tasks in sets; their order must not depend on where the objects sit in memory."""
    wd, cd = small_dicts()
    cd["rollout"]["kv_capacity_tokens"] = 12000  # short of KV space: CTB pauses and resumes tasks
    w, c = build(WorkloadSpec, wd, "w"), build(ClusterSpec, cd, "c")
    rows = []
    for junk in (0, 5000, 20000, 777):
        _ballast = [object() for _ in range(junk)]  # shifts the addresses of the next run's objects
        sim = Simulation(w, c, parse_system("tiderl@0.5"), steps=6, seed=3)
        rows.append(sim.run()["per_step"])
    assert all(r == rows[0] for r in rows)


def test_on_a_shared_host_ers_leaves_the_spare_rank_idle():
    from tiderl.sim.spec import load_cluster, load_workload

    root = Path(__file__).resolve().parents[1] / "jobs" / "sim"
    workload = load_workload(root / "hilo-bench.workload.yaml")
    cluster = load_cluster(root / "cpu.cluster.yaml")
    shared = Simulation(workload, cluster, parse_system("tiderl"), steps=6, seed=0).run()
    # One busy engine already takes the host (a busy rollout rank weighs ~2 slots): the spare ref rank idles
    # from the cold start on.
    assert {(e["rollout"], e["actor"], e["ref"]) for e in shared["roles_timeline"]} == {(1, 1, 0)}
    # The planner prices a decoupled step's coordination as the simulated trainer pays it.
    sim = Simulation(workload, cluster, parse_system("tiderl"), steps=1, seed=0)
    assert sim.ers_limits.decoupled_step_s == sim.costs.decoupled_step_s == cluster.measured.decoupled_step_s > 0
    # Told every rank has a device of its own, the cold-start rule rolls out on the spare rank too.
    dedicated = dataclasses.replace(cluster, measured=dataclasses.replace(cluster.measured, host_compute_slots=None))
    first = Simulation(workload, dedicated, parse_system("tiderl"), steps=6, seed=0).run()["roles_timeline"][0]
    assert (first["rollout"], first["ref"]) == (2, 0)


def test_ctb_claims_spread_over_the_rollout_ranks(monkeypatch):
    # A rank claims at most its share of the tasks in flight (tiderl.policy.ctb.claim_limit, as the run's
    # ranks claim from the store): with 1,024 slots per rank the first rank would otherwise take them all.
    from tiderl.sim import rollout as sr
    from tiderl.sim.tasks import Stage
    over = []
    place = sr.RolloutSide._place

    def checked(self, t, task, rank):
        new = task.stage is Stage.QUEUED
        in_flight = sum(r.num_resident + len(r.paused) for r in self.ranks.values()) + self.queued_tasks()
        place(self, t, task, rank)
        share = -(-in_flight // len(self.ranks))
        if new and rank.num_resident + len(rank.paused) > share:
            over.append((t, rank.index, rank.num_resident, share))
    monkeypatch.setattr(sr.RolloutSide, "_place", checked)
    r = run("tiderl-noers@0.5", num_gpus=8)
    assert r["steps"] == STEPS and not over


def test_ctb_adaptive_budget_in_the_simulator_as_in_the_run(monkeypatch):
    # The simulator's ranks keep CTB's adaptive budget with the run's bookkeeping (BudgetTracker): under KV
    # pressure it moves, CTB decides again on each change, and no paused task is left behind.
    import tiderl.policy.ctb_budget as cb
    changes = []
    adjust = cb.next_budget

    def recorded(state, feedback, limits):
        new = adjust(state, feedback, limits)
        changes.append((state.budget_tokens, new.budget_tokens))
        return new
    monkeypatch.setattr(cb, "next_budget", recorded)
    r = run("tiderl-noers@0.5", num_gpus=8, kv_capacity_tokens=6000, ctb_budget="adaptive")
    assert r["steps"] == STEPS
    assert any(new != old for old, new in changes)
    changes.clear()
    run("tiderl-noers@0.5", num_gpus=8, kv_capacity_tokens=6000, ctb_budget="fixed")
    assert not changes  # fixed: never adjusted


def _rollout_side(ranks: int, tasks: int, on_group_done=lambda t, g: None):
    """A simulated rollout side of `ranks` ranks (CTB) and one group of `tasks` two-turn tasks, not placed."""
    import heapq

    from tiderl.policy.ctb import PriorityWeights
    from test_sim_mechanics import costs

    from tiderl.sim import rollout as sr
    from tiderl.sim.tasks import SimGroup, SimTask
    from tiderl.sim.workload import TaskPlan

    events: list = []
    side = sr.RolloutSide(costs(kv_capacity_tokens=10_000, max_num_seqs=64),
                          lambda t, fn, *a: heapq.heappush(events, (t, len(events), fn, a)),
                          on_group_done, ctb=True, env_concurrency=64, weights=PriorityWeights())
    for index in range(ranks):
        side.add_rank(0.0, index, 0.0)
    plan = TaskPlan("t", 100, [10, 10], [5], [1.0, 1.0], 0.0)
    group_tasks = [SimTask(i, plan, False, 10) for i in range(tasks)]
    group = SimGroup(0, group_tasks, False, "t", 0)
    for task in group_tasks:
        task.group = group
        side.tasks[task.id] = task
    return side, group_tasks


def test_an_open_group_holding_a_task_older_than_the_bound_is_dropped_and_its_late_task_joins_none():
    # The control plane drops, at each new version, the open training groups that hold a finished task
    # older than the coming step's bound (RunStore.drop_doomed_groups): tasks not started never start,
    # a running one finishes into no group. A group with no finished task, or none older, is kept.
    side, tasks = _rollout_side(ranks=1, tasks=4)
    group = tasks[0].group
    for task in tasks[:2]:
        group.remaining.remove(task)
        side._place(0.0, task, side.ranks[0])  # placed at version 0
    assert side.drop_doomed(1) == []  # no task of the group has finished
    side._finish(1.0, tasks[0])
    side.candidates.append(group)  # tasks 2 and 3 wait to be claimed
    assert side.drop_doomed(0) == []  # its finished task is not older than version 0
    assert side.drop_doomed(1) == [group] and group.dropped
    assert not side.candidates and not group.remaining
    assert set(side.tasks) == {tasks[1].id}  # the tasks never started are gone; the running one runs on
    assert side.drop_doomed(1) == []  # dropped once

    done: list = []
    side, tasks = _rollout_side(ranks=1, tasks=2, on_group_done=lambda t, g: done.append(g))
    for task in tasks:
        task.group.remaining.remove(task)
        side._place(0.0, task, side.ranks[0])
    side._finish(1.0, tasks[0])
    assert side.drop_doomed(1) == [tasks[0].group]
    side._finish(2.0, tasks[1])  # the group's last task: it would complete the group
    assert done == [] and not side.tasks


def test_a_rank_resumes_its_own_paused_tasks_past_its_claim_share():
    # Paused tasks are already the rank's (claimed): the claim share limits new tasks only. A rank holding
    # all the paused tasks of the run resumes them when room comes, even with no share left to claim.
    from tiderl.sim.tasks import Stage

    side, tasks = _rollout_side(ranks=2, tasks=6)
    rank = side.ranks[0]
    for task in tasks:  # all six on rank 0, paused there (its share of six on two ranks is three)
        side._place(0.0, task, rank)
        task.stage = Stage.ACTIVE
        side._pause(0.0, task)
    assert rank.num_resident == 0 and len(rank.paused) == 6
    side._ctb_pass(0.0, rank)
    assert rank.num_resident == 6 and not rank.paused


def test_a_rank_whose_tasks_wait_on_their_environment_is_not_idle_for_ers():
    # The real rollout rank counts `rollout_idle_s` only with no task at all; a rank whose tasks wait on the
    # environment, nothing left to claim, is RWT (the simulated one) but not idle: ERS reads the same.
    side, (task,) = _rollout_side(ranks=1, tasks=1)
    rank = side.ranks[0]
    side._place(0.0, task, rank)  # starting its environment session: held, the engine without work
    side.account_all(0.0)  # as `dispatch` accounts after placing
    side.account_all(5.0, force=True)
    assert side.rwt_rank_s() == pytest.approx(5.0) and side.empty_rank_s() == 0.0
    rank.tasks.clear()  # no task at all from t = 5 (as `_finish` accounts after removing a task)
    side.account_all(5.0)
    side.account_all(8.0, force=True)
    assert side.rwt_rank_s() == pytest.approx(8.0) and side.empty_rank_s() == pytest.approx(3.0)


def test_a_group_older_than_the_staleness_bound_is_dropped_as_the_real_trainer_drops_it():
    # run:stream trains groups_min groups a step while the feeder keeps (staleness + 1) x groups_ideal
    # in flight, as the real run's stream does: groups wait past the bound and the trainer drops them
    # (the real run of jobs/bench-latency.yaml dropped 34 of 76 finished groups). The places they free
    # are fed again, so every step still trains its whole fetch.
    r = run("run:stream", num_gpus=8)
    _, cluster = small_specs(8)
    assert r["stale_dropped_groups"] > 0 and r["stale_dropped_gen_tokens"] > 0
    assert r["max_staleness"] <= cluster.training.max_staleness
    assert r["steps"] == STEPS
    assert r["consumed_trajectories"] == sum(s["fetch_groups"] for s in r["per_step"]) * small_specs()[0].group_size


def test_the_feed_counts_a_claimed_group_outstanding_until_its_step_publishes():
    # The control plane counts the store's claimed groups as outstanding (feed_allowance over open, ready
    # and claimed): a place frees when the step that claimed the group publishes, or when a group is
    # dropped. Refeeding at a mid-step drop must not count the running step's claimed groups as done.
    workload, cluster = small_specs(8)
    checked: list[int] = []

    class Checked(Simulation):
        def _release_training(self, t: float) -> None:
            super()._release_training(t)
            published = sum(st.consumed_seqs for st in self.step_stats) // workload.group_size
            outstanding = self.train_released - published - self.dropped_groups
            assert outstanding <= (self.staleness + 1) * self._feed_batch(), (self.version, outstanding)
            checked.append(outstanding)

    r = Checked(workload, cluster, parse_system("run:stream"), steps=STEPS, seed=0).run()
    assert r["stale_dropped_groups"] > 0 and len(checked) > STEPS  # refeeds after drops were checked


def test_ers_admits_fewer_groups_while_the_trainer_drops_stragglers():
    """text-agentic x h100x8: with (staleness + 1) x B groups in flight the staleness bound drops groups
    (36 in 60 steps of seed 0 with admission off); ERS's adaptive admission lowers the cap after
    steps that drop (one eighth of a batch a step, never below a batch; from version 42 here) and the
    run drops fewer groups than with it off."""
    root = Path(__file__).resolve().parents[1]
    import yaml

    workload = build(WorkloadSpec, yaml.safe_load((root / "jobs/sim/text-agentic.workload.yaml").read_text()), "w")
    cluster = build(ClusterSpec, yaml.safe_load((root / "jobs/sim/h100x8.cluster.yaml").read_text()), "c")
    # Without elastic actors an evaluation step keeps the trainer's ranks and the run drops enough groups for
    # the rule to act; with them (evaluation steps take actor ranks, tiderl.policy.ers.overrides) this run
    # drops about 1 group of 32 a step, under the rule's 5% tolerance, and the cap stays.
    cluster = dataclasses.replace(cluster, ers=dataclasses.replace(cluster.ers, elastic_actors=False))
    on = dataclasses.replace(cluster, ers=dataclasses.replace(cluster.ers, adaptive_admission=True))
    on_run = Simulation(workload, on, parse_system("tiderl"), steps=60, seed=0).run()
    off_run = Simulation(workload, cluster, parse_system("tiderl"), steps=60, seed=0).run()  # the default
    full = (cluster.training.max_staleness + 1) * workload.groups_per_step
    caps = [s["inflight_cap"] for s in on_run["per_step"]]
    assert all(c is None for c in (s["inflight_cap"] for s in off_run["per_step"]))
    assert all(workload.groups_per_step <= c <= full for c in caps if c is not None)
    assert min(c for c in caps if c is not None) < full
    assert on_run["stale_dropped_groups"] < off_run["stale_dropped_groups"]
    # Every step still trains its whole fetch.
    assert on_run["consumed_trajectories"] == sum(s["fetch_groups"] for s in on_run["per_step"]) * workload.group_size


def test_ers_sees_the_actor_ranks_wait_as_the_control_plane_reads_it():
    # A decoupled split: the ref ranks wait too, but the control plane's trainer wait is the actor
    # ranks' `twt_s` per actor rank, so the simulator's observation must be the actors' alone.
    workload, cluster = small_specs(6)
    sim = Simulation(workload, cluster, parse_system("tiderl-noers@0.5+ref1"), steps=STEPS, seed=0)
    sim.run()
    by_version = {o.version: o for o in sim.observations}
    refs_waited, compared = False, 0
    for version, (stats, row) in enumerate(zip(sim.step_stats, sim.records), start=1):
        if version not in by_version:
            continue
        o = by_version[version]
        assert stats.num_refs == 1 and stats.num_actors == 2
        assert o.trainer_wait_s == pytest.approx(min(o.duration_s, stats.actor_wait_gpu_s / 2 + row.eval_block_s))
        refs_waited |= stats.twt_gpu_s > stats.actor_wait_gpu_s + 1e-9
        compared += 1
    assert compared >= STEPS - 1 and refs_waited  # the test sees the ref ranks' waits left out


def test_the_simulator_measures_the_task_slots_as_the_control_plane_reads_them():
    """Per completed task the simulator hands ERS its time in a slot, its environment's and its wait for the
    slot (the store's trajectories and tasks); on the shipped bench-latency x cpu pair 1 rollout rank of 16
    slots serves 64 tasks in flight, so tasks wait for a slot, and the rate planner adds the spare rank to
    rollout (it kept 1 while the wait for slots read as generation latency), once its engine is up (engines
    on demand: the plan that wants it asks it to start one, and a later one moves it)."""
    root = Path(__file__).resolve().parents[1]
    import yaml

    from tiderl.policy.ers.signals import slot_wait_s, task_times

    workload = build(WorkloadSpec, yaml.safe_load((root / "jobs/sim/bench-latency.workload.yaml").read_text()), "w")
    cluster = build(ClusterSpec, yaml.safe_load((root / "jobs/sim/cpu.cluster.yaml").read_text()), "c")
    sim = Simulation(workload, cluster, parse_system("tiderl"), steps=40, seed=0)
    result = sim.run()
    for o in sim.observations:
        assert o.tasks_completed == o.groups_completed * workload.group_size
        assert o.task_env_sum_s <= o.task_slot_sum_s + 1e-6  # a task meets its environment from a slot
        assert o.task_wait_sum_s >= 0
    one = tuple(o for o in sim.observations[2:] if o.rollout_ranks == 1)  # past the pipeline fill
    two = tuple(o for o in sim.observations[2:] if o.rollout_ranks == 2)[1:]
    assert len(one) >= 2 and len(two) >= 2
    slot, env = task_times(one)
    assert slot_wait_s(one) > 2 * (slot - env)  # groups waited for slots longer than their tasks generated
    assert slot_wait_s(two) < slot_wait_s(one) / 2
    assert max(r["rollout"] for r in result["roles_timeline"]) == 2


def test_a_rank_without_an_engine_starts_one_on_the_shared_host_before_it_rolls_out():
    """Engines on demand (the default on a shared host): the plan that wants the spare rank in rollout asks it
    to start its engine (reason `engine_start`), the start takes the host's cores at their share, so it lasts
    longer than `engine_start_s` alone, and a later plan moves the rank once the engine is up. Parked
    (`ers.idle_engines: parked`): the spare starts its engine at the cold start and no plan waits for it.
    Not priced (`engine_start_s: 0`): no plan waits either."""
    from tiderl.sim.spec import load_cluster, load_workload

    root = Path(__file__).resolve().parents[1] / "jobs" / "sim"
    workload = load_workload(root / "bench-latency.workload.yaml")
    cluster = load_cluster(root / "cpu.cluster.yaml")
    start_s = cluster.rollout.engine_start_s
    assert start_s > 0
    sim = Simulation(workload, cluster, parse_system("tiderl"), steps=40, seed=0)
    result = sim.run()
    reasons = {s["version"]: s["ers_reason"] for s in result["per_step"]}
    when = {e["version"]: (e["t_s"], e["rollout"]) for e in result["roles_timeline"]}
    waits = sorted(v for v, r in reasons.items() if r == "engine_start")
    assert waits, reasons
    moved = min(v for v, (_, n) in when.items() if n == 2)
    spare = 2  # 1 actor, 1 rollout rank, the spare
    asked = when[waits[0] + 1][0]  # the plan of a step's end is in force from the next version
    assert sim.engines[spare] - asked > start_s  # at the host's share: slower than alone
    assert moved == waits[-1] + 2 and when[moved][0] >= sim.engines[spare]  # it joined once up, not before
    parked_cluster = dataclasses.replace(cluster, ers=dataclasses.replace(cluster.ers, idle_engines="parked"))
    parked = Simulation(workload, parked_cluster, parse_system("tiderl"), steps=40, seed=0)
    out = parked.run()
    assert "engine_start" not in {s["ers_reason"] for s in out["per_step"]}
    assert parked.engines[spare] > start_s  # started at t = 0 beside the working ranks
    free = dataclasses.replace(cluster, rollout=dataclasses.replace(cluster.rollout, engine_start_s=0.0))
    assert "engine_start" not in {s["ers_reason"] for s in Simulation(workload, free, parse_system("tiderl"),
                                                                       steps=40, seed=0).run()["per_step"]}
