#!/usr/bin/env bash
# The Slurm integration tests (pytest -m slurm) against a real single-node Slurm:
# starts the dev cluster (installing it when missing), runs the tests with
# TIDERL_REQUIRE_SLURM=1 so a cluster that fails to come up fails the run, and
# always stops the cluster again. Extra arguments go to pytest.
# Environment: TIDERL_SLURM_DIR (state directory, default /tmp/tiderl-slurm),
# TIDERL_SLURM_NODES (emulated nodes, default 2: the multi-node case runs too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

started=0
cleanup() {
  # A cluster that was already up before this script stays up; one we started goes.
  if [ "$started" = 1 ]; then bash slurm/dev-cluster-stop.sh; fi
}
trap cleanup EXIT

if ! SLURM_CONF=${TIDERL_SLURM_DIR:-/tmp/tiderl-slurm}/etc/slurm.conf scontrol ping 2>/dev/null | grep -q UP; then
  started=1
fi
start_s=$SECONDS
# Captured first: `eval "$(...)"` alone would hide a failed start.
exports=$(bash slurm/dev-cluster-start.sh --nodes "${TIDERL_SLURM_NODES:-2}")
eval "$exports"
echo "slurm_tests: cluster up in $((SECONDS - start_s)) s (SLURM_CONF=$SLURM_CONF)" >&2

status=0
TIDERL_REQUIRE_SLURM=1 "$PY" -m pytest -q -p no:cacheprovider -m slurm tests/test_slurm_cluster.py "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "slurm_tests: pytest collected no slurm tests: failing" >&2
  exit 1
fi
exit "$status"
