"""Running sets of systems (sweeps, `all`) and turning results into tables,
ratios and plots."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from tiderl.policy.ra2p import StageTimes, refs_needed
from tiderl.sim.costs import Costs, derive_costs
from tiderl.sim.simulator import Simulation
from tiderl.sim.spec import ClusterSpec, load_cluster, load_workload
from tiderl.sim.systems import SYSTEMS, System

# The paper's figures the `all` report is compared with (text-only workloads, section 6).
PAPER = {
    "tiderl_over_verl": 5.6,
    "tiderl_over_areal": 1.8,
    "tiderl_over_streamrl": 7.0,
    "ablation_table2": {"stream": 20.2, "stream+ra2p": 23.1, "stream+ra2p+ers": 31.8, "tiderl": 33.3},
    "ers_wait_reduction": [0.686, 0.776],
}


def run_one(workload_path: str, cluster_path: str, system: System, steps: int, seed: int) -> dict:
    sim = Simulation(load_workload(workload_path), load_cluster(cluster_path), system, steps=steps, seed=seed)
    return sim.run()


def _job(args: tuple) -> dict:
    return run_one(*args)


# Told of each finished simulation: (results so far, simulations in all, the finished one's result).
OnDone = Callable[[int, int, dict], None]


def run_many(workload_path: str, cluster_path: str, systems: list[System], steps: int, seed: int,
             jobs: int, on_done: OnDone | None = None) -> list[dict]:
    return _map([(workload_path, cluster_path, s, steps, seed) for s in systems], jobs, on_done)


def run_seeds(workload_path: str, cluster_path: str, systems: list[System], steps: int, seeds: list[int],
              jobs: int, on_done: OnDone | None = None) -> list[list[dict]]:
    """Every system under every seed, `jobs` at a time: one list of results (in `seeds` order) per system."""
    results = _map([(workload_path, cluster_path, s, steps, seed) for s in systems for seed in seeds], jobs, on_done)
    return [results[i * len(seeds):(i + 1) * len(seeds)] for i in range(len(systems))]


def _indexed_job(item: tuple[int, tuple]) -> tuple[int, dict]:
    return item[0], _job(item[1])


def _map(work: list[tuple], jobs: int, on_done: OnDone | None = None) -> list[dict]:
    """The results of `work` in its order; `on_done` hears of each as it finishes."""
    results: list[dict | None] = [None] * len(work)
    if jobs <= 1 or len(work) == 1:
        finished = map(_indexed_job, enumerate(work))
        return _collect(finished, results, on_done)
    with multiprocessing.get_context("fork").Pool(min(jobs, len(work))) as pool:
        return _collect(pool.imap_unordered(_indexed_job, enumerate(work), chunksize=1), results, on_done)


def _collect(finished: Iterable[tuple[int, dict]], results: list[dict | None], on_done: OnDone | None) -> list[dict]:
    for count, (i, result) in enumerate(finished, 1):
        results[i] = result
        if on_done is not None:
            on_done(count, len(results), result)
    return results  # type: ignore[return-value]


def at_default_fraction(system: System, default: float) -> System:
    """A system that runs one split (neither synchronous nor a sweep) and names no fraction runs at the
    cluster's default rollout fraction."""
    if not system.sweep and not system.synchronous and system.rollout_fraction is None:
        return replace(system, rollout_fraction=default)
    return system


def expand(system: System, fractions: tuple[float, ...]) -> list[System]:
    """A fixed-partition system without @F becomes its sweep."""
    if system.synchronous or system.rollout_fraction is not None or not system.sweep:
        return [system]
    return [replace(system, rollout_fraction=f) for f in fractions]


def best_of(results: list[dict]) -> dict:
    best = max(results, key=lambda r: r["goodput_tok_s"])
    out = dict(best)
    out["sweep"] = [
        {"rollout_fraction": r["rollout_fraction"], "goodput_tok_s": r["goodput_tok_s"],
         "rwt_s": r["rwt_s"], "twt_s": r["twt_s"]}
        for r in results
    ]
    return out


FIXED = "tiderl-noers"
"""The system of the best-fixed-partition oracle: CTB + RA2P on a fixed split (no ERS)."""


def refs_to_keep_up(costs: Costs, actors: int) -> int:
    """The fewest ref ranks (at least 1) that keep up with `actors` actor ranks in the decoupled
    pipeline: :func:`tiderl.policy.ra2p.refs_needed` (the planners' rule) on the cost model's stage times
    of one share, as in Simulation._stage_times (their ratio does not depend on the sequence length)."""
    times = StageTimes(t_ref_s=costs.ref_ratio, t_act_f_s=1.0, t_act_b_s=costs.backward_ratio, t_swap_s=0.0)
    return max(1, refs_needed(actors, times))


def fixed_partitions(cluster: ClusterSpec) -> list[System]:
    """Every fixed split of `FIXED` the cluster's ranks allow: each rollout rank count, colocated
    (no ref ranks) and decoupled (dedicated ref ranks, as few as keep up with the actors). With
    `training.actor_ranks` the actor group is that size and the split keeps it whole."""
    costs = derive_costs(cluster)
    n = cluster.num_gpus
    fixed_actors = cluster.training.actor_ranks
    base = SYSTEMS[FIXED]
    colocated, decoupled = [], []
    for rollout in range(1, n):
        rest = n - rollout
        if fixed_actors is None or fixed_actors <= rest or rollout == 1:
            colocated.append(replace(base, rollout_fraction=rollout / n))
        if fixed_actors is not None:
            refs = refs_to_keep_up(costs, fixed_actors)
            if fixed_actors + refs > rest:
                continue
        else:
            # The rest split into M actors and R refs, R the fewest that keep up with M = rest - R.
            refs = next((r for r in range(1, rest) if refs_to_keep_up(costs, rest - r) <= r), rest)
            if rest - refs < 1:
                continue
        decoupled.append(replace(base, rollout_fraction=rollout / n, fixed_refs=refs))
    return colocated + decoupled


def _roles(result: dict) -> dict:
    first = result["roles_timeline"][0]
    return {"rollout_ranks": first["rollout"], "actor_ranks": first["actor"], "ref_ranks": first["ref"],
            "ra2p_mode": first["mode"]}


def best_fixed(results: list[dict]) -> dict | None:
    """The best of the fixed partitions (`FIXED` runs) among `results`, with the whole sweep."""
    fixed = [r for r in results if r["system"].split("@")[0] == FIXED and r["system"] != FIXED]
    if not fixed:
        return None
    best = max(fixed, key=lambda r: r["goodput_tok_s"])
    return {
        "system": best["system"],
        "goodput_tok_s": best["goodput_tok_s"],
        "rollout_fraction": best["rollout_fraction"],
        **_roles(best),
        "rwt_s": best["rwt_s"],
        "twt_s": best["twt_s"],
        "bound_tok_s": best["bound_tok_s"],
        "bound_term": best["bound_term"],
        "sweep": [{"system": r["system"], **_roles(r), "goodput_tok_s": r["goodput_tok_s"], "rwt_s": r["rwt_s"],
                   "twt_s": r["twt_s"]} for r in fixed],
    }


def all_systems(default_fraction: float, fractions: tuple[float, ...],
                fixed: list[System] | None = None) -> list[System]:
    """`--system all`: sync, the async and stream sweeps, the fixed CTB+RA2P partitions (`fixed`,
    e.g. fixed_partitions(cluster); None: the `tiderl-noers` sweep over `fractions`) and the ablation
    chain at `default_fraction`."""
    out = [SYSTEMS["sync"]]
    for name in ("async", "stream"):
        out += expand(SYSTEMS[name], fractions)
    out += expand(SYSTEMS[FIXED], fractions) if fixed is None else list(fixed)
    for name, _ in ABLATION[1:]:
        out.append(replace(SYSTEMS[name], rollout_fraction=default_fraction))
    if default_fraction not in fractions:
        out.append(replace(SYSTEMS["stream"], rollout_fraction=default_fraction))
    return out


# The ablation of the paper's Table 2, each row against the row it adds to: stream, + RA2P, + ERS with
# the paper's rules, + ERS with the rate planner (instead), + CTB on the rate planner (= tiderl), and
# + CTB on the paper's rules.
ABLATION = (("stream", None), ("stream+ra2p", "stream"), ("stream+ra2p+ers", "stream+ra2p"),
            ("stream+ra2p+ers-rate", "stream+ra2p"), ("tiderl", "stream+ra2p+ers-rate"),
            ("tiderl-paper", "stream+ra2p+ers"))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def compare(results: list[dict], default_fraction: float) -> dict:
    """The `all` report: each system, ratios to TideRL, the ablation chain, ERS's waits."""
    by_label = {r["system"]: r for r in results}

    def group(name: str) -> list[dict]:
        return [r for r in results if r["system"].split("@")[0] == name]

    tiderl = next(r for r in results if r["system"].startswith("tiderl@"))
    sync = by_label["sync"]
    best_async = best_of(group("async"))
    best_stream = best_of(group("stream"))
    tg = tiderl["goodput_tok_s"]
    at = f"@{default_fraction:g}"
    ablation = []
    for name, base in ABLATION:
        g = by_label[name + at]["goodput_tok_s"]
        b = by_label[base + at]["goodput_tok_s"] if base else None
        ablation.append({"system": name + at, "over": base + at if base else None, "goodput_tok_s": g,
                         "improvement": round(g / b - 1, 3) if b else None})
    waits = tiderl["rwt_s"] + tiderl["twt_s"]
    fixed = [r for r in group(FIXED) if r["system"] != FIXED]
    reductions = {r["system"]: round(1 - waits / (r["rwt_s"] + r["twt_s"]), 3)
                  for r in fixed if r["rwt_s"] + r["twt_s"] > 0}
    oracle = best_fixed(results)
    return {
        "best_fixed": oracle,
        "bound_tok_s": tiderl["bound_tok_s"],
        "bound_term": tiderl["bound_term"],
        "ratios": {
            "tiderl_over_sync": _ratio(tg, sync["goodput_tok_s"]),
            "tiderl_over_async_best": _ratio(tg, best_async["goodput_tok_s"]),
            "tiderl_over_stream_best": _ratio(tg, best_stream["goodput_tok_s"]),
            "tiderl_over_best_fixed": _ratio(tg, oracle["goodput_tok_s"]) if oracle else None,
            "tiderl_over_upper_bound": _ratio(tg, tiderl["upper_bound_tok_s"]),
            "tiderl_over_bound": _ratio(tg, tiderl["bound_tok_s"]),
            "async_best": best_async["system"],
            "stream_best": best_stream["system"],
        },
        "ablation": ablation,
        "ers_wait_reduction": {
            "tiderl_rwt_plus_twt_s": round(waits, 1),
            "vs_fixed_partition": reductions,
            "vs_best_fixed_partition": reductions.get(oracle["system"]) if oracle else None,
            "best_fixed_partition": oracle["system"] if oracle else None,
        },
        "paper": PAPER,
        "systems": {r["system"]: {**r, "ratio_to_tiderl": _ratio(r["goodput_tok_s"], tg)} for r in results},
    }


def format_table(results: list[dict], reference: float | None = None) -> str:
    head = f"{'system':26} {'goodput tok/s':>13} {'vs tiderl':>9} {'compute':>9} {'latency':>9} {'RWT GPU-s':>10} " \
           f"{'TWT GPU-s':>10} {'KV hit':>7} {'step s':>7} {'stale':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = f"{r['goodput_tok_s'] / reference:.2f}" if reference else "-"
        hit = f"{r['kv_hit_rate']:.3f}" if r["kv_hit_rate"] is not None else "-"
        lines.append(
            f"{r['system']:26} {r['goodput_tok_s']:>13,.0f} {ratio:>9} {r['upper_bound_tok_s']:>9,.0f} "
            f"{r['latency_bound_tok_s']:>9,.0f} "
            f"{r['rwt_s']:>10,.0f} {r['twt_s']:>10,.0f} {hit:>7} {r['step_time_s']:>7.1f} "
            f"{r['mean_staleness']:>6.2f}"
        )
    return "\n".join(lines)


def format_best_fixed(best: dict) -> list[str]:
    """The oracle's line and its sweep, one row per rollout rank count (colocated | decoupled)."""
    out = [f"Best fixed partition ({FIXED}, every split the ranks allow, both RA2P modes): {best['system']}: "
           f"{best['goodput_tok_s']:,.0f} tok/s, {best['rollout_ranks']} rollout / {best['actor_ranks']} actor / "
           f"{best['ref_ranks']} ref ranks, {best['ra2p_mode']}, RWT {best['rwt_s']:,.0f} / TWT {best['twt_s']:,.0f} "
           "GPU-s"]
    rows: dict[int, dict[str, dict]] = {}
    for row in best["sweep"]:
        rows.setdefault(row["rollout_ranks"], {})[row["ra2p_mode"]] = row
    out.append(f"  {'rollout':>7} {'colocated (actors)':>22} {'decoupled (actors+refs)':>26}")
    for n in sorted(rows):
        cells = []
        for mode, width in (("colocated", 22), ("decoupled", 26)):
            x = rows[n].get(mode)
            if x is None:
                cells.append(f"{'-':>{width}}")
                continue
            ranks = f"{x['actor_ranks']}" + (f"+{x['ref_ranks']}" if mode == "decoupled" else "")
            mark = "*" if x["system"] == best["system"] else " "
            cells.append(f"{x['goodput_tok_s']:>{width - len(ranks) - 4},.0f}{mark} ({ranks})")
        out.append(f"  {n:>7} " + " ".join(cells))
    return out


def format_report(report: dict) -> str:
    systems = list(report["systems"].values())
    tiderl = next(r for r in systems if r["system"].startswith("tiderl@"))
    tiderl_g = tiderl["goodput_tok_s"]
    best = report.get("best_fixed")
    # The fixed-partition sweep is listed below, not in the table (but for its best split).
    shown = [r for r in systems if r["system"].split("@")[0] != FIXED or (best and r["system"] == best["system"])]
    out = [format_table(shown, tiderl_g), ""]
    if best:
        out += format_best_fixed(best) + [""]
    out.append(f"Bound of the TideRL run: {report['bound_tok_s']:,.0f} tok/s ({report['bound_term']}; compute "
               f"{tiderl['upper_bound_tok_s']:,.0f}, staleness-latency {tiderl['latency_bound_tok_s']:,.0f})")
    held, least = tiderl.get("group_holding"), tiderl["latency_bound"]
    if held and held["groups"]:
        out.append(f"  a trained group's time in flight, measured (the bound's least): release to seen "
                   f"{held['release_to_seen_s']:.1f} s ({least['slowest_task_s'] + least['seen_delay_s']:.1f}), "
                   f"in the buffer {held['seen_to_claim_s']:.1f} s (0), claim to publish "
                   f"{held['claim_to_publish_s']:.1f} s ({least['after_consumption_s']:.1f} with the feed)")
    out.append("")
    r, p = report["ratios"], report["paper"]
    out.append("TideRL goodput ratios (simulated | paper):")
    out.append(f"  / sync (VeRL-like)          {r['tiderl_over_sync']:>6} | {p['tiderl_over_verl']}")
    out.append(f"  / async best ({r['async_best']:>12}) {r['tiderl_over_async_best']:>6} | {p['tiderl_over_areal']}")
    out.append(f"  / stream best ({r['stream_best']:>11}) {r['tiderl_over_stream_best']:>6} | >{p['tiderl_over_streamrl']}")
    out.append(f"  / best fixed partition      {str(r['tiderl_over_best_fixed']):>6} | -")
    out.append(f"  / bound (min of both)       {str(r['tiderl_over_bound']):>6} | -")
    out.append(f"  / compute bound             {str(r['tiderl_over_upper_bound']):>6} | -")
    out.append("")
    out.append("Ablation (like Table 2, each row over the one named; paper: +RA2P +10.4%, +ERS +35.7%, "
               "+CTB +4.8%):")
    for row in report["ablation"]:
        imp = f"{row['improvement']:+.1%} over {row['over']}" if row["improvement"] is not None else "baseline"
        out.append(f"  {row['system']:26} {row['goodput_tok_s']:>10,.0f} tok/s  {imp}")
    e = report["ers_wait_reduction"]
    out.append("")
    out.append(f"RWT+TWT of TideRL: {e['tiderl_rwt_plus_twt_s']:,.0f} GPU-s; reduction vs the fixed partitions "
               "with the same CTB+RA2P (paper: 68.6-77.6%):")
    reductions = e["vs_fixed_partition"]
    if len(reductions) <= 8:
        for label, red in reductions.items():
            mark = "  <- best goodput" if label == e["best_fixed_partition"] else ""
            out.append(f"  vs {label:26} {red:+.1%}{mark}")
    else:
        if e["vs_best_fixed_partition"] is not None:
            out.append(f"  vs {e['best_fixed_partition']:26} {e['vs_best_fixed_partition']:+.1%}  <- best goodput")
        out.append(f"  vs the {len(reductions)} fixed partitions: {min(reductions.values()):+.1%} to "
                   f"{max(reductions.values()):+.1%}")
    return "\n".join(out)


def plot(results: list[dict], path: str | Path) -> None:
    """Goodput, RWT/TWT and the role timeline of TideRL (or of the only system)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    labels = [r["system"] for r in results]
    x = range(len(results))
    ax = axes[0]
    ax.bar(x, [r["goodput_tok_s"] for r in results], color="tab:blue", label="goodput")
    ax.plot(x, [r["upper_bound_tok_s"] for r in results], "k_", markersize=18, label="compute bound")
    ax.plot(x, [r["latency_bound_tok_s"] for r in results], "r_", markersize=18, label="staleness-latency bound")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("trajectory tokens consumed / s")
    ax.set_title("Goodput")
    ax.legend(fontsize=8)
    ax = axes[1]
    rwt = [r["rwt_s"] / 3600 for r in results]
    twt = [r["twt_s"] / 3600 for r in results]
    ax.bar(x, rwt, color="tab:orange", label="RWT")
    ax.bar(x, twt, bottom=rwt, color="tab:green", label="TWT")
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GPU-hours")
    ax.set_title("Rollout / Training wait")
    ax.legend(fontsize=8)
    ax = axes[2]
    focus = next((r for r in results if r["system"].startswith("tiderl@")), results[0])
    tl = focus["roles_timeline"]
    versions = [e["version"] for e in tl]
    for role, color in (("rollout", "tab:blue"), ("actor", "tab:red"), ("ref", "tab:purple")):
        ax.step(versions, [e[role] for e in tl], where="post", label=role, color=color)
    ax.set_xlabel("version")
    ax.set_ylabel("ranks")
    ax.set_title(f"Roles: {focus['system']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
