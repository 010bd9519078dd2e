#!/usr/bin/env bash
# The demo: sets up its own virtualenv, then runs the plugin through SGLang's classes on CPU ranks (prefill CP + decode).
# The demo is the repository's top-level `demo` package (not shipped in the wheel): the repository root goes on
# PYTHONPATH. Runs in the caller's directory, so a relative --out lands where the caller expects it.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/setup_env.sh"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CP_SHARED_KV_DEMO_PROG="scripts/demo.sh"
exec python -m demo "$@"
