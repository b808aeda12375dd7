"""The files tools/calibrate_cpu.py writes from its measurements: the `tiderl sim` cluster file and the
job's workload file, every value with its source (measured, the job's setting, real runs, the code)."""

from __future__ import annotations

import os
from pathlib import Path


# ---- output files -------------------------------------------------------------------------------
def num(x: float) -> str:
    """A number YAML reads back as a float (YAML 1.1 wants a dot before an exponent)."""
    text = f"{x:.5g}"
    return f"{x:.4e}" if "e" in text else text


# A decoupled step's coordination with its ref ranks, beyond its stages: not timed here (it needs a trainer group
# under a run's load) but from real runs' stores, a step's time less the actor's data wait, decoupled minus
# colocated (jobs/bench-latency.yaml, 7 and 8 runs, 1.29 - 1.16 s; docs/RESULTS.md, 2026-12-04).
DECOUPLED_STEP_S = 0.13


def cluster_yaml(m: dict, job, num_ranks: int, rollout_fraction: float, when: str,
                 decoupled_step_s: float = DECOUPLED_STEP_S) -> str:
    """The cluster file, every value with its source (measured here, the job's setting, or real runs)."""
    src = f"measured by tools/calibrate_cpu.py, {when}, load average {m['load_before']} -> {m['load_after']}"
    r, t = job.rollout, job.trainer
    return f"""# This development machine as a `tiderl sim` cluster: {os.cpu_count()} CPU cores, no GPU, the tiny
# hilo model. Every rank is a process on the same host (rollout: a vLLM CPU engine).
# [M] {src}
#     (median of {m['repeats']} timings after a warm-up; raw figures in its JSON output);
# [J] the job's setting ({m['job']}, with the tool's --set overrides);
# [R] measured from real runs' stores (the command in docs/RESULTS.md);
# [C] a constant of the project's code.
name: cpu
num_gpus: {num_ranks}              # [J] launch.num_ranks (ranks of `tiderl run`, one process each)
env_concurrency: 1024     # [J] one env server; assumption: never the limit (hilo sessions are tiny)
measured:
  decode_step_s: {num(m['decode_step_s'])}          # [M] engine iteration, intercept of the fit over batches {m['batches']}
  decode_s_per_seq: {num(m['decode_s_per_seq'])}       # [M] engine iteration, slope per running sequence
  prefill_s_per_token: {num(m['prefill_s_per_token'])}    # [M] prompt tokens, long minus short prompts
  actor_forward_s_per_token: {num(m['actor_forward_s_per_token'])}   # [M] micro-batch of {m['trainer_tokens_per_microbatch']} tokens
  actor_backward_s_per_token: {num(m['actor_backward_s_per_token'])}  # [M]
  ref_forward_s_per_token: {num(m['ref_forward_s_per_token'])}     # [M] no autograd
  swap_s: {num(m['swap_s'])}                  # [M] HostSwap offload + onload of the model
  weight_sync_s: {num(m['weight_reload_s'])}           # [M] vLLM reload_weights + prefix-cache reset
  optimizer_s: {num(m['step_overhead_s'])}             # [M] the trainer role's whole step minus its forward/backward/ref/swap work (optimizer, publish, checkpoints; mean of {m['trainer_steps']} steps)
  kv_capacity_tokens: {m['kv_capacity_tokens']}       # [M] the engine's KV blocks (minus vLLM's null block) x block size
  decoupled_step_s: {num(decoupled_step_s)}           # [R] a decoupled step's coordination with its ref rank: a step's time less the actor's
                                   # data wait, decoupled (tiderl with a ref) minus colocated (async), means of 7 and 8
                                   # runs of jobs/bench-latency.yaml on this host, 1.29 - 1.16 s (docs/RESULTS.md, 2026-12-04)
  turn_overhead_s: {num(m['turn_overhead_s'])}        # [M] turn latency through the engine wrapper ({num(m['turn_latency_s'])} s, {m['turn_sessions']} loops) minus the iteration and prefill costs above
  rollout_busy_cores: {num(m['rollout_busy_cores'])}     # [M] CPU seconds per second of the driving process and vLLM's engine process during the turn timing
  host_compute_slots: {num(m['host_compute_slots'])}     # [M] {m['host_procs']} training processes at once against one alone ({num(m['host_together_s'])} s vs {num(m['host_alone_s'])} s)
rollout:
  max_num_seqs: {r.max_concurrency}           # [J] rollout.max_concurrency (tasks per rollout rank)
  prefill_chunk_tokens: {m['prefill_chunk_tokens']}   # [M] the engine's max_num_batched_tokens (chunked prefill)
  weight_reload_s: 0.0       # unused with measured costs (measured.weight_sync_s)
  engine_start_s: {num(m['engine_start_s'])}      # [M] a rollout rank's engine start on the job's model (VllmEngine from the job, once, alone)
training:
  micro_batch_tokens: {t.micro_batch_tokens}     # [J] trainer.micro_batch_tokens
  max_staleness: {r.max_staleness}           # [J] rollout.max_staleness
  min_batch_fraction: {t.groups_min / t.groups_ideal:.6g}    # [J] trainer.groups_min / trainer.groups_ideal
  switch_overhead_s: 0.0     # unused with measured costs (measured.swap_s)
  communicator_init_s: 0.0   # [J] one actor rank: no actor group to rebuild
  actor_ranks: {t.actor_ranks}             # [J] trainer.actor_ranks; spare ranks are idle or ref
  default_rollout_fraction: {rollout_fraction}   # [J] launch.rollout_fraction
  rollout_fraction_sweep: [{rollout_fraction}]   # [J] the benchmarked split only
control:
  report_interval_s: {m['report_interval_s']}   # [J] rollout.report_interval_s (or [C] the rollout role's TICK_S): a rollout rank reports and claims once per tick
  poll_s: {m['poll_s']}              # [C] tiderl/run/context.py RankContext.poll_s: trainer and ranks poll the store
  control_tick_s: {m['control_tick_s']}      # [C] tiderl/run/control.py TICK_S: the control plane plans and feeds once per tick
  bell_s: {m['bell_s']}             # [C] tiderl/run/bell.py SLICE_S: a publish, a plan and a finishing report ring bells, seen this often
ers:
  hol_tau: {job.ers.hol_tau}                # [J] ers.hol_tau
  max_moves_per_step: {job.ers.max_moves_per_step}       # [J] ers.max_moves_per_step
  min_rollout_ranks: {job.ers.min_rollout_ranks}
  min_actor_ranks: 1
  max_ref_ranks: {'null' if job.ers.max_ref_ranks is None else job.ers.max_ref_ranks}
  elastic_actors: false      # [J] the real ranks move ref ranks only
"""


def workload_yaml(ts: dict, env: dict, job, run_dir: Path, when: str) -> str:
    s, e = ts["start"], ts["end"]
    gen = (s["gen_tokens_per_turn"] * s["n"] + e["gen_tokens_per_turn"] * e["n"]) / (s["n"] + e["n"])
    prompt = round((s["prompt_tokens"] * s["n"] + e["prompt_tokens"] * e["n"]) / (s["n"] + e["n"]))
    # The turn limit the tasks meet: the agent loop's (env.max_turns) where some trajectory reached it,
    # else the most turns seen (the environment ends its episodes sooner; a geometric capped at the
    # agent's limit would give the slowest task of a group turns that no task plays).
    lo = ts["turns_min"]
    if ts["agent_capped"] or ts["turns_max"] >= job.env.max_turns:
        hi, hi_src = job.env.max_turns, f"[J] env.max_turns ({ts['agent_capped']} trajectories cut there)"
    else:
        hi = ts["turns_max"]
        hi_src = f"[R] most turns seen: the environment ended every episode (env.max_turns {job.env.max_turns})"

    def turns(x: float) -> float:
        return round(min(max(x, lo), hi), 3)

    st, sp = env["env_step_s"], env["env_start_s"]
    return f"""# The job `tools/bench_systems.py` runs ({job.name}: {job.env.name}, the tiny model) as a `tiderl sim` workload.
# [R] measured from the run store of a finished run ({run_dir.name}, {ts['versions']} versions;
#     start = trajectories trained in the first half of the versions, end = the second half);
# [E] measured by tools/calibrate_cpu.py, {when}: {env['env_sessions']} sessions in flight (one rollout
#     rank's concurrency), {sp['n']} starts and {st['n']} steps through the HTTP client;
# [J] the job's setting.
name: {job.env.name}-bench
group_size: {job.rollout.group_size}              # [J] rollout.group_size
groups_per_step: {job.trainer.groups_ideal}         # [J] trainer.groups_ideal
eval_every_steps: {job.rollout.eval_every_steps}        # [J] rollout.eval_every_steps
eval_groups: {job.rollout.eval_groups}             # [J] rollout.eval_groups
eval_group_size: 1         # [J] greedy evaluation: one task per prompt
max_context_tokens: {job.model.max_context_tokens}    # [J] model.max_context_tokens
drift_steps: {max(1, ts['versions'])}            # [R] the run's versions
task_types:
  - name: {job.env.name}
    share: 1.0             # [J] one environment
    prompt_tokens: {prompt}      # [R] tokens before the first generated one
    turns_mean: {{start: {turns(s['turns_mean'])}, end: {turns(e['turns_mean'])}}}   # [R] num_turns
    turns_min: {lo}           # [R] fewest turns seen
    turns_max: {hi}           # {hi_src}
    turns_group_icc: {ts.get('turns_group_icc', 0.0):.3f}   # [R] intraclass correlation of num_turns within a group (every finished training trajectory)
    tokens_mean: {{start: {s['tokens_mean']:.1f}, end: {e['tokens_mean']:.1f}}}   # [R] num_tokens
    gen_tokens_per_turn: {gen:.3f}   # [R] num_generated / num_turns
    gen_tokens_sigma: 0.3  # assumption: spread of tokens per turn (rollout.max_new_tokens caps them)
    obs_tokens_sigma: 0.3  # assumption
    env_latency: {{mean_s: {num(st['mean_s'])}, p99_s: {num(max(st['p99_s'], 1.01 * st['mean_s']))}}}   # [E] /observation
    env_start: {{mean_s: {num(sp['mean_s'])}, p99_s: {num(max(sp['p99_s'], 1.01 * sp['mean_s']))}}}     # [E] /start
"""
