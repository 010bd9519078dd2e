"""The read mode chosen at startup, against the rank model it comes from (``docs/benchmarks/rank_model.json``).

- The layer-time fit matches the model's stock layer (median within 10% over its cells at 370 GB/s).
- The choice over the model's cells costs on average less than prefetching everywhere and than building
  every view in line, with each cell's measured overheads; at CP 8 / 128K / 1K tokens per rank it prefetches.
- ``$SGLANG_CP_SHARED_KV_PREFETCH`` 0 / 1 overrides it; any other value is refused with one line.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from sglang_cp_shared_kv.srt.sglang_wiring.read_mode import PREFETCH_ENV, choose_read_mode, modeled_layer_us

RESULT = Path(__file__).parents[3] / "docs" / "benchmarks" / "rank_model.json"


def _cells() -> list[dict]:
    doc = json.loads(RESULT.read_text())
    cells = []
    for row in doc["rows"]:
        link = row["links"]["370"]
        n, prefix = row["n"], row["prefix"]
        token_bytes = round(row["pull_bytes"] / (prefix * (n - 1) / n))  # the pull is the peers' share of the view
        cells.append(
            {
                "n": n,
                "prefix": prefix,
                "tokens": row["tokens"],
                "token_bytes": token_bytes,
                "stock_us": link["stock_us"],
                "pull_us": link["pull_modeled_us"],
                "inline": link["inline"]["overhead_pct"],
                "prefetch": link["prefetch"]["overhead_pct"],
            }
        )
    return cells


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(PREFETCH_ENV, raising=False)


def test_the_layer_fit_follows_the_model():
    cells = _cells()
    assert len(cells) == 36
    errors = [abs(modeled_layer_us(c["tokens"], c["prefix"]) - c["stock_us"]) / c["stock_us"] for c in cells]
    assert statistics.median(errors) <= 0.10, sorted(errors)


def test_the_choice_beats_either_mode_everywhere():
    chosen, always = [], {"inline": [], "prefetch": []}
    for c in _cells():
        mode = choose_read_mode(c["n"], c["prefix"], c["tokens"] * c["n"], c["token_bytes"])
        assert mode.pull_us == pytest.approx(c["pull_us"], rel=0.01)  # the same bytes over the same link
        chosen.append(c["prefetch"] if mode.prefetch else c["inline"])
        for name in always:
            always[name].append(c[name])
    mean = statistics.mean(chosen)
    assert mean < statistics.mean(always["prefetch"]) and mean < statistics.mean(always["inline"]), (mean, always)


def test_the_users_configuration_prefetches():
    # CP 8, a 128K context, 8K-token chunks (1K per rank), DeepSeek-V3.2's fp8 row + indexer record.
    mode = choose_read_mode(8, 131072, 8192, 656 + 132)
    assert mode.prefetch and not mode.forced
    assert mode.describe().startswith("views prefetch one layer ahead: a full context's pull is modeled at 244 us")
    # A short context: the pull is under 1% of the layer, in line.
    assert not choose_read_mode(8, 32768, 32768, 656 + 132).prefetch


def test_the_setting_overrides(monkeypatch):
    monkeypatch.setenv(PREFETCH_ENV, "0")
    mode = choose_read_mode(8, 131072, 8192, 788)
    assert not mode.prefetch and mode.forced and mode.describe() == f"views in line ({PREFETCH_ENV}=0)"
    monkeypatch.setenv(PREFETCH_ENV, "1")
    assert choose_read_mode(8, 32768, 32768, 788).prefetch
    for bad in ("2", "yes", "-1"):
        monkeypatch.setenv(PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=f"^{PREFETCH_ENV} must be"):
            choose_read_mode(8, 131072, 8192, 788)
