"""A rank process: long-lived; at every sync boundary it reads its role and runs that role's loop.

    python -m tiderl.run.rank RUN_DIR RANK
    srun --ntasks=N python -m tiderl.run.rank RUN_DIR    (each task's rank from Slurm, via submitit; the
                                                          task supervises its rank: tiderl.run.supervise)

observe (the published version and its plan) -> act (the role's loop until the
next boundary) -> record (heartbeats and reports go through the run store).
A rank never restarts to change role: its engine, actor or ref model stays
loaded in the process (`RankContext.engine`, `.actor`, `.ref`) while it serves another role.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tiderl.paths import use_private_umask
from tiderl.run.context import RankContext, RunStopped
from tiderl.run.supervise import CHILD_ENV, supervise
from tiderl.run.weights import close_weight_server
from tiderl.store import RankDeclaredDeadError
from tiderl.store.engine import StoreError
from tiderl.store.types import EventRecord, PlanRecord, RankReport, RankState, Role

log = logging.getLogger("tiderl.rank")
EXIT_DECLARED_DEAD = 75  # EX_TEMPFAIL: the rank was declared dead while away and left; a restart may take its place


async def _wait_next(ctx: RankContext, version: int) -> PlanRecord:
    """Idle until a version after `version` is published and planned."""
    while True:
        plan = ctx.boundary(version)
        if plan is not None:
            return plan
        await ctx.bell("planned").wait_async(ctx.poll_s)  # heartbeats come from the rank's heartbeat thread


async def serve(ctx: RankContext) -> None:
    from tiderl.run.rollout_role import rank_engine, release_engine, run_rollout
    from tiderl.run.handoff import hand_off
    from tiderl.run.trainer_role import release_trainer_group, run_actor_step, run_ref_step

    version = ctx.position()
    plan = await ctx.wait_plan(version)
    ctx.store.register_rank(ctx.rank, plan.roles[ctx.rank])
    previous: Role | None = None
    while True:
        hand_off(ctx, plan)  # a sharded actor's state that the step trains in another layout is checked in
        role = plan.roles[ctx.rank]
        if role is not previous:
            log.info("rank %d: role %s from version %d", ctx.rank, role.value, plan.version)
            ctx.store.report(RankReport(rank=ctx.rank, role=role, version=plan.version, events=[EventRecord(
                "role", f"rank {ctx.rank} is {role.value} from version {plan.version}",
                {"version": plan.version, "role": role.value, "previous": previous.value if previous else None})]))
            previous = role
        if role not in (Role.ACTOR, Role.REF):
            release_trainer_group(ctx)  # no step of this rank's runs in it now
        else:
            await release_engine(ctx)  # the trainer's model in the accelerator memory the engine held
        if role is Role.IDLE and ctx.system.uses_ers and ctx.config.ers.enabled and _engine_wanted(ctx):
            # A parked rollout rank: its engine ready, so that ERS moves it to rollout at a reload's cost,
            # as the simulator prices the move. A fixed split's spare never moves: it starts nothing.
            rank_engine(ctx)
        if role is Role.ROLLOUT:
            nxt = await run_rollout(ctx, plan)
            if nxt is None:
                return
            plan = nxt
            continue
        if role is Role.ACTOR and plan.version < ctx.config.trainer.num_steps:
            await run_actor_step(ctx, plan)
        elif role is Role.REF and plan.ra2p_mode == "decoupled":
            await run_ref_step(ctx, plan)
        plan = await _wait_next(ctx, plan.version)
        ctx.store.report(RankReport(rank=ctx.rank, role=plan.roles[ctx.rank], version=plan.version))


def _engine_wanted(ctx: RankContext) -> bool:
    """Does this idle ERS rank start its engine now? Always with an accelerator of its own; on a shared host
    with `ers.idle_engines: on_demand` only once the control plane asked (docs/ers.md, the plan's invariant 14)."""
    ers = ctx.config.ers
    if ctx.engine is not None or ers.host_slots is None or ers.idle_engines == "parked":
        return True
    return ctx.rank in ctx.store.ranks_with_event("engine_wanted", since_start=False)


def _heartbeats(ctx: RankContext, stopped: threading.Event, *, on_give_up: Callable[[], None] | None = None,
                clock: Callable[[], float] = time.monotonic, declared_dead: threading.Event | None = None) -> None:
    """Beat every `heartbeat_s`, unless a report of the rank carried a beat within the last `heartbeat_s`
    (a rollout rank's tick report does, several times a second: a third of a large run's commits
    saved, docs/RESULTS.md "Run store"). A store error (a lock held past the retries, a filesystem hiccup) is
    retried at the next beat; only when no beat got through for `heartbeat_timeout_s` (the control
    plane has declared the rank dead and given its claims to others by then) does it give up: the
    rank leaves (`on_give_up`, by default SIGTERM to itself) instead of working on without a claim.
    A rank the store says was declared dead (it came back after the timeout) leaves at once, setting
    `declared_dead`."""
    declared_dead = declared_dead or threading.Event()
    launch = ctx.config.launch
    last_ok = clock()
    failing = False
    while not stopped.wait(launch.heartbeat_s):
        age = ctx.store.beat_age_s(ctx.rank)
        if age is not None and age < launch.heartbeat_s:  # the rank's own report beat for it (its tick)
            failing = False
            last_ok = clock()
            continue
        try:
            ctx.store.heartbeat(ctx.rank)
        except RankDeclaredDeadError as e:
            log.error("rank %d: %s; leaving, so that a fresh start takes its place", ctx.rank, e)
            declared_dead.set()
            (on_give_up or (lambda: os.kill(os.getpid(), signal.SIGTERM)))()
            return
        except StoreError as e:
            silent_s = clock() - last_ok
            if silent_s < launch.heartbeat_timeout_s:
                if not failing:
                    log.warning("rank %d: heartbeat failed (%s); retrying every %.0f s", ctx.rank, e,
                                launch.heartbeat_s)
                failing = True
                continue
            log.error("rank %d: no heartbeat got through for %.0f s (the timeout is %.0f s): %s; leaving",
                      ctx.rank, silent_s, launch.heartbeat_timeout_s, e)
            (on_give_up or (lambda: os.kill(os.getpid(), signal.SIGTERM)))()
            return
        if failing:
            log.info("rank %d: heartbeats get through again after %.0f s", ctx.rank, clock() - last_ok)
        failing = False
        last_ok = clock()


def rank_from_slurm() -> int:
    """This task's global rank in a multi-task Slurm step (`SLURM_PROCID`, read through submitit).

    Also gives the task what the local launcher gives each rank (`launcher.rank_env`): one thread, and
    vLLM's CPU worker pinned to a core of its own.
    """
    import os

    import submitit

    if "SLURM_PROCID" not in os.environ:
        raise SystemExit("python -m tiderl.run.rank: no RANK given and not a task of a Slurm step "
                         "(SLURM_PROCID is unset)")
    rank = submitit.JobEnvironment().global_rank
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(rank % (os.cpu_count() or 1)))
    return rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiderl.run.rank")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("rank", type=int, nargs="?", default=None,
                        help="This process's rank (default: its task rank in the Slurm step it runs in).")
    args = parser.parse_args(argv)
    use_private_umask()  # as the launcher's (a Slurm task may not have inherited it)
    if args.rank is None:
        args.rank = rank_from_slurm()
        if os.environ.get(CHILD_ENV) != "1":
            # A task of the Slurm step: supervise the rank, so that a rollout rank that dies is restarted
            # in its task while the step and every other rank carry on (tiderl.run.supervise).
            return supervise(args.run_dir, args.rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    ctx = RankContext.open(args.run_dir, args.rank)
    import socket

    # Where this process's part of the log begins (a Slurm rank's log has no launcher marker).
    log.info("===== rank %d starts: pid %d on %s, run at version %d =====", args.rank, os.getpid(),
             socket.gethostname(), ctx.store.position()[1])
    # The launcher stops ranks with SIGTERM: leave through the cleanup below (engine closed, state recorded).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Heartbeats from their own thread: an engine start or a training step blocks the role loop for
    # longer than the heartbeat timeout on a loaded machine, and that must not read as a dead rank.
    stopped = threading.Event()
    declared_dead = threading.Event()
    beat = threading.Thread(target=_heartbeats, args=(ctx, stopped), kwargs={"declared_dead": declared_dead},
                            name="heartbeat", daemon=True)
    beat.start()
    # This process's own Prometheus registry (vLLM's `vllm:*` metrics live there), when the run serves metrics.
    from tiderl.observe import serve_process_metrics

    serve_process_metrics(ctx.paths.root, ctx.config, ctx.rank)
    state = RankState.STOPPED
    code = 0
    try:
        asyncio.run(serve(ctx))
    except RunStopped as e:
        log.info("rank %d: run %s, stopping", ctx.rank, e)
    except (RankDeclaredDeadError, SystemExit) as e:
        if isinstance(e, RankDeclaredDeadError) or declared_dead.is_set():
            # Away past the heartbeat timeout (stopped, or starved of CPU): its tasks are others' now. It
            # stays dead and leaves with EX_TEMPFAIL; a launcher restarts a rollout rank afresh.
            state, code = RankState.DEAD, EXIT_DECLARED_DEAD
            log.error("rank %d: declared dead while away; leaving (exit %d)", ctx.rank, code)
            ctx.store.record_event(f"rank{ctx.rank}", "rank_left", f"rank {ctx.rank} (pid {os.getpid()}) was "
                                   "declared dead while away; it left, its claims already with other ranks",
                                   rank=ctx.rank)
        else:
            log.info("rank %d: stopped by signal", ctx.rank)
    except Exception as e:
        # Shown as `failed` with this event by `tiderl status`, not as a rank that merely stopped.
        state = RankState.FAILED
        ctx.store.record_event(f"rank{ctx.rank}", "rank_failed", f"rank {ctx.rank} failed: {type(e).__name__}: "
                               f"{str(e)[:500]}", rank=ctx.rank)
        raise
    finally:
        stopped.set()
        # The state first: closing an engine can outlast the launcher's grace period.
        ctx.store.set_rank_state(ctx.rank, state)
        engine = ctx.engine
        try:
            close_weight_server(ctx)  # the leader's shared-memory buckets go with it
            if engine is not None:
                engine.close()
        finally:
            ctx.store.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
