#!/usr/bin/env bash
# Which lines of the rank and control processes the fast tests reach (no vLLM, no Slurm, no JuiceFS, no
# PostgreSQL): the fast suite under coverage.py, the processes the tests start included (the rank, control
# and env-server processes of the local-run tests). `make coverage`; arguments go to pytest.
# Prints the report of tiderl/run and tiderl/trainer, then the whole package's total.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
data=${TIDERL_COVERAGE_DIR:-.coverage-data}
case "$data" in /*) ;; *) data=$PWD/$data ;; esac  # relative to the repository; an absolute one as given
rm -rf "$data" && mkdir -p "$data"
export COVERAGE_FILE=$data/cov
status=0
"$PY" -m coverage run -m pytest -q -p no:cacheprovider \
  -m "not slow and not juicefs and not vllm and not slurm and not postgres" "$@" || status=$?
"$PY" -m coverage combine -q "$data"
"$PY" -m coverage report --include='tiderl/run/*,tiderl/trainer/*' --sort=cover
"$PY" -m coverage report --include='tiderl/*' | tail -1
if [ "$status" -ne 0 ]; then echo "coverage: the tests failed (pytest exit $status)" >&2; fi
exit "$status"
