"""Tasks, groups and the trajectory a finished task hands to the run store."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from tiderl.envs.images import ImageLimits, PngImage, check_png

NO_VERSION = -1  # per-token version of tokens the policy did not sample (prompt, environment)
# A handed-over context's images were checked when the environment sent them; read back, they are
# checked again as PNG files, with room for a long context's worth.
PROGRESS_IMAGE_LIMITS = ImageLimits(max_images=1 << 16)

T = TypeVar("T")
Prune = tuple[int, int]
"""A prune of the sliding image window: (at, dropped): from position `at` of the task's whole id stream on, the
context holds the images after the oldest `dropped` (their placeholders left it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """One part of a trajectory that the sliding image window split: the context the engine saw for its turns.

    The part is the whole stream's ids ``[0, end)`` without the placeholders of the oldest `dropped` images;
    it trains the ids ``[start, end)`` (the earlier ones were trained in the parts before)."""

    start: int
    end: int
    dropped: int


def window_segments(num_tokens: int, prunes: Sequence[Prune]) -> list[Segment]:
    """The parts of a stream of `num_tokens` ids that `prunes` split (one part when it was never pruned)."""
    cuts = [0, *(at for at, _ in prunes), num_tokens]
    dropped = [0, *(d for _, d in prunes)]
    for i, (at, d) in enumerate(prunes):
        if not (cuts[i] < at < num_tokens and d > dropped[i]):
            raise ValueError(f"prunes[{i}]: ({at}, {d}) must be after the previous one ({cuts[i]}, {dropped[i]}), "
                             f"drop more images and lie inside the {num_tokens} ids")
    return [Segment(start=cuts[i], end=cuts[i + 1], dropped=dropped[i]) for i in range(len(dropped))]


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentView:
    """One part's ids as the trainer takes them: the earlier parts' ids carried with loss mask 0."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    images: range  # indices of the task's images in the part's context


def segment_view(seg: Segment, spans: Sequence[tuple[int, int]], token_ids: Sequence[int], loss_mask: Sequence[int],
                 logprobs: Sequence[float], versions: Sequence[int]) -> SegmentView:
    """Part `seg` of a trajectory whose images' placeholders lie at `spans`: the context the engine saw for the
    part's turns (the pruned placeholders left out), trained on the part's own sampled ids only."""
    carried = range(seg.start)
    drop = spans[:seg.dropped]
    return SegmentView(
        token_ids=drop_spans(token_ids[:seg.end], drop),
        loss_mask=drop_spans([0] * len(carried) + list(loss_mask[seg.start:seg.end]), drop),
        logprobs=drop_spans([0.0] * len(carried) + list(logprobs[seg.start:seg.end]), drop),
        versions=drop_spans([NO_VERSION] * len(carried) + list(versions[seg.start:seg.end]), drop),
        images=range(seg.dropped, sum(1 for s, _ in spans if s < seg.end)))


def drop_spans(seq: Sequence[T], spans: Sequence[tuple[int, int]]) -> list[T]:
    """`seq` without the positions in `spans` (sorted, disjoint [start, end) ranges)."""
    out: list[T] = []
    at = 0
    for start, end in spans:
        out.extend(seq[at:start])
        at = end
    out.extend(seq[at:])
    return out


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
    """The task's images so far, in order (one image placeholder each in `token_ids`)."""
    prunes: tuple[Prune, ...] = ()
    """Where the sliding image window pruned the context so far (`Trajectory.prunes`)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"task progress of session {self.session_id}: {name} has "
                                 f"{len(getattr(self, name))} entries for {n} tokens")
        window_segments(n + 1, self.prunes)  # a prune lies inside the ids (the next one comes after them)

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
        prunes = tuple((int(at), int(d)) for at, d in data.get("prunes", ()))
        return cls(**{k: tuple(v) if k in seqs else v for k, v in data.items() if k not in ("images", "prunes")},
                   images=images, prunes=prunes)


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
    image_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """Where each image's placeholder lies in `token_ids` ([start, end): `ChatFormat.image_spans`)."""
    prunes: list[Prune] = dataclasses.field(default_factory=list)
    """Where the sliding image window pruned the context (`rollout.keep_images`): `token_ids` and `images` keep
    the whole task, and the engine's context is the stream without the pruned images' placeholders
    (:meth:`context`); the trainer trains each part with the context the engine saw (`window_segments`)."""

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
    def dropped(self) -> int:
        """Images the sliding window pruned from the context (the oldest)."""
        return self.prunes[-1][1] if self.prunes else 0

    @property
    def engine_tokens(self) -> int:
        """The context's length in the engine: every kept image placeholder expanded into its tokens."""
        d = self.dropped
        kept = self.image_tokens[d:]
        return len(self.token_ids) - sum(e - s for s, e in self.image_spans[:d]) + sum(kept) - len(kept)

    def tokens_freed_by(self, drop: int) -> int:
        """Engine tokens the context loses when the window prunes `drop` more images (each its tokens and the
        rest of its placeholder)."""
        d = self.dropped
        return sum(n + e - s - 1 for n, (s, e) in zip(self.image_tokens[d:d + drop], self.image_spans[d:d + drop]))

    def context(self) -> tuple[list[int], list[PngImage]]:
        """The ids and images the engine gets: the whole stream while nothing was pruned."""
        d = self.dropped
        if not d:
            return self.token_ids, self.images
        return drop_spans(self.token_ids, self.image_spans[:d]), self.images[d:]

    def add_images(self, images: Sequence[PngImage], tokens: list[int], spans: list[tuple[int, int]]) -> None:
        """The images of the ids just appended, their engine token counts and their placeholders' spans."""
        if not len(images) == len(tokens) == len(spans):
            raise ValueError(f"trajectory {self.task.task_id}: {len(tokens)} token counts and {len(spans)} "
                             f"placeholders for {len(images)} images")
        self.images.extend(images)
        self.image_tokens.extend(tokens)
        self.image_spans.extend(spans)

    def prune(self, dropped: int) -> int:
        """Prune the context to the images after the oldest `dropped`, from here on (the trajectory splits here).
        Returns where the engine's context changes (its old prefix up to there stays cached)."""
        if not self.dropped < dropped <= len(self.images):
            raise ValueError(f"trajectory {self.task.task_id}: cannot prune to {dropped} dropped images "
                             f"({self.dropped} dropped of {len(self.images)})")
        changed_at = self.image_spans[self.dropped][0] - sum(e - s for s, e in self.image_spans[:self.dropped])
        self.prunes.append((len(self.token_ids), dropped))
        window_segments(len(self.token_ids) + 1, self.prunes)
        return changed_at

    def append(self, ids: list[int] | tuple[int, ...], *, sampled: bool, logprobs: tuple[float, ...] = (),
               version: int = NO_VERSION, versions: Sequence[int] = ()) -> None:
        """Append `ids`; sampled ones with their logprobs and weights version (`version`, or each token's in
        `versions`)."""
        if versions and len(versions) != len(ids):
            raise ValueError(f"trajectory {self.task.task_id}: {len(versions)} versions for {len(ids)} tokens")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(logprobs if sampled else [0.0] * len(ids))
        self.versions.extend((list(versions) or [version] * len(ids)) if sampled else [NO_VERSION] * len(ids))
        self.check()
