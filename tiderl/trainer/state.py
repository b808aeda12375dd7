"""The actor's training state (weights and AdamW moments) on disk and between ranks.

- **Checkpoints are torch.distributed.checkpoint (DCP) directories.** Every rank of a sharded actor's group
  writes its own shards, in parallel, and nothing is gathered; a read re-shards onto whichever actor reads it:
  one rank reads what two wrote, or the reverse. So a checkpoint taken where ERS changes the actor ranks hands
  the state to the next set (tiderl.run.trainer_role.hand_off). Weights and moments are keyed by parameter
  name, as transformers names them, whichever backend wrote them.
- **A replica that joins the data-parallel group catches up by a broadcast** of the source's tensors, each
  into the tensor the joiner already holds (the same model and optimizer): nothing is pickled.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tiderl.paths import DISK_FULL_ERRNOS

METADATA = ".metadata"
"""The file DCP's coordinator writes last: a directory with it is a complete checkpoint."""


def is_checkpoint(directory: Path) -> bool:
    return (Path(directory) / METADATA).is_file()


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
         group: dist.ProcessGroup | None) -> None:
    """Write weights and optimizer state into `directory`. With `group`, a collective: every rank writes its
    shards, the group's first rank the metadata; without, this rank alone writes its whole state."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    try:
        with _alone(group):
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(directory), process_group=group,
                     no_dist=group is None)
    except CheckpointException as e:
        full = _disk_full(e, directory)
        if full is None:
            raise
        raise full from e


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
         group: dist.ProcessGroup | None, *, weights: bool = True) -> None:
    """Read `directory` into this actor's model and optimizer, re-sharded onto `group` (a collective with
    one). `weights=False`: the optimizer state only (the weights came from a published version)."""
    if not is_checkpoint(directory):
        raise FileNotFoundError(f"{directory}: not a checkpoint (no {METADATA})")
    model_sd, optim_sd = state_dicts(model, optimizer)  # AdamW's moments exist from here, to be read into
    state = {"optimizer": optim_sd} | ({"model": model_sd} if weights else {})
    with _alone(group):
        dcp.load(state, checkpoint_id=str(directory), process_group=group, no_dist=group is None)
    set_state_dict(model, optimizer, model_state_dict=state.get("model", {}), optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=weights))


def broadcast(model: torch.nn.Module, optimizer: torch.optim.Optimizer, src: int, group: dist.ProcessGroup,
              device: torch.device) -> None:
    """Collective over `group`: every rank's weights and optimizer state become those of global rank `src`.
    For replicas (each rank holds the whole state); tensors travel one by one through `device` (NCCL's)."""
    model_sd, optim_sd = state_dicts(model, optimizer)
    moments = optim_sd["state"]
    tensors = [model_sd[k] for k in sorted(model_sd)]
    tensors += [moments[name][k] for name in sorted(moments) for k in sorted(moments[name])
                if isinstance(moments[name][k], torch.Tensor)]
    for t in tensors:
        buf = t if t.device == device else t.to(device)
        dist.broadcast(buf, src=src, group=group)
        if buf is not t:
            t.copy_(buf)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                options: StateDictOptions | None = None) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts by parameter name (sharded tensors for a sharded model;
    `options` as torch's ``get_state_dict``'s). An optimizer that has not stepped gets its moments here, as
    torch makes them (a step of zero gradients at learning rate 0), with its step count put back to 0: zero
    moments at step 0 update as a fresh AdamW does, and every checkpoint and broadcast holds the same keys."""
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if fresh:
        for st in [*optimizer.state.values(), *optim_sd.get("state", {}).values()]:
            step = st.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                st["step"] = 0
    return model_sd, optim_sd


@contextlib.contextmanager
def _alone(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Without a group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _disk_full(e: CheckpointException, directory: Path) -> OSError | None:
    """A rank's full disk, as the OSError that tiderl.paths.when_room retries on. Every rank gets the same
    failures from DCP, so all of them retry, together."""
    for failure in e.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return OSError(exc.errno, f"checkpoint {directory}: {exc.strerror}", str(directory))
    return None
