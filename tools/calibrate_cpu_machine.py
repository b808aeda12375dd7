"""The machine's costs, measured by tools/calibrate_cpu.py (its docstring says what and how): the trainer's
forward, backward, optimizer and swap per token, how many busy ranks the host runs at full speed, vLLM's
engine iteration, prefill, reload and KV capacity, a turn through the project's engine wrapper, and the
trainer role's whole step."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path


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


def _train_worker(model_path: str, seq_tokens: int, micro_batch_tokens: int, iterations: int, commands,
                  out) -> None:
    """One process: load and warm up, say so (None on `out`), then at each command on `commands` time
    `iterations` forward+backward passes (the seconds on `out`); a None command ends it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (max(1, micro_batch_tokens // seq_tokens), seq_tokens))
    model(input_ids=ids).logits.sum().backward()  # warm-up
    out.put(None)
    while commands.get() is not None:
        t0 = time.perf_counter()
        for _ in range(iterations):
            model(input_ids=ids).logits.sum().backward()
        out.put(time.perf_counter() - t0)


def measure_host_slots(model_path: Path, micro_batch_tokens: int, seq_tokens: int, iterations: int,
                       num_procs: int = 2) -> dict:
    """How many busy ranks the host runs at full speed: the same training loop alone, then in
    `num_procs` processes at once; slots = num_procs x (time alone) / (time together). The processes
    are started and warmed up once, before any clock starts; one waiting for its command uses no CPU."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    commands = [ctx.Queue() for _ in range(num_procs)]
    procs = [ctx.Process(target=_train_worker, args=(str(model_path), seq_tokens, micro_batch_tokens, iterations,
                                                     q, out)) for q in commands]
    for proc in procs:
        proc.start()

    def run(n: int) -> float:
        for q in commands[:n]:
            q.put(True)
        return statistics.fmean(_take(out, procs) for _ in range(n))

    try:
        for _ in procs:
            _take(out, procs)  # every model loaded and warmed up
        alone_before = run(1)
        together = run(num_procs)
        alone = (alone_before + run(1)) / 2  # alone before and after: the machine's load drifts
    finally:
        for q in commands:
            q.put(None)
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return {"host_alone_s": alone, "host_together_s": together, "host_procs": num_procs,
            "host_compute_slots": min(float(num_procs), max(1.0, num_procs * alone / together))}


def _take(out, procs: list, timeout_s: float = 900.0) -> float | None:
    """The next item a training process put on `out`; a process that died, or nothing within `timeout_s`,
    ends the calibration with a message."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"calibrate_cpu: a shared-host training process died or hung "
                                 f"(exit codes {dead or 'none'}, {timeout_s:.0f} s)") from None


# ---- vLLM ---------------------------------------------------------------------------------------
def start_engine(job, model_path: Path) -> tuple:
    """The rollout rank's own engine (`for_job`: the job's settings, eager on a CPU), started once for
    every engine figure, and its start time. Spawns: call under `if __name__ == "__main__":`."""
    from tiderl.rollout.vllm_engine import for_job

    t0 = time.perf_counter()
    engine = for_job(job, model_path)
    return engine, time.perf_counter() - t0


def measure_vllm(engine, model_path: Path, weights_dir: str, batches: list[int], decode_tokens: int,
                 repeats: int) -> dict:
    """Engine iteration time by batch size, prefill per token, reload, KV capacity, on `engine`
    (`start_engine`). Its vLLM `LLM` is driven synchronously on the wrapper's engine thread (no request of
    the wrapper in flight), so the timings hold no wrapper overhead; the job's weights are back in it after."""
    # The wrapper owns the LLM and its thread; a tool may borrow both between requests (as
    # tools/check_vision_engine.py does), and the wrapper has no public handle for this.
    llm = engine._llm
    config = llm.llm_engine.vllm_config
    max_seqs = int(config.scheduler_config.max_num_seqs)
    if max(batches) > max_seqs:
        raise SystemExit(f"calibrate_cpu: --batches {max(batches)} exceeds the engine's max_num_seqs {max_seqs} "
                         "(rollout.max_concurrency: a rank never batches more)")
    figures = asyncio.run(engine._call(lambda: _measure_llm(llm, model_path, weights_dir, batches, decode_tokens,
                                                            repeats)))
    return {"kv_capacity_tokens": engine.kv_capacity_tokens,
            "prefill_chunk_tokens": int(config.scheduler_config.max_num_batched_tokens), **figures}


def _measure_llm(llm, model_path: Path, weights_dir: str, batches: list[int], decode_tokens: int,
                 repeats: int) -> dict:
    """The timings of `measure_vllm`, on the engine thread."""
    from vllm import SamplingParams

    max_len = int(llm.llm_engine.vllm_config.model_config.max_model_len)
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

    def reload(path: str) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        llm.reset_prefix_cache()

    reload_s = median_s(lambda: reload(weights_dir), repeats)
    reload(str(model_path))  # the job's own weights again, for the turns timed on this engine next
    return {
        "decode_iteration_s_by_batch": {str(b): iteration_s[b] for b in batches},
        "decode_step_s": step_s,
        "decode_s_per_seq": per_seq_s,
        "prefill_s_per_token": prefill_s_per_token,
        "weight_reload_s": reload_s,
    }


def model_vocab(model_path: Path) -> int:
    return int(json.loads((model_path / "config.json").read_text())["vocab_size"])


def measure_turns(engine, model_path: Path, m: dict, sessions: int, turns: int, prompt_tokens: int,
                  gen_tokens: int, obs_tokens: int) -> dict:
    """Turn latency through the project's engine wrapper (`engine`, a `VllmEngine` as a rollout rank drives
    it): `sessions` loops of `turns` generations each, the context growing by the answer and an observation.
    The overhead is the mean latency minus what the measured iteration and prefill costs account for."""
    from tiderl.rollout.engine import SamplingSpec

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

    cpu0, wall0 = cpu_s(), time.perf_counter()
    asyncio.run(main())
    busy_cores = (cpu_s() - cpu0) / (time.perf_counter() - wall0)
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
