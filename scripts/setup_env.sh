#!/usr/bin/env bash
# Build (or reuse) the project's virtualenv in .venv with everything tests and demo need, and
# activate it with the CPU run settings.
# Idempotent: a second run only checks. Usage: source scripts/setup_env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CP_SHARED_KV_VENV:-$ROOT/.venv}"
STAMP="$VENV/.cp_shared_kv_stamp"
WANT="$(cat "$ROOT"/requirements/*.txt "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" "$ROOT/scripts/torchvision_cpu_shim.py" | sha1sum | cut -d' ' -f1)"

# Mooncake's engine links libibverbs even without RDMA hardware.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  echo "[setup] installing libibverbs1 (needed by the Mooncake transfer engine)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q libibverbs1 >/dev/null; }
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing requirements (a few minutes on a fresh machine)"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements/test.txt" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements/sglang.txt" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps sglang==0.5.23 2>&1 | grep -v "^WARNING: Location" || true
  # torchvision 0.28.0 links CUDA torch; this import hook lets it (and so sglang) import on CPU torch.
  "$VENV/bin/python" "$ROOT/scripts/torchvision_cpu_shim.py" --install
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch, triton, mooncake.engine, sglang_cp_shared_kv" \
    || { echo "[setup] FAILED: the virtualenv is incomplete" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# No GPU here: Triton kernels run in its interpreter. Quiet Mooncake; unbuffered progress.
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
export MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
export PYTHONUNBUFFERED=1
