"""The Prometheus endpoint: scrape it over HTTP and find the run's quantities with rank and role labels."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, Counter
from prometheus_client.parser import text_string_to_metric_families

from tiderl.config import load_job
from tiderl.observe.metrics import METRICS_DIR, MetricsServer, serve_process_metrics
from tiderl.rundir import create_run
from tiderl.store import FinishedTrajectory, MetricPoint, NewGroup, RankReport, Role, RunState, TaskKind, VersionRecord

ROOT = Path(__file__).resolve().parents[1]
SETS = ["trainer.groups_min=1", "trainer.groups_ideal=1", "rollout.group_size=2", "launch.num_ranks=2",
        "monitor.metrics_port=0", "monitor.metrics_host=127.0.0.1"]


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    found = [v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


@pytest.fixture
def story(tmp_path: Path):
    config = load_job(ROOT / "jobs" / "quickstart.yaml", SETS)
    _, s = create_run(config, tmp_path / "r")
    s.register_initial_version("weights/v0", "c0")
    s.register_rank(0, Role.ACTOR)
    s.register_rank(1, Role.ROLLOUT)
    s.plan_roles(0, {0: Role.ACTOR, 1: Role.ROLLOUT}, ra2p_mode="colocated", fetch_groups=1)
    s.set_run_state(RunState.RUNNING)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2)])
    claims = s.claim_tasks(1, 2)
    s.report(RankReport(rank=1, role=Role.ROLLOUT, finished=[
        FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], logprobs=[0, -1, -1, -1],
                           token_versions=[-1, 0, 0, 0], num_turns=2 + 2 * i, reward=float(i), success=bool(i),
                           env=("hilo", "pytool")[i])
        for i, c in enumerate(claims)], metrics=[
        MetricPoint("rwt_s", 1.5, 0, "rollout"), MetricPoint("prefix_cache_queries", 200, 0, "rollout"),
        MetricPoint("prefix_cache_hits", 50, 0, "rollout"), MetricPoint("kv_usage", 0.25, 0, "rollout")]))
    got = s.claim_ready_groups(0, 1)
    s.publish_version(VersionRecord(version=1, path="weights/v1", checksum="c1", trajectory_ids=[t.id for t in got],
                                    step_started_at=0.0, duration_s=2.0, ras=1, tprm_s=0.5, ra2p_mode="colocated"),
                      owner=0)
    s.report(RankReport(rank=0, role=Role.ACTOR, metrics=[
        MetricPoint("twt_s", 0.75, 0, "actor"), MetricPoint("logprob_mismatch_on_policy", 3e-7, 0, "actor"),
        MetricPoint("entropy", 2.5, 0, "actor"), MetricPoint("grad_norm", 0.8, 0, "actor"),
        MetricPoint("lr", 1e-5, 0, "actor"), MetricPoint("kl", 0.01, 0, "actor")]))
    server = MetricsServer.start(tmp_path / "r", s, config)
    assert server is not None
    yield tmp_path / "r", s, server
    server.close()
    s.close()


def test_scrape_the_control_plane_endpoint(story) -> None:
    run_dir, store, server = story
    assert (run_dir / METRICS_DIR / "control.url").read_text().strip() == server.url
    m = scrape(server.url)
    assert value(m, "tiderl_version") == 1
    assert value(m, "tiderl_run_state", state="running") == 1 and value(m, "tiderl_run_state", state="failed") == 0
    assert value(m, "tiderl_consumed_tokens_total") == 6
    assert value(m, "tiderl_step_goodput_tokens_per_second") == 3.0
    assert value(m, "tiderl_step_ra2p_mode", mode="colocated") == 1
    assert value(m, "tiderl_rollout_wait_seconds_total", rank="1", role="rollout") == 1.5
    assert value(m, "tiderl_trainer_wait_seconds_total", rank="0", role="actor") == 0.75
    assert value(m, "tiderl_prefix_cache_hit_ratio", rank="1", role="rollout") == 0.25
    assert value(m, "tiderl_kv_cache_usage_ratio", rank="1", role="rollout") == 0.25
    assert value(m, "tiderl_logprob_mismatch_on_policy", rank="0", role="actor") == 3e-7
    assert value(m, "tiderl_rank_up", rank="1", role="rollout", state="running") == 1
    assert value(m, "tiderl_trajectory_staleness_versions_count") == 2
    assert value(m, "tiderl_train_success_rate") == 0.5
    assert value(m, "tiderl_policy_entropy", rank="0", role="actor") == 2.5
    assert value(m, "tiderl_trainer_grad_norm", rank="0", role="actor") == 0.8
    assert value(m, "tiderl_trainer_learning_rate", rank="0", role="actor") == 1e-5
    assert value(m, "tiderl_trainer_kl", rank="0", role="actor") == 0.01
    assert value(m, "tiderl_train_turns_mean") == 3.0 and value(m, "tiderl_train_turns_max") == 4
    assert value(m, "tiderl_train_env_reward_mean", env="hilo") == 0.0
    assert value(m, "tiderl_train_env_reward_mean", env="pytool") == 1.0
    assert value(m, "tiderl_train_env_success_rate", env="pytool") == 1.0
    assert value(m, "tiderl_train_env_trajectories", env="hilo") == 1
    assert value(m, "tiderl_stalled") == 0
    assert value(m, "tiderl_endpoint_info", process="control", url=server.url) == 1

    # Later points add up (read incrementally); a refresh is what the control plane's tick does.
    store.report(RankReport(rank=1, role=Role.ROLLOUT, metrics=[MetricPoint("rwt_s", 2.0, 1, "rollout")]))
    server.collector.refresh(store, server.limits)
    assert value(scrape(server.url), "tiderl_rollout_wait_seconds_total", rank="1", role="rollout") == 3.5


def test_rank_process_endpoint_serves_the_default_registry(tmp_path: Path) -> None:
    config = load_job(ROOT / "jobs" / "quickstart.yaml", SETS)
    engine_counter = Counter("tiderl_test_engine_tokens", "Stands in for a vllm:* metric of the rank's engine.")
    try:
        engine_counter.inc(7)
        served = serve_process_metrics(tmp_path, config, rank=3)
        assert served is not None
        server, url = served
        try:
            assert (tmp_path / METRICS_DIR / "rank3.url").read_text().strip() == url
            assert value(scrape(url), "tiderl_test_engine_tokens_total") == 7
        finally:
            server.shutdown()
            server.server_close()
    finally:
        REGISTRY.unregister(engine_counter)
    off = load_job(ROOT / "jobs" / "quickstart.yaml")
    assert serve_process_metrics(tmp_path, off, rank=3) is None and MetricsServer.start(tmp_path, None, off) is None
