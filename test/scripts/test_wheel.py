"""The package as a wheel: ``python -m build`` makes it, and it installs beside SGLang like any plugin.

The wheel is built (``--no-isolation``: the test environment's setuptools, no network) from a copy of
the files it is made of, installed with ``--no-deps`` into a fresh virtualenv, and used there:

- without torch (nothing else installed yet): the package, its version and SGLang entry point module
  import;
- beside the test environment's SGLang (its site directory added to the new venv, as
  ``--system-site-packages`` would from the test venv): ``python -m sglang.launch_server --help``
  lists ``--enable-cp-shared-kv``, from the wheel's install.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.sglang


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    # No PYTHONPATH: what the new venv imports must come from what is installed in it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(kwargs.pop("env", {}))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, **kwargs)
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_installs_without_torch_and_beside_sglang(tmp_path):
    from sglang_cp_shared_kv import __version__

    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "python", src / "python", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(src)])
    (wheel,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
    assert os.path.basename(wheel) == f"sglang_cp_shared_kv-{__version__}-py3-none-any.whl"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()

    probe = (
        "import importlib.util, sglang_cp_shared_kv as p, sglang_cp_shared_kv.srt.plugin; "
        "from importlib.metadata import entry_points; "
        "(ep,) = [e for e in entry_points(group='sglang.srt.plugins') if e.name == 'cp_shared_kv']; "
        "print(p.__version__, p.__file__, ep.value, importlib.util.find_spec('torch') is not None)"
    )
    version, where, entry, has_torch = _run([python, "-c", probe], cwd=tmp_path).stdout.split()
    assert (version, entry, has_torch) == (__version__, "sglang_cp_shared_kv.srt.plugin:load", "False")
    assert where.startswith(site), where

    # The test environment's packages (SGLang, torch) behind the wheel's install: its site directory is
    # processed like a system site (its .pth files too), after the new venv's own.
    test_site = sysconfig.get_paths()["purelib"]
    Path(site, "zz_test_env.pth").write_text(f"import site; site.addsitedir({test_site!r})\n")
    where = _run([python, "-c", "import sglang_cp_shared_kv as p; print(p.__file__)"], cwd=tmp_path).stdout.strip()
    assert where.startswith(site), where  # still the wheel's copy, not the test env's
    env = {"SGLANG_PLUGINS": "cp_shared_kv", "PYTHONWARNINGS": "ignore"}
    proc = _run([python, "-m", "sglang.launch_server", "--help"], cwd=tmp_path, env=env)
    assert "--enable-cp-shared-kv" in proc.stdout
    assert "prefill context-parallel ranks" in proc.stdout  # our help text, not a stray match
