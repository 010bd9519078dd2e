"""``srt/`` is what an SGLang server loads and all the package ships: it imports nothing of the demo (``demo/``)
or the test oracles (``reference/``), which live beside the package at the repository root."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRT = ROOT / "python" / "sglang_cp_shared_kv" / "srt"
OUTSIDE = ("demo", "reference", "benchmark")  # the repository's own packages, never shipped


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_no_srt_module_imports_the_reference_stack():
    files = sorted(SRT.rglob("*.py"))
    assert len(files) > 10
    bad = [
        f"{f.relative_to(SRT)}: {name}"
        for f in files
        for name in _imports(f)
        if (name.startswith("sglang_cp_shared_kv.") and not name.startswith("sglang_cp_shared_kv.srt"))
        or name.split(".")[0] in OUTSIDE
    ]
    assert bad == []


def test_the_package_ships_only_srt():
    """The wheel's packages (``setup.py``: ``find_packages("python")``): the package and ``srt/``, no demo or oracle."""
    from setuptools import find_packages

    packages = find_packages(str(ROOT / "python"))
    assert "sglang_cp_shared_kv.srt" in packages
    assert [p for p in packages if p != "sglang_cp_shared_kv" and not p.startswith("sglang_cp_shared_kv.srt")] == []


@pytest.mark.sglang
def test_loading_the_plugin_and_every_srt_module_imports_no_reference_module():
    code = (
        "import importlib, pkgutil, sys\n"
        "import sglang_cp_shared_kv.srt as srt\n"
        "from sglang_cp_shared_kv.srt.plugin import load\n"
        "load()\n"
        "def outside():\n"
        f"    return sorted(m for m in sys.modules if m.split('.')[0] in {OUTSIDE!r})\n"
        "after_load = outside()\n"
        "for m in pkgutil.walk_packages(srt.__path__, 'sglang_cp_shared_kv.srt.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(after_load, outside())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] []"
