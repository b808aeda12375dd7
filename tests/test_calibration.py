"""Calibration against the real job: the calibration tool writes cluster and workload files the
simulator loads and runs, and the sim-vs-real comparison computes what its docstring says."""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys

import pytest
from sim_helpers import ROOT

from tiderl.config import load_job
from tiderl.sim.costs import derive_costs
from tiderl.sim.simulator import Simulation
from tiderl.sim.spec import load_cluster, load_workload
from tiderl.sim.workload import intraclass_correlation
from tiderl.sim.systems import parse_system, with_scheduler

sys.path.insert(0, str(ROOT / "tools"))
calibrate_yaml = importlib.import_module("calibrate_cpu_yaml")
calibrate_workload = importlib.import_module("calibrate_cpu_workload")
sim_vs_real = importlib.import_module("sim_vs_real")
bench_systems = importlib.import_module("bench_systems")

BENCH_SETS = ["launch.num_ranks=3", "launch.rollout_fraction=0.34", "trainer.groups_ideal=2",
              "trainer.groups_min=1", "rollout.eval_every_steps=0"]
MEASURED = {
    "job": "jobs/quickstart.yaml", "repeats": 3, "batches": [1, 4, 16], "load_before": "1.00 1.00 1.00",
    "load_after": "1.00 1.00 1.00", "decode_step_s": 0.004, "decode_s_per_seq": 0.0002,
    "prefill_s_per_token": 2e-5, "actor_forward_s_per_token": 5e-5, "actor_backward_s_per_token": 1.1e-4,
    "ref_forward_s_per_token": 3e-5, "swap_s": 0.002, "weight_reload_s": 0.05, "optimizer_s": 0.08, "engine_start_s": 12.5,
    "kv_capacity_tokens": 20000, "trainer_tokens_per_microbatch": 512, "prefill_chunk_tokens": 4096,
    "host_compute_slots": 1.2, "host_procs": 2, "host_alone_s": 1.0, "host_together_s": 1.6667,
    "report_interval_s": 0.25, "poll_s": 0.2, "control_tick_s": 0.2, "bell_s": 0.02, "step_overhead_s": 0.3, "trainer_steps": 5, "turn_overhead_s": 0.05, "turn_latency_s": 0.06, "turn_sessions": 16, "rollout_busy_cores": 1.5,
}
TRAJECTORIES = {
    "versions": 12, "turns_min": 1, "turns_max": 6, "agent_capped": 0, "turns_group_icc": 0.42,
    "start": {"n": 96, "turns_mean": 4.4, "tokens_mean": 104.4, "gen_tokens_per_turn": 2.36, "prompt_tokens": 26.0},
    "end": {"n": 96, "turns_mean": 4.9, "tokens_mean": 116.2, "gen_tokens_per_turn": 2.32, "prompt_tokens": 26.0},
}
ENV = {"env_sessions": 16, "env_start_s": {"n": 64, "mean_s": 0.02, "p99_s": 0.09},
       "env_step_s": {"n": 300, "mean_s": 0.015, "p99_s": 0.08}}


def _write_files(tmp_path):
    job = load_job(ROOT / "jobs" / "quickstart.yaml", BENCH_SETS)
    cluster = tmp_path / "cpu.cluster.yaml"
    workload = tmp_path / "hilo.workload.yaml"
    cluster.write_text(calibrate_yaml.cluster_yaml(MEASURED, job, job.launch.num_ranks, job.launch.rollout_fraction,
                                                   "2026-01-01"))
    workload.write_text(calibrate_yaml.workload_yaml(TRAJECTORIES, ENV, job, tmp_path / "run", "2026-01-01"))
    return cluster, workload


def test_calibration_files_load_and_carry_the_measurements(tmp_path):
    cluster_path, workload_path = _write_files(tmp_path)
    cluster = load_cluster(cluster_path)
    workload = load_workload(workload_path)
    assert cluster.num_gpus == 3 and cluster.training.actor_ranks == 1 and cluster.gpu is None
    costs = derive_costs(cluster)
    assert costs.decode_iteration_s(4, 0.0, 0.0) == pytest.approx(0.004 + 4 * 0.0002)
    assert costs.prefill_s(100.0) == pytest.approx(100 * 2e-5)
    assert costs.train_s(100) == pytest.approx(100 * (5e-5 + 1.1e-4 + 3e-5))
    assert (costs.swap_s, costs.weight_sync_s, costs.kv_capacity_tokens) == (0.002, 0.05, 20000)
    assert (costs.optimizer_s(1), costs.turn_overhead_s, costs.engine_start_s) == (0.3, 0.05, 12.5)
    assert costs.decoupled_step_s == calibrate_yaml.DECOUPLED_STEP_S > 0  # from real runs, with its source
    assert (cluster.control.report_interval_s, cluster.control.poll_s, cluster.control.control_tick_s) == (0.25, 0.2, 0.2)
    assert cluster.control.bell_s == 0.02
    assert costs.host_speed(0, 1) == 1.0 and costs.host_speed(0, 3) == pytest.approx(0.4)
    assert costs.host_speed(1, 1) == pytest.approx(1.2 / 2.5)  # a busy rollout rank weighs 1.5 cores
    assert workload.groups_per_step == 2 and workload.group_size == 8
    task = workload.task_types[0]
    assert task.turns_mean.start == pytest.approx(4.4) and task.env_latency.mean_s == pytest.approx(0.015)
    assert task.turns_max == 6  # the quickstart's env.max_turns
    assert task.turns_group_icc == pytest.approx(0.42)


def test_the_turns_intraclass_correlation_is_the_share_of_variance_a_group_shares():
    assert intraclass_correlation([[2, 2, 2], [5, 5, 5], [3, 3, 3]]) == pytest.approx(1.0)
    assert intraclass_correlation([[1, 6], [1, 6], [1, 6]]) == 0.0  # all within, clamped
    # Groups of the most common size only (a group still in flight is incomplete); too few: 0.
    assert intraclass_correlation([[2, 2], [5, 5], [9]]) == pytest.approx(1.0)
    assert intraclass_correlation([[2, 4]]) == 0.0 and intraclass_correlation([]) == 0.0
    # One-way ANOVA's ICC(1): MSB = 2 * ((2 - 3.5)^2 + (5 - 3.5)^2) = 9, MSW = (1 + 1 + 1 + 1) / 2 = 2.
    assert intraclass_correlation([[1, 3], [4, 6]]) == pytest.approx((9 - 2) / (9 + 2))


def test_the_run_stores_groups_give_the_turns_intraclass_correlation_trained_or_not(tmp_path):
    """trajectory_stats reads the correlation over every finished training trajectory: the group that was
    trained and the one still waiting both count (the trained ones alone would be the quick groups)."""
    from tiderl.rundir import create_run
    from tiderl.store import NewGroup, Role, RunState, TaskKind, VersionRecord

    _, s = create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "run")
    s.register_initial_version("weights/v0", "c0")
    s.register_rank(0, Role.ROLLOUT)
    s.register_rank(1, Role.ACTOR)
    s.set_run_state(RunState.RUNNING)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.TRAIN, 2, 2)])
    claims = s.claim_tasks(0, 4)
    turns = {claims[0].task_id: 1, claims[1].task_id: 3, claims[2].task_id: 4, claims[3].task_id: 6}
    s.report(_finished_report(claims, turns))
    got = s.claim_ready_groups(1, 1)  # one group trained, the other stays ready
    s.publish_version(VersionRecord(version=1, path="weights/v1", checksum="c1", trajectory_ids=[t.id for t in got],
                                    step_started_at=0.0, duration_s=1.0), owner=1)
    s.close()
    ts = calibrate_workload.trajectory_stats(tmp_path / "run")
    assert ts["start"]["n"] == 2  # the summaries: trained trajectories only
    # Groups {1, 3} and {4, 6}: MSB = 2 * (1.5^2 + 1.5^2) = 9, MSW = 4 / 2 = 2, ICC(1) = 7 / 11.
    assert ts["turns_group_icc"] == pytest.approx(7 / 11)


def _finished_report(claims, turns):  # type: ignore[no-untyped-def]
    from tiderl.store import FinishedTrajectory, RankReport

    return RankReport(rank=0, finished=[
        FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], logprobs=[0, -1, -1, -1],
                           token_versions=[-1, 0, 0, 0], num_turns=turns[c.task_id], reward=1.0, success=True)
        for c in claims])


def test_the_turn_cap_is_the_agent_loops_where_trajectories_reached_it(tmp_path):
    """With no trajectory cut at env.max_turns, the environment ended every episode itself (hilo's own
    limit below the agent loop's): the most turns seen is the cap the simulated tasks meet."""
    job = load_job(ROOT / "jobs" / "quickstart.yaml", [*BENCH_SETS, "env.max_turns=8"])
    path = tmp_path / "hilo.workload.yaml"
    for capped, seen, cap in ((3, 8, 8), (0, 8, 8), (0, 5, 5)):
        path.write_text(calibrate_yaml.workload_yaml({**TRAJECTORIES, "agent_capped": capped, "turns_max": seen},
                                                     ENV, job, tmp_path / "run", "2026-01-01"))
        assert load_workload(path).task_types[0].turns_max == cap, (capped, seen)


def test_every_calibrated_value_names_its_source(tmp_path):
    for path in _write_files(tmp_path):
        for line in path.read_text().splitlines():
            body = line.split("#")[0]
            if ":" in body and body.split(":", 1)[1].strip() and not body.strip().startswith("- name"):
                key = body.split(":")[0].strip()
                assert "#" in line or key in {"name", "min_actor_ranks", "min_rollout_ranks", "max_ref_ranks"}, line


@pytest.mark.parametrize("system", ["sync", "async", "stream", "tiderl"])
def test_the_real_systems_simulate_on_the_calibrated_files(tmp_path, system):
    cluster_path, workload_path = _write_files(tmp_path)
    cluster = load_cluster(cluster_path)
    sim_system = with_scheduler(parse_system(f"run:{system}"), "ctb")
    result = Simulation(load_workload(workload_path), cluster, sim_system, steps=4, seed=0,
                        rollout_fraction=cluster.training.default_rollout_fraction).run()
    assert result["steps"] == 4 and result["goodput_gen_tok_s"] > 0
    timeline = result["roles_timeline"]
    assert all(entry["actor"] == 1 for entry in timeline)  # one actor rank, as in `tiderl run`
    if system == "stream":
        assert all(r["fetch_groups"] == 1 for r in result["per_step"])  # groups_min
    if system == "sync":
        assert result["max_staleness"] == 0


def test_run_sync_waits_for_training_before_feeding(tmp_path):
    """A staleness-0 barrier: no trajectory is trained by a version later than the one it started on."""
    cluster_path, workload_path = _write_files(tmp_path)
    cluster = load_cluster(cluster_path)
    sync = Simulation(load_workload(workload_path), cluster, with_scheduler(parse_system("run:sync"), "ctb"),
                      steps=4, seed=0, rollout_fraction=0.34)
    sync.run()
    assert set(sync.staleness_seen) == {0}


def test_a_shared_host_slows_overlapping_ranks(tmp_path):
    """Rollout and training overlap in `run:async`: sharing one host slows both, so the same run
    takes longer than with an accelerator per rank."""
    cluster_path, workload_path = _write_files(tmp_path)
    workload = load_workload(workload_path)
    loaded = load_cluster(cluster_path)
    # Event-driven control (no polling grid), so only the host sharing differs.
    shared = dataclasses.replace(loaded, control=type(loaded.control)())
    own = dataclasses.replace(shared, measured=dataclasses.replace(shared.measured, host_compute_slots=None))
    system = with_scheduler(parse_system("run:async"), "ctb")
    runs = [Simulation(workload, c, system, steps=6, seed=0, rollout_fraction=0.34).run() for c in (own, shared)]
    assert runs[1]["sim_time_s"] > runs[0]["sim_time_s"]
    assert runs[1]["rollout"]["decode_tokens"] > 0


def test_a_polled_control_loop_delays_readiness_and_boundaries(tmp_path):
    """Ticks and polls delay every group's readiness and every step start: the same run takes longer
    than with an event-driven control loop, and longer without the run's bells than with them."""
    cluster_path, workload_path = _write_files(tmp_path)
    workload = load_workload(workload_path)
    polled = load_cluster(cluster_path)
    instant = dataclasses.replace(polled, control=type(polled.control)())
    no_bells = dataclasses.replace(polled, control=dataclasses.replace(polled.control, bell_s=None))
    system = with_scheduler(parse_system("run:sync"), "ctb")
    runs = [Simulation(workload, c, system, steps=4, seed=0, rollout_fraction=0.34)
            for c in (instant, polled, no_bells)]
    results = [sim.run() for sim in runs]
    assert results[0]["sim_time_s"] < results[1]["sim_time_s"] < results[2]["sim_time_s"]
    # A step starts half a bell's look after the publish (the control plane's wait), half another
    # (the ranks' wait for the plan), then the sync; without bells a tick and a poll.
    for sim, result, looks in ((runs[1], results[1], (0.02, 0.02)), (runs[2], results[2], (0.2, 0.2))):
        publishes = [r["end_s"] for r in result["per_step"]]
        starts = [s.start_s for s in sim.step_stats[1:]]
        assert starts == pytest.approx([t + sum(looks) / 2 + sim.costs.weight_sync_s for t in publishes[:len(starts)]])
    c = polled.control
    delay = (c.woken_s(c.control_tick_s) + c.woken_s(c.poll_s)) / 2 + runs[1].costs.weight_sync_s
    publishes = [r["end_s"] for r in results[1]["per_step"]]
    starts = [s.start_s for s in runs[1].step_stats[1:]]
    assert starts == pytest.approx([t + delay for t in publishes[:len(starts)]])


def test_steady_figures_from_literal_steps():
    rows = [{"end_s": 10.0, "gen_tokens": 999, "rwt_s": 50.0, "twt_s": 60.0},
            {"end_s": 14.0, "gen_tokens": 100, "rwt_s": 1.0, "twt_s": 2.0},
            {"end_s": 20.0, "gen_tokens": 200, "rwt_s": 3.0, "twt_s": None}]
    got = sim_vs_real.steady_from_steps(rows)
    assert got["steady_goodput_tok_s"] == pytest.approx(300 / 10)
    assert got["step_s"] == pytest.approx(5.0)
    assert got["rwt_s_per_step"] == pytest.approx(2.0)
    assert got["twt_s_per_step"] == pytest.approx(1.0)  # a missing value counts as no wait
    assert sim_vs_real.steady_from_steps(rows[:1]) == dict.fromkeys(sim_vs_real.FIGURES)
    # From a later version (the bench's steady window): the rows before it are left out on both sides.
    numbered = [r | {"version": v} for v, r in enumerate(rows, start=1)]
    later = sim_vs_real.steady_from_steps(numbered, from_version=2)
    assert later["steady_goodput_tok_s"] == pytest.approx(200 / 6) and later["step_s"] == pytest.approx(6.0)
    assert sim_vs_real.steady_from_steps(numbered, from_version=3) == dict.fromkeys(sim_vs_real.FIGURES)


def test_the_steady_window_starts_once_every_engine_is_up():
    from tiderl.store.step_figures import steady_from_version, steady_goodput

    published = [(0, 0.0), (1, 50.0), (2, 60.0), (3, 70.0), (4, 80.0)]
    # An engine came up after version 1 (a second rollout rank, an idle rank's): the window starts at 3.
    assert steady_from_version(published, [40.0, 65.0]) == 3
    assert steady_from_version(published, [40.0, 70.0]) == 3  # published as it came up
    # Every engine up before version 1 (or none recorded): version 1, the start of the old window.
    assert steady_from_version(published, [20.0, 45.0]) == 1
    assert steady_from_version(published, []) == 1
    # The last engine after the last version: no window left (the last version).
    assert steady_from_version(published, [90.0]) == 4
    # The goodput of that window: the tokens of the versions after its first, over the time between.
    rows = [(v, at, 10 * v) for v, at in published]
    got = steady_goodput(rows, [40.0, 65.0], run_created_at=5.0)
    assert got.from_version == 3 and got.tok_s == pytest.approx(40 / 10) and got.startup_s == pytest.approx(65.0)
    assert steady_goodput(rows, [], run_created_at=5.0, from_version=1).tok_s == pytest.approx((20 + 30 + 40) / 30)
    late = steady_goodput(rows, [90.0], run_created_at=5.0)
    assert late.from_version == 4 and late.tok_s is None and late.startup_s == pytest.approx(75.0)
    assert steady_goodput([], [], run_created_at=5.0) == type(late)(1, None, None)


def test_compare_reports_errors_and_what_is_over_threshold():
    measured = {"sync": {"steady_goodput_tok_s": 40.0, "step_s": 5.0, "rwt_s_per_step": 2.0, "twt_s_per_step": None},
                "stream": {"steady_goodput_tok_s": 30.0, "step_s": 4.0, "rwt_s_per_step": 0.0,
                           "twt_s_per_step": 1.0}}
    simulated = {"sync": {"steady_goodput_tok_s": 50.0, "step_s": 4.5, "rwt_s_per_step": 1.0,
                          "twt_s_per_step": 3.0},
                 "stream": {"steady_goodput_tok_s": 30.0, "step_s": 4.0, "rwt_s_per_step": 1.0,
                            "twt_s_per_step": 1.2}}
    out = sim_vs_real.compare(measured, simulated)
    sync = out["systems"]["sync"]
    assert sync["steady_goodput_tok_s"]["error"] == pytest.approx(0.25)
    assert sync["step_s"]["error"] == pytest.approx(-0.1)
    assert sync["rwt_s_per_step"]["error"] == pytest.approx(-0.5)
    assert sync["twt_s_per_step"]["error"] is None  # nothing measured
    assert out["systems"]["stream"]["rwt_s_per_step"]["error"] is None  # measured 0: no relative error
    # 25% exactly is not over; -50% is.
    assert out["over_threshold"] == ["sync.rwt_s_per_step"]
    assert sim_vs_real.compare(measured, {})["systems"] == {}


def test_the_real_group_holding_reads_the_steady_groups_life_from_the_store(tmp_path):
    """Two groups played and trained for real in a run store, the first created before version 1 (the
    start-up, left out), the second after it: its creation, completion, the trainer's claim and the
    publication of the version that trained it."""
    import time

    from tiderl.rundir import create_run, open_run
    from tiderl.roles import Role
    from tiderl.store.types import FinishedTrajectory, NewGroup, RankReport, TaskKind, VersionRecord

    config = load_job(ROOT / "jobs" / "quickstart.yaml", ["rollout.eval_every_steps=0", "launch.num_ranks=2"])
    run_dir = tmp_path / "run"
    _, store = create_run(config, run_dir)
    store.register_initial_version("model", "0")
    store.register_rank(1, Role.ROLLOUT)
    for version in (1, 2):
        store.add_groups([NewGroup(TaskKind.TRAIN, version, 2)])
        claims = store.claim_tasks(1, 2)
        time.sleep(0.02)
        store.report(RankReport(rank=1, role=Role.ROLLOUT, version=version - 1, finished=[
            FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0],
                               token_versions=[-1, version - 1], num_turns=1, reward=float(i), success=bool(i))
            for i, c in enumerate(claims)]))
        time.sleep(0.02)
        got = store.claim_ready_groups(0, 1)
        time.sleep(0.02)
        store.publish_version(VersionRecord(version=version, path=f"weights/v{version}", checksum="c",
                                            trajectory_ids=[t.id for t in got], step_started_at=0.0,
                                            duration_s=0.1), owner=0)
    published = {r["version"]: r["created_at"] for r in store.measure.version_rows()}
    created, completed, claimed, at = store.tx.read(lambda c: c.exec_driver_sql(
        "select g.created_at, g.completed_at, min(r.claimed_at), v.created_at from task_groups g"
        " join trajectories r on r.group_id = g.id join versions v on v.version = r.consumed_version"
        " where v.version = 2 group by g.id").one())
    store.close()
    got = sim_vs_real.real_group_holding(run_dir)
    assert got == {"groups": 1, "release_to_seen_s": pytest.approx(completed - created, abs=1e-3),
                   "seen_to_claim_s": pytest.approx(claimed - completed, abs=1e-3),
                   "claim_to_publish_s": pytest.approx(at - claimed, abs=1e-3)}
    assert min(got["release_to_seen_s"], got["seen_to_claim_s"], got["claim_to_publish_s"]) >= 0.015
    assert sim_vs_real.real_group_holding(run_dir, from_version=0)["groups"] == 2
    # bench_systems' steady window reads the same store: every engine up before version 1 (none
    # recorded), it starts at version 1; one that came up after version 2, no window is left.
    goodput, start = bench_systems.steady_goodput(run_dir)
    assert start == 1 and goodput == pytest.approx(2 / (published[2] - published[1]), rel=1e-6)
    _, store = open_run(run_dir)
    store.record_event("rank1", "engine_up", "rank 1: engine up", rank=1)
    store.close()
    assert bench_systems.steady_goodput(run_dir) == (None, 2)


@pytest.mark.slow
@pytest.mark.vllm
def test_calibration_tool_writes_a_cluster_file_the_simulator_loads(tmp_path):
    out = tmp_path / "cpu.cluster.yaml"
    sets = [a for s in BENCH_SETS for a in ("--set", s)]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "calibrate_cpu.py"), *sets, "--out", str(out),
                           "--repeats", "1", "--batches", "1,2", "--decode-tokens", "4", "--turns", "2",
                           "--trainer-steps", "1", "--host-iterations", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    cluster = load_cluster(out)
    costs = derive_costs(cluster)
    assert cluster.measured.kv_capacity_tokens == raw["kv_capacity_tokens"] > 0
    assert costs.train_s(64) > 0 and costs.decode_iteration_s(2, 0.0, 0.0) > 0
