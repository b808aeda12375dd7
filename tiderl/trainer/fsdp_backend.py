"""FSDP2 trainer backend (``trainer.backend: fsdp``): the actor sharded over its data-parallel group.

Each decoder layer, and then the whole model, is wrapped by ``fully_shard``: weights, gradients and
AdamW state live as shards of the group (a rank holds 1/N of each), and a layer's full weights exist
only while it computes. Per rank and parameter that is 16/N bytes of fp32 state instead of the 16 the
replicated ``torch`` backend holds (tools/bench_trainer.py measures both).

- Loading: only the group's first rank reads the model's files; the others build its skeleton on the meta
  device and receive their shards from it, one parameter at a time (``_shards_from_first_rank``), so a
  node's actor ranks do not each hold (and read from the shared filesystem) a whole fp32 copy while they build.
- Precision: fp32 sharded weights and optimizer state (``set_dtype``: ``bfloat16`` computes in bf16
  where the device supports it, ``MixedPrecisionPolicy``); gradients are reduced in fp32.
- Gradients are *summed* over the group, as the GRPO loss expects (it is divided by the global token
  count, tiderl.trainer.grpo): every FSDP module has a divide factor of 1, and on gloo (which has no
  pre/post-scaled reduce-scatter) the reduction is forced to SUM.
- Lockstep: FSDP's all-gathers and reduce-scatters run inside each forward and backward, so every rank
  of the group must run the same number of them. The RA2P modes give ranks unequal shares of a step; a
  rank with fewer micro-batches runs padding passes (another rank's micro-batch, loss times zero) until
  the shares are even (``lockstep``, tiderl.trainer.modes).
- Activation checkpointing (transformers' gradient checkpointing, non-reentrant) recomputes each layer in
  the backward instead of keeping its activations (``activation_checkpointing``).
- Publishing and checkpoints are collectives (``collective_io``). Publishing gathers the full weights onto
  the group's first rank (in host memory), which writes them; a retry of the write after a full disk reuses
  what was gathered. A checkpoint is DCP's (tiderl.trainer.state): every rank writes its own shards, and a
  read re-shards onto the group that reads it, whatever its size.
- The reference model is frozen and replicated (2 or 4 bytes a parameter, no gradients or moments).

Without a group (one actor) nothing is sharded: the model computes in the same precision on one rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from tiderl.trainer import state
from tiderl.trainer.backend import ActorBackend, ActorForward, OptimConfig, OptimStats
from tiderl.trainer.batch import MicroBatch
from tiderl.trainer.torch_backend import (HostSwap, TorchRef, _actor_forward, _banned, _load, autocast,
                                         compute_dtype, model_class, optimizer_step, set_lr)

def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, each sharded on its own: the modules that transformers itself keeps
    whole (``_no_split_modules``: the decoder layer, and a vision-language model's vision blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"fsdp backend: {type(model).__name__} names no decoder layer class (_no_split_modules)")
    return layers


def _skeleton(model_path: Path) -> torch.nn.Module:
    """The model of `model_path`'s config on the meta device: its structure, tied weights included, and no
    storage, read nor allocated."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return model_class(config).from_config(config, dtype=torch.float32)


def _shards_from_first_rank(model: torch.nn.Module, full: dict[str, torch.Tensor], group: dist.ProcessGroup,
                            mesh: DeviceMesh) -> None:
    """Fill a sharded model, on its device, from the group's first rank, the only one that read the weights
    (`full`, {} on the others): one parameter at a time, each rank receives its shard of it (`distribute_tensor`
    from the mesh's first rank), and every buffer, those the state dict leaves out too (a rotary embedding's
    frequencies), is sent whole. So the group's ranks hold one full copy of the model between them while they
    build, not one each, and only one rank reads the files. (torch's `broadcast_from_rank0` sends from the
    world's rank 0 over every rank; an actor group is any set of a run's ranks.)"""
    from torch.distributed.tensor import DTensor, distribute_tensor

    first = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor):
                raise TypeError(f"fsdp backend: parameter {name} was not sharded")
            local = param.to_local()
            whole = full[name].to(local.device, local.dtype) if name in full else \
                torch.empty(param.shape, dtype=local.dtype, device=local.device)
            local.copy_(distribute_tensor(whole, mesh, param.placements).to_local())
        for buffer in model.buffers():
            dist.broadcast(buffer, src=first, group=group)


class FsdpActor(ActorBackend):
    lockstep = True
    collective_io = True

    def __init__(self, model_path: Path, device: torch.device, optim: OptimConfig, dp_group: dist.ProcessGroup | None,
                 temperature: float = 1.0, *, dtype: str = "auto", activation_checkpointing: bool = False) -> None:
        self.device = device
        self.temperature = temperature
        self.optim_config = optim
        self.banned = _banned(model_path)
        self.compute_dtype = compute_dtype(dtype, device)
        self._group = dp_group if dp_group is not None and dist.get_world_size(dp_group) > 1 else None
        self.read_weights = self._group is None or dist.get_rank(self._group) == 0
        """Whether this rank read the model's weights files: only the group's first rank does (the others
        build the model's skeleton and receive their shards from it)."""
        # fp32: the sharded master weights
        model = (_load(model_path, torch.device("cpu")) if self.read_weights else _skeleton(model_path)).train()
        if activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self._group is not None:
            full = model.state_dict() if self.read_weights else {}  # the first rank's whole tensors, to send
            mesh = DeviceMesh.from_group(self._group, device.type)
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            gloo = dist.get_backend(self._group) == "gloo"
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)  # summed: the loss is already a global token mean
                    if gloo:
                        module.set_force_sum_reduction_for_comms(True)
            if self.read_weights:
                model.to(device)
            else:
                model.to_empty(device=device)  # storage for this rank's shards and the buffers, to be filled
            _shards_from_first_rank(model, full, self._group, mesh)
            del full
        self.model = model.to(device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        self.local_params = sum(t.numel() for t in local)
        """The parameters whose weights, gradients and moments this rank holds."""
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay, eps=optim.eps)
        # Unsharded, the host copy's swap (tiderl.trainer.torch_backend); sharded, FSDP moves its own shards.
        self._swap = HostSwap(self.model, device) if self._group is None else None
        self._resident = True
        self._steps = 0
        self._gathered: dict[str, tuple[int, Any]] = {}  # what a collective gathered, by kind, for a retry

    # ---- the group the state is sharded over ------------------------------------------------------
    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group

    @dp_group.setter
    def dp_group(self, group: dist.ProcessGroup | None) -> None:
        same = group is self._group or (group is None or dist.get_world_size(group) == 1) and self._group is None
        if not same:
            raise RuntimeError("fsdp backend: the actor's state is sharded over the group it was built with; "
                               "a different data-parallel group needs a new actor")

    @property
    def is_resident(self) -> bool:
        return self._swap.is_resident if self._swap is not None else self._resident

    def offload(self) -> float:
        if self._swap is not None:
            return self._swap.offload()
        return self._move(False)

    def onload(self) -> float:
        if self._swap is not None:
            return self._swap.onload()
        return self._move(True)

    def _move(self, resident: bool) -> float:
        if resident == self._resident:
            return 0.0
        t0 = time.perf_counter()
        self.model.to(self.device if resident else torch.device("cpu"))  # a no-op on a CPU device
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._resident = resident
        return time.perf_counter() - t0

    def train_forward(self, mb: MicroBatch) -> ActorForward:
        if not self.is_resident:
            raise RuntimeError("actor model is offloaded; onload() it before a forward pass")
        # Sharded, the mixed-precision policy casts; unsharded, autocast computes in the same dtype.
        with autocast(self.device, torch.float32 if self._group is not None else self.compute_dtype):
            return _actor_forward(self.model, mb, self.device, self.temperature, self.banned)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self, grad_scale: float = 1.0) -> OptimStats:
        if not self.is_resident:
            raise RuntimeError("actor model is offloaded; onload() it before the optimizer step")
        # FSDP reduced (summed) each gradient into its shard in the backward passes.
        stats = optimizer_step(self.params, self.optimizer, self.optim_config.grad_clip, grad_scale)
        self._steps += 1
        return stats

    # ---- publishing and checkpoints: collectives over the group -----------------------------------
    def _writes(self) -> bool:
        return self._group is None or dist.get_rank(self._group) == 0

    def _gather(self, kind: str, gather: Any) -> Any:
        """`gather()` once per optimizer step and kind: a write retried after a full disk reuses it (the
        other ranks took part once)."""
        held = self._gathered.get(kind)
        if held is None or held[0] != self._steps:
            self._gathered = {k: v for k, v in self._gathered.items() if v[0] == self._steps}
            held = self._gathered[kind] = (self._steps, gather())
        return held[1]

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights on the group's first rank (host memory), {} elsewhere. Collective."""
        if not self.is_resident:
            raise RuntimeError("actor model is offloaded; onload() it before gathering its weights")
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return self._gather("weights", lambda: get_model_state_dict(self.model, options=options))

    def save_weights(self, directory: Path | None) -> None:
        """Write config and safetensors weights into `directory` on the group's first rank; the other
        ranks take part in the gather with ``directory`` None. Collective."""
        state = self.full_weights()
        if self._writes():
            if directory is None:
                raise ValueError("fsdp backend: the group's first rank writes the weights: it needs a directory")
            self.model.save_pretrained(directory, state_dict=state)

    @property
    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The group a checkpoint is written and read over (None: this rank alone, unsharded)."""
        return self._group

    def save_checkpoint(self, directory: Path) -> None:
        """Every rank of the group writes its shards of the weights and AdamW moments into `directory`
        (tiderl.trainer.state: DCP, nothing gathered). Collective."""
        if not self.is_resident:
            raise RuntimeError("actor model is offloaded; onload() it before a checkpoint")
        state.save(self.model, self.optimizer, directory, self._group)

    def load_checkpoint(self, directory: Path, *, weights: bool = True) -> None:
        """Read a checkpoint whatever group wrote it, re-sharded onto this one. Collective."""
        state.load(self.model, self.optimizer, directory, self._group, weights=weights)

    def take_state_from(self, src: int) -> None:
        raise RuntimeError("fsdp backend: a sharded actor's state is not a replica to broadcast; every member "
                           "of the group builds from the same published version and checkpoint")


def make(role: str, model_path: Path, *, device: str = "cpu", optim: OptimConfig | None = None,
         dp_group: dist.ProcessGroup | None = None, temperature: float = 1.0, dtype: str = "auto",
         activation_checkpointing: bool = False) -> TorchRef | FsdpActor:
    """The actor sharded over `dp_group`; the reference model replicated (tiderl.trainer.torch_backend's)."""
    dev = torch.device(device)
    if role == "ref":
        return TorchRef(model_path, dev, temperature, compute_dtype(dtype, dev))
    return FsdpActor(model_path, dev, optim or OptimConfig(), dp_group, temperature, dtype=dtype,
                     activation_checkpointing=activation_checkpointing)
