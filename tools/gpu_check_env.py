"""The GPU check's first two stages (tools/gpu_check_stages.py): ``environment`` (torch, CUDA, the device,
NCCL, whether vLLM imports, the project's vLLM plugins made findable where tiderl is not installed) and
``model`` (a random-init Qwen2 in bf16 with a tokenizer of the tiny models' machinery)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check_context import Context, Partial
from gpu_check_meter import synchronize

PLUGIN_GROUP = "vllm.general_plugins"
# The project's vLLM plugins (pyproject.toml): a machine where tiderl is not installed lacks them.
PLUGINS = {"tiderl_vision": "tiderl.rollout.vision_compat:vllm_plugin",
           "tiderl_weights": "tiderl.rollout.vllm_transfer:register"}


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
