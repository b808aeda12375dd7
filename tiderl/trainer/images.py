"""A trajectory's images on the trainer's side (a vision-language model).

The rollout context holds one ``<|image_pad|>`` id per image, which the engine expands into the
image's tokens (docs/rollout.md, "Images"). The trainer must score exactly the context the engine
saw: :meth:`ImageInputs.expand` turns a sample's placeholders into as many image tokens as the
model's image processor makes of the picture (its ``image_grid_thw``: t x h x w patches, one
token per merge x merge of them), with loss mask 0, rollout log-probability 0 and no version on
the added positions, and carries the pixel values and the grid with the sample; the actor and the
reference then run the vision tower on them (:mod:`tiderl.trainer.torch_backend`). The 3-D rotary
positions of Qwen2-VL are computed from ``token_types`` (1 on image tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiderl.envs.images import ImageLimits, check_png
from tiderl.rollout.chat import IMAGE_PAD, VISION_END, VISION_START, ImageTokens, placeholder_spans
from tiderl.trainer.batch import SampleImages, TrainSample

# The images of a stored trajectory were checked when the environment sent them; read back, they are
# checked again as PNG files, with room for a long context's worth.
STORED_IMAGE_LIMITS = ImageLimits(max_images=1 << 16)


class ImageInputs:
    """The model's image processor and image placeholder id."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoProcessor

        from tiderl.rollout.vision_compat import allow_processors_without_torchvision

        allow_processors_without_torchvision()
        processor = AutoProcessor.from_pretrained(model_dir)
        self.image_processor: Any = processor.image_processor
        self.merge_size = int(self.image_processor.merge_size)
        self.image_pad_id = int(processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD))
        vocab = processor.tokenizer.get_vocab()
        self.vision_ids = (vocab.get(VISION_START), vocab.get(VISION_END))

    def placeholder_spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """Where each image placeholder of `ids` lies (`tiderl.rollout.chat.placeholder_spans`)."""
        return placeholder_spans(ids, self.image_pad_id, *self.vision_ids)

    @classmethod
    def of_model(cls, model_dir: str | Path) -> "ImageInputs | None":
        """None for a model without an image processor (a text model). Loaded once per model directory
        in a process (the leader asks at every step with images)."""
        return _inputs_of(str(Path(model_dir).resolve()))

    def expand(self, sample: TrainSample, pngs: Sequence[bytes]) -> TrainSample:
        """`sample` with each image placeholder expanded into the image's tokens, and the pixels."""
        pads = sum(1 for t in sample.token_ids if t == self.image_pad_id)
        if pads != len(pngs):
            raise ValueError(f"trajectory {sample.trajectory_id}: {pads} image placeholders for {len(pngs)} images")
        if not pngs:
            return sample
        pictures = [check_png(p, STORED_IMAGE_LIMITS).to_pil() for p in pngs]
        out = self.image_processor(images=pictures, return_tensors="pt")
        grid = out["image_grid_thw"]
        counts = [int(n) // (self.merge_size ** 2) for n in grid.prod(dim=-1)]
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        types: list[int] = []
        image = 0
        for token, m, lp, v in zip(sample.token_ids, sample.loss_mask, sample.rollout_logprobs,
                                   sample.token_versions):
            if token == self.image_pad_id:
                n = counts[image]
                image += 1
                ids += [token] * n
                mask += [0] * n
                logprobs += [0.0] * n
                versions += [-1] * n
                types += [1] * n
            else:
                ids.append(token)
                mask.append(m)
                logprobs.append(lp)
                versions.append(v)
                types.append(0)
        return replace(sample, token_ids=tuple(ids), loss_mask=tuple(mask), rollout_logprobs=tuple(logprobs),
                       token_versions=tuple(versions),
                       images=SampleImages(pixel_values=out["pixel_values"], grid_thw=grid, token_types=tuple(types)))


@functools.lru_cache(maxsize=4)
def _inputs_of(model_dir: str) -> ImageInputs | None:
    return ImageInputs(model_dir) if ImageTokens.of_model(model_dir) is not None else None
