"""Workload and cluster files: the shipped ones load, bad ones fail naming file and key;
the sampler and the derived costs behave as documented."""

from __future__ import annotations

import random
import statistics

import pytest
import yaml
from sim_helpers import CLUSTER, ROOT, WORKLOAD

from tiderl.config import ConfigError
from tiderl.sim.costs import derive_costs
from tiderl.sim.spec import LatencyDist, load_cluster, load_workload
from tiderl.sim.workload import TaskSampler, geometric_p


def test_shipped_files_load():
    w = load_workload(WORKLOAD)
    assert (w.group_size, w.groups_per_step, w.eval_every_steps, w.max_context_tokens) == (8, 32, 20, 8192)
    for name in ("h100x32", "h100x8"):
        c = load_cluster(ROOT / "jobs" / "sim" / f"{name}.cluster.yaml")
        assert c.training.rollout_fraction_sweep == (0.125, 0.25, 0.375, 0.5)


def test_every_shipped_value_names_its_source():
    for path in [WORKLOAD, CLUSTER, ROOT / "jobs" / "sim" / "h100x32.cluster.yaml"]:
        for line in path.read_text().splitlines():
            body = line.split("#")[0]
            if ":" in body and body.split(":", 1)[1].strip() and not body.strip().startswith("- name"):
                key = body.split(":")[0].strip()
                if key in ("name",) or key.startswith("-"):
                    continue
                assert "#" in line or key in {"gen_tokens_sigma", "obs_tokens_sigma", "min_rollout_ranks",
                                             "min_actor_ranks", "max_ref_ranks", "history_steps"}, (path, line)


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda d: d.update(bogus=1), "bogus"),
        (lambda d: d.update(group_size="eight"), "group_size"),
        (lambda d: d["task_types"][0]["env_latency"].update(p99_s=0.1), "task_types[0].env_latency.p99_s"),
        (lambda d: d["task_types"][1].update(turns_max=2), "task_types[1].turns_max"),
    ],
)
def test_bad_workload_names_file_and_key(tmp_path, edit, key):
    data = yaml.safe_load(WORKLOAD.read_text())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_workload(path)
    assert e.value.source == str(path) and e.value.key == key


def test_lognormal_from_mean_and_p99():
    mu, sigma = LatencyDist(mean_s=1.0, p99_s=5.0).lognormal_params()
    rng = random.Random(0)
    xs = sorted(rng.lognormvariate(mu, sigma) for _ in range(60_000))
    assert statistics.fmean(xs) == pytest.approx(1.0, rel=0.04)
    assert xs[int(0.99 * len(xs))] == pytest.approx(5.0, rel=0.08)


def test_turns_have_the_workload_mean_before_the_context_limit():
    p = geometric_p(8.0, 2, 20)
    mean = 2 + sum((1 - p) ** k for k in range(1, 19))
    assert mean == pytest.approx(8.0, abs=1e-6)
    w = load_workload(WORKLOAD)
    sampler = TaskSampler(w, seed=1)
    tasks = [t for g in range(300) for t in sampler.group(g, 0, 8, False) if t.task_type == "webshop"]
    assert statistics.fmean(t.num_turns for t in tasks) == pytest.approx(8.0, rel=0.06)
    assert statistics.fmean(t.total_tokens for t in tasks) == pytest.approx(3400, rel=0.06)


def test_a_groups_tasks_share_their_turns_as_the_workload_says_and_keep_the_marginal():
    """`turns_group_icc`: the turns' intraclass correlation within a group is the workload's, the mean (and so
    the whole marginal: a copula) stays the capped geometric's; at 0 the draws are the independent ones."""
    from dataclasses import replace

    from tiderl.sim.workload import intraclass_correlation, latent_correlation, turns_icc

    base = load_workload(ROOT / "jobs" / "sim" / "bench-latency.workload.yaml")
    p = geometric_p(4.0, 1, 6)
    for icc in (0.2, 0.45, 0.8):
        assert turns_icc(p, 1, 6, latent_correlation(p, 1, 6, icc)) == pytest.approx(icc, abs=1e-3)

    def sample(icc: float) -> list[list[int]]:
        tt = replace(base.task_types[0], turns_group_icc=icc)
        sampler = TaskSampler(replace(base, task_types=[tt]), seed=4)
        return [[t.num_turns for t in sampler.group(g, 0, 8, False)] for g in range(2000)]

    icc_of = intraclass_correlation  # one-way ANOVA ICC(1) (tested in tests/test_calibration.py)

    independent, shared = sample(0.0), sample(0.45)
    assert abs(icc_of(independent)) < 0.05 and icc_of(shared) == pytest.approx(0.45, abs=0.06)
    mean = base.task_types[0].turns_mean.start
    for groups in (independent, shared):
        assert statistics.fmean(x for g in groups for x in g) == pytest.approx(mean, rel=0.03)
    # At 0 a group draws no shared value: the random stream, so every other draw, is the one the simulator
    # drew before the key existed (these values are from that sampler).
    assert independent[:3] == [[6, 5, 6, 6, 3, 2, 2, 6], [6, 6, 6, 6, 4, 2, 6, 3], [2, 1, 1, 3, 4, 1, 2, 6]]
    plain = TaskSampler(replace(base, task_types=[replace(base.task_types[0], turns_group_icc=0.0)]), seed=4)
    assert [round(t.env_latency_s[0], 6) for t in plain.group(3, 0, 8, False)][:3] == [0.229991, 2.087137, 0.482605]


def test_sampled_tasks_respect_the_context_limit_and_are_reproducible():
    w = load_workload(WORKLOAD)
    a, b = TaskSampler(w, seed=3), TaskSampler(w, seed=3)
    for g in range(100):
        ga, gb = a.group(g, 50, 8, False), b.group(g, 50, 8, False)
        assert [t.total_tokens for t in ga] == [t.total_tokens for t in gb]
        assert len({t.task_type for t in ga}) == 1  # one prompt, one task family
        for t in ga:
            assert t.total_tokens <= w.max_context_tokens
            assert len(t.obs_tokens) == t.num_turns - 1
            assert len(t.env_latency_s) == t.num_turns


def test_derived_costs_match_public_figures():
    costs = derive_costs(load_cluster(CLUSTER))
    # Qwen2.5-7B: 57,344 KV bytes per token; 80 GB x 0.9 - 15.2 GB weights - 4 GB reserve.
    assert costs.kv_capacity_tokens == pytest.approx((72e9 - 15.24e9 - 4e9) / 57344, rel=1e-3)
    # One decode iteration at batch 1 reads the weights once: 15.24 GB / (3.35 TB/s x 0.7) + 2 ms.
    assert costs.decode_iteration_s(1, 0, 0) == pytest.approx(15.24e9 / 2.345e12 + 0.002, rel=1e-3)
    # A swap moves the 15.24 GB model over PCIe Gen5 (64 GB/s x 0.8) plus the switch overhead.
    assert costs.swap_s == pytest.approx(15.24e9 / 51.2e9 + 0.05, rel=1e-3)
