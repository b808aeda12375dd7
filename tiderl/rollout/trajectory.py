"""Tasks, groups and the trajectory a finished task hands to the run store."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from tiderl.envs.images import ImageLimits, PngImage, check_png

NO_VERSION = -1  # per-token version of tokens the policy did not sample (prompt, environment)
# A handed-over context's images were checked when the environment sent them; read back, they are
# checked again as PNG files, with room for a long context's worth.
PROGRESS_IMAGE_LIMITS = ImageLimits(max_images=1 << 16)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskProgress:
    """A task stopped at a turn boundary, to be carried on by another rank: its env session
    (paused, on `server`) and its context so far, token by token as in `Trajectory`. The next
    rank prefills the context afresh and continues with the next generation."""

    session_id: str
    server: str | None  # the env server URL holding the session (None: an in-process env)
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    num_prompt_tokens: int
    num_turns: int
    num_pauses: int = 0
    images: tuple[PngImage, ...] = ()
    """The context's images so far, in order (one image placeholder each in `token_ids`)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"task progress of session {self.session_id}: {name} has "
                                 f"{len(getattr(self, name))} entries for {n} tokens")

    @property
    def first_version(self) -> int | None:
        """The oldest weights version of its sampled tokens (None before the first generation)."""
        sampled = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(sampled) if sampled else None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
               for f in dataclasses.fields(self) if f.name != "images"}
        if self.images:
            out["images"] = [base64.b64encode(i.data).decode("ascii") for i in self.images]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TaskProgress":
        seqs = ("token_ids", "loss_mask", "logprobs", "versions")
        images = tuple(check_png(base64.b64decode(d), PROGRESS_IMAGE_LIMITS) for d in data.get("images", ()))
        return cls(**{k: tuple(v) if k in seqs else v for k, v in data.items() if k != "images"}, images=images)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpec:
    """One task: one prompt (env + seed + options) played once, or carried on from `progress`."""

    task_id: str
    group_id: str
    env: str
    seed: int
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    is_eval: bool = False
    eval_version: int | None = None  # evaluation tasks: the weights version they evaluate
    task_type: str = ""  # for CTB's task-diversity rule; default: the env name
    progress: TaskProgress | None = dataclasses.field(default=None, compare=False)  # handed over by another rank


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """A GRPO group: the G tasks of one prompt. Advantages need all of them."""

    group_id: str
    tasks: tuple[TaskSpec, ...]

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError(f"group {self.group_id}: tasks: a group needs at least one task")
        if any(t.group_id != self.group_id for t in self.tasks):
            raise ValueError(f"group {self.group_id}: tasks: every task must carry group_id {self.group_id!r}")

    @property
    def is_eval(self) -> bool:
        return self.tasks[0].is_eval

    @property
    def size(self) -> int:
        return len(self.tasks)


def make_group(
    group_id: str,
    env: str,
    seed: int,
    group_size: int,
    *,
    options: dict[str, Any] | None = None,
    is_eval: bool = False,
    eval_version: int | None = None,
) -> GroupSpec:
    """G tasks of the same prompt (same env, seed and options)."""
    if group_size < 1:
        raise ValueError(f"group_size: must be >= 1, got {group_size}")
    tasks = tuple(
        TaskSpec(
            task_id=f"{group_id}/{i}",
            group_id=group_id,
            env=env,
            seed=seed,
            options=dict(options or {}),
            is_eval=is_eval,
            eval_version=eval_version,
            task_type=env,
        )
        for i in range(group_size)
    )
    return GroupSpec(group_id=group_id, tasks=tasks)


@dataclasses.dataclass(kw_only=True, slots=True)
class Trajectory:
    """A finished task, token by token, exactly as the policy saw and sampled it.

    ``token_ids`` is the whole context: prompt, the sampled ids of every turn and the
    environment's answers. ``loss_mask`` is 1 exactly on sampled ids. ``logprobs`` and
    ``versions`` are the rollout logprob and the weights version of each sampled id
    (0.0 and ``NO_VERSION`` elsewhere)."""

    task: TaskSpec
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    num_prompt_tokens: int
    reward: float = 0.0
    num_turns: int = 0
    finish: str = ""  # "done" | "max_turns" | "max_context"
    num_pauses: int = 0
    env_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    env_s: float = 0.0
    """Seconds this rank waited on the environment for the task (session start and steps)."""
    images: list[PngImage] = dataclasses.field(default_factory=list)
    """The images of the context, in order: one image placeholder id each in `token_ids`, which the
    engine expands into `image_tokens` tokens."""
    image_tokens: list[int] = dataclasses.field(default_factory=list)
    """Tokens each image is in the engine (`ChatFormat.image_count`)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {self.task.task_id}: {name} has {len(getattr(self, name))} entries for {n} tokens")

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def engine_tokens(self) -> int:
        """The context's length in the engine: every image placeholder expanded into its tokens."""
        return len(self.token_ids) + sum(self.image_tokens) - len(self.image_tokens)

    def add_images(self, images: tuple[PngImage, ...] | list[PngImage], tokens: list[int]) -> None:
        if len(images) != len(tokens):
            raise ValueError(f"trajectory {self.task.task_id}: {len(tokens)} token counts for {len(images)} images")
        self.images.extend(images)
        self.image_tokens.extend(tokens)

    def append(self, ids: list[int] | tuple[int, ...], *, sampled: bool, logprobs: tuple[float, ...] = (), version: int = NO_VERSION) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(logprobs if sampled else [0.0] * len(ids))
        self.versions.extend([version if sampled else NO_VERSION] * len(ids))
        self.check()

    def to_record(self) -> dict[str, Any]:
        """Plain data for the run store."""
        return {
            "task_id": self.task.task_id,
            "group_id": self.task.group_id,
            "is_eval": self.task.is_eval,
            "eval_version": self.task.eval_version,
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "num_prompt_tokens": self.num_prompt_tokens,
            "reward": self.reward,
            "num_turns": self.num_turns,
            "finish": self.finish,
            "num_pauses": self.num_pauses,
        }
