"""Which config keys `tiderl run --resume RUN_DIR --set KEY=VALUE` may change, and the changes an override makes.

A resumed run carries on from its store, its weights and its trainer checkpoint, all made under the config
the run was created with. A key may change on resume only where every process of the run can take the new
value from the next launch on without contradicting what is already there: how long the run goes on
(`trainer.num_steps`, never below the version already published), the optimizer's step size and clip, how
often it evaluates and checkpoints and how much it keeps, liveness and monitoring thresholds, the store's
waits, where the env servers are. Every other key is refused with the reason: the model, the tokenizer and
chat format (the weights and the recorded tokens were made by them), the environment and its options (the
tasks, sessions and rewards in the store), the ranks and their split (`launch.num_ranks`, `trainer.actor_ranks`:
the plans, trainer groups and sharded checkpoints name them),
the store's location, `system`, the seed and the group shape (the task feed), `slurm:` (fixed when the job
was submitted).

An allow-list rather than a deny-list: a key added later is refused on resume until someone decides
otherwise here.

A fork (`tiderl run --resume RUN_DIR --fork NEW_DIR`) is a new run: its own store, groups, ranks and plans, so
every key may change there but those the checkpoint it starts from was made with (`FORK_REFUSED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiderl.config.schema import to_dict

# Keys that may change on resume (a trailing "." allows the whole section), each with why it may.
RESUMABLE: dict[str, str] = {
    "trainer.num_steps": "how long the run goes on (at least the version already published)",
    "trainer.lr": "the optimizer's step size from the next step on",
    "trainer.lr_schedule": "the learning-rate schedule, a function of the step's version",
    "trainer.lr_final_ratio": "the learning-rate schedule, a function of the step's version",
    "trainer.lr_warmup_steps": "the learning-rate schedule, a function of the step's version",
    "trainer.grad_clip": "the gradient clip from the next step on",
    "trainer.kl_coef": "the KL weight from the next step on",
    "trainer.checkpoint_every": "how often the optimizer state is checkpointed",
    "trainer.keep_checkpoints": "how many checkpoints are kept",
    "trainer.keep_versions": "how many weight versions are kept",
    "trainer.backend": "checkpoints are DCP's, keyed by parameter name: either backend reads them, re-sharded",
    "rollout.eval_every_steps": "the evaluation cadence of the versions still to come",
    "launch.heartbeat_s": "liveness of the processes of the next launch",
    "launch.heartbeat_timeout_s": "liveness of the processes of the next launch",
    "launch.restarts": "how often the next launch restarts a process that dies",
    "monitor.": "stall and mismatch thresholds, metrics endpoints and figures",
    "store.busy_timeout_s": "how long a process waits on the store",
    "store.max_retries": "how often a process retries the store",
    "store.disk_full_wait_s": "how long a process waits for disk space",
    "store.outage_wait_s": "how long a process waits for the store to come back",
    "env.servers": "env servers are started (or found) anew at each launch",
    "env.num_servers": "env servers are started anew at each launch",
    "env.request_timeout_s": "a request's timeout on the env servers of the next launch",
    "env.max_retries": "retries of a request to the env servers of the next launch",
}

# Why the most likely refused keys may not change (a prefix ending in "." covers its section); others get
# DEFAULT_REASON.
REFUSED_BECAUSE: dict[str, str] = {
    "system": "the run's plans, staleness bound and roles were made for it",
    "name": "it names the run directory and the store's run",
    "seed": "the task feed and the evaluation prompts already in the store were drawn with it",
    "model.": "the run's weights and the tokens in its store were made with this model, tokenizer and chat format",
    "env.": "the tasks, sessions and rewards in the run's store were made by this environment and its options",
    "launch.num_ranks": "the run's plans, roles and trainer groups name its ranks",
    "launch.rollout_fraction": "the run's plans and roles were made for this split",
    "trainer.actor_ranks": "the actor group and its (sharded) checkpoints were made for these ranks",
    "store.": "the run's store is where it is: moving it is not a resume",
    "slurm.": "fixed when the job was submitted: a resume submits nothing",
    "rollout.group_size": "the groups in the run's store have this many tasks",
}
DEFAULT_REASON = "the run's store, weights and groups were made with the old value"

# Keys a fork may not change, with why (a prefix ending in "." covers its section).
FORK_REFUSED: dict[str, str] = {
    "model.": "the checkpoint the fork starts from holds this model's weights, trained with its tokenizer and chat "
              "format",
}


@dataclass(frozen=True)
class Change:
    """One key an override changes: its dotted name, the old and the new value (plain YAML data)."""

    key: str
    old: Any
    new: Any

    def text(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def changes(old: Any, new: Any) -> list[Change]:
    """The leaf keys whose values differ between two job configs, in the config's order."""
    found: list[Change] = []
    _diff(to_dict(old), to_dict(new), "", found)
    return found


def _diff(old: Any, new: Any, prefix: str, out: list[Change]) -> None:
    if isinstance(old, dict) and isinstance(new, dict) and prefix != "env.options" \
            and prefix != "model.chat_template_kwargs":
        for k in list(old) + [k for k in new if k not in old]:
            _diff(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k), out)
    elif old != new:
        out.append(Change(prefix, old, new))


def _match(key: str, table: dict[str, str]) -> str | None:
    for pattern, why in table.items():
        if key == pattern or (pattern.endswith(".") and key.startswith(pattern)):
            return why
    return None


def refusal(change: Change) -> str | None:
    """Why `change` may not be made on resume; None when it may."""
    if _match(change.key, RESUMABLE) is not None:
        return None
    return _match(change.key, REFUSED_BECAUSE) or DEFAULT_REASON


def fork_refusal(change: Change) -> str | None:
    """Why `change` may not be made on a fork; None when it may."""
    return _match(change.key, FORK_REFUSED)


def override_of(change: Change, overrides: list[str]) -> str | None:
    """The `--set` among `overrides` that made `change` (`env.options.high=3` changes `env.options`), if any."""
    for given in overrides:
        key = given.partition("=")[0].strip()
        if key == change.key or change.key.startswith(key + ".") or key.startswith(change.key + "."):
            return given
    return None


def resumable_keys() -> list[str]:
    """The keys (and sections, as `monitor.*`) that may change on resume, for messages and docs."""
    return [k + "*" if k.endswith(".") else k for k in RESUMABLE]
