#!/usr/bin/env bash
# The whole test suite, with the services it needs. Called by `make test` (and so by .ci/run).
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

status=0
"$PY" -m pytest -q -p no:cacheprovider --durations=15 "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "run_tests: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
