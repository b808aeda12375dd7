"""The report's figures: one function per PNG, each drawing a `ReportData` onto a matplotlib Figure.

Every figure has a title, axis labels with units and a legend where it shows
more than one series; a figure whose data the run has not recorded (yet) says
so in its middle instead of being left blank.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from tiderl.observe.report.data import ReportData

ROLE_COLOURS = {"rollout": "tab:blue", "actor": "tab:red", "ref": "tab:orange", "idle": "lightgray",
                "dead": "black"}
MODE_COLOURS = {"decoupled": "tab:purple", "colocated": "tab:green", "vanilla_stream": "tab:brown",
                "vanilla": "tab:gray"}
DPI = 110


def goodput(data: ReportData, fig: Figure) -> str:
    ax = fig.add_subplot()
    if not data.versions:
        return _empty(ax, "Goodput over time", "no version published yet")
    t = [v["t_s"] for v in data.versions]
    step = [v["consumed_tokens"] / v["duration_s"] if v["duration_s"] else 0.0 for v in data.versions]
    cumulative, total = [(0.0, 0.0)], 0
    for v in data.versions:
        total += v["consumed_tokens"] or 0
        cumulative.append((v["t_s"], total / v["t_s"] if v["t_s"] > 0 else 0.0))
    if data.end_s > cumulative[-1][0]:
        cumulative.append((data.end_s, total / data.end_s))
    ax.plot(t, step, "o-", label="per step (trained tokens / step duration)")
    ax.plot(*zip(*cumulative), "--", marker="s", markevery=list(range(1, len(data.versions) + 1)),
            label="whole run so far (trained tokens / wall time, start-up included)")
    _annotate_versions(ax, data)
    ax.set(title="Goodput: generated tokens the trainer consumed, per second", xlabel="time since run start (s)",
           ylabel="goodput (tokens/s)")
    ax.set_xlim(0, max(data.end_s, t[-1]) * 1.02)
    ax.set_ylim(bottom=0)
    ax.legend()
    return "goodput per step and for the whole run so far"


def reward(data: ReportData, fig: Figure) -> str:
    axes = fig.subplots(1, 2)
    evals = [e for e in data.evals if e["success_rate"] is not None]
    if not data.versions and not evals:
        _empty(axes[1], "Success rate", "no step trained and no evaluation done yet")
        return _empty(axes[0], "Reward", "no step trained and no evaluation done yet")
    for ax, key, title, unit in ((axes[0], "reward_mean", "Mean reward", "reward (environment units)"),
                                 (axes[1], "success_rate", "Success rate", "success rate (fraction of tasks)")):
        train = [(v["version"], v[key]) for v in data.versions if v[key] is not None]
        if train:
            ax.plot(*zip(*train), "o-", label="training (trajectories of step v-1 -> v)")
        ev = [(e["eval_version"], e[key]) for e in evals if e[key] is not None]
        if ev:
            ax.plot(*zip(*ev), "s-", color="tab:red", label="evaluation of weights version v")
        ax.set(title=title, xlabel="weights version v", ylabel=unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if key == "success_rate":
            ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize="small")
    fig.suptitle("Reward and success rate: training and evaluation")
    return "mean reward and success rate per version, training and evaluation"


TRAINING_PANELS = (("pg_loss", "Policy-gradient loss", "per trained token"), ("kl", "KL to the reference", "nats"),
                   ("entropy", "Policy entropy", "nats a trained token"), ("grad_norm", "Gradient norm", "before clipping"),
                   ("lr", "Learning rate", ""), ("response_tokens_mean", "Response length", "tokens a sequence"),
                   ("turns_mean", "Agent turns per task", "turns (mean, and max dashed)"),
                   ("clip_frac", "Clipped share", "of trained tokens"))


def training(data: ReportData, fig: Figure) -> str:
    axes = fig.subplots(2, 4).flatten()
    turns = [(v["version"], v["turns_mean"]) for v in data.versions if v.get("turns_mean") is not None]
    series = dict(data.trainer) | {"turns_mean": turns}
    if not any(series.values()):
        for ax, (_, title, _) in zip(axes, TRAINING_PANELS):
            _empty(ax, title, "no step trained yet")
        return "training curves: no step trained yet"
    for ax, (key, title, unit) in zip(axes, TRAINING_PANELS):
        points = series.get(key) or []
        if not points:
            _empty(ax, title, "not recorded")
            continue
        ax.plot(*zip(*points), "o-", markersize=3)
        if key == "turns_mean":
            most = [(v["version"], v["turns_max"]) for v in data.versions if v.get("turns_max") is not None]
            if most:
                ax.plot(*zip(*most), "--", color="tab:gray")
        ax.set(title=title, xlabel="weights version v", ylabel=unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("Training curves: the step that published version v")
    return "the actor's step figures per version: loss, KL, entropy, gradient norm, learning rate, lengths, turns"


def waits(data: ReportData, fig: Figure) -> str:
    ax = fig.add_subplot()
    if not data.waits:
        return _empty(ax, "Rollout and training wait time (RWT, TWT)", "no wait recorded yet")
    series: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    totals: dict[tuple[str, int], float] = defaultdict(float)
    for p in data.waits:
        key = (p["name"], p["rank"])
        totals[key] += p["value"]
        series[key].append((p["t_s"], totals[key]))
    for (name, rank), pts in sorted(series.items()):
        label = f"{'RWT' if name == 'rwt_s' else 'TWT'} rank {rank}"
        end = max(data.end_s, pts[-1][0])
        ax.step(*zip(*([(0.0, 0.0)] + pts + [(end, pts[-1][1])])), where="post", label=label,
                linestyle="-" if name == "rwt_s" else "--")
    ax.set(title="Wait time: rollout blocked (RWT) and trainer starved (TWT), cumulative",
           xlabel="time since run start (s)", ylabel="cumulative wait (s)")
    ax.set_xlim(left=0)
    ax.legend(fontsize="small")
    return ("cumulative RWT per rollout rank (recorded every tick) and TWT per trainer rank (recorded when "
            "its step ends)")


def roles(data: ReportData, fig: Figure) -> str:
    ax = fig.add_subplot()
    if not data.roles:
        return _empty(ax, "Role timeline per rank", "no role planned yet")
    ranks = sorted({s.rank for s in data.roles})
    for s in data.roles:
        ax.broken_barh([(s.start_s, s.end_s - s.start_s)], (s.rank - 0.4, 0.8),
                       facecolors=ROLE_COLOURS.get(s.role, "white"), edgecolors="white")
    _annotate_versions(ax, data)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set(title="Role timeline per rank (roles change at sync boundaries)", xlabel="time since run start (s)")
    ax.set_xlim(0, max(data.end_s, max(s.end_s for s in data.roles)))
    seen = [r for r in ROLE_COLOURS if any(s.role == r for s in data.roles)]
    ax.legend(handles=[Patch(color=ROLE_COLOURS[r], label=r) for r in seen], loc="upper right", fontsize="small")
    return "which rank was rollout, actor, ref or idle when (dotted lines: published versions)"


def prefix_cache(data: ReportData, fig: Figure) -> str:
    left, right = fig.subplots(1, 2)
    queries: dict[tuple[int, int], float] = defaultdict(float)
    hits: dict[tuple[int, int], float] = defaultdict(float)
    usage: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for p in data.cache:
        if p["name"] == "prefix_cache_queries":
            queries[(p["rank"], p["version"])] += p["value"]
        elif p["name"] == "prefix_cache_hits":
            hits[(p["rank"], p["version"])] += p["value"]
        else:
            usage[p["rank"]].append((p["t_s"], 100.0 * p["value"]))
    rates: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (rank, version), q in sorted(queries.items()):
        if q > 0 and version is not None:
            rates[rank].append((version, 100.0 * hits[(rank, version)] / q))
    if rates:
        for rank, pts in sorted(rates.items()):
            left.plot(*zip(*pts), "o-", label=f"rank {rank}")
        left.set(title="Prefix-cache hit rate", xlabel="weights version", ylabel="hit rate (% of prompt tokens)")
        left.set_ylim(-2, 102)
        left.xaxis.set_major_locator(MaxNLocator(integer=True))
        left.legend(fontsize="small")
    else:
        _empty(left, "Prefix-cache hit rate", "no prefix-cache lookups recorded")
    if usage:
        for rank, pts in sorted(usage.items()):
            right.plot(*zip(*pts), "-", marker="o", markersize=3, label=f"rank {rank}")
        right.set(title="KV-cache usage", xlabel="time since run start (s)", ylabel="KV cache used (%)")
        right.set_ylim(-2, 102)
        right.legend(fontsize="small")
    else:
        _empty(right, "KV-cache usage", "no KV-cache usage recorded")
    fig.suptitle("KV cache of the rollout engines (vLLM)")
    return "prefix-cache hit rate per rollout rank and version, KV-cache usage over time"


def staleness(data: ReportData, fig: Figure) -> str:
    ax = fig.add_subplot()
    rows = [r for r in data.staleness if r["staleness"] is not None]
    if not rows:
        return _empty(ax, "Staleness of trained trajectories", "no trajectory trained yet")
    xs = [int(r["staleness"]) for r in rows]
    total_traj = sum(r["trajectories"] for r in rows) or 1
    total_tok = sum(r["tokens"] or 0 for r in rows) or 1
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [100.0 * r["trajectories"] / total_traj for r in rows], width,
           label=f"trajectories ({total_traj})")
    ax.bar([x + width / 2 for x in xs], [100.0 * (r["tokens"] or 0) / total_tok for r in rows], width,
           label=f"generated tokens ({total_tok})")
    ax.set_xticks(xs)
    ax.set(title="Staleness: versions between a trajectory's oldest weights and the weights trained",
           xlabel="staleness (versions)", ylabel="share of everything trained (%)")
    ax.legend()
    return "how many versions behind the trained weights each trajectory's oldest token was"


def ra2p_mode(data: ReportData, fig: Figure) -> str:
    ax = fig.add_subplot()
    steps = [v for v in data.versions if v["duration_s"] is not None]
    if not steps:
        return _empty(ax, "RA2P mode per step", "no step trained yet")
    modes = sorted({v["ra2p_mode"] or "unknown" for v in steps})
    for mode in modes:
        chosen = [v for v in steps if (v["ra2p_mode"] or "unknown") == mode]
        ax.bar([v["version"] for v in chosen], [v["duration_s"] for v in chosen],
               color=MODE_COLOURS.get(mode, "tab:olive"), label=f"{mode} ({len(chosen)} step{'' if len(chosen) == 1 else 's'})")
    ax.set(title="RA2P mode and duration of each step", xlabel="version published by the step",
           ylabel="step duration (s)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    return "the RA2P mode each step ran in, with its duration"


FIGURES: dict[str, Callable[[ReportData, Figure], str]] = {
    "goodput": goodput, "reward": reward, "training": training, "waits": waits, "roles": roles,
    "prefix_cache": prefix_cache, "staleness": staleness, "ra2p_mode": ra2p_mode,
}
SIZES = {"reward": (11, 4.5), "prefix_cache": (11, 4.5), "training": (16, 7)}


def write_all(data: ReportData, out_dir: Path,
              on_figure: Callable[[str], None] | None = None) -> dict[str, tuple[Path, str]]:
    """Every figure as `out_dir/NAME.png` (written to a temporary file, then renamed); name -> (path, caption).
    `on_figure(name)` is called before each figure is drawn (a progress line)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, draw in FIGURES.items():
        if on_figure is not None:
            on_figure(name)
        fig = Figure(figsize=SIZES.get(name, (9, 4.5)), layout="constrained")
        caption = draw(data, fig)
        path = out_dir / f"{name}.png"
        tmp = out_dir / f".{name}.png.tmp"
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, path)
        written[name] = (path, caption)
    return written


def _annotate_versions(ax: Any, data: ReportData) -> None:
    for v in data.versions:
        ax.axvline(v["t_s"], color="gray", linestyle=":", linewidth=0.8)


def _empty(ax: Any, title: str, why: str) -> str:
    ax.set(title=title, xticks=[], yticks=[])
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="dimgray")
    return f"{title}: {why}"
