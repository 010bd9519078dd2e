#!/usr/bin/env bash
# The demo: sets up its own virtualenv, then runs the CP shared-KV pipeline on CPU ranks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
exec python -m sglang_cp_shared_kv.reference.demo "$@"
