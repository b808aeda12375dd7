"""`tiderl submit JOB.yaml [--set k=v ...] [--run-dir DIR] [--dry-run [--advise W C] | --parsable | --json] [--wait]`.

A run as one Slurm job. The config is validated as `tiderl run` and `tiderl config`
validate it (`tiderl.rundir.validate_job`: env options, engine, model, trainer backend),
and it is laid out on the `slurm:` resources before anything is written (exit 2 on a bad one); resources that
look CPU-sized for a GPU job are warned about on stderr
(`sbatch.resource_warnings`). `--dry-run` prints the sbatch script and the
ranks' srun step, and stops there; with `--advise WORKLOAD CLUSTER` it also prints what the
simulator predicts for the job's operating point and its neighbours (`tiderl plan`'s advice, with the
`--set` overrides of the recommendation). Otherwise the request is checked against
what its partition can ever give (`tiderl.slurm.fit`; exit 2 naming the field
to change, nothing created), then the run directory and store are
created here (so the job only ever resumes what exists), submitit submits
`tiderl.slurm.job.SlurmRun`, and the job id goes into `RUN_DIR/slurm/jobs.json`.

stdout: `job ID` and `run dir DIR` lines, or with `--parsable` only what
`sbatch --parsable` prints, with `--json` one JSON object
(`submit.submission_record`). In those two modes every other line (`--wait`'s
progress included) goes to stderr, so stdout stays machine-readable.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tiderl.config.cli import add_override_argument

if TYPE_CHECKING:
    from tiderl.config import JobConfig
    from tiderl.slurm.cluster import SlurmCluster

WAIT_POLL_S = 5.0
EXIT_FINISHED, EXIT_NOT_FINISHED, EXIT_BAD_INPUT = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=Path, help="Job file (jobs/*.yaml).")
    add_override_argument(parser)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="Run directory to create, on a filesystem every node sees "
                             "(default: launch.runs_dir/NAME-TIMESTAMP).")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--dry-run", action="store_true",
                        help="Print the sbatch script that would be submitted, then the ranks' srun step as "
                             "comment lines; create and submit nothing.")
    output.add_argument("--parsable", action="store_true",
                        help="Print only the job id, as `sbatch --parsable` does (JOBID, or JOBID;CLUSTER when "
                             "the job went to a named cluster); other lines go to stderr.")
    output.add_argument("--json", action="store_true",
                        help="Print one JSON object: job_id, cluster, job_name, run_dir, logs (every log path), "
                             "follow and status (commands); other lines go to stderr.")
    parser.add_argument("--wait", action="store_true",
                        help="Follow the run until its job ends; exit 0 only if the run finished.")
    parser.add_argument("--advise", nargs=2, metavar=("WORKLOAD", "CLUSTER"), default=None,
                        help="With --dry-run: simulate the job's operating point and its neighbours (half and "
                             "twice the GPUs and groups, one version of staleness less and more) on these "
                             "simulator files with the job's settings in them (tiderl plan), and print the "
                             "advice after the script, with the --set overrides of the recommendation.")


def run(args: argparse.Namespace) -> int:
    from tiderl.config import load_job
    from tiderl.paths import use_private_umask
    from tiderl.rundir import RunDirError, create_run, default_run_dir, validate_job
    from tiderl.slurm.cluster import SlurmCluster, SlurmError
    from tiderl.slurm.runjobs import slurm_dir
    from tiderl.slurm.sbatch import SlurmScriptError, resource_warnings
    from tiderl.slurm.submit import dry_run_text, parsable_line, run_parameters, submission_record
    from tiderl.store.types import RunState

    if args.advise is not None and not args.dry_run:
        print("tiderl submit: --advise goes with --dry-run (nothing submitted)", file=sys.stderr)
        return EXIT_BAD_INPUT
    config = load_job(args.job, args.overrides)  # ConfigError: exit 2 (tiderl.cli), nothing created
    # The check `tiderl run` and `tiderl config` make (env options, engine, model, trainer backend, memory),
    # likewise: before a dry run, before any queue.
    plan = validate_job(config)
    run_dir = (args.run_dir if args.run_dir is not None else default_run_dir(config)).absolute()
    try:
        params = run_parameters(config, run_dir)
    except SlurmScriptError as e:
        print(f"tiderl submit: {args.job}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for warning in resource_warnings(config.slurm):
        print(f"tiderl submit: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        advice = None
        if args.advise is not None:  # files checked before anything prints: exit 2 names the one at fault
            advice = _advise(config, args)
            if isinstance(advice, int):
                return advice
        print(dry_run_text(config, run_dir, slurm_dir(run_dir)), end="")
        if plan:
            print(plan, end="")
        if advice is not None:
            from tiderl.sim.plan_cli import advice_lines

            print(advice_lines(advice, str(args.job), args.overrides), end="")
        return 0
    cluster = SlurmCluster()
    try:
        cluster.ping()
    except SlurmError as e:
        print(f"tiderl submit: {e} (every Slurm client needs SLURM_CONF when the cluster's config is not "
              "in the default place)", file=sys.stderr)
        return EXIT_NOT_FINISHED
    try:
        findings = fit_findings(cluster, config)
    except SlurmError as e:
        print(f"tiderl submit: warning: could not read the partition's limits ({e}); submitting unchecked",
              file=sys.stderr)
        findings = []
    if findings:
        for finding in findings:
            print(f"tiderl submit: {args.job}: {finding}", file=sys.stderr)
        print("tiderl submit: nothing submitted: the partition could never start this job", file=sys.stderr)
        return EXIT_BAD_INPUT
    use_private_umask()  # the run's files, and the batch job's (sbatch passes the umask on), its user's alone
    try:
        paths, store = create_run(config, run_dir)
    except RunDirError as e:
        print(f"tiderl submit: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        job_id, cluster_name = submit_run(run_dir, params, max_time_limits=config.slurm.max_time_limits)
    except Exception as e:
        store.set_run_state(RunState.FAILED, f"not submitted: {type(e).__name__}: {e}")
        print(f"tiderl submit: submitting {run_dir} failed: {e}", file=sys.stderr)
        return EXIT_NOT_FINISHED
    finally:
        store.close()
    # Scripts read stdout: in the machine-readable modes it holds that one answer, the rest goes to stderr.
    if args.parsable:
        print(parsable_line(job_id, cluster_name), flush=True)
    elif args.json:
        print(json.dumps(submission_record(config, paths.root, job_id, cluster_name)), flush=True)
    else:
        print(f"job {job_id}")
        print(f"run dir {paths.root}", flush=True)
    if not args.wait:
        return 0
    try:
        return follow(run_dir, job_id, out=sys.stderr if args.parsable or args.json else sys.stdout)
    except KeyboardInterrupt:
        print(f"\ntiderl submit: stopped following; job {job_id} goes on (tiderl cancel {run_dir} ends it)",
              file=sys.stderr)
        return 130


def _advise(config: JobConfig, args: argparse.Namespace) -> dict | int:
    """`--advise WORKLOAD CLUSTER`: the plan around the job (tiderl.sim.plan_cli.advise_job), or EXIT_BAD_INPUT
    after naming a missing, broken or swapped file."""
    import os

    from tiderl.config import ConfigError
    from tiderl.sim.plan_cli import advise_job

    workload, cluster = args.advise
    for label, path in (("WORKLOAD", workload), ("CLUSTER", cluster)):
        if not os.path.isfile(path):
            print(f"tiderl submit: --advise {label}: {path}: no such file", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        return advise_job(config, workload, cluster, jobs=os.cpu_count() or 1)
    except ConfigError as e:
        print(f"tiderl submit: --advise: config error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def fit_findings(cluster: "SlurmCluster", config: "JobConfig") -> list[str]:
    """What of the job's request its partition (`slurm.partition`, else the cluster's default) can never
    give, each naming the field to change (tiderl.slurm.fit); empty when it fits or no partition applies."""
    from tiderl.slurm.fit import SlurmRequest, misfits
    from tiderl.slurm.sbatch import ranks_per_node

    slurm = config.slurm
    partitions = cluster.partitions()
    if slurm.partition is not None:
        named = [p for p in partitions if p.name == slurm.partition]
        if not named:
            known = ", ".join(p.name for p in partitions) or "none"
            return [f"slurm.partition={slurm.partition}: the cluster has no such partition (known: {known})"]
        partition = named[0]
    else:
        defaults = [p for p in partitions if p.default]
        if not defaults:
            return []  # sbatch itself says that a partition must be named
        partition = defaults[0]
    request = SlurmRequest(nodes=slurm.nodes, tasks_per_node=ranks_per_node(slurm, config.launch.num_ranks),
                           cpus_per_task=slurm.cpus_per_task, mem_gb=slurm.mem_gb,
                           gpus_per_node=slurm.gpus_per_node, time_min=slurm.time_min, partition=partition.name)
    return misfits(request, partition, cluster.partition_nodes(partition.name))


def submit_run(run_dir: Path, params: dict, *, max_time_limits: int = 3) -> tuple[str, str | None]:
    """Submit `SlurmRun(run_dir)` with these executor parameters; records the job and returns its id and the
    cluster sbatch named (None when it named none). After `max_time_limits` time-limit requeues submitit
    requeues no more."""
    import submitit

    from tiderl.slurm.job import SlurmRun
    from tiderl.slurm.runjobs import record_job, slurm_dir
    from tiderl.slurm.states import sbatch_cluster
    from tiderl.slurm.submit import batch_python, slurm_conf, submit_command

    class RunExecutor(submitit.SlurmExecutor):
        cluster: str | None = None

        @property
        def _submitit_command_str(self) -> str:
            return submit_command(self.python, self.folder)

        def _get_job_id_from_submission_command(self, string: bytes | str) -> str:  # type: ignore[override]
            # submitit keeps only the job id of sbatch's answer; `--parsable` also needs the cluster it names.
            text = string if isinstance(string, str) else string.decode()
            self.cluster = sbatch_cluster(text)
            return submitit.SlurmExecutor._get_job_id_from_submission_command(text)

    # After `slurm.setup` (a venv, a module): the cluster's `python`, not this machine's interpreter.
    python = shlex.quote(batch_python(params.get("setup", ())))
    executor = RunExecutor(folder=slurm_dir(run_dir), max_num_timeout=max_time_limits, python=python)
    executor.update_parameters(**params)
    job = executor.submit(SlurmRun(str(run_dir)))
    record_job(run_dir, job.job_id, job_name=params["job_name"], slurm_conf=slurm_conf())
    return job.job_id, executor.cluster


def follow(run_dir: Path, job_id: str, out: TextIO = sys.stdout, poll_s: float = WAIT_POLL_S) -> int:
    """Print progress until the job has ended, or stop (exit 1, the job left as it is) once it pends for a
    reason that waiting cannot resolve (tiderl.slurm.fit.cannot_start); 0 if the run finished."""
    from tiderl.observe import collect, progress_line, summary
    from tiderl.rundir import open_run
    from tiderl.slurm.fit import cannot_start
    from tiderl.slurm.runjobs import slurm_jobs_of_run
    from tiderl.slurm.states import JobState
    from tiderl.store.types import RunState

    _, store = open_run(run_dir)
    last = ""
    try:
        while True:
            jobs = {j["job_id"]: j for j in slurm_jobs_of_run(run_dir)}
            job = jobs.get(job_id, {"state": "UNKNOWN", "reason": "not in the run's job list"})
            doc = collect(store)
            line = (f"job {job_id} {job['state']}" + (f" ({job['reason']})" if job["reason"] else "")
                    + f"  run {doc['state']}  " + progress_line(doc).rstrip())
            if line != last:
                print(line, file=out, flush=True)
                last = line
            if _job_ended(job["state"], JobState):
                break
            if job["state"] == JobState.PENDING.value and cannot_start(job["reason"]):
                print(f"job {job_id} cannot start: it is pending for {job['reason']}, which waiting does not "
                      "resolve (the request exceeds what its partition, account or QOS can ever give, or names "
                      f"something that does not exist). The job is left as it is: `tiderl cancel {run_dir}` "
                      "removes it; change the job's `slurm:` fields and submit again.", file=out, flush=True)
                return EXIT_NOT_FINISHED
            time.sleep(poll_s)
            time.sleep(poll_s)
        state = store.run_info().state
        print(summary(store), file=out, flush=True)
    finally:
        store.close()
    print(f"job {job_id} {job['state']}, run {state.value}", file=out, flush=True)
    return EXIT_FINISHED if state is RunState.FINISHED else EXIT_NOT_FINISHED


def _job_ended(state: str, job_state_type: type) -> bool:
    try:
        parsed = job_state_type(state)
    except ValueError:
        return False  # UNKNOWN: Slurm did not answer this time, or accounting has not caught up
    # A preempted job with --requeue comes back PENDING: only the other final states end the wait.
    return parsed.is_finished and parsed is not job_state_type.PREEMPTED
