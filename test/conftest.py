"""Test helper modules importable from every test directory (pytest adds only each test's own), and the
repository's top-level packages (``demo``, ``reference``, ``benchmark``) whatever the directory pytest runs in."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "reference"))
if str(Path(__file__).parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).parents[1]))
