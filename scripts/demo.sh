#!/usr/bin/env bash
# The demo: sets up its own virtualenv, then runs the CP shared-KV pipeline on CPU ranks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
export MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
export PYTHONUNBUFFERED=1
exec python -m sglang_cp_shared_kv.demo "$@"
