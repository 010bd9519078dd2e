#!/usr/bin/env bash
# The demo: sets up its own virtualenv, then runs the plugin through SGLang's classes on CPU ranks (prefill CP + decode).
# Runs in the caller's directory, so a relative --out lands where the caller expects it.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/setup_env.sh"
export CP_SHARED_KV_DEMO_PROG="scripts/demo.sh"
exec python -m sglang_cp_shared_kv.demo "$@"
