"""`tiderl run`: the whole run as local processes (env servers, control plane, ranks) under one launcher.

The launcher validates the config and checks the model and trainer backend
(`tiderl.models.preflight`: a bad one creates nothing), creates or reopens
the run dir, finds or builds the model, starts the env servers
(unless `env.servers` points at external ones), the control plane and
`launch.num_ranks` rank processes, shows a progress line until the control
plane declares the run finished, and stops every child on Ctrl-C, on a
child's failure or at the end. The run state records how it ended.

`tiderl submit` runs the same launch inside a Slurm job (`tiderl.slurm.job`):
only the way ranks start differs (`start_ranks`: one `srun` step instead of
local children), and a signal from Slurm raises `Interrupted`, which stops the
children and leaves the run resumable.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tiderl.config import ConfigError, JobConfig, dump_job, load_job
from tiderl.config.resume import Change, changes, override_of, refusal, resumable_keys
from tiderl.paths import RunPaths, use_private_umask
from tiderl.run import procs
from tiderl.run.context import write_run_files
from tiderl.run.supervise import Restarter, replace_child, restart_trainer_group
from tiderl.rundir import create_run, model_checksum, open_run, validate_job
from tiderl.store import RunStore
from tiderl.store.engine import StoreError
from tiderl.store.types import RankState, Role, RunState

PROGRESS_S = 2.0
LOG_EVERY_S = 10.0
FINISH_GRACE_S = 15.0


class LaunchError(RuntimeError):
    """A process of the run failed to start or died; the message names it."""


class Interrupted(Exception):
    """Raised (from a signal handler) while a launch runs: stop every child and leave the run resumable.

    The run state stays `running` with this message, unless it is already final (finished, or cancelled
    by `tiderl cancel`); `tiderl run --resume` or a requeued Slurm job carries on from the store.
    """


@dataclass
class Launch:
    config: JobConfig
    paths: RunPaths
    store: RunStore
    resumed: bool
    changes: tuple[Change, ...] = ()
    """A resume's `--set` overrides, allowed (`tiderl.config.resume`) and not applied yet: `apply_changes`
    writes them into RUN_DIR/config.yaml and the store before any process of the run starts. A fork's
    (`tiderl.run.fork`) are in its config and store already."""


def prepare(job: Path | None, overrides: list[str], run_dir: Path | None, resume: Path | None) -> Launch:
    """Validate and create (or reopen) the run. Raises ConfigError before touching the disk: a bad config,
    or a model or trainer backend that cannot serve the run (`tiderl.rundir.validate_job`, the check `tiderl
    config` and `tiderl submit` make; on resume on the config merged with the overrides, checked again before
    the store is opened, since the model may have moved). A resume's override of a key that may not change
    on resume is refused here, nothing changed (`tiderl.config.resume`)."""
    use_private_umask()  # what the run's processes write is its user's alone (they inherit it)
    if resume is not None:
        saved = RunPaths(Path(resume)).config
        found: tuple[Change, ...] = ()
        if saved.is_file():  # else open_run says what the directory lacks
            merged = load_job(saved, overrides)
            found = tuple(changes(load_job(saved), merged))
            refuse_changes(found, overrides)
            validate_job(merged)
        paths, _ = open_run(resume)
        config = load_job(paths.config, overrides)
        store = RunStore.for_run_dir(paths.root, config.store)
        return Launch(config, paths, store, resumed=True, changes=found)
    if job is None:
        raise LaunchError("give a job file, or --resume RUN_DIR")
    config = load_job(job, overrides)
    validate_job(config)
    paths, store = create_run(config, run_dir)
    return Launch(config, paths, store, resumed=False)


def refuse_changes(found: tuple[Change, ...], overrides: list[str]) -> None:
    """ConfigError (exit 2) naming the first override of a key that may not change on resume, and why."""
    for change in found:
        why = refusal(change)
        if why is None:
            continue
        given = override_of(change, overrides)
        raise ConfigError(f"--set {given}" if given else "tiderl run --resume", change.key,
                          f"cannot change on resume ({change.old!r} -> {change.new!r}): {why}; nothing was changed. "
                          f"Keys that may change on resume: {', '.join(resumable_keys())}")


def check_steps(launch: Launch, version: int) -> None:
    """ConfigError for a resume whose `trainer.num_steps` is below `version`, the version the run published."""
    steps = launch.config.trainer.num_steps
    if steps < version:
        raise ConfigError(f"--set trainer.num_steps={steps}", "trainer.num_steps",
                          f"{launch.paths.root} has published version {version} already: a resumed run goes on to at "
                          f"least that version (give {version} to end it there); nothing was changed")


def apply_changes(launch: Launch, version: int, *, reopen: bool) -> None:
    """Make a resume's overrides the run's config before any process starts: RUN_DIR/config.yaml (which the
    control plane and the ranks load) written atomically, and in one store transaction the run's recorded
    config and a `config_changed` event naming each key, old -> new (`reopen`: a finished run extended, back
    to running). ConfigError (nothing changed) for a `trainer.num_steps` below `version` (`check_steps`);
    the old config.yaml back if the store cannot record the change."""
    from tiderl.paths import atomic_write_text

    cfg, paths = launch.config, launch.paths
    check_steps(launch, version)
    if not launch.changes:
        return
    before = paths.config.read_text()
    resolved = dump_job(cfg)
    atomic_write_text(paths.config, resolved)
    try:
        launch.store.change_config(resolved, [{"key": c.key, "old": c.old, "new": c.new} for c in launch.changes],
                                   reopen_message=f"extended to {cfg.trainer.num_steps} steps" if reopen else None)
    except BaseException:
        atomic_write_text(paths.config, before)
        raise


def _has_initial_version(store: RunStore) -> bool:
    from sqlalchemy import select

    from tiderl.store.schema import versions

    return store.tx.read(lambda c: c.execute(select(versions.c.version).where(versions.c.version == 0)).first()
                         is not None)


def launch_note(launch: Launch) -> str:
    """What each child's log is told at the start of this launch (procs.launch_marker)."""
    if not launch.resumed:
        return f"launch of run {launch.paths.root.name}"
    return f"resume of run {launch.paths.root.name} at version {launch.store.run_info().version}"


def _token_file(launch: Launch) -> Path:
    from tiderl.envs.launch import ensure_run_token

    # Servers the run starts always require a token: the job's, else one of the run's own.
    cfg = launch.config.env
    return Path(cfg.token_file) if cfg.token_file else ensure_run_token(launch.paths.root)


LATENCY_SEEDS_PER_RUN = 100_000  # env servers of one run: each its own latency seed


def start_env_server(launch: Launch, env: dict[str, str] | None, i: int, *, port: int = 0,
                     note: str | None = None) -> tuple[procs.Child, str]:
    """Env server `i` of the run (on `port`; 0: a free one) and its URL, once it listens."""
    from tiderl.envs.launch import server_argv, wait_for_url

    port_file = launch.paths.env_port(i)
    port_file.unlink(missing_ok=True)
    # Delays keyed by the run's seed and the server: runs of one job on one seed see the same delays.
    argv = server_argv(launch.config.env, port_file, token_file=_token_file(launch), port=port,
                       latency_seed=launch.config.seed * LATENCY_SEEDS_PER_RUN + i)
    child = procs.spawn(f"env{i}", argv, launch.paths.env_log(i), env=env, marker=note or launch_note(launch))
    try:
        return child, wait_for_url(port_file, child.proc)
    except Exception:
        procs.stop([child])
        raise


def start_env_servers(launch: Launch, env: dict[str, str] | None = None) -> tuple[list[procs.Child], list[str]]:
    cfg = launch.config.env
    if cfg.servers:
        return [], list(cfg.servers)
    children, urls = [], []
    for i in range(cfg.num_servers):
        try:
            child, url = start_env_server(launch, env, i)
        except Exception:
            procs.stop(children)
            raise
        children.append(child)
        urls.append(url)
    return children, urls


def start_control(launch: Launch, tag: dict[str, str], note: str | None = None) -> procs.Child:
    return procs.spawn("control", [sys.executable, "-m", "tiderl.run.control", str(launch.paths.root)],
                       launch.paths.control_log(), env=tag, marker=note or launch_note(launch))


RankStarter = Callable[[Launch, dict[str, str]], list[procs.Child]]


def start_local_rank(launch: Launch, tag: dict[str, str], rank: int, note: str) -> procs.Child:
    paths = launch.paths
    return procs.spawn(f"rank{rank}", [sys.executable, "-m", "tiderl.run.rank", str(paths.root), str(rank)],
                       paths.rank_log(rank), env=rank_env(rank) | tag, marker=note)


def start_local_ranks(launch: Launch, tag: dict[str, str]) -> list[procs.Child]:
    """`launch.num_ranks` rank processes on this machine, each a child with its own log."""
    note = launch_note(launch)
    return [start_local_rank(launch, tag, r, note) for r in range(launch.config.launch.num_ranks)]


def restarter(launch: Launch, tag: dict[str, str], start_ranks: RankStarter, urls: list[str]) -> Restarter | None:
    """How `_watch` starts a replacement for a child that died: the control plane (it keeps no state
    outside the store), an env server (on its old port, so every client's URL still holds) and a local
    rank. None for what this launch cannot restart: the ranks as one srun step, or launch.restarts 0."""
    if launch.config.launch.restarts == 0:
        return None

    def start(child: procs.Child) -> procs.Child | None:
        note = f"restart of {child.name} after it died"
        if child.name == "control":
            return start_control(launch, tag, note)
        if child.name.startswith("env") and child.name[3:].isdigit():
            i = int(child.name[3:])
            port = int(urllib.parse.urlsplit(urls[i]).port or 0)
            replacement, url = start_env_server(launch, tag, i, port=port, note=note)
            return replacement if url == urls[i] else None
        if child.name.startswith("rank") and start_ranks is start_local_ranks:
            return start_local_rank(launch, tag, int(child.name[4:]), note)
        return None

    return start


def run_launch(launch: Launch, out: TextIO = sys.stdout, *, start_ranks: RankStarter = start_local_ranks,
               finish_grace_s: float = FINISH_GRACE_S) -> int:
    """Run to the end; returns the exit code (0 finished, 1 failed, 130 cancelled, 143 interrupted)."""
    cfg, paths, store = launch.config, launch.paths, launch.store
    tag = {procs.RUN_DIR_ENV: str(paths.root.resolve())}
    children: list[procs.Child] = []
    state, message = RunState.FAILED, ""
    try:
        from tiderl.models.for_job import model_dir  # torch and transformers: only once a run starts

        model = model_dir(cfg)
        if not launch.resumed:
            if not _has_initial_version(store):  # a first launch killed right after this line left it
                store.register_initial_version(str(model), model_checksum(model))
        else:
            end_previous_launch(store, paths)
        env_children, urls = start_env_servers(launch, tag)
        children += env_children
        write_run_files(paths, model, urls)
        store.set_run_state(RunState.RUNNING, "resumed" if launch.resumed else None)
        children.append(start_control(launch, tag))
        launched_at = time.time()
        children += start_ranks(launch, tag)
        print(f"run dir {paths.root} ({cfg.system}, {cfg.launch.num_ranks} ranks, env {', '.join(urls)})",
              file=out, flush=True)
        r = cfg.rollout
        eval_tasks = r.eval_groups * r.eval_group_size
        state, message = _watch(store, children, out, eval_tasks, launched_at,
                                restart=restarter(launch, tag, start_ranks, urls),
                                restart_limit=cfg.launch.restarts,
                                own_ranks=paths if start_ranks is start_local_ranks else None)
    except KeyboardInterrupt:
        state, message = RunState.CANCELLED, "interrupted"
    except Interrupted as e:
        state, message = RunState.RUNNING, str(e)
    except Exception as e:
        state, message = RunState.FAILED, f"{type(e).__name__}: {e}"
        raise
    finally:
        # The processes are stopped whatever the store says: a full disk or a damaged run.db must not
        # leave ranks running behind a launcher that died on its own bookkeeping.
        current: RunState | None = None
        try:
            current = store.run_info().state
            if current is RunState.FINISHED and state is RunState.FINISHED:
                _let_ranks_leave(children, finish_grace_s)
            elif not (current.is_terminal and state is RunState.RUNNING) and current is not RunState.CANCELLED:
                # A run someone cancelled (`tiderl cancel`) stays cancelled: ranks dying then are its consequence.
                store.set_run_state(state, message)
        except StoreError as e:
            print(f"\nthe run store could not record the run as {state.value}: {e}", file=out, flush=True)
        if state is not RunState.FINISHED:
            print(f"\nstopping: {message or state.value}; ending {len(children)} processes "
                  f"(up to {procs.STOP_GRACE_S:.0f} s)", file=out, flush=True)
        procs.stop(children)
        try:
            from tiderl.observe import summary

            _mark_ranks_stopped(store)
            print(file=out)
            print(summary(store), file=out, flush=True)
            current = store.run_info().state
        except StoreError as e:
            print(f"the run store could not be read for the summary: {e}", file=out, flush=True)
        if state is not RunState.FINISHED and current is not RunState.FINISHED:
            print(f"resume with: tiderl run --resume {paths.root}", file=out, flush=True)
        store.close()
    return {RunState.FINISHED: 0, RunState.CANCELLED: 130, RunState.RUNNING: 143}.get(state, 1)


def _mark_ranks_stopped(store: RunStore) -> None:
    """Every process of this launch is gone: a rank still recorded as live (killed before it could say
    so, or the actor still in its step at Ctrl-C) is stopped, not running."""
    for rank in store.ranks():
        if rank.state in (RankState.RUNNING, RankState.STARTING):
            store.set_rank_state(rank.rank, RankState.STOPPED)


def rank_sessions(store: RunStore) -> list[int]:
    """The pids the store recorded for the run's ranks on this host: each led its own session, which
    `procs.reap_leftovers` searches for what a dead rank left."""
    here = socket.gethostname()
    return [r.pid for r in store.ranks() if r.pid and r.host == here]


def end_previous_launch(store: RunStore, paths: RunPaths) -> None:
    """Before a resume: kill what the previous launch left, and give every claim of its ranks back."""
    # A killed launcher's ranks died with it, but their vLLM engine cores may live on.
    leftovers = procs.reap_leftovers(paths.root, rank_sessions(store))
    if leftovers:
        store.record_event("launcher", "leftovers_killed",
                           f"killed {len(leftovers)} processes left by the previous launch",
                           data={"pids": leftovers})
    # Every process of the previous launch is gone: their claims go back to the pool now. A rank that was
    # stopped by a signal (Ctrl-C, Slurm's SIGTERM at a requeue) recorded itself `stopped` with its claims
    # still held, and `reclaim_expired` only takes claims from ranks it finds running.
    for rank in store.ranks():
        if rank.state in (RankState.STOPPED, RankState.FAILED):
            store.set_rank_state(rank.rank, RankState.RUNNING)
    store.reclaim_expired(0.0, reason="was not running when the run resumed")
    shutil.rmtree(paths.rendezvous, ignore_errors=True)


def _let_ranks_leave(children: list[procs.Child], grace_s: float) -> None:
    """A finished run's ranks notice it within a tick and leave on their own; wait for that a moment."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(c.exit_code is None for c in children if c.name.startswith("rank")):
        time.sleep(0.2)


def rank_env(rank: int) -> dict[str, str]:
    """One CPU slot per rank: one thread, and vLLM's CPU worker pinned to the rank's core (vLLM's
    automatic binding would pin every engine of the machine to the same core)."""
    env = {"OMP_NUM_THREADS": "1"}
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(rank % (os.cpu_count() or 1))
    return env


def engines_up(store: RunStore, version: int, since: float) -> tuple[int, int] | None:
    """(rollout ranks whose engine is up since `since`, rollout ranks of `version`'s plan); None before
    the control plane's first plan."""
    plan = store.plan_at(version)
    if plan is None:
        return None
    rollout = {r for r, role in plan.roles.items() if role is Role.ROLLOUT}
    up = {e["rank"] for e in store.recent_events(4 * len(plan.roles) + 16, kinds=["engine_up"]) if e["ts"] >= since}
    return len(up & rollout), len(rollout)


def _watch(store: RunStore, children: list[procs.Child], out: TextIO, eval_tasks: int,
           launched_at: float, *, restart: Restarter | None = None,
           restart_limit: int = 0, own_ranks: RunPaths | None = None) -> tuple[RunState, str]:
    """Show progress until the run ends; restart what died where allowed (`own_ranks`: the run's paths
    where its ranks are this launcher's own children, which lets an actor or ref rank that died restart
    with its trainer group)."""
    from tiderl.observe import collect, progress_line

    restarts: dict[str, int] = {}
    is_tty = out.isatty()
    last_line, last_print = "", 0.0
    first_version = store.run_info().version
    while True:
        time.sleep(PROGRESS_S)
        doc = collect(store)
        # Until the first step of this launch, what it waits for: the engines starting.
        engines = engines_up(store, doc["version"], launched_at) if doc["version"] == first_version else None
        line = progress_line(doc, eval_tasks, engines)
        if is_tty:
            print("\r" + line, end="", file=out, flush=True)
        elif line != last_line and time.monotonic() - last_print >= LOG_EVERY_S:
            # Not a terminal (a log file, CI): a new line when something changed, at most every few seconds.
            print(line.rstrip(), file=out, flush=True)
            last_line, last_print = line, time.monotonic()
        if doc["state"] == RunState.FINISHED.value:
            return RunState.FINISHED, doc["message"] or ""
        control = next(c for c in children if c.name == "control")
        for i, child in enumerate(children):
            code = child.exit_code
            if code is not None and (child is not control or code != 0):
                # Ranks leave on their own once the run is over: that is no failure, even if it happened
                # after `doc` was read.
                now = store.run_info().state
                if now.is_terminal:
                    return now, store.run_info().message or ""
                replacement = replace_child(store, child, code, restart, restarts, restart_limit, out)
                if replacement is not None:
                    children[i] = replacement
                    continue
                if own_ranks is not None and restart_trainer_group(store, children, child, code, restart,
                                                                    restarts, restart_limit, own_ranks, out):
                    continue
                return RunState.FAILED, f"{child.name} exited with code {code} (log: {child.log_path})"
        if control.exit_code == 0:
            return RunState(doc["state"]), doc["message"] or ""


