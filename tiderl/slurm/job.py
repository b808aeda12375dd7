"""What runs inside the Slurm job of `tiderl submit`: the submitted function, `SlurmRun`.

It runs in the batch step on the first node (submitit with `slurm_use_srun=False`)
and is the local launcher with one difference: the ranks start as one `srun`
step (`submit.rank_step_of`) instead of local children. Env servers and the
control plane are its children, as with `tiderl run`.

Every attempt of the job (the first, and each one after a requeue) runs the
same pickled `SlurmRun`: it resumes the run directory when an earlier attempt
had started it, exactly as `tiderl run --resume` does (old ranks declared dead,
their claims back in the pool, weights newer than the last committed version
dropped by the trainer, new env servers).

Signals:
- SIGUSR2 (`--signal=B:USR2@N` before the time limit, or a preemption warning):
  stop every child, leave the run resumable, then submitit's handler calls
  `checkpoint` (the run store is the checkpoint: it re-submits the same
  `SlurmRun`) and requeues the job.
- SIGTERM (scancel, `scontrol requeue`, preemption without warning): stop
  every child and leave the run resumable; Slurm requeues or ends the job.
"""

from __future__ import annotations

import signal
import types
from pathlib import Path

import submitit

from tiderl.paths import RunPaths
from tiderl.run import procs
from tiderl.run.launcher import Interrupted, Launch, prepare, run_launch
from tiderl.slurm.submit import SRUN_LOG, rank_step_env, rank_step_of
from tiderl.store.types import RunState


# Ranks of a finished run leave by themselves (engines closed, state recorded); stopping the srun step
# before that kills them and the step reads CANCELLED. Closing engines takes tens of seconds on a busy node.
FINISH_GRACE_S = 90.0


class RunNotFinished(RuntimeError):
    """The run ended failed, or Slurm stopped it: the job ends with this error (Slurm state FAILED)."""


def start_slurm_ranks(launch: Launch, tag: dict[str, str]) -> list[procs.Child]:
    """The ranks as one multi-task srun step of this job; one child (srun) stands for all of them.
    The step is `submit.rank_step_of`, the one `tiderl submit --dry-run` prints."""
    argv = rank_step_of(launch.config, launch.paths.root)
    env = tag | rank_step_env(launch.config.slurm)
    return [procs.spawn("ranks", argv, launch.paths.logs / SRUN_LOG, env=env)]


class SlurmRun(submitit.helpers.Checkpointable):
    """The submitted function: run (or resume) the run in `run_dir` until it ends."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> str:
        launch = prepare(None, [], None, Path(self.run_dir))
        state = launch.store.run_info().state
        if state in (RunState.FINISHED, RunState.CANCELLED):
            launch.store.close()
            return f"run {self.run_dir} is already {state.value}: nothing to run"
        # The first attempt finds the run as `tiderl submit` created it; later attempts resume it.
        launch.resumed = state is not RunState.STARTING
        env = submitit.JobEnvironment()
        print(f"tiderl: job {env.job_id} on {env.hostname}, run dir {self.run_dir}"
              f"{' (resumed)' if launch.resumed else ''}", flush=True)

        received: list[int] = []
        launching = [True]

        def interrupt(signum: int, frame: types.FrameType | None) -> None:
            received.append(signum)
            # Once, and only inside the launch: a second signal must not break the clean-up the first started.
            if len(received) == 1 and launching[0]:
                raise Interrupted(f"job {env.job_id} stopped by Slurm ({signal.Signals(signum).name}); "
                                  "a requeued job resumes the run")

        requeue = signal.getsignal(signal.SIGUSR2)  # submitit's checkpoint-and-requeue handler
        previous_term = signal.signal(signal.SIGTERM, interrupt)
        signal.signal(signal.SIGUSR2, interrupt)
        try:
            code = run_launch(launch, start_ranks=start_slurm_ranks, finish_grace_s=FINISH_GRACE_S)
        finally:
            launching[0] = False
            signal.signal(signal.SIGTERM, previous_term)
            signal.signal(signal.SIGUSR2, requeue)
        if received and received[0] == signal.SIGUSR2 and callable(requeue):
            requeue(signal.SIGUSR2, None)  # checkpoint() below, `scontrol requeue`, exit
        if code == 0:
            return f"run {self.run_dir} finished"
        if code == 130:
            return f"run {self.run_dir} cancelled"
        raise RunNotFinished(f"run {self.run_dir} did not finish (launcher exit code {code}): "
                             f"see {RunPaths(Path(self.run_dir)).logs}")

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        # The run store and the trainer's checkpoints are the state: the same call resumes them.
        return submitit.helpers.DelayedSubmission(SlurmRun(self.run_dir))

