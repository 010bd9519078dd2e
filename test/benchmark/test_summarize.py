"""docs/benchmarks.md's tables are the ones its JSON results give (``python -m benchmark.cp_shared_kv.summarize``)."""

import re

from benchmark.cp_shared_kv import summarize


def test_every_marked_table_is_current_and_known():
    text = summarize.DOC.read_text()
    names = re.findall(r"<!-- table:([\w-]+) -->", text)
    assert sorted(names) == sorted(summarize.TABLES), names
    assert summarize.render(text) == text, "run: python -m benchmark.cp_shared_kv.summarize"


def test_render_fills_only_between_markers():
    text = "prose 1.0\n<!-- table:pd-transfer -->\nstale\n<!-- /table:pd-transfer -->\nmore prose\n"
    out = summarize.render(text)
    assert out.startswith("prose 1.0\n<!-- table:pd-transfer -->\n| prefill CP ranks |")
    assert out.endswith("<!-- /table:pd-transfer -->\nmore prose\n") and "stale" not in out
