"""Fault campaign: short real runs of the quickstart job, ONE injected fault each, checked from the store.

    .venv/bin/python tools/chaos.py --all --seed 0
    .venv/bin/python tools/chaos.py --fault rollout_kill --fault store_lock --seed 3 --keep

Each trial runs `python -m tiderl run jobs/quickstart.yaml --run-dir DIR --set ...`: `--steps` steps
of 2 groups x 4 tasks, 4 ranks (rank 0 actor, ranks 1-2 rollout, rank 3 ref: `system=async` with a
fixed decoupled RA2P mode, so every role exists for the whole run), environment steps of 0.3 s
(`rollout_stop` runs 30 steps: the rank it stops must have time to come back). Once version 1 or 2
is published and a seeded random delay has passed, the trial injects its fault, then
waits for the launcher to end (the launcher fault only: after one `tiderl run --resume`; no other
fault gets any help). It prints one JSON line per fault:

    fault, seed, survived (finished at the last version, exit code 0, nobody stepping in),
    trajectories_lost, consumed_twice, recovery_s (fault -> the next new version), exit_code, run_dir, note

Lost and twice come from the store (`exactly_once`); the note adds the env servers' own session
counters (GET /health with the run's token, polled every 2 s while the run lives) next to the
store's. Every process and mount a trial starts is ended when it ends, on Ctrl-C too, and every wait
has a timeout (`--timeout-s` per trial).

`--model-path DIR` gives every trial an already built model (`model.path`): a job whose warm start
changed would otherwise build its model (minutes, under load tens of minutes) inside the first
trial's timeout, and inside every later one that starts while it is still building.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from chaos_faults import FAULTS
from chaos_trial import run_trial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="Every fault, in the order listed by --fault's help.")
    parser.add_argument("--fault", action="append", default=[], choices=list(FAULTS),
                        help="A fault to inject (repeatable): " + ", ".join(FAULTS))
    parser.add_argument("--seed", type=int, default=0, help="Seeds each trial's fault point (version and delay).")
    parser.add_argument("--steps", type=int, default=10, help="trainer.num_steps of each run.")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="Wall-clock limit of one trial.")
    parser.add_argument("--keep", action="store_true", help="Keep the run directories (else removed after each).")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/tiderl-chaos"), help="Where trials run.")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="An already built model for every trial (model.path); default: the job's own, "
                             "built by the first trial that needs it, inside that trial's timeout.")
    args = parser.parse_args(argv)
    names = list(FAULTS) if args.all else args.fault
    if not names:
        parser.error("give --all or at least one --fault")
    # SIGINT (even where a shell started the tool with it ignored), SIGTERM and SIGHUP end the campaign
    # like Ctrl-C: every trial's cleanup runs.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        for name in names:
            print(f"chaos: {name} (seed {args.seed}): {FAULTS[name].what}", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            line = run_trial(FAULTS[name], seed=args.seed, steps=args.steps, timeout_s=args.timeout_s,
                             work_root=args.work_dir, keep=args.keep, model_path=args.model_path)
            print(json.dumps(line), flush=True)
            print(f"chaos: {name} took {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("chaos: interrupted; the trial's processes and mounts are gone", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
