"""scripts/setup_env.sh's libibverbs check: no SIGPIPE race, and never a password prompt.

Each test sources the real script with stand-ins for ``ldconfig``, ``apt-get``, ``sudo`` (and ``id``)
first on PATH; the virtualenv step only checks, as the environment is already built (from this
checkout's setup files: the tests skip where it was not, rather than reinstall it).
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup_env.sh"
LIB_LINE = "\tlibibverbs.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libibverbs.so.1"


def _built_from_this_checkout() -> bool:
    """Whether setup_env.sh built this environment from this checkout's setup files (its stamp): otherwise
    sourcing the script would reinstall the environment the tests run in."""
    stamp = Path(sys.prefix) / ".cp_shared_kv_stamp"
    files = [*sorted((ROOT / "requirements").glob("*.txt")), ROOT / "setup.py", SCRIPT]
    files.append(ROOT / "scripts" / "torchvision_cpu_shim.py")
    want = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()
    return stamp.exists() and stamp.read_text().strip() == want


# The tests that source the script against the environment the tests run in.
needs_built_env = pytest.mark.skipif(
    not _built_from_this_checkout(), reason="needs the environment setup_env.sh built from this checkout"
)


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


def _source(bin_dir: Path, venv: str = sys.prefix, **extra_env: str) -> subprocess.CompletedProcess:
    """``source`` the setup script with ``bin_dir``'s stubs first on PATH and ``venv`` as the virtualenv."""
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CP_SHARED_KV_VENV=venv, **extra_env)
    return subprocess.run(
        ["bash", "-c", f"source {SCRIPT} && echo SOURCED"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _record_installers(bin_dir: Path, log: Path) -> None:
    _stub(bin_dir, "apt-get", f'echo "apt-get $*" >> {log}; exit 1')
    _stub(
        bin_dir,
        "sudo",
        f'if [ "$1" = "-n" ]; then echo "sudo $*" >> {log}; echo "sudo: a password is required" >&2; exit 1; fi\n'
        f'echo "PROMPT sudo $*" >> {log}; read -r -p "[sudo] password: " pw; exit 1',
    )


@needs_built_env
def test_library_found_although_ldconfig_dies_of_sigpipe(tmp_path):
    """ldconfig lists the library first, then 10 MB more: a reader that stops at the match kills it with
    SIGPIPE (as `grep -q` did under pipefail). The check must still find the library and install nothing."""
    _stub(
        tmp_path,
        "ldconfig",
        f"echo '{LIB_LINE}'\n"
        "yes '\tlibother.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libother.so.1' | head -n 200000",
    )
    log = tmp_path / "installs.log"
    _record_installers(tmp_path, log)
    # The stand-in does die of SIGPIPE under an early-exiting reader:
    probe = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {tmp_path}/ldconfig -p | grep -q libibverbs.so.1; echo $?"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "141"
    proc = _source(tmp_path)
    assert proc.returncode == 0 and "SOURCED" in proc.stdout, proc.stderr
    assert "installing libibverbs1" not in proc.stdout
    assert not log.exists()


@needs_built_env
def test_missing_library_as_user_fails_in_one_line_without_prompting(tmp_path):
    _stub(tmp_path, "ldconfig", "echo '\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6'")
    _stub(tmp_path, "id", 'if [ "$1" = "-u" ]; then echo 1000; else exec /usr/bin/id "$@"; fi')
    log = tmp_path / "installs.log"
    _record_installers(tmp_path, log)
    proc = _source(tmp_path)
    assert proc.returncode != 0 and "SOURCED" not in proc.stdout
    calls = log.read_text().splitlines()
    assert calls and all(c.startswith("sudo -n apt-get") for c in calls), calls
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[setup] FAILED:") and "sudo apt-get install -y libibverbs1" in last, proc.stderr


@needs_built_env
def test_missing_library_as_root_runs_apt_get_non_interactively(tmp_path):
    _stub(tmp_path, "ldconfig", "echo '\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6'")
    _stub(tmp_path, "id", 'if [ "$1" = "-u" ]; then echo 0; else exec /usr/bin/id "$@"; fi')
    log = tmp_path / "installs.log"
    _stub(tmp_path, "apt-get", f'echo "apt-get $* DEBIAN_FRONTEND=$DEBIAN_FRONTEND" >> {log}; exit 0')
    _stub(tmp_path, "sudo", f'echo "PROMPT sudo $*" >> {log}; exit 1')
    proc = _source(tmp_path)
    assert proc.returncode == 0 and "SOURCED" in proc.stdout, proc.stderr
    assert log.read_text().splitlines() == ["apt-get install -y -q libibverbs1 DEBIAN_FRONTEND=noninteractive"]


def _fake_venv(root: Path, log: Path, torch_build: str) -> Path:
    """A virtualenv of stand-ins, never built: its pip logs what it is asked, its python answers the script's
    probes (the CPU index cannot be reached; ``torch_build``, e.g. ``2.13.0+cpu (a CPU build)``, is installed)."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    _stub(venv / "bin", "pip", f'echo "pip $*" >> {log}')
    _stub(
        venv / "bin",
        "python",
        'case "$*" in *urlopen*) exit 1;; *torch.__version__*) echo "' + torch_build + '";; esac',
    )
    (venv / "bin" / "activate").write_text("true\n")
    return venv


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the CPU torch path runs where nvidia-smi is not")
def test_unreachable_cpu_index_says_where_torch_comes_from_and_which_build_came(tmp_path):
    """Where PyTorch's CPU index cannot be reached, torch comes from pip's own index settings with the rest of
    the requirements: the lines say so, then name the build pip installed (a CUDA one from PyPI, a CPU one
    from a mirror that has it), instead of claiming one."""
    _stub(tmp_path, "ldconfig", f"echo '{LIB_LINE}'")
    log = tmp_path / "pip.log"
    for build in ("2.13.0+cpu (a CPU build)", "2.13.0 (a CUDA build)"):
        venv = _fake_venv(tmp_path / build.split()[0], log, build)
        proc = _source(tmp_path, str(venv), CP_SHARED_KV_TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu")
        assert proc.returncode == 0 and "SOURCED" in proc.stdout, proc.stdout + proc.stderr
        lines = [line for line in proc.stdout.splitlines() if "torch" in line and "1/4" not in line]
        assert lines[0] == (
            "[setup] http://127.0.0.1:9/whl/cpu cannot be reached: torch==2.13.0 comes from pip's own index "
            "settings with requirements/test.txt (PyPI's Linux wheel is the CUDA build)"
        ), proc.stdout
        assert lines[1] == f"[setup] installed torch {build}", proc.stdout
        assert "default index" not in proc.stdout
    assert not any("whl/cpu" in call for call in log.read_text().splitlines())  # the unreachable index: not asked
