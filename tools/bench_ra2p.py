"""RA2P benchmark: one training step with 8 ready micro-batches, four ref/actor execution modes.

Runs the real trainer code (plan -> RA2P executor -> GRPO loss -> AdamW ->
weight publishing) on a small random-init Qwen2 with gloo processes: M actor
ranks plus one ref rank (the ref rank works only in decoupled mode). Every
micro-batch is ready when the step starts (RAS = N, no later arrivals). The
four modes run in ``--rounds`` interleaved rounds (so a change in machine
load hits every mode alike); in each round a mode starts from the base model
and runs ``--warmup`` unmeasured steps, then ``--steps`` measured ones. The
figure is the median per-step time of the actor group (the slowest rank).

The cost model (``tiderl.policy.ra2p``) is calibrated with the stage times
measured in the vanilla-streaming-with-offload run (per share: ref forward,
actor forward, loss + backward, one swap) and predicts the decoupled and
colocated step times; the measured optimizer step is added to both.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tiderl.config.trainer import TrainerConfig
from tiderl.policy import ra2p
from tiderl.policy.ra2p import Ra2pMode
from tiderl.trainer.local import LocalGroupJob, SyntheticSource, run_local_group
from tiderl.trainer.plan import plan_step
from tiderl.trainer.synthetic import ModelSize, make_model_dir

MODES = (Ra2pMode.DECOUPLED, Ra2pMode.COLOCATED, Ra2pMode.VANILLA_STREAM, Ra2pMode.VANILLA_STREAM_OFFLOAD)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-actors", type=int, default=2, help="actor ranks (data parallel)")
    p.add_argument("--micro-batches", type=int, default=8, help="global micro-batches ready at the step start")
    p.add_argument("--seqs-per-share", type=int, default=2, help="sequences in one rank's share of a micro-batch")
    p.add_argument("--seq-tokens", type=int, default=256, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="measured steps per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the four modes")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per mode")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--work-dir", type=Path, default=None, help="keep the run here (default: a temp dir)")
    return p.parse_args(argv)


def _num_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="np") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    m = args.num_actors
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-ra2p-"))
    size = ModelSize(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=args.layers,
                     num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128))
    base = make_model_dir(work / "base", size)
    num_seqs = args.micro_batches * m * args.seqs_per_share
    group_size = 4
    if num_seqs % group_size:
        raise SystemExit(f"bench_ra2p: {num_seqs} sequences do not form complete groups of {group_size}")
    # Equal lengths: every share costs the same, as the cost model assumes.
    source = SyntheticSource(num_groups=num_seqs // group_size, group_size=group_size, min_tokens=args.seq_tokens,
                             max_tokens=args.seq_tokens, vocab_size=size.vocab_size)
    config = TrainerConfig(micro_batch_tokens=args.seqs_per_share * args.seq_tokens, checkpoint_every=10_000,
                           keep_versions=1, max_aggregate=64)
    job = LocalGroupJob(config=config, base_model=base, run_dir=work / "run", out_dir=work / "out", source=source,
                        modes=MODES * args.rounds, num_actors=m, num_refs=1, num_steps=args.steps,
                        threads_per_rank=args.threads_per_rank, warmup_steps=args.warmup)
    t0 = time.perf_counter()
    records = run_local_group(job, timeout_s=3600)
    wall_s = time.perf_counter() - t0
    actor0 = records[0]
    measured = {mode.value: statistics.median(r["duration_s"] for r in actor0[mode.value]) for mode in MODES}

    cal = actor0[Ra2pMode.VANILLA_STREAM_OFFLOAD.value]
    times = ra2p.StageTimes(
        t_ref_s=statistics.median(r["t_ref_s"] for r in cal),
        t_act_f_s=statistics.median(r["t_act_f_s"] for r in cal),
        t_act_b_s=statistics.median(r["t_act_b_s"] for r in cal),
        t_swap_s=statistics.median(r["t_swap_s"] for r in cal),
    )
    optimizer_s = statistics.median(r["optimizer_s"] for r in cal)
    inp = source.next_step(0, Ra2pMode.DECOUPLED)
    n_global = {}
    for mode in (Ra2pMode.DECOUPLED, Ra2pMode.COLOCATED):
        plan = plan_step(inp.samples, version=0, mode=mode, num_actors=m, micro_batch_tokens=config.micro_batch_tokens)
        # Global micro-batches = shares of the busiest rank (each global micro-batch gives a rank one share).
        n_global[mode] = max(len(a) for a in plan.assignment)
    pred_dec = ra2p.decoupled_cost_s([0.0] * n_global[Ra2pMode.DECOUPLED], times, m, 1) + optimizer_s
    pred_col = ra2p.colocated_cost_s([0.0] * n_global[Ra2pMode.COLOCATED], times, config.max_aggregate) + optimizer_s
    best_vanilla = min(measured["vanilla_stream"], measured["vanilla_stream_offload"])
    best_ra2p = min(measured["decoupled"], measured["colocated"])
    out = {
        "decoupled_s": round(measured["decoupled"], 4),
        "colocated_s": round(measured["colocated"], 4),
        "vanilla_stream_s": round(measured["vanilla_stream"], 4),
        "vanilla_stream_offload_s": round(measured["vanilla_stream_offload"], 4),
        "predicted_decoupled_s": round(pred_dec, 4),
        "predicted_colocated_s": round(pred_col, 4),
        "prediction_error_decoupled_pct": round(100 * (pred_dec - measured["decoupled"]) / measured["decoupled"], 1),
        "prediction_error_colocated_pct": round(100 * (pred_col - measured["colocated"]) / measured["colocated"], 1),
        "cost_model_choice": ra2p.choose_mode([0.0] * n_global[Ra2pMode.COLOCATED], times, m, 1).mode.value,
        "best_ra2p_vs_best_vanilla_pct": round(100 * (best_vanilla - best_ra2p) / best_vanilla, 1),
        "stage_times_s": {"t_ref": times.t_ref_s, "t_act_f": times.t_act_f_s, "t_act_b": times.t_act_b_s,
                          "t_swap": times.t_swap_s, "optimizer": optimizer_s},
        "micro_batches_global": {mode.value: n for mode, n in n_global.items()},
        "swaps_per_step": {mode.value: actor0[mode.value][0]["num_swaps"] for mode in MODES},
        "wait_ref_s_decoupled": round(statistics.mean(r["wait_ref_s"] for r in actor0["decoupled"]), 4),
        "num_actors": m,
        "num_refs": 1,
        "sequences_per_step": num_seqs,
        "seq_tokens": args.seq_tokens,
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": size.vocab_size,
                  "params": _num_params(base)},
        "threads_per_rank": args.threads_per_rank,
        "steps": args.steps,
        "rounds": args.rounds,
        "step_times_s": {mode.value: [round(r["duration_s"], 3) for r in actor0[mode.value]] for mode in MODES},
        "load_avg_1m": os.getloadavg()[0],
        "warmup": args.warmup,
        "wall_s": round(wall_s, 1),
    }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
