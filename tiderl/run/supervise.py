"""Restarting a process of the run that died: the one policy, and the supervisor of a Slurm task.

Locally the launcher (`tiderl.run.launcher`) watches every child and restarts what `restartable`
allows. Under Slurm the ranks are the tasks of one srun step, which the batch step's launcher sees
as one child: there each task runs `python -m tiderl.run.rank RUN_DIR` as its own supervisor
(`supervise`), which runs the rank as a child process and, when it dies while rolling out,
quarantines it (dead, its claims back in the pool) and starts it again; the step goes on with
every other rank untouched.

An actor or ref that dies inside a step restarts with its whole trainer group (`group_restartable`):
every actor and ref rank is stopped, their claims go back, and they start again from the last
published version while the rollout ranks carry on. The group's restart generation lives in the run
store (`RunStore.trainer_generation`): a restart moves it on, naming the ranks it stops, and each
generation's steps meet in their own rendezvous directory (`RunPaths.rendezvous_generation`), so a
restarted group never finds the broken step's files. Locally the launcher owns every rank process
and stops and starts the group itself (`restart_trainer_group`). Under Slurm no process owns them
all: the supervisor of the rank that died moves the generation on (`advance_trainer_generation`,
a compare-and-set, so two members that die together move it once), and every supervisor reads the
generation every `GENERATION_POLL_S`: one whose rank the new generation names stops its rank and
starts it again (`_wait_child`). Past `launch.restarts` group restarts (counted from the task's
start), the task ends with the rank's exit code and `srun --kill-on-bad-exit` ends the step, as
before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from collections.abc import Callable
from typing import TextIO

from tiderl.paths import RunPaths
from tiderl.roles import Role
from tiderl.run import procs
from tiderl.store import RunStore
from tiderl.store.engine import StoreError
from tiderl.store.types import RunState, TrainerGeneration

Restarter = Callable[[procs.Child], "procs.Child | None"]
"""How the local launcher starts a replacement for a child that died (None: it cannot)."""

CHILD_ENV = "TIDERL_SUPERVISED"  # set in the rank a supervisor runs: that one is the rank itself
POLL_S = 0.5
GENERATION_POLL_S = 2.0  # how often a Slurm task's supervisor reads the trainer group's generation


def restartable(name: str, role: Role | None, restarts: int, limit: int) -> bool:
    """Whether a child that died is restarted in place: the control plane and env servers always (up to
    `limit` times each), a rank only while rolling out (its tasks return to the pool and any rank may
    run them); an actor or ref is inside a step with others, which a lone newcomer cannot join."""
    if restarts >= limit:
        return False
    if name.startswith("rank"):
        return role is Role.ROLLOUT
    return name == "control" or name.startswith("env")


TRAINER_GROUP = "trainer"  # the restart count of the trainer group (its actor and ref ranks together)


def group_restartable(role: Role | None, restarts: int, limit: int) -> bool:
    """Whether an actor or ref rank that died is restarted with its whole trainer group (every actor and
    ref rank stopped, their claims back, all started again from the last published version; the local
    launcher only): the step in flight is lost, nothing it trained was committed."""
    return role in (Role.ACTOR, Role.REF) and restarts < limit


def quarantine(store: RunStore, rank: int, code: int, n: int, limit: int, where: str) -> str:
    """A dead rank's claims back in the pool before it restarts; returns what to add to the messages."""
    back = store.declare_dead(rank, f"rank {rank} exited with code {code} while rolling out; restart {n} of "
                                    f"{limit} ({where})")
    return f"; its {back.tasks_returned} tasks went back to the pool"


def record_restart(store: RunStore, name: str, rank: int | None, code: int, n: int, limit: int, returned: str) -> None:
    store.record_event("launcher" if rank is None else f"rank{rank}", "restarted",
                       f"{name} restarted ({n} of {limit}) after it exited with code {code}{returned}",
                       rank=rank, data={"process": name, "code": code})


def supervise(run_dir: Path, rank: int, *, child_argv: list[str] | None = None, limit: int | None = None,
              poll_s: float = POLL_S) -> int:
    """Run rank `rank` as a child until it ends; restart it where `restartable` allows. Returns the exit
    code of the rank's last run. SIGTERM and SIGINT go to the rank, and end the supervision (SIGUSR2 is the
    launcher's alone: `procs.launcher_child_setup`)."""
    from tiderl.config import load_job
    from tiderl.paths import RunPaths

    argv = child_argv or [sys.executable, "-m", "tiderl.run.rank", str(run_dir), str(rank)]
    if limit is None:
        limit = load_job(RunPaths(Path(run_dir)).config).launch.restarts
    stopping: list[int] = []
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        if child:
            try:
                os.killpg(child[0].pid, signum)
            except ProcessLookupError:
                pass  # the rank and its group are gone: nothing to forward to

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(Path(run_dir), rank, argv, limit, poll_s, stopping, child)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(run_dir: Path, rank: int, argv: list[str], limit: int, poll_s: float, stopping: list[int],
               child: list[subprocess.Popen[bytes]]) -> int:
    restarts = 0
    store = RunStore.for_run_dir(run_dir)
    try:
        seen = store.trainer_generation()
        first = seen.number  # group restarts are counted from the task's start, as locally from the launch's
        while True:
            proc = subprocess.Popen(argv, env={**os.environ, CHILD_ENV: "1"}, start_new_session=True,
                                    preexec_fn=procs.launcher_child_setup)
            child[:] = [proc]
            seen, joined = _wait_child(proc, store, rank, seen, poll_s, stopping)
            code = proc.returncode
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what it left in its group (a vLLM engine core)
            except ProcessLookupError:
                pass  # it left nothing
            if stopping or (code == 0 and not joined):
                return code
            state, _ = store.position()
            if state is not RunState.RUNNING:
                return code
            if joined:  # the trainer group restarts around another member's death: this rank goes with it
                _stop_for_group(store, rank, seen)
                continue
            role = next((r.role for r in store.ranks() if r.rank == rank), None)
            if restartable(f"rank{rank}", role, restarts, limit):
                restarts += 1
                returned = quarantine(store, rank, code, restarts, limit, "restarted by its Slurm task")
                record_restart(store, f"rank{rank}", rank, code, restarts, limit, returned)
                print(f"tiderl: rank {rank} exited with code {code}: restarting it ({restarts} of {limit}){returned}",
                      file=sys.stderr, flush=True)
                continue
            restarted = _restart_group(store, rank, role, code, seen, first, limit)
            if restarted is None:
                return code
            seen = restarted
    finally:
        store.close()


def _wait_child(proc: subprocess.Popen[bytes], store: RunStore, rank: int, seen: TrainerGeneration,
                poll_s: float, stopping: list[int]) -> tuple[TrainerGeneration, bool]:
    """Wait until the rank ends, reading the trainer group's generation every GENERATION_POLL_S; a newer
    generation that names this rank stops it (its group is restarting). Returns the newest generation
    read and whether it stopped the rank for it."""
    next_read = time.monotonic() + GENERATION_POLL_S
    while proc.poll() is None:
        time.sleep(poll_s)
        if stopping or time.monotonic() < next_read:
            continue
        next_read = time.monotonic() + GENERATION_POLL_S
        try:
            now = store.trainer_generation()
        except StoreError:
            continue  # the store is away: read it again later (the rank rides the outage out itself)
        if now.number > seen.number:
            seen = now
            if rank in now.members:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it ended just now
                proc.wait()
                return seen, True
    return seen, False


def _stop_for_group(store: RunStore, rank: int, generation: TrainerGeneration) -> None:
    store.declare_dead(rank, f"rank {rank} stopped to restart the trainer group (generation {generation.number})")
    print(f"tiderl: rank {rank}: the trainer group restarts (generation {generation.number}, ranks "
          f"{', '.join(map(str, generation.members))}): restarting this rank with it", file=sys.stderr, flush=True)


def _restart_group(store: RunStore, rank: int, role: Role | None, code: int, seen: TrainerGeneration, first: int,
                   limit: int) -> TrainerGeneration | None:
    """The rank died as actor or ref: move the trainer group to a new generation (or join the one another
    member's supervisor just started for the same failure), quarantine the rank and return the generation
    it restarts in; None where `group_restartable` refuses (the task then ends with the rank's code)."""
    for _ in range(3):  # a compare-and-set lost to another supervisor is read again
        now = store.trainer_generation()
        if now.number > seen.number and rank in now.members:
            _stop_for_group(store, rank, now)  # its death and the restart are one failure
            return now
        if not group_restartable(role, now.number - first, limit):
            return None
        members = sorted({r.rank for r in store.ranks() if r.role in (Role.ACTOR, Role.REF)} | {rank})
        if store.advance_trainer_generation(now.number, members):
            moved = TrainerGeneration(now.number + 1, tuple(members))
            back = store.declare_dead(rank, f"rank {rank} ({role.value if role else '?'}) exited with code {code} inside a step; the "
                                            f"trainer group restarts (generation {moved.number})")
            names = ", ".join(f"rank{m}" for m in members)
            store.record_event(f"rank{rank}", "trainer_restarted",
                               f"trainer group ({names}) restarted ({moved.number - first} of {limit}) after "
                               f"rank{rank} exited with code {code} inside a step; {back.trajectories_returned} "
                               "claimed trajectories back to ready", rank=rank,
                               data={"process": f"rank{rank}", "code": code, "members": names,
                                     "generation": moved.number})
            print(f"tiderl: rank {rank} ({role.value if role else '?'}) exited with code {code} inside a step: restarting the trainer "
                  f"group ({names}; generation {moved.number})", file=sys.stderr, flush=True)
            return moved
    return None


def replace_child(store: RunStore, child: procs.Child, code: int, restart: Restarter | None,
             restarts: dict[str, int], limit: int, out: TextIO) -> procs.Child | None:
    """A child that died, started again where `restartable` allows it (a rank is quarantined first: dead,
    its claims back in the pool); None when the run must fail instead."""
    if restart is None:
        return None
    rank = int(child.name[4:]) if child.name.startswith("rank") and child.name[4:].isdigit() else None
    role = next((r.role for r in store.ranks() if r.rank == rank), None) if rank is not None else None
    if not restartable(child.name, role, restarts.get(child.name, 0), limit):
        return None
    restarts[child.name] = n = restarts.get(child.name, 0) + 1
    procs.stop([child])  # what it left in its process group (a rank's vLLM engine core)
    try:
        returned = quarantine(store, rank, code, n, limit, f"log: {child.log_path}") if rank is not None else ""
    except StoreError as e:  # its claims return at the heartbeat timeout instead
        returned = f"; its tasks could not be returned to the pool now ({e})"
    print(f"\n{child.name} exited with code {code}: restarting it ({n} of {limit}){returned}", file=out, flush=True)
    try:
        replacement = restart(child)
    except Exception as e:  # the replacement did not come up: the run fails on the original death
        print(f"{child.name} did not restart: {type(e).__name__}: {e}", file=out, flush=True)
        return None
    if replacement is not None:
        try:
            record_restart(store, child.name, rank, code, n, limit, returned)
        except StoreError as e:
            print(f"{child.name}'s restart could not be recorded in the run store: {e}", file=out, flush=True)
    return replacement


def rank_of(name: str) -> int | None:
    return int(name[4:]) if name.startswith("rank") and name[4:].isdigit() else None


def restart_trainer_group(store: RunStore, children: list[procs.Child], dead: procs.Child, code: int,
                           restart: Restarter | None, restarts: dict[str, int], limit: int, paths: RunPaths,
                           out: TextIO) -> bool:
    """An actor or ref rank died inside a step with others: stop the trainer group (every actor and ref
    rank), give their claims back, move the group to a new generation (a fresh rendezvous; the broken
    step's files removed) and start them all again; they resume from the last published version
    (uncommitted weights are dropped) while rollout ranks carry on. False where `group_restartable`
    refuses (the run then fails, as before)."""
    rank = rank_of(dead.name)
    if restart is None or rank is None:
        return False
    roles = {r.rank: r.role for r in store.ranks()}
    n = restarts.get(TRAINER_GROUP, 0)
    if not group_restartable(roles.get(rank), n, limit):
        return False
    restarts[TRAINER_GROUP] = n = n + 1
    members = [c for c in children if (r := rank_of(c.name)) is not None
               and roles.get(r) in (Role.ACTOR, Role.REF)]
    names = ", ".join(c.name for c in members)
    print(f"\n{dead.name} ({roles.get(rank)}) exited with code {code} inside a step: restarting the trainer "
          f"group ({names}; {n} of {limit}) from the last published version", file=out, flush=True)
    procs.stop(members)
    returned = 0
    for c in members:
        member = rank_of(c.name)
        assert member is not None
        try:
            returned += store.declare_dead(member, f"rank {member} stopped to restart the trainer group after "
                                                   f"{dead.name} exited with code {code}").trajectories_returned
        except StoreError as e:
            print(f"the claims of {c.name} could not be returned now ({e})", file=out, flush=True)
    try:
        generation = store.trainer_generation().number
        store.advance_trainer_generation(generation, sorted(r for c in members if (r := rank_of(c.name)) is not None))
    except StoreError as e:  # the group meets in the old generation's directory, emptied below
        print(f"the trainer group's new generation could not be recorded now ({e})", file=out, flush=True)
        generation = None
    # The broken step's marker and rendezvous files (its members are stopped).
    shutil.rmtree(paths.rendezvous_generation(generation) if generation is not None else paths.rendezvous,
                  ignore_errors=True)
    for c in members:
        try:
            replacement = restart(c)
        except Exception as e:
            print(f"{c.name} did not restart: {type(e).__name__}: {e}", file=out, flush=True)
            return False
        if replacement is None:
            return False
        children[children.index(c)] = replacement
    try:
        store.record_event("launcher", "trainer_restarted",
                           f"trainer group ({names}) restarted ({n} of {limit}) after {dead.name} exited with "
                           f"code {code} inside a step; {returned} claimed trajectories back to ready",
                           rank=rank, data={"process": dead.name, "code": code, "members": names})
    except StoreError as e:
        print(f"the trainer group's restart could not be recorded in the run store: {e}", file=out, flush=True)
    return True
