"""The trainer-backend interface: what the GRPO step and the RA2P modes need from a framework.

Two roles, each behind a small abstract class:
- :class:`RefBackend`: frozen reference model, forward only (``ref_logprobs``);
- :class:`ActorBackend`: the trained policy: forward with a graph, backward of
  a loss built elsewhere (so the loss can wait for ``ref_logprobs``, RA2P's
  deferred loss), optimizer step with data-parallel gradient reduction and
  clipping, weight export, checkpoint state.
Both can be swapped out of the accelerator and back (``offload``/``onload``),
which is what colocated RA2P and the vanilla-streaming baselines pay for.

The PyTorch/transformers backends implement both: ``torch`` replicates the actor on every
data-parallel rank, ``fsdp`` shards it (FSDP2). A Megatron-Core
backend for GPU clusters implements the same two classes and registers a
name in :data:`BACKENDS`; nothing above this interface changes.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiderl.trainer.batch import MicroBatch
from tiderl.trainer.registry import BACKENDS, BUILTIN, SHARDED  # noqa: F401  (the registry, without torch)


class UnknownBackendError(ValueError):
    """A trainer backend name that is not registered."""


@dataclass(frozen=True, slots=True)
class OptimConfig:
    """AdamW and clipping settings of the actor."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass(frozen=True, slots=True)
class OptimStats:
    grad_norm: float
    lr: float


@dataclass(frozen=True, slots=True)
class ActorForward:
    """The actor's forward of a micro-batch: what its loss and its step statistics need of the logits."""

    logprobs: torch.Tensor
    """``[B, T-1]`` log-probabilities of the tokens, with the autograd graph kept for the backward."""
    entropy: torch.Tensor
    """``[B, T-1]`` entropy (nats) of the policy where the loss mask is set, 0 elsewhere; no graph
    (tiderl.trainer.grpo.token_entropy)."""


class SwappableModel(ABC):
    """A model that can leave the accelerator for host memory and come back."""

    @abstractmethod
    def offload(self) -> float:
        """Move the weights to host memory and free them on the device; returns seconds spent."""

    @abstractmethod
    def onload(self) -> float:
        """Bring the weights back onto the device; returns seconds spent."""

    @property
    @abstractmethod
    def is_resident(self) -> bool:
        """Whether the weights are on the device (forward passes are possible)."""


class RefBackend(SwappableModel):
    @abstractmethod
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """``[B, T-1]`` logprobs of the micro-batch's tokens, no graph, on the host."""


class ActorBackend(SwappableModel):
    lockstep: bool = False
    """Whether every rank of the data-parallel group must run the same number of forward and backward
    passes in a step (a sharded backend's collectives run inside them; tiderl.trainer.modes pads)."""
    collective_io: bool = False
    """Whether :meth:`save_weights`, :meth:`full_weights` and the checkpoints are collectives over the group:
    every rank calls them (a sharded backend gathers the full weights onto the group's first rank, and every
    rank writes its shards of a checkpoint)."""

    @abstractmethod
    def train_forward(self, mb: MicroBatch) -> ActorForward:
        """The forward the GRPO step trains on: the micro-batch's logprobs, with the autograd graph kept for a
        later :meth:`backward`, and the policy's entropy at its trained tokens, from the same logits."""

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        """``[B, T-1]`` logprobs with the autograd graph kept for a later :meth:`backward` (:meth:`train_forward`'s)."""
        return self.train_forward(mb).logprobs

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss`` (no reduction across ranks yet)."""

    @abstractmethod
    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer steps (a schedule's value for this step)."""

    @abstractmethod
    def step(self, grad_scale: float = 1.0) -> OptimStats:
        """Reduce gradients over the data-parallel group (SUM), multiply them by ``grad_scale`` (a streamed
        step divided its losses by a provisional normalizer), clip, AdamW step, zero grads."""

    @abstractmethod
    def save_weights(self, directory: Path) -> None:
        """Write the model config and safetensors weights into ``directory`` (HF layout)."""

    @abstractmethod
    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full weights by parameter name (for a :attr:`collective_io` backend a collective: the group's
        first rank gets them, the others an empty dict)."""

    @property
    def checkpoint_group(self) -> Any:
        """The process group a checkpoint is written and read over (None: this rank alone)."""
        return None

    @abstractmethod
    def save_checkpoint(self, directory: Path) -> None:
        """Write weights and optimizer state into `directory` as a DCP checkpoint (tiderl.trainer.state): for
        a :attr:`collective_io` backend every rank of the group writes its shards into the same directory."""

    @abstractmethod
    def load_checkpoint(self, directory: Path, *, weights: bool = True) -> None:
        """Read a DCP checkpoint whichever ranks wrote it (re-sharded onto this actor's group; collective for
        a :attr:`collective_io` backend). `weights=False`: the optimizer state only."""

    @abstractmethod
    def take_state_from(self, src: int) -> None:
        """Collective over the data-parallel group: this rank's weights and optimizer state become global
        rank `src`'s (a replica that joined the group catches up)."""


def make_backend(name: str, role: str, model_path: str | Path, **options: Any) -> RefBackend | ActorBackend:
    """Build the ``role`` (``actor`` or ``ref``) backend registered as ``name``."""
    if role not in ("actor", "ref"):
        raise ValueError(f"make_backend: role must be 'actor' or 'ref', got {role!r}")
    try:
        target = BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise UnknownBackendError(f"unknown trainer backend {name!r} (known: {known})") from None
    module_name, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(role, Path(model_path), **options)
