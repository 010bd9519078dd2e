#!/usr/bin/env bash
# The test command: sets up its own virtualenv, then runs the whole suite on CPU.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not sglang" -x).
# Output: one line per test as it finishes, with a running count ([ 12/345]), then the 25 slowest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
set +e
python -m pytest -v -o console_output_style=count --durations=25 "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure here.
if [ "$rc" -eq 5 ]; then echo "no tests collected: failing" >&2; exit 1; fi
exit "$rc"
