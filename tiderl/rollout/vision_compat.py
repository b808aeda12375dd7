"""Qwen2-VL's processor where torchvision is missing: images through the PIL backend, no videos.

transformers (5.x) builds every Qwen-VL processor with a video processor, and its video
processors all need torchvision; without torchvision, `Qwen2VLProcessor(...)` and
`Qwen2VLProcessor.from_pretrained(...)` fail (`VIDEO_PROCESSOR_MAPPING has no attribute
'_extra_content'`; upstream: huggingface/transformers#43986, #48556), although the image path
(`Qwen2VLImageProcessorPil`) needs only PIL. vLLM loads the processor the same way, so an
image-only vision-language model could not run either.

CPU machines here have no torchvision: PyPI's builds of it fail to import beside the CPU build
of torch (`operator torchvision::nms does not exist`), and the setup removes them.

`allow_processors_without_torchvision()` closes the gap where (and only where) torchvision is
missing: the processor's video slot gets `ImagesOnlyVideoProcessor`, which refuses videos with
a clear error, and the module of Qwen2-VL's torchvision image processor (which vLLM's Qwen-VL
models import `smart_resize` from) is the PIL image processor's module. Images are processed
by transformers' own `Qwen2VLImageProcessorPil` (resizing may differ in detail from the
torchvision backend; the trainer and vLLM use the same one here).

It must run in every process that builds a processor: the trainer, and vLLM's front end,
engine core and workers. vLLM starts its processes by spawning, and they do not run the module
that built the engine, so TideRL registers `vllm_plugin` as a vLLM general plugin (entry point
`tiderl_vision` in the `vllm.general_plugins` group, pyproject.toml): vLLM loads it in every
process it starts, and for an engine built for images (`VllmEngine(max_images=N)` sets
`TIDERL_VLLM_VISION=1`, which those processes inherit) it applies the patch and
`register_vl_models_with_vllm()`. vLLM also needs `limit_mm_per_prompt={"image": N, "video": 0}`.

The same plugin keeps every image's pixels with a request that the engine core schedules
(`keep_image_data_for_resumed_requests`): a weight update resumes requests whose images the prefix
cache covered when they started, and they need the vision tower again. The scheduler runs in the
engine core, which loads the plugin itself (in its own process or in this one), so nothing else
calls it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_applied = False
VISION_ENV = "TIDERL_VLLM_VISION"  # "1": this process and its children serve a vision-language engine


class VideosNeedTorchvisionError(RuntimeError):
    """A video was given to a processor built without torchvision."""


def allow_processors_without_torchvision() -> bool:
    """Patch transformers so that Qwen-VL processors build without torchvision (idempotent).
    Returns True if the patch is in force, False where torchvision is installed (nothing to do)."""
    global _applied
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return False
    if _applied:
        return True
    import importlib

    from transformers import processing_utils
    from transformers.video_processing_utils import VideoProcessorMixin

    # The module itself: `from transformers.models.auto import ...` hands out a stand-in without torchvision.
    video_processing_auto = importlib.import_module("transformers.models.auto.video_processing_auto")

    class ImagesOnlyVideoProcessor(VideoProcessorMixin):
        """Fills a processor's video slot where torchvision is missing; refuses videos."""

        def preprocess(self, videos: Any, **kwargs: Any) -> Any:
            raise VideosNeedTorchvisionError("videos need torchvision, which is not installed; images work without it")

        def to_dict(self) -> dict[str, Any]:
            return {}

        def save_pretrained(self, *args: Any, **kwargs: Any) -> list[str]:
            return []  # nothing to save: a real video processor is built where torchvision is installed

    def images_only(cls: Any, *args: Any, **kwargs: Any) -> ImagesOnlyVideoProcessor:
        return ImagesOnlyVideoProcessor()

    # The processor checks each part's class by name on the transformers module, where this
    # name is only exported with torchvision.
    setattr(processing_utils.transformers_module, "VideoProcessorMixin", VideoProcessorMixin)
    video_processing_auto.AutoVideoProcessor.from_pretrained = classmethod(images_only)  # type: ignore[assignment]
    # vLLM's Qwen-VL models import `smart_resize` from the torchvision image processor's module,
    # which cannot be imported without torchvision; the PIL module defines the same function.
    sys.modules.setdefault(
        "transformers.models.qwen2_vl.image_processing_qwen2_vl",
        importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"),
    )
    _applied = True
    return True


def images_only_video_processor() -> Any:
    """A video-processor placeholder for building a processor by hand (after the patch)."""
    import importlib

    auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    return auto.AutoVideoProcessor.from_pretrained("")


def register_vl_models_with_vllm() -> None:
    """Register vLLM's own Qwen2-VL class with vLLM's model registry as an imported class.

    vLLM inspects a lazily registered architecture by importing it in a fresh Python
    subprocess, where `allow_processors_without_torchvision` has not run and the import
    fails without torchvision; an imported class is inspected in this process instead. Call
    it after `allow_processors_without_torchvision()` and before building the engine."""
    if not allow_processors_without_torchvision():
        return
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    ModelRegistry.register_model("Qwen2VLForConditionalGeneration", Qwen2VLForConditionalGeneration)


def keep_image_data_for_resumed_requests() -> bool:
    """Send every image's data to the workers with a request, also where the prefix cache covers it.

    vLLM (0.32) strips the pixels of an image whose tokens the prefix cache holds when a request is first
    scheduled (`strip_covered_mm_data`): no encoder run is needed then. The worker keeps the request's
    features as they arrived, and a request that is preempted and resumed reuses them. A weight update
    preempts every running request and drops the prefix cache (`reset_prefix_cache(reset_running_requests=
    True)`), so a resumed request whose image was covered needs the vision tower again and finds no pixels:
    the worker's assertion "Expected number of multimodal embeddings ... got 0" kills the engine. (A request
    preempted for room and resumed after its cached blocks were evicted meets the same.) Keeping the data
    costs sending each image to the workers with every new request, which vLLM did before it stripped them.
    Returns whether vLLM had the function to replace (a later vLLM without it needs nothing)."""
    try:
        from vllm.v1.core.sched import output
    except ImportError:
        return False
    if not hasattr(output, "strip_covered_mm_data"):
        return False

    def keep(mm_features: Any, num_computed_tokens: int, uses_mrope: bool = False) -> Any:
        return mm_features

    output.strip_covered_mm_data = keep
    return True


def vllm_plugin() -> None:
    """vLLM general plugin: in every process vLLM starts for an engine built for images (VISION_ENV),
    the processor patch, Qwen2-VL's registration and the images kept for resumed requests (the engine core
    schedules them); nothing for a text engine."""
    if os.environ.get(VISION_ENV) == "1":
        register_vl_models_with_vllm()
        keep_image_data_for_resumed_requests()
