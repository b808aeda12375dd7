"""PyTorch + transformers trainer backend (CPU with gloo here, CUDA with NCCL on GPUs).

Data parallelism is explicit: gradients are accumulated locally over all
micro-batches of a step and reduced once, by SUM, in :meth:`TorchActor.step`
(the GRPO loss is already divided by the global token count, see
``grpo.py``). Ranks may therefore hold different numbers of micro-batches,
which is what RA2P's dispatchers produce.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tiderl.trainer.backend import ActorBackend, ActorForward, OptimConfig, OptimStats, RefBackend
from tiderl.trainer.batch import MicroBatch
from tiderl.trainer import state
from tiderl.trainer.logits import output_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HostSwap:
    """Moves a module's weights between the device and a host-side copy.

    Offload copies every parameter and buffer into host buffers (pinned on
    CUDA) and releases the device storage; onload allocates device storage and
    copies back. On a CPU-only machine the "device" is host memory too, but
    the copies and (de)allocations are real, so the measured cost is the
    memory-bandwidth part of a swap.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self._module = module
        self._device = device
        self._tensors = {name: t for name, t in module.named_parameters()}
        self._tensors.update({f"buffer:{n}": b for n, b in module.named_buffers()})
        pin = device.type == "cuda"
        self._host = {n: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for n, t in self._tensors.items()}
        self._resident = True

    @property
    def is_resident(self) -> bool:
        return self._resident

    def offload(self) -> float:
        if not self._resident:
            return 0.0
        t0 = time.perf_counter()
        for name, t in self._tensors.items():
            self._host[name].copy_(t.data, non_blocking=True)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        for t in self._tensors.values():
            t.data = torch.empty(0, dtype=t.dtype, device=self._device)
        self._resident = False
        return time.perf_counter() - t0

    def onload(self) -> float:
        if self._resident:
            return 0.0
        t0 = time.perf_counter()
        for name, t in self._tensors.items():
            host = self._host[name]
            t.data = torch.empty(host.shape, dtype=host.dtype, device=self._device)
            t.data.copy_(host, non_blocking=True)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._resident = True
        return time.perf_counter() - t0


def _banned(model_path: Path) -> tuple[int, ...]:
    """The ids the engine never samples for this model: the chat format's own (a vision-language model's
    vision tokens; none for a text model)."""
    from tiderl.rollout.chat import ChatFormat, ImageTokens

    image_tokens = ImageTokens.of_model(model_path)
    if image_tokens is None:
        return ()
    from transformers import AutoTokenizer

    return ChatFormat(AutoTokenizer.from_pretrained(model_path), image_tokens).banned_ids


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`trainer.dtype` on `device`: ``auto`` is bf16 on a GPU that supports it, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"trainer dtype: {name!r} is not one of auto, {', '.join(DTYPES)}") from None


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """Compute in `dtype` with fp32 weights (nothing to do for fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def model_class(config: Any) -> Any:
    """The transformers auto class a model config builds: a vision-language model (both towers train, and both
    are published by save_pretrained) or a causal LM."""
    if getattr(config, "vision_config", None):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _load(model_path: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"trainer backend: {model_path} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig

    return model_class(AutoConfig.from_pretrained(model_path)).from_pretrained(model_path, dtype=dtype).to(device)


def _run(model: torch.nn.Module, mb: MicroBatch, device: torch.device) -> Callable[[], Any]:
    """The model's forward of `mb` (its output's ``.logits`` reduced by tiderl.trainer.logits)."""
    return lambda: model(
        input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device), use_cache=False,
        **{name: t.to(device) for name, t in mb.vision.items()},  # images through the vision tower
    )


def _logprobs(model: torch.nn.Module, mb: MicroBatch, device: torch.device, temperature: float,
              banned: tuple[int, ...] = ()) -> torch.Tensor:
    """The tokens' log-probabilities, the output layer in chunks (tiderl.trainer.logits)."""
    return output_logprobs(model, _run(model, mb, device), mb.input_ids.to(device), temperature=temperature,
                           banned=banned)[0]


def _actor_forward(model: torch.nn.Module, mb: MicroBatch, device: torch.device, temperature: float,
                   banned: tuple[int, ...] = ()) -> ActorForward:
    """The actor's log-probabilities and, from the same logits, its entropy at the trained tokens."""
    logprobs, entropy = output_logprobs(model, _run(model, mb, device), mb.input_ids.to(device),
                                        temperature=temperature, banned=banned, loss_mask=mb.loss_mask)
    assert entropy is not None
    return ActorForward(logprobs, entropy)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, grad_clip: float,
                   grad_scale: float = 1.0) -> OptimStats:
    """Scale the reduced gradients, clip them (the norm over every rank's shards for sharded ones), step,
    zero them: the update both actor backends make once their gradients are summed."""
    if grad_scale != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(grad_scale)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return OptimStats(grad_norm=float(grad_norm), lr=optimizer.param_groups[0]["lr"])


class TorchRef(RefBackend):
    def __init__(self, model_path: Path, device: torch.device, temperature: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> None:
        """Frozen: its weights are stored in the compute `dtype` (no fp32 master copy to keep)."""
        self.device = device
        self.temperature = temperature
        self.banned = _banned(model_path)
        self.model = _load(model_path, device, dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._swap = HostSwap(self.model, device)

    @property
    def is_resident(self) -> bool:
        return self._swap.is_resident

    def offload(self) -> float:
        return self._swap.offload()

    def onload(self) -> float:
        return self._swap.onload()

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if not self.is_resident:
            raise RuntimeError("reference model is offloaded; onload() it before a forward pass")
        return _logprobs(self.model, mb, self.device, self.temperature, self.banned).cpu()


class TorchActor(ActorBackend):
    def __init__(
        self,
        model_path: Path,
        device: torch.device,
        optim: OptimConfig,
        dp_group: dist.ProcessGroup | None = None,
        temperature: float = 1.0,
        dtype: torch.dtype = torch.float32,
        activation_checkpointing: bool = False,
    ) -> None:
        """fp32 weights, gradients and AdamW state; forwards and backwards compute in `dtype` (autocast)."""
        self.device = device
        self.temperature = temperature
        self.optim_config = optim
        self.dp_group = dp_group
        self.compute_dtype = dtype
        self.banned = _banned(model_path)
        self.model = _load(model_path, device).train()
        if activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, eps=optim.eps
        )
        self._swap = HostSwap(self.model, device)

    @property
    def is_resident(self) -> bool:
        return self._swap.is_resident

    def offload(self) -> float:
        return self._swap.offload()

    def onload(self) -> float:
        return self._swap.onload()

    def train_forward(self, mb: MicroBatch) -> ActorForward:
        if not self.is_resident:
            raise RuntimeError("actor model is offloaded; onload() it before a forward pass")
        with autocast(self.device, self.compute_dtype):
            return _actor_forward(self.model, mb, self.device, self.temperature, self.banned)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _reduce_gradients(self) -> None:
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        # One flat buffer: one collective per step instead of one per tensor.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            if p.grad is None:
                p.grad = flat[offset : offset + n].view_as(p).clone()
            else:  # in place: the step's peak is the gradients and one flat buffer (4 bytes a parameter)
                p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self, grad_scale: float = 1.0) -> OptimStats:
        if not self.is_resident:
            raise RuntimeError("actor model is offloaded; onload() it before the optimizer step")
        self._reduce_gradients()
        return optimizer_step(self.params, self.optimizer, self.optim_config.grad_clip, grad_scale)

    def save_weights(self, directory: Path) -> None:
        if not self.is_resident:
            raise RuntimeError("actor model is offloaded; onload() it before saving weights")
        self.model.save_pretrained(directory)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def save_checkpoint(self, directory: Path) -> None:
        state.save(self.model, self.optimizer, directory, None)  # a replica: the leader's alone

    def load_checkpoint(self, directory: Path, *, weights: bool = True) -> None:
        state.load(self.model, self.optimizer, directory, None, weights=weights)

    def take_state_from(self, src: int) -> None:
        if self.dp_group is None:
            raise RuntimeError("actor: no data-parallel group to take the state from")
        state.broadcast(self.model, self.optimizer, src, self.dp_group, self.device)


def make(
    role: str,
    model_path: Path,
    *,
    device: str = "cpu",
    optim: OptimConfig | None = None,
    dp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    dtype: str = "auto",
    activation_checkpointing: bool = False,
) -> TorchRef | TorchActor:
    """`temperature`: the sampling temperature of the trajectories trained on (rollout.temperature):
    log-probabilities are those of softmax(logits / T), as the engine's, for the actor and the ref alike.
    `dtype`: trainer.dtype (compute_dtype)."""
    dev = torch.device(device)
    compute = compute_dtype(dtype, dev)
    if role == "ref":
        return TorchRef(model_path, dev, temperature, compute)
    return TorchActor(model_path, dev, optim or OptimConfig(), dp_group, temperature, compute, activation_checkpointing)
