"""The stages of ``tools/gpu_check.py``, run in child processes (one per group of stages).

Each process writes one JSON line per stage to ``WORK/PROCESS.jsonl`` as soon as the stage ends, so a
process that is killed at its time budget still leaves the stages it finished. A stage's failure is
caught and written as its record (``ok: false`` with the error and the traceback's end); the next stage of
the process runs all the same.

Processes and their stages, in the order they run:

- ``environment``: ``environment`` (torch, CUDA, the device, NCCL, whether vLLM imports);
- ``model``: ``model`` (a random-init Qwen2 with Qwen2.5-1.5B's shapes, or a tiny one, in bf16, and a
  tokenizer trained on the spot by the tiny models' machinery);
- ``trainer``: ``fsdp_step`` (the ``fsdp`` backend on a one-rank NCCL group, GRPO steps by the project's
  step code);
- ``engine``: ``vllm_engine`` (start, generate, sleep and wake), ``logprob_agreement`` (the engine's
  sampled tokens scored by the trainer's actor), ``weight_transfer`` (a trained version to the engine
  through the ``trainer.weight_sync: transfer`` path, then the same agreement on the new weights).

The engine sleeps (vLLM's level 1) while the actor trains in its process, as a rollout rank's engine
does when its rank trains; the actor's optimizer state and the engine's KV cache never share the
device at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROCESSES: dict[str, tuple[str, ...]] = {
    "environment": ("environment",),
    "model": ("model",),
    "trainer": ("fsdp_step",),
    "engine": ("vllm_engine", "logprob_agreement", "weight_transfer"),
}
PLUGIN_GROUP = "vllm.general_plugins"
# The project's vLLM plugins (pyproject.toml): a machine where tiderl is not installed lacks them.
PLUGINS = {"tiderl_vision": "tiderl.rollout.vision_compat:vllm_plugin",
           "tiderl_weights": "tiderl.rollout.vllm_transfer:register"}
TRANSPORT = ("tiderl.weightsync: a TCPStore rendezvous and a two-rank gloo group over TCP, from the trainer's "
             "host memory into the engine worker's host memory, then loaded onto its device; no NCCL path exists")


@dataclass(frozen=True, slots=True)
class Preset:
    """The model and the workload of a check (``--size``)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # at least the tokenizer's
    max_positions: int
    rope_theta: float
    tokenizer_vocab: int
    # the engine
    kv_blocks: int | None  # None: gpu_memory_utilization of the device
    max_model_len: int
    max_num_seqs: int
    requests: int
    prompt_tokens: int
    new_tokens: int
    agreement_seqs: int  # of the engine's generations, scored by the trainer and trained on
    # the trainer
    micro_batches: int
    seqs: int
    seq_tokens: int
    warmup: int
    steps: int
    lr: float
    transfer_versions: int


PRESETS = {
    # Qwen2.5-1.5B's shapes (its config.json): about 1.54 B parameters, the output layer tied to the embedding.
    "full": Preset("full", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
                   max_positions=32768, rope_theta=1e6, tokenizer_vocab=384, kv_blocks=None, max_model_len=2048,
                   max_num_seqs=64, requests=32, prompt_tokens=128, new_tokens=128, agreement_seqs=8,
                   micro_batches=4, seqs=2, seq_tokens=1024, warmup=1, steps=2, lr=1e-3, transfer_versions=2),
    # For a CPU (the test): head_dim 32, which vLLM's CPU attention supports.
    "tiny": Preset("tiny", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=0,
                   max_positions=4096, rope_theta=1e4, tokenizer_vocab=384, kv_blocks=16, max_model_len=480,
                   max_num_seqs=8, requests=4, prompt_tokens=24, new_tokens=8, agreement_seqs=4,
                   micro_batches=2, seqs=2, seq_tokens=48, warmup=1, steps=2, lr=1e-2, transfer_versions=2),
}


class Partial(Exception):
    """A stage that failed with some figures measured before it did."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


@dataclass(slots=True)
class Context:
    work: Path
    preset: Preset
    device: str  # cuda or cpu, resolved
    model_dir: Path
    engine_eager: bool = False

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# ---- memory --------------------------------------------------------------------------------------


class Meter:
    """A stage's memory peaks: this process's CUDA allocator (allocated, reserved), the device's used memory
    (every process: vLLM's engine core included) and host RSS (this process and its children), sampled every
    0.2 s by a thread."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda and _cuda_usable()
        self.device_used_start = self.device_used_peak = None
        self.rss_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, name="gpu-check-meter", daemon=True)

    def __enter__(self) -> Meter:
        if self.cuda:
            import torch

            try:
                torch.cuda.reset_peak_memory_stats()
                self.device_used_start = self.device_used_peak = device_used()
            except Exception:  # a device in an error state: the stage itself reports it
                self.cuda = False
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()

    def _sample_loop(self) -> None:
        while not self._stop.wait(0.2):
            self._sample()

    def _sample(self) -> None:
        self.rss_peak = max(self.rss_peak, host_rss())
        if self.cuda:
            try:
                used = device_used()
            except Exception:  # a device in an error state: the stage reports the error, the meter goes on
                return
            self.device_used_peak = max(self.device_used_peak or 0, used)

    def peaks(self) -> dict[str, Any]:
        out: dict[str, Any] = {"host_rss_peak_bytes": self.rss_peak, "gpu_allocated_peak_bytes": None,
                               "gpu_reserved_peak_bytes": None, "device_used_peak_bytes": self.device_used_peak,
                               "device_used_start_bytes": self.device_used_start}
        if self.cuda:
            import torch

            try:
                out["gpu_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
                out["gpu_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
            except Exception as e:  # as above
                out["gpu_error"] = f"{type(e).__name__}: {e}"
        return out


def _cuda_usable() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA set-up: the stage itself reports it
        return False


def device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def device_free() -> int | None:
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None


def host_rss() -> int:
    """This process's resident memory and its children's (vLLM's engine core), in bytes."""
    try:
        import psutil
    except ImportError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return int(total)


def synchronize(ctx: Context) -> None:
    if ctx.cuda:
        import torch

        torch.cuda.synchronize()


# ---- running the stages of a process -------------------------------------------------------------


def record(out: Path, stage: str, cuda: bool, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one stage, write its record as a JSON line to `out` (at once) and return it."""
    t0 = time.perf_counter()
    error = tb = None
    figures: dict[str, Any] = {}
    with Meter(cuda) as meter:
        try:
            figures = fn()
        except Partial as e:
            figures, error, tb = e.figures, str(e), traceback.format_exc()
        except Exception as e:  # every failure is the stage's result; the next stage still runs
            error, tb = f"{type(e).__name__}: {e}", traceback.format_exc()
    rec = {"stage": stage, "ok": error is None, "seconds": round(time.perf_counter() - t0, 3), "error": error,
           **figures, "memory": meter.peaks()}
    if tb:
        rec["traceback"] = tb[-3000:]
    with out.open("a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    print(f"[gpu_check] {stage}: {'ok' if error is None else 'FAILED: ' + error} ({rec['seconds']:.1f} s)",
          file=sys.stderr, flush=True)
    return rec


def run_process(name: str, ctx: Context) -> None:
    out = ctx.work / f"{name}.jsonl"
    if name == "environment":
        record(out, "environment", ctx.cuda, lambda: stage_environment(ctx))
    elif name == "model":
        record(out, "model", ctx.cuda, lambda: stage_model(ctx))
    elif name == "trainer":
        record(out, "fsdp_step", ctx.cuda, lambda: stage_fsdp_step(ctx))
    elif name == "engine":
        EngineStages(ctx, out).run()
    else:
        raise SystemExit(f"gpu_check: unknown process {name!r}")


# ---- 1. the environment --------------------------------------------------------------------------


def stage_environment(ctx: Context) -> dict[str, Any]:
    import platform
    import subprocess

    import torch
    import torch.distributed as dist

    facts: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "device": ctx.device,
        "nccl_available": dist.is_nccl_available(), "gloo_available": dist.is_gloo_available(),
    }
    try:
        import psutil

        facts["host_memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        facts["host_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for module in ("transformers", "tokenizers", "safetensors"):
        facts[module] = _version(module)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        facts.update({"device_count": torch.cuda.device_count(), "device_name": props.name,
                      "device_memory_bytes": int(total), "device_free_bytes": int(free),
                      "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                      "bf16_supported": torch.cuda.is_bf16_supported()})
        try:
            nccl = torch.cuda.nccl.version()
            facts["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:  # a torch build without NCCL
            facts["nccl_version"] = f"unavailable: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        facts["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        facts["nvidia_smi"] = f"unavailable: {e}"
    t0 = time.perf_counter()
    try:
        import vllm

        facts["vllm"] = getattr(vllm, "__version__", "unknown")
        facts["vllm_import_s"] = round(time.perf_counter() - t0, 2)
        from vllm.platforms import current_platform

        facts["vllm_platform"] = type(current_platform).__name__
        facts["vllm_sleep_mode"] = bool(current_platform.is_sleep_mode_available())
    except Exception as e:  # a fact of the machine, not the stage's failure: the engine stages report it
        facts["vllm"] = None
        facts["vllm_error"] = f"{type(e).__name__}: {e}"
    facts["tiderl_installed"] = _version("tiderl")
    facts["tiderl_vllm_plugins"] = sorted(_registered_plugins())
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1])
        facts["git_commit"] = head.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        facts["git_commit"] = None
    if ctx.device == "cuda" and not torch.cuda.is_available():
        raise Partial("--device cuda, but torch sees no CUDA device", facts)
    return facts


def _version(dist_name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _registered_plugins() -> set[str]:
    from importlib import metadata

    return {ep.name for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name in PLUGINS}


def ensure_vllm_plugins(work: Path, *, force: bool = False) -> str:
    """Make vLLM find the project's plugins (the ``tiderl`` weight-transfer backend) in every process it
    starts. Installed (``pip install -e .``), tiderl's entry points are there; on a machine that only has the
    working tree on PYTHONPATH, a distribution holding nothing but those entry points is written under
    `work` and put on sys.path and PYTHONPATH (which vLLM's processes inherit). Returns what was done."""
    if not force and set(PLUGINS) <= _registered_plugins():
        return "installed"
    site = work / "vllm-plugins"
    info = site / "tiderl_gpu_check_plugins-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiderl-gpu-check-plugins\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[{PLUGIN_GROUP}]\n" + "".join(f"{name} = {target}\n" for name, target in PLUGINS.items()))
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(site) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *paths])
    return f"added: {site}"


# ---- 2. the model --------------------------------------------------------------------------------


def stage_model(ctx: Context) -> dict[str, Any]:
    """A random-init Qwen2 in bf16 with a tokenizer of the project's tiny models (byte-level BPE with the
    chat format's special tokens and template, trained on the hilo demonstrations); the model's vocabulary
    is the preset's or the tokenizer's, whichever is larger."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tiderl.models import demos, tiny_model
    from tiderl.rollout.chat import ChatFormat

    p = ctx.preset
    t0 = time.perf_counter()
    texts = [m["content"] for seed in range(200) for m in demos.play_demonstration("hilo", seed, 0.3)[0]]
    tokenizer = tiny_model.train_tokenizer(texts, p.tokenizer_vocab)
    fmt = ChatFormat(tokenizer)
    out = ctx.model_dir
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    tokenizer_s = time.perf_counter() - t0
    config = Qwen2Config(
        vocab_size=max(p.vocab, len(tokenizer)), hidden_size=p.hidden, intermediate_size=p.intermediate,
        num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
        head_dim=p.hidden // p.heads, max_position_embeddings=p.max_positions, rope_theta=p.rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=fmt.pad_id, eos_token_id=fmt.end_of_turn_id,
        bos_token_id=fmt.end_of_turn_id,
    )
    config.save_pretrained(out)
    # Read back as transformers reads it (its qwen2 tokenizer class adds <|endoftext|>): the model embeds
    # every id the tokenizer of its directory has.
    loaded = len(AutoTokenizer.from_pretrained(out))
    vocab = config.vocab_size = max(config.vocab_size, loaded)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(ctx.device):  # initialised where it is fastest: on the GPU there is one
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    synchronize(ctx)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(out)
    save_s = time.perf_counter() - t0
    params = sum(t.numel() for t in model.parameters())
    dtypes = sorted({str(t.dtype) for t in model.parameters()})
    del model
    return {"path": str(out), "parameters": params, "dtype": dtypes, "vocab_size": vocab,
            "tokenizer_size": loaded, "hidden": p.hidden, "layers": p.layers, "heads": p.heads,
            "kv_heads": p.kv_heads, "intermediate": p.intermediate, "tie_word_embeddings": True,
            "bytes_on_disk": sum(f.stat().st_size for f in out.glob("*.safetensors")),
            "tokenizer_s": round(tokenizer_s, 3), "build_s": round(build_s, 3), "save_s": round(save_s, 3)}


def use_model(ctx: Context) -> None:
    if not (ctx.model_dir / "config.json").is_file():
        raise RuntimeError(f"no model at {ctx.model_dir} (the model stage failed or did not run)")


# ---- 4. one step of the fsdp backend -------------------------------------------------------------


def trainer_group(ctx: Context, name: str) -> tuple[Any, float]:
    """A one-rank trainer group (tiderl.trainer.group, a file:// rendezvous): NCCL on a GPU, gloo on a CPU;
    NCCL's communicator is made at the first collective, so one all-reduce is part of the set-up."""
    import torch
    import torch.distributed as dist

    from tiderl.trainer.group import init_trainer_group

    rendezvous = ctx.work / "rendezvous" / name
    rendezvous.unlink(missing_ok=True)  # a kept work directory's, from an earlier check
    t0 = time.perf_counter()
    comm = init_trainer_group(0, 1, 0, rendezvous, backend="nccl" if ctx.cuda else "gloo")
    x = torch.ones(1, device=ctx.device)
    dist.all_reduce(x)
    synchronize(ctx)
    if float(x.item()) != 1.0:
        raise RuntimeError(f"a one-rank all-reduce gave {float(x.item())}")
    return comm, time.perf_counter() - t0


def make_actor(ctx: Context, comm: Any) -> Any:
    from tiderl.trainer.backend import OptimConfig, make_backend

    return make_backend("fsdp", "actor", ctx.model_dir, device=ctx.device, optim=OptimConfig(lr=ctx.preset.lr),
                        dp_group=comm.dp_group, dtype="bfloat16" if ctx.cuda else "float32")


def train_step(ctx: Context, actor: Any, mbs: list[Any], version: int) -> dict[str, Any]:
    """One GRPO step of `actor` over the micro-batches `mbs`, by the project's step code (forward, loss and
    backward per micro-batch, then the optimizer step), the loss divided by the step's model tokens."""
    from tiderl.trainer import step as grpo_step
    from tiderl.trainer.step import LossConfig, StepAccumulator

    synchronize(ctx)
    started = time.perf_counter()
    acc = StepAccumulator(version=version)
    normalizer = float(sum(mb.num_model_tokens for mb in mbs))
    loss = LossConfig(kl_coef=0.0)  # no reference model in the check
    for mb in mbs:
        grpo_step.finish(actor, mb, grpo_step.forward(actor, mb, acc), None, loss, normalizer, acc)
    t_opt = time.perf_counter()
    optim = actor.step()
    synchronize(ctx)
    stats = grpo_step.reduce_stats(acc, optim.grad_norm, time.perf_counter() - t_opt, started, None)
    return {"step_s": time.perf_counter() - started, "loss": stats.loss, "grad_norm": stats.grad_norm,
            "tokens": sum(int(mb.attention_mask.sum()) for mb in mbs), "model_tokens": stats.num_tokens,
            "forward_s": stats.t_act_f_s, "loss_backward_s": stats.t_act_b_s, "optimizer_s": stats.optimizer_s,
            "logprob_mismatch_on_policy": stats.logprob_mismatch_on_policy}


def stage_fsdp_step(ctx: Context) -> dict[str, Any]:
    import torch

    from tiderl.trainer.batch import collate
    from tiderl.trainer.group import leave_trainer_group
    from tiderl.trainer.synthetic import random_samples

    use_model(ctx)
    p = ctx.preset
    comm, init_s = trainer_group(ctx, "trainer")
    try:
        t0 = time.perf_counter()
        actor = make_actor(ctx, comm)
        synchronize(ctx)
        load_s = time.perf_counter() - t0
        vocab = int(actor.model.config.vocab_size)
        steps = []
        for k in range(p.warmup + p.steps):
            samples = random_samples(1, p.micro_batches * p.seqs, vocab_size=vocab, min_tokens=p.seq_tokens,
                                     max_tokens=p.seq_tokens, version=k, seed=k)
            mbs = [collate(samples[i * p.seqs:(i + 1) * p.seqs], index=i) for i in range(p.micro_batches)]
            steps.append(train_step(ctx, actor, mbs, k))
        measured = steps[p.warmup:]
        step_s = statistics.median(s["step_s"] for s in measured)
        return {
            "backend": "fsdp", "process_group": "nccl" if ctx.cuda else "gloo", "world_size": 1,
            "sharded": actor.dp_group is not None, "compute_dtype": str(actor.compute_dtype).replace("torch.", ""),
            "parameters": sum(t.numel() for t in actor.model.parameters()),
            "group_init_s": round(init_s, 3), "load_s": round(load_s, 3),
            "first_step_s": round(steps[0]["step_s"], 4), "step_s": round(step_s, 4),
            "steps_s": [round(s["step_s"], 4) for s in measured],
            "tokens_per_step": measured[-1]["tokens"], "tokens_per_s": round(measured[-1]["tokens"] / step_s, 1),
            "forward_s": measured[-1]["forward_s"], "loss_backward_s": measured[-1]["loss_backward_s"],
            "optimizer_s": measured[-1]["optimizer_s"], "loss": measured[-1]["loss"],
            "grad_norm": measured[-1]["grad_norm"],
            "max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if ctx.cuda else None,
            "micro_batches": p.micro_batches, "seqs_per_micro_batch": p.seqs, "seq_tokens": p.seq_tokens,
            "note": "one rank: the fsdp backend shards over a data-parallel group of 2 or more, so here it trains "
                    "the whole model unsharded (fp32 weights and AdamW state, bf16 autocast on a GPU)",
        }
    finally:
        leave_trainer_group()


# ---- 3, 5, 6: the engine, the agreement, the transfer ---------------------------------------------


def _diff(a: list[float], b: list[float]) -> dict[str, Any]:
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)]
    if not gaps:
        raise RuntimeError("no tokens to compare")
    return {"max_abs": max(gaps), "mean_abs": sum(gaps) / len(gaps), "tokens": len(gaps)}


class EngineStages:
    """Stages 3, 5 and 6 in one process: one engine start serves all three."""

    def __init__(self, ctx: Context, out: Path) -> None:
        self.ctx = ctx
        self.out = out
        self.engine: Any = None
        self.engine_error: str | None = None
        self.prompts: list[list[int]] = []
        self.generations: list[Any] = []
        self.actor: Any = None
        self.comm: Any = None

    def run(self) -> None:
        from tiderl.trainer.group import leave_trainer_group

        try:
            started = record(self.out, "vllm_engine", self.ctx.cuda, self.vllm_engine)
            if not self.generations:
                self.engine_error = self.engine_error or started["error"]
            record(self.out, "logprob_agreement", self.ctx.cuda, self.logprob_agreement)
            record(self.out, "weight_transfer", self.ctx.cuda, self.weight_transfer)
        finally:
            if self.engine is not None:
                self.engine.close()
            leave_trainer_group()

    # -- 3 --
    def sampling(self, seed: int, tokens: int) -> Any:
        from tiderl.rollout.engine import SamplingSpec

        return SamplingSpec(max_new_tokens=tokens, temperature=1.0, seed=seed)

    def generate(self, prompts: list[list[int]], tokens: int) -> list[Any]:
        async def all_of() -> list[Any]:
            return await asyncio.gather(*(self.engine.generate(pr, self.sampling(100 + i, tokens))
                                          for i, pr in enumerate(prompts)))

        return asyncio.run(all_of())

    def vllm_engine(self) -> dict[str, Any]:
        import random

        ctx, p = self.ctx, self.ctx.preset
        use_model(ctx)
        figures: dict[str, Any] = {"plugins": ensure_vllm_plugins(ctx.work)}
        try:
            import vllm  # noqa: F401  (its own error, before the engine's)

            from tiderl.rollout.vllm_engine import VllmEngine
        except Exception as e:
            self.engine_error = f"vLLM does not import: {type(e).__name__}: {e}"
            raise Partial(self.engine_error, figures) from e
        kwargs: dict[str, Any] = {"block_size": 32, "max_model_len": p.max_model_len, "max_num_seqs": p.max_num_seqs,
                                  "dtype": "bfloat16" if ctx.cuda else "float32", "num_kv_blocks": p.kv_blocks,
                                  "gpu_memory_utilization": 0.5, "seed": 0}
        if ctx.engine_eager:
            kwargs["enforce_eager"] = True
        figures["settings"] = {**kwargs, "enforce_eager": kwargs.get("enforce_eager", not ctx.cuda)}
        free_before = device_free() if ctx.cuda else None
        t0 = time.perf_counter()
        try:
            self.engine = VllmEngine(ctx.model_dir, **kwargs)
        except Exception as e:
            self.engine_error = f"the engine did not start: {type(e).__name__}: {e}"
            raise
        figures["start_s"] = round(time.perf_counter() - t0, 2)
        figures["kv_capacity_tokens"] = self.engine.kv_capacity_tokens
        if ctx.cuda:
            figures["engine_device_bytes"] = free_before - device_free()
        from transformers import AutoTokenizer

        # Prompts of ids both the tokenizer and the model have.
        top = min(len(AutoTokenizer.from_pretrained(ctx.model_dir)), self.vocab_size())
        rng = random.Random(0)
        self.prompts = [[rng.randrange(3, top) for _ in range(p.prompt_tokens)] for _ in range(p.requests)]
        t0 = time.perf_counter()
        self.generate(self.prompts[:1], p.new_tokens)  # the first steps are slow (warm-up)
        figures["first_request_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        self.generations = self.generate(self.prompts, p.new_tokens)
        seconds = time.perf_counter() - t0
        generated = sum(len(g.token_ids) for g in self.generations)
        figures.update({"requests": len(self.prompts), "prompt_tokens": p.prompt_tokens, "new_tokens": p.new_tokens,
                        "generated_tokens": generated, "generate_s": round(seconds, 3),
                        "tokens_per_s": round(generated / seconds, 1)})
        figures.update(self.sleep_and_wake())
        again = self.generate(self.prompts[:1], p.new_tokens)
        figures["generates_after_wake"] = len(again[0].token_ids) > 0  # (a request may sample its end early)
        return figures

    def sleep_and_wake(self) -> dict[str, Any]:
        free0 = device_free()
        t0 = time.perf_counter()
        released = asyncio.run(self.engine.release_memory())
        sleep_s = time.perf_counter() - t0
        free1 = device_free()
        t0 = time.perf_counter()
        asyncio.run(self.engine.restore_memory())
        wake_s = time.perf_counter() - t0
        free2 = device_free()
        out: dict[str, Any] = {"sleep_supported": bool(released), "sleep_s": round(sleep_s, 3),
                               "wake_s": round(wake_s, 3), "freed_bytes": None, "restored_bytes": None}
        if free0 is not None:
            out["freed_bytes"] = free1 - free0
            out["restored_bytes"] = free1 - free2
        if not released:
            out["sleep_note"] = "vLLM has no sleep mode on this platform: release_memory keeps the memory"
        return out

    def vocab_size(self) -> int:
        return int(json.loads((self.ctx.model_dir / "config.json").read_text())["vocab_size"])

    # -- 5 --
    def ensure_actor(self) -> None:
        if self.actor is None:
            use_model(self.ctx)
            self.comm, _ = trainer_group(self.ctx, "engine")
            self.actor = make_actor(self.ctx, self.comm)

    def release_engine(self) -> bool:
        return self.engine is not None and bool(asyncio.run(self.engine.release_memory()))

    def restore_engine(self) -> None:
        if self.engine is not None:
            if self.ctx.cuda:  # the actor's cached blocks back to the device, for the engine to take again
                import torch

                torch.cuda.empty_cache()
            asyncio.run(self.engine.restore_memory())

    def samples(self, prompts: list[list[int]], gens: list[Any], version: int) -> list[Any]:
        from tiderl.advantages import group_advantages
        from tiderl.trainer.batch import TrainSample

        rewards = [float(i % 2) for i in range(len(gens))]
        return [TrainSample(trajectory_id=f"t{i}", group_id="g0", token_ids=tuple(pr) + tuple(g.token_ids),
                            loss_mask=(0,) * len(pr) + (1,) * len(g.token_ids),
                            rollout_logprobs=(0.0,) * len(pr) + tuple(g.logprobs),
                            token_versions=(-1,) * len(pr) + (version,) * len(g.token_ids), advantage=adv,
                            reward=rewards[i])
                for i, (pr, g, adv) in enumerate(zip(prompts, gens, group_advantages(rewards), strict=True))]

    def micro_batches(self, samples: list[Any]) -> list[Any]:
        from tiderl.trainer.batch import collate

        per = self.ctx.preset.seqs
        return [collate(samples[i:i + per], index=i // per) for i in range(0, len(samples), per)]

    def scored(self, mbs: list[Any]) -> dict[str, list[float]]:
        """The trainer's log-probabilities of each micro-batch's model tokens (the actor's forward: bf16
        autocast on a GPU), the same in fp32 (its fp32 weights, no autocast), and the engine's."""
        import torch

        from tiderl.trainer.grpo import token_logprobs

        out: dict[str, list[float]] = {"trainer": [], "fp32": [], "engine": []}
        device = self.ctx.device
        with torch.no_grad():
            for mb in mbs:
                mask = mb.loss_mask > 0
                out["trainer"] += self.actor.forward(mb).float().cpu()[mask].tolist()
                ids = mb.input_ids.to(device)
                logits = self.actor.model(input_ids=ids, attention_mask=mb.attention_mask.to(device),
                                          use_cache=False).logits
                fp32 = token_logprobs(logits.float(), ids, temperature=self.actor.temperature,
                                      banned=self.actor.banned)
                out["fp32"] += fp32.float().cpu()[mask].tolist()
                out["engine"] += mb.old_logprobs[mask].tolist()
        return out

    def logprob_agreement(self) -> dict[str, Any]:
        n = self.ctx.preset.agreement_seqs
        figures: dict[str, Any] = {"engine_released": self.release_engine()}  # room for the actor on the device
        self.ensure_actor()
        figures["compute_dtype"] = str(self.actor.compute_dtype).replace("torch.", "")
        if self.generations:
            figures["engine_dtype"] = "bfloat16" if self.ctx.cuda else "float32"
            mbs = self.micro_batches(self.samples(self.prompts[:n], self.generations[:n], 0))
        else:  # no engine: the trainer's own precision against fp32, on random tokens
            from tiderl.trainer.synthetic import random_samples

            p = self.ctx.preset
            samples = random_samples(1, n, vocab_size=int(self.actor.model.config.vocab_size),
                                     min_tokens=p.prompt_tokens + p.new_tokens,
                                     max_tokens=p.prompt_tokens + p.new_tokens)
            mbs = self.micro_batches(samples)
        scored = self.scored(mbs)
        figures["trainer_vs_fp32"] = _diff(scored["trainer"], scored["fp32"])
        if not self.generations:
            raise Partial(f"no engine samples ({self.engine_error}): only the trainer's precision was measured",
                          figures)
        figures["engine_vs_trainer"] = _diff(scored["engine"], scored["trainer"])
        figures["engine_vs_fp32"] = _diff(scored["engine"], scored["fp32"])
        figures["max_abs"] = figures["engine_vs_trainer"]["max_abs"]
        figures["mean_abs"] = figures["engine_vs_trainer"]["mean_abs"]
        return figures

    # -- 6 --
    def weight_transfer(self) -> dict[str, Any]:
        import torch

        from tiderl.weightsync.server import WeightServer

        ctx, p = self.ctx, self.ctx.preset
        self.ensure_actor()
        wire = torch.bfloat16 if ctx.cuda else torch.float32  # the engines' dtype (tiderl.run.weights.wire_dtype)
        n = p.agreement_seqs
        prompts = self.prompts[:n]
        gens = self.generations[:n]
        if not gens:
            from tiderl.trainer.synthetic import random_samples

            train_on = random_samples(1, n, vocab_size=int(self.actor.model.config.vocab_size),
                                      min_tokens=p.prompt_tokens + p.new_tokens,
                                      max_tokens=p.prompt_tokens + p.new_tokens)
        engine = self.engine if gens else None  # an engine that started but sampled nothing is not trusted
        versions = []
        server = WeightServer("127.0.0.1", commit_wait_s=5.0)  # the engine is on this host
        client = None
        try:
            for version in range(1, p.transfer_versions + 1):
                row: dict[str, Any] = {"version": version}
                self.release_engine()  # the step's optimizer state where the engine's cache was
                samples = self.samples(prompts, gens, version - 1) if gens else train_on
                row["train_step_s"] = round(train_step(ctx, self.actor, self.micro_batches(samples), version - 1)
                                            ["step_s"], 4)
                t0 = time.perf_counter()
                self.restore_engine()
                row["wake_s"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                state = self.actor.full_weights()  # host memory, as the leader publishes
                row["gather_s"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                staged = server.stage(version, state.items(), wire)
                server.commit(version)
                row["stage_s"] = round(time.perf_counter() - t0, 3)
                row["bytes"] = staged.nbytes
                if engine is not None:
                    t0 = time.perf_counter()
                    got = asyncio.run(engine.receive_weights(server.address, version))
                    row["receive_and_load_s"] = round(time.perf_counter() - t0, 3)
                    up = engine.last_update
                    row.update({"received_version": got, "receive_s": round(up.receive_s, 3),
                                "stall_s": round(up.stall_s, 3), "engine_bytes": up.nbytes})
                    fresh = self.generate(prompts, p.new_tokens)
                    row["after_transfer"] = _diff(*self._after(prompts, fresh, version))
                else:  # the wire alone: what an engine worker receives, then onto the device
                    if client is None:
                        from tiderl.weightsync.client import WeightClient

                        client = WeightClient(server.address)
                    t0 = time.perf_counter()
                    received = client.receive(version)
                    row["receive_s"] = round(time.perf_counter() - t0, 3)
                    t0 = time.perf_counter()
                    on_device = [t.to(ctx.device) for _, t in received.tensors]
                    synchronize(ctx)
                    row["to_device_s"] = round(time.perf_counter() - t0, 3)
                    del on_device
                parts = ("receive_and_load_s",) if engine is not None else ("receive_s", "to_device_s")
                row["total_s"] = round(sum(row[k] for k in ("gather_s", "stage_s", *parts)), 3)
                versions.append(row)
        finally:
            server.close()
        figures: dict[str, Any] = {
            "weight_sync": "transfer", "transport": TRANSPORT, "wire_dtype": str(wire).replace("torch.", ""),
            "versions": versions, "bytes": versions[-1]["bytes"],
            "seconds_per_version": round(statistics.median(v["total_s"] for v in versions), 3),
        }
        if engine is None:
            figures["path"] = "wire only (no engine): server -> WeightClient -> device"
            raise Partial(f"no engine ({self.engine_error}): the wire alone was measured", figures)
        figures["path"] = "trainer full_weights -> WeightServer -> vLLM weight-transfer backend 'tiderl' -> engine"
        figures["receive_and_load_s"] = round(statistics.median(v["receive_and_load_s"] for v in versions), 3)
        figures["after_transfer_max_abs"] = max(v["after_transfer"]["max_abs"] for v in versions)
        return figures

    def _after(self, prompts: list[list[int]], gens: list[Any], version: int) -> tuple[list[float], list[float]]:
        """The engine's log-probabilities of what it sampled on the transferred version, and the trainer's."""
        if any(g.weights_version != version for g in gens):
            raise RuntimeError(f"the engine sampled on version {[g.weights_version for g in gens]}, not {version}")
        scored = self.scored(self.micro_batches(self.samples(prompts, gens, version)))
        return scored["engine"], scored["trainer"]


def main(argv: list[str]) -> int:
    """``PROCESS WORK SIZE DEVICE MODEL_DIR EAGER``: run one process's stages (called by gpu_check.py)."""
    name, work, size, device, model_dir, eager = argv
    ctx = Context(work=Path(work), preset=PRESETS[size], device=resolve_device(device), model_dir=Path(model_dir),
                  engine_eager=eager == "1")
    run_process(name, ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
