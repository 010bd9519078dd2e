#!/usr/bin/env bash
# Build (or reuse) the project's virtualenv in .venv with everything tests and demo need, and
# activate it with the CPU run settings.
# Idempotent: a second run only checks. Usage: source scripts/setup_env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CP_SHARED_KV_VENV:-$ROOT/.venv}"
STAMP="$VENV/.cp_shared_kv_stamp"
TORCH_CPU_INDEX="${CP_SHARED_KV_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
WANT="$(cat "$ROOT"/requirements/*.txt "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" "$ROOT/scripts/torchvision_cpu_shim.py" | sha1sum | cut -d' ' -f1)"

# Mooncake's engine links libibverbs even without RDMA hardware. The check reads ldconfig's whole
# listing before matching: `ldconfig -p | grep -q` lets grep exit at the first match, and under
# pipefail ldconfig's SIGPIPE then reads as "missing".
LDCONFIG_LIST="$(ldconfig -p 2>/dev/null || true)"
if [[ "$LDCONFIG_LIST" != *libibverbs.so.1* ]]; then
  echo "[setup] installing libibverbs1 (needed by the Mooncake transfer engine)"
  SUDO=()
  # Never prompt: sudo -n fails at once where a password would be needed.
  [ "$(id -u)" -ne 0 ] && SUDO=(sudo -n)
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[setup] FAILED: libibverbs.so.1 is missing and there is no apt-get here: install your distribution's libibverbs (rdma-core) package, then rerun" >&2
    return 1 2>/dev/null || exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! { "${SUDO[@]}" apt-get install -y -q libibverbs1 </dev/null >/dev/null 2>&1 \
      || { "${SUDO[@]}" apt-get update -q </dev/null >/dev/null 2>&1 \
        && "${SUDO[@]}" apt-get install -y -q libibverbs1 </dev/null >/dev/null 2>&1; }; }; then
    echo "[setup] FAILED: could not install libibverbs1 without a password prompt: run 'sudo apt-get install -y libibverbs1' yourself, then rerun" >&2
    return 1 2>/dev/null || exit 1
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  python3 -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing requirements (a few minutes on a fresh machine; later runs skip this)"
  SETUP_T0=$SECONDS
  setup_step() { echo "[setup] $1 (at $((SECONDS - SETUP_T0)) s)"; }
  setup_step "1/4 torch (CPU), triton, pytest, matplotlib, Mooncake"
  # Without a GPU, torch's CPU wheel (~200 MB) rather than PyPI's CUDA build (~5 GB of NVIDIA wheels).
  # Where PyTorch's CPU index cannot be reached, torch comes with the rest of requirements/test.txt from
  # pip's own index settings: PyPI's CUDA build, or what a configured mirror serves (a CPU build, or the
  # torch already installed here). The line after the install names the build pip left.
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    TORCH_PIN="$(grep -E '^torch==' "$ROOT/requirements/test.txt")"
    if "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('$TORCH_CPU_INDEX/torch/', timeout=15)" >/dev/null 2>&1 \
      && "$VENV/bin/pip" install -q --disable-pip-version-check --index-url "$TORCH_CPU_INDEX" "$TORCH_PIN"; then
      echo "[setup] $TORCH_PIN from $TORCH_CPU_INDEX (no nvidia-smi here)"
    else
      echo "[setup] $TORCH_CPU_INDEX cannot be reached: $TORCH_PIN comes from pip's own index settings with requirements/test.txt (PyPI's Linux wheel is the CUDA build)"
    fi
  fi
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements/test.txt" 2>&1 | grep -v "^WARNING: Location" || true
  echo "[setup] installed torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__, "(a CUDA build)" if torch.version.cuda else "(a CPU build)")' 2>/dev/null || echo "(none: see pip's messages above)")"
  setup_step "2/4 what sglang needs to import on CPU"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$ROOT/requirements/sglang.txt" 2>&1 | grep -v "^WARNING: Location" || true
  setup_step "3/4 sglang 0.5.23 (without its CUDA pins)"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps sglang==0.5.23 2>&1 | grep -v "^WARNING: Location" || true
  # torchvision 0.28.0 links CUDA torch; this import hook lets it (and so sglang) import on CPU torch.
  "$VENV/bin/python" "$ROOT/scripts/torchvision_cpu_shim.py" --install
  setup_step "4/4 this package (editable)"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$ROOT" 2>&1 | grep -v "^WARNING: Location" || true
  setup_step "done"
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
