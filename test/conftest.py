"""Test helper modules importable from every test directory (pytest adds only each test's own), and the
repository's top-level packages (``demo``, ``reference``, ``benchmark``) whatever the directory pytest runs in,
in the tests' own process and in the worker processes they start."""

import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).parents[1])
sys.path.insert(0, str(Path(__file__).parent / "reference"))
if ROOT not in sys.path:
    sys.path.append(ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)

# Tests written for SGLang's tree with the series applied: ``test_upstream_patch.py`` runs them there.
if "CP_SHARED_KV_PATCHED_TREE" not in os.environ:
    collect_ignore = ["upstream"]
