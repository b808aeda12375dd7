"""Measure this machine's costs for `tiderl sim` and write them as a cluster file
(and, from a finished run's store, the job's workload file).

    python tools/calibrate_cpu.py [--job jobs/quickstart.yaml] [--set KEY=VALUE ...]
        [--out jobs/sim/cpu.cluster.yaml]
        [--workload-from RUN_DIR --workload-out jobs/sim/hilo-bench.workload.yaml]
        [--repeats 5] [--batches 1,2,4,8,16] [--decode-tokens 32]

Measured, each the median of `--repeats` timings after a warm-up, on the job's
own model and settings:
- vLLM, on a rollout rank's own engine (`VllmEngine` from the job: its settings,
  eager on a CPU), started once for every engine figure below: its start time;
  the time of one engine iteration at each batch size (generating
  `--decode-tokens` more tokens per request, EOS ignored, minus the same
  requests generating one token), fitted as
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
- A turn through the project's engine wrapper (the same engine), as many loops
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
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

from calibrate_cpu_machine import (measure_host_slots, measure_trainer, measure_trainer_step, measure_turns,
                                   measure_vllm, start_engine)
from calibrate_cpu_workload import measure_env, trajectory_stats
from calibrate_cpu_yaml import DECOUPLED_STEP_S, cluster_yaml, workload_yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def control_intervals(job) -> dict:
    """The polling intervals of `tiderl run`'s control loop: the job's `rollout.report_interval_s`,
    the ranks' store poll and the control plane's tick."""
    from tiderl.run.bell import SLICE_S
    from tiderl.run.context import RankContext
    from tiderl.run.control import TICK_S as CONTROL_TICK_S

    report = job.rollout.report_interval_s
    poll = next(f.default for f in dataclasses.fields(RankContext) if f.name == "poll_s")
    return {"report_interval_s": report, "poll_s": poll, "control_tick_s": CONTROL_TICK_S, "bell_s": SLICE_S}


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
    parser.add_argument("--batches", default="1,2,4,8,16",
                        help="Engine batch sizes for the decode fit (at most the job's rollout.max_concurrency).")
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
    if args.workload_from is not None:
        m.update(measure_env(job.env.name, job.rollout.max_concurrency, args.env_episodes))
        m["trajectories"] = trajectory_stats(args.workload_from)
    shape = m.get("trajectories", {}).get("end", {"prompt_tokens": 26, "gen_tokens_per_turn": 2.0,
                                                  "tokens_mean": 110.0, "turns_mean": 5.0})
    gen = max(1, round(shape["gen_tokens_per_turn"]))
    obs = max(1, round((shape["tokens_mean"] - shape["prompt_tokens"]) / max(shape["turns_mean"], 1.0)) - gen)
    # One engine for every engine figure: a start costs more than all the timings on it.
    engine, m["engine_start_s"] = start_engine(job, path)
    try:
        m.update(measure_vllm(engine, path, m["weights_dir"], m["batches"], args.decode_tokens, args.repeats))
        m.update(measure_turns(engine, path, m, job.rollout.max_concurrency, args.turns,
                               round(shape["prompt_tokens"]), gen, obs))
    finally:
        engine.close()
    shutil.rmtree(m.pop("weights_dir"), ignore_errors=True)
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
