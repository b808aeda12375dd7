"""The trainer backends by name, importable without torch (`tiderl config` and `tiderl submit` check a job's
`trainer.backend` before anything heavy is loaded)."""

from __future__ import annotations

BACKENDS: dict[str, str] = {
    "torch": "tiderl.trainer.torch_backend:make",
    "fsdp": "tiderl.trainer.fsdp_backend:make",
}
"""name -> "module:factory"; the factory takes (role, model_path, **options). A plugin registers its own."""

BUILTIN: frozenset[str] = frozenset(BACKENDS)
"""The backends TideRL ships: their modules import wherever TideRL's dependencies do."""

SHARDED: frozenset[str] = frozenset({"fsdp"})
"""Backends whose actor shards its state over the data-parallel group: it is built inside the group, and
built again in the next one when the group changes (tiderl.run.trainer_role)."""
