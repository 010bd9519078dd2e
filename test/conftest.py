"""Test helper modules importable from every test directory (pytest adds only each test's own)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "reference"))
