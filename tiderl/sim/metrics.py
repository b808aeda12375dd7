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
no model switch, no weight sync, no optimizer communication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiderl.sim.costs import Costs, describe

if TYPE_CHECKING:
    from tiderl.sim.rollout import SimTask
    from tiderl.sim.simulator import Simulation


def _generation_gpu_s(tasks: list[SimTask], costs: Costs, decode_s_per_token: float) -> float:
    total = 0.0
    for task in tasks:
        plan = task.plan
        total += costs.prefill_s(plan.prompt_tokens, 0.0)
        pos = plan.prompt_tokens
        for i, gen in enumerate(plan.gen_tokens):
            total += gen * decode_s_per_token
            pos += gen
            if i < len(plan.obs_tokens):
                total += costs.prefill_s(plan.obs_tokens[i], pos)
                pos += plan.obs_tokens[i]
    return total


def upper_bound_tok_s(sim: Simulation) -> float:
    consumed = sim.consumed_tasks
    if not consumed:
        return 0.0
    costs = sim.costs
    everything = consumed + sim.eval_tasks_done
    mean_ctx = sum(t.plan.total_tokens / 2 for t in everything) / len(everything)
    per_token = costs.best_decode_s_per_token(mean_ctx)
    gpu_s = _generation_gpu_s(everything, costs, per_token)
    gpu_s += sum(costs.train_s(t.plan.total_tokens) for t in consumed)
    tokens = sum(t.plan.total_tokens for t in consumed)
    return tokens / (gpu_s / sim.num_gpus)


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
    return {
        "system": sim.system.label,
        "rollout_fraction": sim.rollout_fraction,
        "steps": len(records),
        "sim_time_s": round(sim.end_s, 3),
        "goodput_tok_s": round(consumed_tokens / end, 1),
        "goodput_gen_tok_s": round(consumed_gen / end, 1),
        "upper_bound_tok_s": round(upper_bound_tok_s(sim), 1),
        "rwt_s": round(acc["rwt"], 1),
        "twt_s": round(sim.twt_gpu_s, 1),
        "kv_hit_rate": round(counters["hit"] / counters["query"], 4) if counters["query"] else None,
        "step_time_s": round(sum(r.duration_s for r in records) / len(records), 3) if records else None,
        "consumed_tokens": consumed_tokens,
        "consumed_trajectories": len(sim.consumed_tasks),
        "mean_staleness": round(sum(sim.staleness_seen) / len(sim.staleness_seen), 3) if sim.staleness_seen else 0,
        "max_staleness": max(sim.staleness_seen, default=0),
        "gpu_s": {
            "rollout_busy": round(acc["busy"], 1),
            "rollout_idle_env": round(acc["idle"], 1),
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
