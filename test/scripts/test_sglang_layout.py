"""``scripts/sglang_layout.py``: the series' modules at SGLang's 88 columns, the same program."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = '''\
"""A module docstring whose first paragraph runs well past eighty-eight columns, so that it must be refilled.

- a list item that is long enough to need a second line when laid out at SGLang's width of 88 columns
- a short item

Its formula stays as written::

    total = first_term_of_the_formula + second_term_of_the_formula + third_term
"""


def check(value: int, name: str) -> None:
    if value < 0:  # a trailing comment that takes this line past the width the formatter allows here
        raise ValueError(f"{name} must be a non-negative int, got {value!r}; pass a count of pages, not bytes")
    message = "a plain literal that stands alone on its line and has to be split into adjacent literals"
    print(message)  # noqa: T201 -- a pragma that tools read where it stands, long or not, stays put
'''


@pytest.fixture(scope="module")
def layout_module():
    spec = importlib.util.spec_from_file_location("sglang_layout", ROOT / "scripts" / "sglang_layout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_layout_fits_88_columns_and_keeps_the_program(layout_module):
    out = layout_module.layout(SOURCE, "example")
    lines = out.splitlines()
    long = [line for line in lines if len(line) > 88]
    assert long == [line for line in lines if "noqa" in line]  # only the pragma's line is left as it was
    assert layout_module._shape(out) == layout_module._shape(SOURCE)
    tree, before = ast.parse(out), ast.parse(SOURCE)
    assert ast.get_docstring(tree).split() == ast.get_docstring(before).split()
    assert "    total = first_term_of_the_formula" in out  # the literal block is kept
    assert "- a list item that is long enough" in out and "  width of 88 columns" in out  # hanging indent
    # The trailing comment moved above its code; the f-string split outside its braces.
    assert any(line.strip().startswith("# a trailing comment") for line in lines)
    namespace: dict = {}
    exec(compile(out, "example", "exec"), namespace)
    with pytest.raises(ValueError, match="n must be a non-negative int, got -1; pass a count of pages, not bytes"):
        namespace["check"](-1, "n")


def test_a_changed_program_is_refused(layout_module):
    assert layout_module._shape(SOURCE) != layout_module._shape(SOURCE.replace("not bytes", "not tokens"))
    assert layout_module._shape(SOURCE) == layout_module._shape(
        SOURCE.replace("must be refilled.", "must be\n refilled.")
    )
