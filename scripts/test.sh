#!/usr/bin/env bash
# The test command: sets up its own virtualenv, then runs the whole suite on CPU.
# Extra arguments go to pytest (e.g. scripts/test.sh -m "not sglang" -x).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
set +e
python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure here.
if [ "$rc" -eq 5 ]; then echo "no tests collected: failing" >&2; exit 1; fi
exit "$rc"
