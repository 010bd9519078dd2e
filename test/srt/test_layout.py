"""``srt/`` is what an SGLang server loads: it imports nothing of the standalone stack (``reference/``)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRT = Path(__file__).resolve().parents[2] / "python" / "sglang_cp_shared_kv" / "srt"


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
        if name.startswith("sglang_cp_shared_kv.") and not name.startswith("sglang_cp_shared_kv.srt")
    ]
    assert bad == []


@pytest.mark.sglang
def test_loading_the_plugin_and_every_srt_module_imports_no_reference_module():
    code = (
        "import importlib, pkgutil, sys\n"
        "import sglang_cp_shared_kv.srt as srt\n"
        "from sglang_cp_shared_kv.srt.plugin import load\n"
        "load()\n"
        "after_load = sorted(m for m in sys.modules if m.startswith('sglang_cp_shared_kv.reference'))\n"
        "for m in pkgutil.walk_packages(srt.__path__, 'sglang_cp_shared_kv.srt.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(after_load, sorted(m for m in sys.modules if m.startswith('sglang_cp_shared_kv.reference')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[] []"
