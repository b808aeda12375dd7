"""`tiderl samples RUN_DIR [--version N] [--worst | --best] [-n K] [--eval]`: a run's trajectories as text.

Each trajectory is shown turn by turn: its token sequence is split where the
`loss_mask` changes, so the model's tokens (mask 1, what the trainer trains on)
read apart from the prompt and the environment's answers (mask 0). The header
gives the task, the rank that produced it, its reward, success, advantage, the
weights versions its tokens came from and how it ended.

The advantage is the one the store wrote when the trajectory's group completed;
where it has none (an evaluation, or a group not complete yet) it is computed
the same way (`tiderl.advantages.group_advantages`) over the rewards of its
whole group, and marked so; a group still incomplete has none yet.

`--version N` picks the trajectories trained into version N (the training step
that produced weights version N: the batch behind the step's reward and loss in
`tiderl status` and the report), 1 to the run's latest version; with `--eval`,
the evaluation of version N (0 to latest). Without it, any version's. Order:
the most recent first, or by reward (`--worst`, `--best`).

Tokens are decoded with the tokenizer of the run's base model (version 0's
directory in the run store) or `--tokenizer DIR`. Exit 2 with one line when
RUN_DIR is not a run, the version is out of range or the tokenizer cannot be
loaded; exit 1 when the selection holds no trajectory (yet).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tiderl.advantages import group_advantages
from tiderl.store import codec
from tiderl.config.cli import at_least

EXIT_OK, EXIT_NONE, EXIT_USAGE = 0, 1, 2
MODEL, PROMPT, ENV = "model", "prompt", "env"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class SamplesError(RuntimeError):
    """What was asked cannot be shown; the message says why (exit 2)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One trajectory as stored, its tokens unpacked, and its advantage (stored or computed over its group)."""

    id: int
    task_id: int
    group_id: int
    kind: str
    rank: int
    state: str
    token_ids: list[int]
    loss_mask: list[int]
    num_turns: int
    reward: float
    success: bool
    advantage: float | None
    advantage_computed: bool  # not stored: computed here over the group's rewards
    group_done: int  # trajectories of its group recorded so far
    group_size: int
    min_version: int
    max_version: int
    consumed_version: int | None
    eval_version: int | None
    finish: str | None


def segments(token_ids: list[int], loss_mask: list[int]) -> list[tuple[str, list[int]]]:
    """The trajectory split where the mask changes: (`model`, ids) for the model's tokens; the tokens before the
    model's first are the `prompt`, those between the model's turns (and after its last) the `env`'s."""
    out: list[tuple[str, list[int]]] = []
    seen_model = False
    for tok, m in zip(token_ids, loss_mask):
        who = MODEL if m else (ENV if seen_model else PROMPT)
        seen_model = seen_model or bool(m)
        if out and out[-1][0] == who:
            out[-1][1].append(tok)
        else:
            out.append((who, [tok]))
    return out


def check_version(version: int, latest: int, *, evaluation: bool) -> None:
    """SamplesError naming the valid range when `version` is outside it."""
    low = 0 if evaluation else 1
    if low <= version <= latest:
        return
    if not evaluation and version == 0 and latest >= 0:
        raise SamplesError("version 0 is the base model: no trajectories were trained into it; "
                           + (f"give 1 to {latest} (the run's latest)" if latest else "the run has no trained "
                              "version yet"))
    what = "evaluated versions" if evaluation else "trained versions"
    raise SamplesError(f"version {version}: the run's {what} are {low} to {latest}" if latest >= low else
                       f"version {version}: the run has no trained version yet")


def load_samples(store: Any, *, version: int | None = None, evaluation: bool = False, order: str = "recent",
                 limit: int = 4) -> list[Sample]:
    """Up to `limit` trajectories of the run: training ones (trained into `version`, when given) or, with
    `evaluation`, evaluation ones (of `version`); `order` recent | worst | best."""
    from sqlalchemy import select

    from tiderl.store.schema import task_groups, trajectories as tr

    t, g = tr.c, task_groups.c
    query = (select(t.id, t.task_id, t.group_id, t.kind, t.rank, t.state, t.token_ids, t.loss_mask, t.num_turns,
                    t.reward, t.success, t.advantage, t.min_version, t.max_version, t.consumed_version, t.finish,
                    g.size, g.eval_version)
             .join(task_groups, g.id == t.group_id)
             .where(t.kind == ("eval" if evaluation else "train")))
    if version is not None:
        query = query.where(g.eval_version == version if evaluation else t.consumed_version == version)
    keys = {"recent": (t.finished_at.desc(), t.id.desc()), "worst": (t.reward.asc(), t.id.desc()),
            "best": (t.reward.desc(), t.id.desc())}[order]
    query = query.order_by(*keys).limit(limit)

    def read(c: Any) -> tuple[list[Any], dict[int, dict[int, float]]]:
        rows = c.execute(query).mappings().all()
        gids = sorted({r["group_id"] for r in rows})
        rewards: dict[int, dict[int, float]] = {gid: {} for gid in gids}
        if gids:
            for tid, gid, reward in c.execute(select(t.id, t.group_id, t.reward).where(t.group_id.in_(gids))
                                              .order_by(t.group_id, t.id)):
                rewards[gid][tid] = float(reward)
        return list(rows), rewards

    rows, rewards = store.tx.read(read)
    return [_sample(r, rewards[r["group_id"]]) for r in rows]


def _sample(r: Any, group_rewards: dict[int, float]) -> Sample:
    advantage, computed = r["advantage"], False
    if advantage is None and len(group_rewards) == r["size"]:
        ids = list(group_rewards)
        try:
            advantage, computed = group_advantages([group_rewards[i] for i in ids])[ids.index(r["id"])], True
        except ValueError:  # a reward that is not finite: no advantage to show
            advantage = None
    return Sample(
        id=r["id"], task_id=r["task_id"], group_id=r["group_id"], kind=r["kind"], rank=r["rank"], state=r["state"],
        token_ids=codec.unpack_ints(r["token_ids"]), loss_mask=codec.unpack_mask(r["loss_mask"]),
        num_turns=r["num_turns"], reward=float(r["reward"]), success=bool(r["success"]), advantage=advantage,
        advantage_computed=computed, group_done=len(group_rewards), group_size=r["size"],
        min_version=r["min_version"], max_version=r["max_version"], consumed_version=r["consumed_version"],
        eval_version=r["eval_version"], finish=r["finish"])


def render(sample: Sample, decode: Any) -> str:
    """One trajectory as text: a header line, then each segment under a marker naming who wrote it."""
    if sample.advantage is None:
        adv = f"- (its group has {sample.group_done} of {sample.group_size} trajectories)"
    else:
        adv = f"{sample.advantage:+.3f}" + (" (computed over its group)" if sample.advantage_computed else "")
    versions = (f"v{sample.min_version}" if sample.min_version == sample.max_version
                else f"v{sample.min_version}-v{sample.max_version}")
    where = (f"evaluation of version {sample.eval_version}" if sample.kind == "eval" else
             f"trained into version {sample.consumed_version}" if sample.consumed_version is not None else
             f"not trained ({sample.state})")
    lines = [f"=== trajectory {sample.id} (task {sample.task_id}, group {sample.group_id}, rank {sample.rank}): "
             f"reward {sample.reward:.3f}  success {'yes' if sample.success else 'no'}  advantage {adv}",
             f"    {sample.num_turns} turns, {len(sample.token_ids)} tokens "
             f"({sum(1 for m in sample.loss_mask if m)} the model's), generated at {versions}, {where}"
             + (f", ended: {sample.finish}" if sample.finish else "")]
    turn = 0
    for who, ids in segments(sample.token_ids, sample.loss_mask):
        if who == MODEL:
            turn += 1
            lines.append(f"--- model (turn {turn}, {len(ids)} tokens) ---")
        else:
            lines.append(f"--- {who} ({len(ids)} tokens) ---")
        lines.append(decode(ids))
    return "\n".join(lines)


def tokenizer_dir(store: Any, run_root: Path) -> Path:
    """The run's base model directory: version 0's path in the run store (relative paths: to the run dir)."""
    from sqlalchemy import select

    from tiderl.store.schema import versions

    base = store.tx.read(lambda c: c.execute(select(versions.c.path).where(versions.c.version == 0)).scalar())
    if not base:
        raise SamplesError(f"{run_root}: the run store records no base model (version 0) yet: give --tokenizer DIR")
    path = Path(base)
    return path if path.is_absolute() else run_root / path


def load_decoder(path: Path) -> Any:
    """A function ids -> text from the tokenizer in `path` (special tokens kept: the chat markup shows)."""
    if not path.is_dir():
        raise SamplesError(f"tokenizer: {path} is not a directory (the run's base model; give --tokenizer DIR)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise SamplesError(f"tokenizer: cannot load one from {path}: none of {', '.join(TOKENIZER_FILES)} there "
                           "(give --tokenizer DIR)")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises OSError, ValueError and others for a directory without one
        detail = " ".join(str(e).split())[:300]
        raise SamplesError(f"tokenizer: cannot load one from {path}: {type(e).__name__}: {detail}") from None
    return lambda ids: tok.decode(ids, skip_special_tokens=False)



def _version(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="Run directory (holds run.db); works while the run goes on.")
    parser.add_argument("--version", type=_version, default=None, metavar="N",
                        help="Only the trajectories trained into version N (the step that produced weights version "
                             "N, whose reward `tiderl status` shows on version N's row): 1 to the latest version. "
                             "With --eval: the evaluation of version N (0 to the latest).")
    order = parser.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true", help="Lowest reward first (default: most recent first).")
    order.add_argument("--best", action="store_true", help="Highest reward first (default: most recent first).")
    parser.add_argument("-n", type=at_least(1), default=4, metavar="K", help="How many trajectories (default 4).")
    parser.add_argument("--eval", action="store_true", help="Evaluation trajectories instead of training ones.")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                        help="Decode with the tokenizer in DIR (default: the run's base model, version 0).")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from tiderl.rundir import RunDirError, open_run

    out = out or sys.stdout
    try:
        paths, store = open_run(args.run_dir, read_only=True)
    except RunDirError as e:
        print(f"tiderl samples: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        latest = store.run_info().version
        if args.version is not None:
            check_version(args.version, latest, evaluation=args.eval)
        order = "worst" if args.worst else "best" if args.best else "recent"
        samples = load_samples(store, version=args.version, evaluation=args.eval, order=order, limit=args.n)
        if not samples:
            what = "evaluation" if args.eval else "training"
            at = ("" if args.version is None else
                  f" of version {args.version}" if args.eval else f" trained into version {args.version}")
            print(f"tiderl samples: no {what} trajectories{at} in {paths.root} yet", file=sys.stderr)
            return EXIT_NONE
        decode = load_decoder(args.tokenizer if args.tokenizer is not None else tokenizer_dir(store, paths.root))
    except SamplesError as e:
        print(f"tiderl samples: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        store.close()
    print("\n\n".join(render(s, decode) for s in samples), file=out, flush=True)
    return EXIT_OK
