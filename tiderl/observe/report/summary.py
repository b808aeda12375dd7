"""The report's Markdown page: the run in numbers, the figures, the diagnosis at report time."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from tiderl.observe.report.data import ReportData


def render(data: ReportData, figures: dict[str, tuple[Path, str]], diagnosis: dict[str, Any] | None) -> str:
    info = data.info
    elapsed = max(data.end_s, 1e-9)
    total = data.consumed_tokens
    waits: Counter[str] = Counter()
    for p in data.waits:
        waits[p["name"]] += p["value"]
    modes = Counter(v["ra2p_mode"] or "unknown" for v in data.versions)
    lines = [
        f"# Run report: {info.name}",
        "",
        "| | |",
        "| --- | --- |",
        f"| system | `{info.system}` |",
        f"| state | {info.state.value}" + (f" ({info.message})" if info.message else "") + " |",
        f"| versions published | {info.version} |",
        f"| wall time | {elapsed:.0f} s |",
        f"| trained generated tokens | {total} |",
        f"| goodput (whole run) | {total / elapsed:.1f} tokens/s |",
        *([f"| goodput (steady, from version {data.steady.from_version}; start-up before it "
           f"{data.steady.startup_s:.0f} s) | {data.steady.tok_s:.1f} tokens/s |"]
          if data.steady is not None and data.steady.tok_s is not None else []),
        f"| RWT (rollout wait, all ranks) | {waits['rwt_s']:.1f} s |",
        f"| TWT (trainer wait, all ranks) | {waits['twt_s']:.1f} s |",
        f"| RA2P modes | {', '.join(f'{m}: {n} step' + ('' if n == 1 else 's') for m, n in sorted(modes.items())) or '-'} |",
    ]
    for name, words in (("logprob_mismatch_on_policy", "engine log-prob mismatch, tokens of the weights trained"),
                        ("logprob_mismatch_stale", "engine log-prob mismatch, stale tokens")):
        values = data.mismatch.get(name) or []
        if values:
            lines.append(f"| {words} (nats a token: mean, max over {len(values)} step{'' if len(values) == 1 else 's'}) | "
                         f"{sum(values) / len(values):.2g}, {max(values):.2g} |")
    evals = [e for e in data.evals if e["success_rate"] is not None]
    if evals:
        lines += ["", "## Evaluations", "", "| weights version | tasks | success rate | mean reward |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {e['eval_version']} | {e['num_tasks']} | {e['success_rate']:.3f} | {e['reward_mean']:.3f} |"
                  for e in evals]
    if data.versions:
        lines += ["", "## Steps", "", "| version | step (s) | tokens | goodput (tok/s) | reward | success | RAS | "
                  "TPRM (s) | max staleness | mode |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for v in data.versions:
            rate = v["consumed_tokens"] / v["duration_s"] if v["duration_s"] else None
            lines.append(f"| {v['version']} | {_f(v['duration_s'], 1)} | {v['consumed_tokens']} | {_f(rate, 0)} | "
                         f"{_f(v['reward_mean'], 3)} | {_f(v['success_rate'], 3)} | {v['ras'] if v['ras'] is not None else '-'} | "
                         f"{_f(v['tprm_s'], 2)} | {v['max_staleness'] if v['max_staleness'] is not None else '-'} | "
                         f"{v['ra2p_mode'] or '-'} |")
    if any("ctb_admitted" in row or "prefix_cache_queries" in row for row in data.ctb.values()):
        lines += ["", "## Rollout scheduling (CTB) per weights version", "",
                  "Tasks the scheduler admitted, paused and resumed on the ranks that held the version; turns whose "
                  "context the prefix cache kept or evicted; the prompt tokens found in the prefix cache; mean "
                  "KV-cache usage and CTB budget (tokens) over the ranks' reports.", "",
                  "| version | admitted | paused | resumed | prefix kept | prefix evicted | hit rate | KV usage | "
                  "CTB budget |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for version, row in data.ctb.items():
            queries = row.get("prefix_cache_queries", 0.0)
            hit = row.get("prefix_cache_hits", 0.0) / queries if queries > 0 else None
            usage = row.get("kv_usage")
            lines.append(f"| {version} | " + " | ".join(str(int(row.get(k, 0))) for k in (
                "ctb_admitted", "ctb_pauses", "ctb_resumes", "ctb_prefix_kept", "ctb_prefix_evicted"))
                + f" | {_f(hit, 3)} | {_f(usage * 100 if usage is not None else None, 1)}"
                + ("%" if usage is not None else "") + f" | {_f(row.get('ctb_budget_tokens'), 0)} |")
    held = data.holding
    lines += ["", "## A training group's time in flight", ""]
    if held.get("groups"):
        which = ("created from the publication of version 1 on (one created during the start-up waits for the "
                 "engines to start)" if held["from_version"] == 1 else
                 "of the whole run, start-up included (none created after version 1 was trained)")
        lines += [f"Means over the {held['groups']} trained groups {which}, in seconds: from its creation to "
                  "its last task's report, then until the trainer claimed it, then until the version that "
                  "trained it was published (the step's other groups and its training). `tiderl sim` reports "
                  "the same parts, and the least the staleness-latency bound allows for each "
                  "(docs/simulator.md).", "",
                  "| creation to completion | completion to claim | claim to publication |", "| --- | --- | --- |",
                  f"| {held['release_to_seen_s']:.2f} | {held['seen_to_claim_s']:.2f} | "
                  f"{held['claim_to_publish_s']:.2f} |"]
    else:
        lines.append("no training group trained yet")
    lines += ["", "## Figures", ""]
    for name, (path, caption) in figures.items():
        lines += [f"**{name}**: {caption}", "", f"![{name}]({path.name})", ""]
    if diagnosis is not None:
        lines += ["## Diagnosis at report time", "", f"- trainer: {diagnosis['trainer']}",
                  f"- rollout: {diagnosis['rollout']}"]
        lines += [f"- {f['severity']}: {f['message']}" for f in diagnosis["findings"]]
        lines.append("")
    return "\n".join(lines)


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
