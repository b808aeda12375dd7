"""What one simulated run reports, and the physical upper bound.

Units: goodput in trajectory tokens consumed by the trainer per second (the
paper's training throughput: every token of a consumed trajectory, prompt,
generated and observed); waits and overheads in GPU-seconds (rank-seconds)
summed over the run.

Upper bound: the same consumed trajectories (and the evaluation rounds the
run had to play) on the same GPUs, if every GPU-second went to useful work:
each prompt and observation token prefilled exactly once, each generated
token decoded at the largest batch the KV capacity allows, each trained
token's reference forward and actor forward/backward done once; no waiting,
no model switch, no weight sync, no optimizer communication. On a shared host
(`measured.host_compute_slots`) that work also has to fit the host's slots,
a busy rollout rank weighing `rollout_busy_cores`.

Staleness-latency bound (docs/simulator.md, "Bounds"): at most
(max_staleness + 1) x B_ideal training groups hold a place in flight (from
their release until the feed after their consumption), and a group holds one
at least as long as its slowest task's unavoidable latency (environment start
and steps, the engine's own minimum for its prefills and its decode at batch
1, the turn overhead) plus the control loop's delays and its own training
tail. By Little's law over the run, goodput <= in-flight groups x tokens per
group / time held per group. `bound_tok_s` is the smaller of the two bounds;
`bound_term` names it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tiderl.policy.admission import inflight_bound
from tiderl.sim.costs import Costs, describe

if TYPE_CHECKING:
    from tiderl.sim.simulator import Simulation
    from tiderl.sim.tasks import SimTask
    from tiderl.sim.workload import TaskPlan

# The engine's chunked prefill is a fluid backlog re-evaluated at every event: within the last chunk it
# drains geometrically, so by the time a request starts decoding at least (1 - 1/e) of its backlog's
# prefill tokens have been computed (docs/simulator.md, "Bounds").
PREFILL_DRAINED = 1.0 - math.exp(-1.0)


def _generation_gpu_s(tasks: list[SimTask], costs: Costs, decode_s_per_token: float) -> float:
    total = 0.0
    for task in tasks:
        plan = task.plan
        total += sum(costs.prefill_s(new, cached) for new, cached in plan.turn_prefills())
        total += sum(plan.gen_tokens) * decode_s_per_token
    return total


def upper_bound_tok_s(sim: Simulation) -> float:
    consumed = sim.consumed_tasks
    if not consumed:
        return 0.0
    costs = sim.costs
    everything = consumed + sim.eval_tasks_done
    mean_ctx = sum(t.plan.total_tokens / 2 for t in everything) / len(everything)
    per_token = costs.best_decode_s_per_token(mean_ctx)
    rollout_s = _generation_gpu_s(everything, costs, per_token)
    train_s = sum(costs.train_s(n) for t in consumed for n in t.plan.segments)
    tokens = sum(t.plan.total_tokens for t in consumed)
    seconds = (rollout_s + train_s) / sim.num_gpus
    if costs.host_compute_slots is not None:
        # A shared host runs `host_compute_slots` cores' worth of work at once; a busy rollout rank
        # occupies `rollout_busy_cores` of them (Costs.host_speed).
        seconds = max(seconds, (rollout_s * costs.rollout_busy_cores + train_s) / costs.host_compute_slots)
    return tokens / seconds


def turn_prefill_min_s(costs: Costs, new_tokens: float, context_tokens: float) -> float:
    """The least time the engine spends before a request with `new_tokens` to prefill (its whole
    context `context_tokens`) decodes its first token: max(1, new / chunk) iterations of at least the
    batch-1 iteration time, and at least (1 - 1/e) of the new tokens' dense prefill FLOPs."""
    c = costs
    iterations = max(1.0, new_tokens / c.prefill_chunk_tokens)
    memory = c.weights_read_s + context_tokens * c.kv_read_s_per_token
    compute = iterations * c.flop_s_per_token + PREFILL_DRAINED * new_tokens * c.prefill_s_per_token
    return iterations * c.step_overhead_s + max(iterations * max(memory, c.flop_s_per_token), compute)


def task_min_latency_s(plan: TaskPlan, costs: Costs, engine_free_s: float = 0.0) -> float:
    """A task's unavoidable latency from its release: environment start (and the engines' weight
    reload still running `engine_free_s` after the release), then per turn the engine's
    minimum prefill (the prompt, then each observation: a prefix hit is the best case), its generated
    tokens at the batch-1 decode iteration (the fastest per sequence), the turn overhead and the
    environment step. No queueing, no preemption, no weight sync but the one given. On a shared host a rank playing a
    task runs at most at the share one busy rollout rank alone gets (`Costs.host_speed(1)`); engine
    time and turn overhead stretch by its inverse."""
    c = costs
    stretch = 1.0 / c.host_speed(1, 0)
    total = max(plan.start_latency_s, engine_free_s)
    for i, (gen, (new, cached)) in enumerate(zip(plan.gen_tokens, plan.turn_prefills())):
        ctx = cached + new
        engine = turn_prefill_min_s(c, new, ctx) + gen * c.decode_iteration_s(1, ctx, 0.0)
        total += (engine + c.turn_overhead_s) * stretch + plan.env_latency_s[i]
    return total


def train_tail_min_s(plans: list[TaskPlan], costs: Costs) -> float:
    """The least trainer time after a group is claimed until its step's weights exist: its longest
    sequence's actor forward (or reference forward, whichever is longer: the backward needs both) and
    backward on one rank, then the optimizer step."""
    c = costs
    longest = max(n for p in plans for n in p.segments)
    compute = c.forward_s(longest) * (max(1.0, c.ref_ratio) + c.backward_ratio) / c.host_speed(0, 1)
    return compute + min(c.optimizer_s_single_node, c.optimizer_s_multi_node)


def little_bound_tok_s(tokens: list[float], holds_s: list[float], in_flight_groups: float) -> float:
    """Little's law over a run: at most `in_flight_groups` groups hold a place in flight at once and
    group g holds one for at least holds_s[g], so the run lasts at least sum(holds) / in_flight and
    goodput <= in_flight x sum(tokens) / sum(holds) (in-flight tokens / latency per group)."""
    latency = sum(holds_s)
    if not tokens:
        return 0.0
    return in_flight_groups * sum(tokens) / latency if latency > 0 else math.inf


def in_flight_limit_groups(sim: Simulation) -> int:
    """The staleness bound's most training groups in flight: (max_staleness + 1) x the largest batch
    the feeder keeps out (B_ideal; ERS's adaptive retention only fetches fewer)."""
    batch = max([sim.b_ideal, sim.fetch] + [r.fetch_groups for r in sim.records])
    return inflight_bound(batch, sim.staleness)


def latency_bound_parts(sim: Simulation) -> dict:
    """The staleness-latency bound of a finished run and its terms (docs/simulator.md).

    A group holds its place in flight from its release until the next release after its consumption
    (the feeder refills only at a feed, after a publish): at least its slowest task's unavoidable
    latency, the polling delay before the trainer sees it (and `sync`'s switch to training), its
    training tail and optimizer step, and the delay from the publish to the next feed (not for the
    last step's groups: the run ends at its publish). A group released at a feed (every group but
    those of the first release) also finds the engines reloading weights until weight_sync_s after
    the publish."""
    groups: dict[int, list[TaskPlan]] = {}
    index: dict[int, int] = {}
    for task in sim.consumed_tasks:  # claim order
        groups.setdefault(id(task.group), []).append(task.plan)
        index[id(task.group)] = task.group.id[1]  # ("t", release order)
    costs, c = sim.costs, sim.cluster.control
    seen_delay = (c.report_interval_s + c.woken_s(c.poll_s)) / 2  # Simulation._group_done
    release_delay = (c.woken_s(c.control_tick_s) + c.report_interval_s) / 2  # Simulation._publish -> _feed
    reload_left = max(0.0, costs.weight_sync_s - release_delay)  # flush_all at the publish, then _feed
    if sim.system.synchronous:
        seen_delay += costs.phase_switch_s  # _sync_train starts after the switch
        release_delay = costs.phase_switch_s  # _sync_publish -> _sync_start_version
        reload_left = 0.0  # the engines wake with the release
    in_flight = in_flight_limit_groups(sim)
    last_step = sim.records[-1].fetch_groups if sim.records else 0
    tokens, holds, latency, after = [], [], 0.0, 0.0
    for i, (key, plans) in enumerate(groups.items()):
        # The first release (at t = 0, no reload) is at most `in_flight` groups.
        free = reload_left if index[key] >= in_flight else 0.0
        slowest = max(task_min_latency_s(p, costs, free) for p in plans)
        tail = train_tail_min_s(plans, costs) + (release_delay if i < len(groups) - last_step else 0.0)
        tokens.append(sum(p.total_tokens for p in plans))
        holds.append(slowest + seen_delay + tail)
        latency += slowest
        after += tail
    n = max(len(groups), 1)
    return {
        "latency_bound_tok_s": little_bound_tok_s(tokens, holds, in_flight),
        "in_flight_groups": in_flight,
        "tokens_per_group": round(sum(tokens) / n, 1),
        "slowest_task_s": round(latency / n, 3),
        "seen_delay_s": round(seen_delay, 3),
        "after_consumption_s": round(after / n, 3),
    }


def group_holding(sim: Simulation, released_from_s: float = 0.0) -> dict:
    """Where the trained groups' time in flight went, measured (means per group, seconds; the groups
    released at `released_from_s` or later: tools/sim_vs_real.py's steady window passes the first
    publication, as a real run's groups created during its start-up wait for its engines): from the
    feeder's release until the trainer saw the group complete (its slowest task, with the engines'
    queueing, CTB pauses and the report delay), in the buffer until a step claimed it, and from the
    claim until that step published (the step's other groups, its training, its optimizer step).
    The staleness-latency bound counts each part at its least (`latency_bound`): the measured
    parts show which one keeps a run below the bound."""
    publish_at = {r.version: r.end_s for r in sim.records}
    seen: set[int] = set()
    parts = [0.0, 0.0, 0.0]
    n = 0
    for task in sim.consumed_tasks:
        g = task.group
        if id(g) in seen or g.claim_version not in publish_at or g.released_s < released_from_s:
            continue
        seen.add(id(g))
        n += 1
        parts[0] += g.seen_s - g.released_s
        parts[1] += g.claimed_s - g.seen_s
        parts[2] += publish_at[g.claim_version] - g.claimed_s
    return {
        "groups": n,
        "release_to_seen_s": round(parts[0] / n, 3) if n else None,
        "seen_to_claim_s": round(parts[1] / n, 3) if n else None,
        "claim_to_publish_s": round(parts[2] / n, 3) if n else None,
    }


def latency_bound_tok_s(sim: Simulation) -> float:
    return latency_bound_parts(sim)["latency_bound_tok_s"]


def summarize(sim: Simulation, wall_s: float) -> dict:
    counters = sim.rollout.counters()
    acc = sim.rollout.accounts
    consumed_tokens = sum(t.plan.total_tokens for t in sim.consumed_tasks)
    consumed_gen = sum(sum(t.plan.gen_tokens) for t in sim.consumed_tasks)
    end = sim.end_s or 1e-9
    records = sim.records
    stats = sim.step_stats
    predicted = [
        (r.compute_s, r.predicted_decoupled_s if r.mode == "decoupled" else r.predicted_colocated_s)
        for r in records
        if r.predicted_colocated_s is not None and r.compute_s > 0
    ]
    ra2p_error = (
        sum(abs(p - a) / a for a, p in predicted) / len(predicted) if predicted else None
    )
    modes = [r.mode for r in records]
    compute_bound = upper_bound_tok_s(sim)
    latency_parts = latency_bound_parts(sim)
    latency_bound = latency_parts.pop("latency_bound_tok_s")
    return {
        "system": sim.system.label,
        "rollout_fraction": sim.rollout_fraction,
        "steps": len(records),
        "sim_time_s": round(sim.end_s, 3),
        "goodput_tok_s": round(consumed_tokens / end, 1),
        "goodput_gen_tok_s": round(consumed_gen / end, 1),
        "upper_bound_tok_s": round(compute_bound, 1),
        "latency_bound_tok_s": round(latency_bound, 1),
        "bound_tok_s": round(min(compute_bound, latency_bound), 1),
        "bound_term": "compute" if compute_bound <= latency_bound else "staleness_latency",
        "latency_bound": latency_parts,
        "group_holding": group_holding(sim),
        "stale_dropped_groups": sim.dropped_groups,
        "stale_dropped_gen_tokens": sim.dropped_gen_tokens,
        "rwt_s": round(sim.rollout.rwt_rank_s(), 1),
        "twt_s": round(sim.twt_gpu_s, 1),
        "kv_hit_rate": round(counters["hit"] / counters["query"], 4) if counters["query"] else None,
        "step_time_s": round(sum(r.duration_s for r in records) / len(records), 3) if records else None,
        "consumed_tokens": consumed_tokens,
        "consumed_trajectories": len(sim.consumed_tasks),
        "mean_staleness": round(sum(sim.staleness_seen) / len(sim.staleness_seen), 3) if sim.staleness_seen else 0,
        "max_staleness": max(sim.staleness_seen, default=0),
        "gpu_s": {
            "rollout_busy": round(acc["busy"], 1),
            "rollout_idle_env": round(acc["idle"] + acc["idle_held"], 1),
            "rollout_weight_sync": round(acc["stall"], 1),
            "trainer_busy": round(sum(s.busy_gpu_s for s in stats), 1),
            "trainer_swap": round(sum(s.swap_gpu_s for s in stats), 1),
            "trainer_bubble": round(sum(s.bubble_gpu_s for s in stats), 1),
            "eval_block": round(sim.eval_block_gpu_s, 1),
            "actor_regroup": round(sim.regroup_gpu_s, 1),
        },
        "rollout": {
            "prefill_tokens": round(counters["prefill"]),
            "decode_tokens": round(counters["decode"]),
            "query_tokens": round(counters["query"]),
            "hit_tokens": round(counters["hit"]),
            "preemptions": int(counters["preempt"]),
            "gen_tok_s_per_busy_gpu": round(counters["decode"] / acc["busy"], 1) if acc["busy"] else None,
        },
        "ra2p": {
            "decoupled_steps": modes.count("decoupled"),
            "colocated_steps": modes.count("colocated"),
            "cost_model_mean_abs_error": round(ra2p_error, 3) if ra2p_error is not None else None,
        },
        "roles_timeline": sim.timeline,
        "derived_costs": describe(sim.costs),
        "per_step": sim.step_rows(),
        "wall_s": round(wall_s, 3),
    }
