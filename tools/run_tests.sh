#!/usr/bin/env bash
# The whole test suite, with the services it needs. Called by `make test` (and so by .ci/run).
# - Starts the single-node development Slurm cluster (slurm/dev-cluster-start.sh; it installs
#   Debian's slurm-wlm, munge and MariaDB when missing) and always stops it again if it started it.
#   Without root the cluster cannot start: the slurm tests then skip, unless TIDERL_REQUIRE_SLURM=1.
# - JuiceFS mounts are made and removed by the tests themselves (tests/conftest.py).
# pytest's exit code 5 (no tests collected) is a failure here, not a pass (when neither tier collects any).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export TIDERL_SLURM_DIR=${TIDERL_SLURM_DIR:-/tmp/tiderl-slurm}

started=0
cleanup() { if [ "$started" = 1 ]; then bash slurm/dev-cluster-stop.sh >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT

if SLURM_CONF=$TIDERL_SLURM_DIR/etc/slurm.conf scontrol ping 2>/dev/null | grep -q UP; then
  export SLURM_CONF=$TIDERL_SLURM_DIR/etc/slurm.conf
  echo "run_tests: using the Slurm dev cluster already up ($SLURM_CONF)"
elif exports=$(bash slurm/dev-cluster-start.sh --nodes "${TIDERL_SLURM_NODES:-2}"); then
  started=1
  eval "$exports"
  echo "run_tests: Slurm dev cluster started ($SLURM_CONF)"
else
  echo "run_tests: the Slurm dev cluster did not start: slurm tests will skip" >&2
  if [ "${TIDERL_REQUIRE_SLURM:-}" = 1 ]; then exit 1; fi
fi

# Two tiers, every test in one of them: the fast tier first, stopping at its first failure (minutes), then the
# tests that start engines, runs, clusters or train (marked slow, vllm or slurm). Arguments go to both (a
# `-k` or a path narrows both; a tier that then selects nothing is skipped, not failed).
# Each tier runs in TIDERL_TEST_WORKERS processes (pytest-xdist; 0: one process): a test file stays whole in one
# worker and the Slurm tests share one (tests/conftest.py), so a tier's CPU-bound tests overlap with the ones that
# wait (Slurm's scheduling, servers, subprocesses).
FAST="not slow and not vllm and not slurm"
WORKERS=${TIDERL_TEST_WORKERS:-2}
tier() {
  local name=$1; shift
  local started=$SECONDS rc=0
  "$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadscope "$@" || rc=$?
  echo "run_tests: $name tier: exit $rc in $((SECONDS - started)) s" >&2
  return "$rc"
}
fast=0
tier fast -x -m "$FAST" "$@" || fast=$?
slow=0
if [ "$fast" -eq 0 ] || [ "$fast" -eq 5 ]; then
  tier slow -m "not ($FAST)" --durations=25 "$@" || slow=$?
fi
if [ "$fast" -eq 5 ] && [ "$slow" -eq 5 ]; then
  echo "run_tests: pytest collected no tests: failing" >&2
  exit 1
fi
for rc in "$fast" "$slow"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
exit 0
