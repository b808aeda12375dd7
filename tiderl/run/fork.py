"""`tiderl run --resume RUN_DIR --fork NEW_DIR [--set k=v ...]`: a new run that starts from RUN_DIR's newest
complete checkpoint, RUN_DIR only read.

The fork is a run of its own (its directory, config, store, groups, ranks and plans) whose step and version
counters, weights and optimizer state carry on from the checkpoint of step N: its store starts at version N,
`NEW_DIR/weights/vN` holds the checkpoint's weights (exported through the trainer backend, since the source may
have pruned its own `weights/vN`), `NEW_DIR/ckpt/stepN` a copy of the checkpoint, so the fork's trainer resumes
from it exactly as a resumed run does (`tiderl.trainer.rank.find_resume_point`) and its rollout ranks start on
version N. Its feed draws its prompts after every prompt the source drew. Everything is checked before anything
is made (the config merged with the overrides, as a run's or a resume's; a source with a complete checkpoint;
the same base model); a fork that fails while it is made leaves no NEW_DIR, nor the store it made outside it (a
PostgreSQL schema, a SQLite file `store.url` names). The fork is whole once its `forked` event is written, the last
thing made (`made_fork`): a requeued Slurm job whose step is this command resumes it (`tiderl.run_cli`).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.config import ConfigError, JobConfig, load_job
from tiderl.config.resume import Change, changes, fork_refusal, override_of
from tiderl.paths import RunPaths, checkpoint_dir, use_private_umask
from tiderl.run.launcher import Launch
from tiderl.rundir import RunDirError, create_run, model_checksum, open_run, validate_job
from tiderl.store import ForkOrigin, RunStore, TaskKind
from tiderl.store.engine import StoreError
from tiderl.store.location import store_url

if TYPE_CHECKING:
    from tiderl.trainer.publish import Checkpoint


def prepare_fork(source: Path, overrides: list[str], new_dir: Path) -> Launch:
    """Check everything, then make the fork in `new_dir` and return its launch (not a resume: its processes
    start as a new run's). ConfigError for a bad or refused override; RunDirError for a source without a
    complete checkpoint, a NEW_DIR that is not new, another base model, or a fork that could not be made (then
    nothing is left of it)."""
    use_private_umask()
    src = RunPaths(Path(source))
    _check_new_dir(src, Path(new_dir))
    src_paths, src_store = open_run(src.root, read_only=True)
    try:
        if not src_paths.config.is_file():
            raise RunDirError(f"{src.root}: no {src_paths.config.name}: not a run directory to fork")
        saved = load_job(src_paths.config)
        config = load_job(src_paths.config, overrides)
        found = tuple(changes(saved, config))
        _refuse(found, overrides)
        validate_job(config)
        ckpt = _newest_checkpoint(src_paths)
        _check_steps(config, found, ckpt, src_paths)
        if _same_store(src_paths, Path(new_dir), config, saved):
            raise RunDirError(f"{new_dir}: the fork's run store would be {src.root}'s own (store.url names one "
                              "database or schema for both): give the fork a store of its own with --set store.url=...")
        base, base_checksum = _base_model(config, src_store, src.root)
        origin = ForkOrigin(run_dir=str(src.root.resolve()), step=ckpt.step, version=ckpt.version,
                            source_train_groups=sum(src_store.groups_by_state(TaskKind.TRAIN).values()))
    except StoreError as e:
        raise RunDirError(f"{src.root}: {e}") from e
    finally:
        src_store.close()
    paths, store = _make(config, Path(new_dir), ckpt, (base, base_checksum), origin, found)
    return Launch(config, paths, store, resumed=False, changes=found)


def made_fork(source: Path, new_dir: Path) -> ForkOrigin | None:
    """Where the fork of `source` that `new_dir` holds started, where a fork was made there whole (its `forked`
    event is the last thing `prepare_fork` writes); None where `new_dir` holds no run, another run, or a fork
    whose making was cut off."""
    try:
        _, store = open_run(new_dir, read_only=True)
    except RunDirError:
        return None
    try:
        origin = store.fork_origin()
    except StoreError:
        return None
    finally:
        store.close()
    return origin if origin is not None and Path(origin.run_dir) == Path(source).resolve() else None


def _check_new_dir(src: RunPaths, new_dir: Path) -> None:
    if new_dir.exists() and (not new_dir.is_dir() or any(new_dir.iterdir())):
        made = f" (it holds this fork already: `tiderl run --resume {new_dir}` resumes it)" \
            if made_fork(src.root, new_dir) else ""
        raise RunDirError(f"{new_dir}: exists and is not an empty directory{made}: a fork makes a new run directory")
    target, root = new_dir.resolve(), src.root.resolve()
    if target == root or root in target.parents:
        raise RunDirError(f"{new_dir}: inside {src.root}, which a fork only reads: give a directory outside it")


def _refuse(found: tuple[Change, ...], overrides: list[str]) -> None:
    """ConfigError (exit 2) naming the first override of a key a fork may not change, and why."""
    for change in found:
        why = fork_refusal(change)
        if why is not None:
            given = override_of(change, overrides)
            raise ConfigError(f"--set {given}" if given else "tiderl run --fork", change.key,
                              f"cannot change on a fork ({change.old!r} -> {change.new!r}): {why}; nothing was created")


def _check_steps(config: JobConfig, found: tuple[Change, ...], ckpt: Checkpoint, src: RunPaths) -> None:
    """ConfigError where the fork would have no step to train: `trainer.num_steps` not past the checkpoint's version."""
    steps = config.trainer.num_steps
    if steps > ckpt.version:
        return
    given = any(c.key == "trainer.num_steps" for c in found)
    raise ConfigError(f"--set trainer.num_steps={steps}" if given else str(src.config), "trainer.num_steps",
                      f"the fork starts at version {ckpt.version} (the checkpoint of step {ckpt.step} in {src.root}): "
                      f"give --set trainer.num_steps=N with N > {ckpt.version}; nothing was created")


def _same_store(src: RunPaths, new_dir: Path, config: JobConfig, saved: JobConfig) -> bool:
    """Whether the fork's store would be the source's (a `store.url` naming one SQLite file or PostgreSQL schema)."""
    return store_url(new_dir, config.store.url) == store_url(src.root, saved.store.url)


def _newest_checkpoint(src: RunPaths) -> Checkpoint:
    """The source's newest checkpoint whose files match their checksums (the one a resume reads)."""
    from tiderl.trainer.publish import Checkpointer

    ckpt = Checkpointer(src.ckpt, every=1).latest()
    if ckpt is None:
        raise RunDirError(f"{src.root}: no complete checkpoint in {src.ckpt} to fork from (a run checkpoints every "
                          "trainer.checkpoint_every steps; a damaged one is skipped)")
    return ckpt


def _base_model(config: JobConfig, src_store: RunStore, src_root: Path) -> tuple[Path, str]:
    """The fork's base model (version 0, and its reference model) and its checksum: the job's model, which must
    be the one the source started from (the checksum its first launch recorded)."""
    from tiderl.models.for_job import model_dir

    base = model_dir(config)
    digest, recorded = model_checksum(base), src_store.version_checksum(0)
    if recorded is not None and digest != recorded:
        raise RunDirError(f"base model {base}: its weights are not the ones {src_root} started from (checksum "
                          f"{recorded[:16]} recorded there, files now {digest[:16]}): the checkpoint was trained "
                          "from that model; restore it, or start a new run")
    return base, digest


def _make(config: JobConfig, new_dir: Path, ckpt: Checkpoint, base: tuple[Path, str], origin: ForkOrigin,
          found: tuple[Change, ...]) -> tuple[RunPaths, RunStore]:
    """The fork's directory and store (`base`: version 0, its path and checksum), its checkpoint and weights;
    nothing of it left where this fails: its directory, and what it made of its store (`RunStore.drop_created`:
    a store outside the directory, a PostgreSQL schema, is dropped too)."""
    existed = new_dir.is_dir()
    # The fork's store before the fork makes it: what a failure takes back is what was not there.
    place = RunStore(store_url(new_dir, config.store.url), config.store)
    try:
        before = place.existing_tables()
    except StoreError as e:
        place.close()
        raise RunDirError(f"{new_dir}: the fork's store: {e}; nothing was created") from e
    store: RunStore | None = None
    try:
        paths, store = create_run(config, new_dir)
        _export_weights(config, _copy_checkpoint(ckpt, paths), base[0], paths)
        store.register_initial_version(str(base[0]), base[1])
        store.start_fork(origin, [{"key": c.key, "old": c.old, "new": c.new} for c in found])
        return paths, store
    except BaseException as e:
        if store is not None:
            store.close()
        kept = "nothing of it was kept"
        try:
            place.drop_created(before)
        except (StoreError, OSError) as drop_error:  # the server gone meanwhile: the user drops it
            kept = f"its directory was removed, but not its store {place.label} ({drop_error}): drop that by hand"
        shutil.rmtree(new_dir, ignore_errors=True)
        if existed:
            new_dir.mkdir()
        if isinstance(e, (OSError, StoreError, RuntimeError, ValueError)):  # torch's and DCP's errors among them
            raise RunDirError(f"{new_dir}: the fork could not be made, {kept}: {e}") from e
        raise
    finally:
        place.close()


def _copy_checkpoint(ckpt: Checkpoint, paths: RunPaths) -> Checkpoint:
    """The checkpoint, whole or not at all, as `ckpt/step{N}` of the fork (checked against its checksums)."""
    from tiderl.trainer.publish import verify

    final = checkpoint_dir(paths.ckpt, ckpt.step)
    tmp = final.parent / f".{final.name}.tmp-fork"
    shutil.copytree(ckpt.path, tmp)
    verify(tmp)
    tmp.rename(final)
    return replace(ckpt, path=final)


def _export_weights(config: JobConfig, ckpt: Checkpoint, base: Path, paths: RunPaths) -> None:
    """`weights/v{N}` of the fork: the checkpoint's weights, written as the trainer publishes a version (the
    replicated backend reads a checkpoint of either backend, re-sharded)."""
    from tiderl.trainer.backend import OptimConfig, make_backend
    from tiderl.trainer.publish import Checkpointer, WeightPublisher

    t = config.trainer
    actor = make_backend("torch", "actor", base, device="cpu",
                         optim=OptimConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip))
    Checkpointer(paths.ckpt, every=1).restore(actor, ckpt, weights=True)
    publisher = WeightPublisher(paths.weights, base, t.keep_versions, disk_full_wait_s=config.store.disk_full_wait_s)
    publisher.publish(actor, ckpt.version)
