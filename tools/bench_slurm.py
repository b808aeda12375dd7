"""Time the development Slurm cluster: first start, second start, a trivial job, stop, restart. Prints JSON.

    .venv/bin/python tools/bench_slurm.py [--nodes N] [--port-base P]

Uses a fresh state directory of its own (deleted at the end) and its own ports, so
a dev cluster that is already running is left alone. Needs root and Slurm's packages
(the start script installs them when missing; that install is not part of the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiderl.config.schema import build  # noqa: E402
from tiderl.config.slurm import SlurmConfig  # noqa: E402
from tiderl.slurm.cluster import SlurmCluster  # noqa: E402
from tiderl.slurm.sbatch import make_sbatch_script  # noqa: E402
from tiderl.slurm.states import JobState  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--port-base", type=int, default=7817)
    args = parser.parse_args()

    state_dir = Path(tempfile.mkdtemp(prefix="tiderl-slurm-bench-"))
    env = {**os.environ, "TIDERL_SLURM_DIR": str(state_dir), "TIDERL_SLURM_PORT_BASE": str(args.port_base),
           "SLURM_CONF": str(state_dir / "etc" / "slurm.conf")}
    start = ["bash", str(ROOT / "slurm" / "dev-cluster-start.sh"), "--nodes", str(args.nodes)]
    stop = ["bash", str(ROOT / "slurm" / "dev-cluster-stop.sh")]
    figures: dict[str, float | int] = {"nodes": args.nodes}
    try:
        figures["first_start_s"] = timed(start, env)
        figures["second_start_s"] = timed(start, env)
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
        config = build(SlurmConfig, {"time_min": 2, "signal_delay_s": 0, "mem_gb": 1}, "bench", "slurm")
        script = state_dir / "true.sbatch"
        script.write_text(make_sbatch_script(config, name="bench", log_dir=state_dir / "log", num_tasks_per_node=1,
                                             command=["true"]))
        cluster = SlurmCluster()
        submitted = time.perf_counter()
        job_id = cluster.submit(script)
        state = cluster.wait(job_id, timeout_s=120, poll_s=0.05)
        figures["job_submit_to_sacct_completed_s"] = time.perf_counter() - submitted
        if state is not JobState.COMPLETED:
            raise SystemExit(f"bench job {job_id} ended {state.value}")
        figures["stop_s"] = timed(stop, env)
        figures["restart_s"] = timed(start, env)
    finally:
        subprocess.run(stop + ["--purge"], env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
