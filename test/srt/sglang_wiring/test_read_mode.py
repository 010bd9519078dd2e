"""The read mode chosen at startup, against the rank model it comes from (``docs/benchmarks/rank_model.json``).

- The layer-time fit matches the model's stock layer (median within 10% over its cells at 370 GB/s).
- The choice over the model's cells costs on average less than prefetching everywhere and than building
  every view in line, with each cell's measured overheads; at CP 8 / 128K / 1K tokens per rank it prefetches.
- ``$SGLANG_CP_SHARED_KV_PREFETCH`` 0 / 1 overrides it; any other value is refused with one line.
- A prefill server's configurator (CP 8, flag on) sizes the view arena for the chosen mode and says why in its
  one INFO line at sizing: prefetch at a 128K context, in line at 8K.
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
    for bad in ("2", "-1"):  # read as SGLang reads its settings: a warning, then the default (off)
        monkeypatch.setenv(PREFETCH_ENV, bad)
        with pytest.warns(UserWarning, match=f"Invalid value for {PREFETCH_ENV}"):
            assert not choose_read_mode(8, 32768, 32768, 788).prefetch


def _server_rank(_rank: int, _world: int, model_root: str, context: int, chunk: int) -> dict:
    import logging
    import os

    from plugin_models import configurator, prefill_cp_argv
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.srt.sglang_wiring import view_arena

    argv = prefill_cp_argv(model_root, 64, 8) + ["--chunked-prefill-size", str(chunk), "--context-length", str(context)]
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    server_args.__dict__["enable_cp_shared_kv"] = True  # the record as the launcher passes it
    publish(server_args, role="scheduler")
    config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_root, "dsa")]))
    config.context_len = context
    kvc = configurator(config, 64)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger(view_arena.__name__).addHandler(handler)
    logging.getLogger(view_arena.__name__).setLevel(logging.INFO)
    with get_parallel().override(attn_cp_rank=3, attn_cp_size=8, attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        mode = view_arena.read_mode_for(kvc)
        arena = view_arena.charge_arena(kvc)
    return {"prefetch": mode.prefetch, "describe": mode.describe(), "logged": logged, "arena": arena}


@pytest.mark.sglang
def test_a_server_sizes_its_arena_for_the_mode_and_logs_why(tmp_path, monkeypatch):
    """A prefill server's configurator with the flag (CP 8): the arena is sized for the mode the model picks, and
    its one INFO line at sizing says which and why."""
    from plugin_models import write_model_dirs

    from reference.spawn import spawn_ranks

    write_model_dirs(tmp_path, ["mla", "dsa"])
    monkeypatch.setenv("SGLANG_PLUGINS", "cp_shared_kv")
    monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")  # contexts past the tiny model's
    long, short = (spawn_ranks(_server_rank, 1, str(tmp_path), ctx, 8192, timeout_s=300)[0] for ctx in (131072, 8192))
    assert long["prefetch"] and not short["prefetch"], (long, short)
    for res in (long, short):
        (line,) = [m for m in res["logged"] if "view arena" in m]
        assert line.endswith(res["describe"]), line
        assert ("2 x 8192 chunk tokens" in line) == res["prefetch"], line
