"""`tiderl report`: every figure and the Markdown summary, for a built store and for a short real run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fake_engine import SCRIPTED_ENGINE, scripted_run_env

from tiderl.cli import main
from tiderl.config import load_job
from tiderl.observe.report.data import load, role_spans
from tiderl.observe.report.figures import FIGURES
from tiderl.rundir import create_run, open_run
from tiderl.store import FinishedTrajectory, MetricPoint, NewGroup, RankReport, Role, RunState, TaskKind, VersionRecord

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EMPTY_NOTES = ("no version published yet", "no step trained", "no wait recorded", "no role planned",
               "no prefix-cache lookups recorded", "no KV-cache usage recorded", "no trajectory trained yet",
               "no training group trained yet")


def assert_report(out_dir: Path) -> str:
    for name in FIGURES:
        png = out_dir / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, png
    summary = (out_dir / "summary.md").read_text()
    for name in FIGURES:
        assert f"![{name}]({name}.png)" in summary
    assert not list(out_dir.glob(".*.tmp"))
    return summary


def test_report_of_a_built_story(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, s = create_run(load_job(ROOT / "jobs" / "quickstart.yaml", ["launch.num_ranks=2"]), tmp_path / "r")
    s.register_initial_version("weights/v0", "c0")
    s.register_rank(0, Role.ACTOR)
    s.register_rank(1, Role.ROLLOUT)
    s.plan_roles(0, {0: Role.ACTOR, 1: Role.ROLLOUT}, ra2p_mode="colocated", fetch_groups=1)
    s.set_run_state(RunState.RUNNING)
    s.add_groups([NewGroup(TaskKind.TRAIN, 1, 2), NewGroup(TaskKind.EVAL, 7, 1, eval_version=0)])
    claims = s.claim_tasks(1, 3)
    s.report(RankReport(rank=1, role=Role.ROLLOUT, finished=[
        FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1, -1],
                           token_versions=[-1, 0, 0], num_turns=1, reward=float(i % 2), success=bool(i % 2))
        for i, c in enumerate(claims)], metrics=[
        MetricPoint("rwt_s", 0.5, 0, "rollout"), MetricPoint("prefix_cache_queries", 100, 0, "rollout"),
        MetricPoint("prefix_cache_hits", 40, 0, "rollout"), MetricPoint("kv_usage", 0.3, 0, "rollout"),
        MetricPoint("kv_usage", 0.5, 0, "rollout"), MetricPoint("ctb_admitted", 3, 0, "rollout"),
        MetricPoint("ctb_pauses", 1, 0, "rollout"), MetricPoint("ctb_resumes", 1, 0, "rollout"),
        MetricPoint("ctb_prefix_kept", 2, 0, "rollout"), MetricPoint("ctb_budget_tokens", 512, 0, "rollout")]))
    got = s.claim_ready_groups(0, 1)
    s.publish_version(VersionRecord(version=1, path="weights/v1", checksum="c1", trajectory_ids=[t.id for t in got],
                                    step_started_at=0.0, duration_s=2.0, ras=0, tprm_s=0.5, ra2p_mode="colocated"),
                      owner=0)
    s.report(RankReport(rank=0, role=Role.ACTOR, metrics=[
        MetricPoint("twt_s", 1.25, 0, "actor"), MetricPoint("logprob_mismatch_on_policy", 2e-7, 0, "actor"),
        MetricPoint("logprob_mismatch_stale", 0.02, 0, "actor"), MetricPoint("entropy", 0.7, 0, "actor"),
        MetricPoint("grad_norm", 1.5, 0, "actor")]))
    # A second group, created after version 1: the steady window of the group's time in flight.
    s.add_groups([NewGroup(TaskKind.TRAIN, 2, 2)])
    s.report(RankReport(rank=1, role=Role.ROLLOUT, version=1, finished=[
        FinishedTrajectory(task_id=c.task_id, token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1, -1],
                           token_versions=[-1, 1, 1], num_turns=1, reward=float(i), success=bool(i))
        for i, c in enumerate(s.claim_tasks(1, 2))]))
    got = s.claim_ready_groups(0, 1)
    s.publish_version(VersionRecord(version=2, path="weights/v2", checksum="c2", trajectory_ids=[t.id for t in got],
                                    step_started_at=0.0, duration_s=1.0, ra2p_mode="colocated"), owner=0)
    s.plan_roles(2, {0: Role.ACTOR, 1: Role.IDLE}, ra2p_mode="colocated", fetch_groups=1)
    s.set_run_state(RunState.FINISHED, "2 steps done")

    data = load(s)
    assert [v["version"] for v in data.versions] == [1, 2] and data.consumed_tokens == 8
    assert data.holding == s.reader.group_holding(1) | {"from_version": 1} and data.holding["groups"] == 1
    assert [(x.rank, x.role) for x in data.roles] == [(0, "actor"), (1, "rollout"), (1, "idle")]
    assert [e["eval_version"] for e in data.evals] == [0]
    # The actor's metrics of the step at version 0 are the curves' points at version 1 (the version it published).
    assert data.trainer["entropy"] == [(1, 0.7)] and data.trainer["grad_norm"] == [(1, 1.5)] and data.trainer["kl"] == []
    assert [v["turns_mean"] for v in data.versions] == [1.0, 1.0]
    assert main(["report", str(tmp_path / "r"), "--out", str(tmp_path / "out")]) == 0
    assert f"{len(FIGURES)} figures" in capsys.readouterr().out and "training" in FIGURES
    summary = assert_report(tmp_path / "out")
    assert "| goodput (whole run) |" in summary and "| 0 | 1 | " in summary  # eval of v0: one task
    # CTB per weights version: increments summed, levels averaged (KV usage 0.3 and 0.5: 40%).
    assert data.ctb[0]["ctb_admitted"] == 3 and data.ctb[0]["kv_usage"] == pytest.approx(0.4)
    assert "| 0 | 3 | 1 | 1 | 2 | 0 | 0.400 | 40.0% | 512 |" in summary, summary
    assert not any(note in summary for note in EMPTY_NOTES)
    # The engine's log-prob mismatch, the tokens of the weights trained apart from the stale ones.
    assert "| engine log-prob mismatch, tokens of the weights trained (nats a token: mean, max over 1 step) | " \
           "2e-07, 2e-07 |" in summary, summary
    assert "| engine log-prob mismatch, stale tokens (nats a token: mean, max over 1 step) | 0.02, 0.02 |" in summary
    held = data.holding
    assert (f"| {held['release_to_seen_s']:.2f} | {held['seen_to_claim_s']:.2f} | "
            f"{held['claim_to_publish_s']:.2f} |") in summary


def test_report_of_a_run_without_steps_says_what_is_missing(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    create_run(load_job(ROOT / "jobs" / "quickstart.yaml"), tmp_path / "r")
    assert main(["report", str(tmp_path / "r")]) == 0  # default: RUN_DIR/report
    summary = assert_report(tmp_path / "r" / "report")
    assert "no version published yet" in summary and "no role planned yet" in summary
    assert "no training group trained yet" in summary


def test_report_of_something_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no run store" in capsys.readouterr().err


def test_role_spans_dead_rank_and_restart() -> None:
    control = [dict(version=0, rank=1, role="rollout"), dict(version=2, rank=1, role="ref"),
               dict(version=5, rank=1, role="rollout")]  # version 5 never published: ignored
    spans = role_spans(control, {0: 0.0, 1: 10.0, 2: 20.0}, [dict(rank=1, t_s=30.0)], 100.0,
                       restarted_s={1: 60.0})
    assert [(s.role, s.start_s, s.end_s) for s in spans] == [("rollout", 0.0, 20.0), ("ref", 20.0, 30.0),
                                                            ("dead", 30.0, 60.0), ("ref", 60.0, 100.0)]


# ---- one short real run (torch, env server, the scripted engine): every figure has data --------------
# The engine is tests/fake_engine.py's, with its model of a prefix cache: the report reads what every engine
# reports, and vLLM's own figures are checked where vLLM runs (tests/test_run_e2e.py).
REAL = [f"rollout.engine={SCRIPTED_ENGINE}", "model.init_train_steps=5", "system=async", "trainer.num_steps=2", "trainer.groups_min=1", "trainer.groups_ideal=2",
        "rollout.group_size=4", "rollout.eval_every_steps=2", "rollout.eval_groups=2", "rollout.max_concurrency=8",
        "launch.num_ranks=3", "launch.rollout_fraction=0.34", "monitor.metrics_port=0",
        "monitor.metrics_host=127.0.0.1"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "run"
    sets = [a for s in REAL for a in ("--set", s)]
    out = subprocess.run([sys.executable, "-m", "tiderl", "run", "jobs/quickstart.yaml", *sets, "--run-dir",
                          str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=900, env=scripted_run_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_report_of_a_short_real_run(real_run: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tiderl", "report", str(real_run), "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = assert_report(tmp_path)
    assert not any(note in summary for note in EMPTY_NOTES), summary
    _, store = open_run(real_run)
    try:
        data = load(store)
    finally:
        store.close()
    assert len(data.versions) == 2 and data.staleness and data.cache and data.waits
    assert data.holding["groups"] > 0 and "## A training group's time in flight" in summary
    assert sum(row.get("ctb_admitted", 0) for row in data.ctb.values()) > 0, data.ctb  # the rollout ranks' CTB figures
    assert "## Rollout scheduling (CTB) per weights version" in summary
    assert {s.role for s in data.roles} >= {"actor", "rollout"}
    # The control plane served Prometheus metrics while the run went (monitor.metrics_port=0: a free port).
    assert (real_run / "metrics" / "control.url").read_text().startswith("http://127.0.0.1:")


@pytest.mark.slow
def test_status_of_a_finished_real_run(real_run: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tiderl", "status", str(real_run), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK: run quickstart at version 2 (finished)"), out.stdout
