"""The GPU path in one go: the figures a lent GPU machine must give, as one JSON document.

Stages (docs/trainer.md, "Checking the GPU path"), each run in a child process with its own time budget;
a stage that fails or runs out of time is reported with its error and the stages after it still run:

1. ``environment``: torch, CUDA, the device and its memory, NCCL, whether vLLM imports;
2. ``model``: a random-init Qwen2 with Qwen2.5-1.5B's shapes (``--size full``; ``tiny`` for a CPU) in bf16,
   saved with a tokenizer built by the tiny models' machinery (tiderl.models.tiny_model);
3. ``vllm_engine``: the project's engine (tiderl.rollout.vllm_engine) in bf16 at gpu_memory_utilization 0.5:
   start time, tokens/s of a batch of requests, sleep and wake (memory freed, seconds);
4. ``fsdp_step``: GRPO steps of the ``fsdp`` trainer backend on a one-rank NCCL group: step seconds,
   tokens/s, torch.cuda.max_memory_allocated;
5. ``logprob_agreement``: the engine's log-probabilities of the tokens it sampled against the trainer's
   actor on the same tokens (and both against fp32);
6. ``weight_transfer``: trained versions from the actor to the engine by ``trainer.weight_sync: transfer``
   (tiderl.weightsync, gloo over TCP), seconds per version and bytes, then the agreement on the new weights;
7. ``memory``: every stage's peaks (GPU allocated and reserved in its process, the device's used memory
   across processes, host RSS).

Without vLLM the engine stages fail with the import error, and the agreement and transfer stages still
measure what needs no engine (the trainer's bf16 against fp32; the transfer's wire into device memory).

``tools/gpu_check.sh`` picks the Python and runs this; ``--out`` gets the JSON (rewritten after each
process, so a run killed from outside leaves what it finished), otherwise it is printed. Exit status 0
when every stage passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_check_context import PRESETS  # noqa: E402  (stdlib only at import)
from gpu_check_stages import PROCESSES  # noqa: E402  (stdlib only at import, the stages' modules too)

STAGES = tuple(s for stages in PROCESSES.values() for s in stages) + ("memory",)
# Seconds per process, and for the whole: the last process may use what the others left of the whole. The full
# check stays within 8 minutes (a lent GPU machine's command, its start aside).
BUDGETS = {
    "full": {"environment": 45, "model": 90, "trainer": 110, "engine": 235},
    "tiny": {"environment": 60, "model": 60, "trainer": 60, "engine": 180},
}
TOTAL_BUDGET = {"full": 480, "tiny": 360}
NEEDS_MODEL = ("trainer", "engine")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(PRESETS), default="full", help="full: Qwen2.5-1.5B's shapes; tiny: a CPU's")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (default: print it)")
    p.add_argument("--log", type=Path, default=None, help="write the stages' output here")
    p.add_argument("--work", type=Path, default=None, help="work directory, kept (default: a temporary one)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="use this Hugging Face model directory instead of building one (the model stage then "
                        "only reads it)")
    p.add_argument("--processes", default=",".join(PROCESSES),
                   help=f"which processes to run, of {','.join(PROCESSES)}")
    p.add_argument("--budget", action="append", default=[], metavar="PROCESS=SECONDS",
                   help="a process's time budget (repeatable)")
    p.add_argument("--total-budget", type=float, default=None,
                   help="seconds for the whole (default: full 480, tiny 360); the last process gets what is left, "
                        "at least its own budget")
    p.add_argument("--engine-eager", action="store_true",
                   help="vLLM without compilation and CUDA graphs on a GPU (a faster start)")
    args = p.parse_args(argv)
    args.selected = [s.strip() for s in args.processes.split(",") if s.strip()]
    unknown = [s for s in args.selected if s not in PROCESSES]
    if unknown or not args.selected:
        p.error(f"--processes: {', '.join(unknown) or 'none'} not among {', '.join(PROCESSES)}")
    args.budgets = dict(BUDGETS[args.size])
    for item in args.budget:
        name, _, seconds = item.partition("=")
        try:
            args.budgets[name] = float(seconds)
        except ValueError:
            p.error(f"--budget: {item!r} is not PROCESS=SECONDS")
        if name not in PROCESSES:
            p.error(f"--budget: {name!r} not among {', '.join(PROCESSES)}")
    if args.total_budget is None:
        args.total_budget = TOTAL_BUDGET[args.size]
    return args


def run_child(name: str, args: argparse.Namespace, work: Path, model_dir: Path, log: Path,
              budget: float) -> dict[str, Any]:
    """One process of stages under its budget, in a session of its own (its children, vLLM's engine core,
    are killed with it). Returns how it ended."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, str(HERE / "gpu_check_stages.py"), name, str(work), args.size, args.device,
           str(model_dir), "1" if args.engine_eager else "0"]
    (work / f"{name}.jsonl").unlink(missing_ok=True)  # a kept work directory's records, from an earlier check
    t0 = time.monotonic()
    with log.open("ab") as out:
        out.write(f"\n===== {name} (budget {budget:.0f} s) =====\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=ROOT)
        timed_out = False
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.wait()
        except BaseException:  # stopped from outside (SIGTERM, Ctrl-C): the stage's processes go too
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc, quiet=True)  # what it left behind (an engine core that outlived it)
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 2), "budget_s": budget}


def _kill_group(proc: subprocess.Popen[bytes], quiet: bool = False) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if quiet and sig == signal.SIGTERM:
            time.sleep(0.5)
            continue
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[rec.pop("stage")] = rec
    return out


def log_tail(log: Path, name: str, chars: int = 2000) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    start = text.rfind(f"===== {name} ")
    return text[start:][-chars:] if start >= 0 else ""


def missing_record(name: str, ended: dict[str, Any], log: Path) -> dict[str, Any]:
    if ended.get("skipped"):
        why = ended["skipped"]
    elif ended["timed_out"]:
        why = f"timed out: process {name!r} was killed at its budget of {ended['budget_s']:.0f} s"
    else:
        why = f"process {name!r} exited with status {ended['rc']} before this stage ended"
    return {"ok": False, "seconds": None, "error": why, "log_tail": log_tail(log, name)}


def memory_stage(stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    per = {name: rec["memory"] for name, rec in stages.items() if isinstance(rec.get("memory"), dict)}
    if not per:
        return {"ok": False, "seconds": 0.0, "error": "no stage reported its memory", "per_stage": {}}

    def peak(key: str) -> int | None:
        values = [m[key] for m in per.values() if m.get(key) is not None]
        return max(values) if values else None

    keys = ("gpu_allocated_peak_bytes", "gpu_reserved_peak_bytes", "device_used_peak_bytes", "host_rss_peak_bytes")
    return {"ok": True, "seconds": 0.0, "error": None, "per_stage": per, **{k: peak(k) for k in keys}}


def document(args: argparse.Namespace, stages: dict[str, dict[str, Any]], started: float,
             finished: bool) -> dict[str, Any]:
    wanted = [s for name in args.selected for s in PROCESSES[name]]
    all_stages = {s: stages.get(s, {"ok": False, "seconds": None, "error": "not run yet"}) for s in wanted}
    all_stages["memory"] = memory_stage({s: r for s, r in all_stages.items()})
    env = all_stages.get("environment", {})
    return {
        "check": "tiderl tools/gpu_check.py", "size": args.size, "device": env.get("device", args.device),
        "device_name": env.get("device_name"), "python": sys.executable,
        "python_choice": os.environ.get("TIDERL_GPU_CHECK_CHOICE"), "finished": finished,
        "ok": finished and all(r.get("ok") for r in all_stages.values()),
        "total_s": round(time.monotonic() - started, 1), "budgets_s": {n: args.budgets[n] for n in args.selected},
        "total_budget_s": args.total_budget,
        "failed": [s for s, r in all_stages.items() if not r.get("ok")], "stages": all_stages,
    }


def summary(doc: dict[str, Any]) -> str:
    key = {"environment": ("device_name", "torch", "vllm"), "model": ("parameters", "bytes_on_disk"),
           "fsdp_step": ("step_s", "tokens_per_s", "max_memory_allocated_bytes"),
           "vllm_engine": ("start_s", "tokens_per_s", "freed_bytes"), "logprob_agreement": ("max_abs", "mean_abs"),
           "weight_transfer": ("seconds_per_version", "bytes"),
           "memory": ("device_used_peak_bytes", "host_rss_peak_bytes")}
    lines = []
    for name, rec in doc["stages"].items():
        figures = ", ".join(f"{k} {rec[k]}" for k in key.get(name, ()) if rec.get(k) is not None)
        state = "ok" if rec.get("ok") else f"FAILED ({rec.get('error')})"
        lines.append(f"  {name:<18} {state}  {figures}")
    return "\n".join([f"gpu_check: {'all stages passed' if doc['ok'] else 'failed: ' + ', '.join(doc['failed'])}"
                      f" in {doc['total_s']} s", *lines])


class Stopped(Exception):
    """SIGTERM (the shell's overall timeout, a cancelled job)."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(f"stopped by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    started = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="tiderl-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    log = args.log or work / "gpu_check.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    model_dir = args.model_dir or work / "model"
    stages: dict[str, dict[str, Any]] = {}

    def write(finished: bool) -> dict[str, Any]:
        doc = document(args, stages, started, finished)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            os.replace(tmp, args.out)
        return doc

    name = ""
    try:
        for name in args.selected:
            ended: dict[str, Any]
            if name == "model" and args.model_dir is not None:
                stages["model"] = given_model(args.model_dir)
                continue
            if name in NEEDS_MODEL and "model" in stages and not stages["model"].get("ok"):
                ended = {"skipped": f"skipped: no model at {model_dir} (stage 'model' failed)"}
            else:
                budget = args.budgets[name]
                if name == args.selected[-1]:
                    budget = max(budget, args.total_budget - (time.monotonic() - started))
                print(f"[gpu_check] {name}: running (budget {budget:.0f} s)", file=sys.stderr, flush=True)
                ended = run_child(name, args, work, model_dir, log, budget)
            got = read_records(work / f"{name}.jsonl")
            for stage in PROCESSES[name]:
                stages[stage] = got.get(stage) or missing_record(name, ended, log)
                if "log_tail" not in stages[stage] and not stages[stage].get("ok"):
                    stages[stage]["log_tail"] = log_tail(log, name)
            write(False)
        doc = write(True)
    except Stopped as e:  # what ended so far; the rest marked as not run
        print(f"[gpu_check] {e}", file=sys.stderr, flush=True)
        got = read_records(work / f"{name}.jsonl")
        for stage in PROCESSES.get(name, ()):
            stages[stage] = got.get(stage) or {"ok": False, "seconds": None, "log_tail": log_tail(log, name),
                                               "error": f"{e} while process {name!r} ran"}
        doc = write(False)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(summary(doc), file=sys.stderr, flush=True)
    if args.out is None:
        print(json.dumps(doc, indent=1, default=str))
    if not doc["finished"]:
        return 124
    return 0 if doc["ok"] else 1


def given_model(model_dir: Path) -> dict[str, Any]:
    """The model stage for `--model-dir`: what the directory holds (no build)."""
    config = model_dir / "config.json"
    if not config.is_file():
        return {"ok": False, "seconds": 0.0, "error": f"--model-dir {model_dir}: no config.json"}
    c = json.loads(config.read_text())
    return {"ok": True, "seconds": 0.0, "error": None, "path": str(model_dir), "given": True,
            "vocab_size": c.get("vocab_size"), "hidden": c.get("hidden_size"), "layers": c.get("num_hidden_layers"),
            "bytes_on_disk": sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))}


if __name__ == "__main__":
    sys.exit(main())
