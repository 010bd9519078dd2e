"""The decode DCP benchmark measures what it says: the pools it builds hold the rows and tokens of their
layouts, and its global top-k run on gloo ranks equals the replicated indexer's, ties at the edge included."""

import os

import pytest

pytestmark = [pytest.mark.sglang]


def test_capacity_reads_each_layout_from_sglang_classes():
    from benchmark.cp_shared_kv.decode_dcp import PS, capacity

    rows = 64 * PS
    by = {r["layout"]: r for r in capacity(4, rows)}
    repl, dcp, ours = by["replicated"], by["sglang_dcp"], by["sharded"]
    assert repl["capacity_ratio"] == 1.0
    # SGLang's DCP: the latent striped (the same rows per rank), the indexer pages whole on every rank.
    assert dcp["tokens"] == 4 * repl["tokens"] and dcp["index_rows_per_rank"] > 3 * rows
    assert 1.0 < dcp["capacity_ratio"] < 4.0
    # Sharded: the same bytes per rank as the replicated pool, four times the tokens.
    assert ours["bytes_per_rank"] == repl["bytes_per_rank"] and ours["index_rows_per_rank"] <= rows + PS
    assert ours["capacity_ratio"] > dcp["capacity_ratio"]


@pytest.mark.multirank
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="SGLang's indexer writer is Triton")
def test_global_topk_run_equals_the_replicated_indexer():
    from benchmark.cp_shared_kv.decode_dcp import topk_rank

    from reference.spawn import spawn_ranks

    ranks = spawn_ranks(topk_rank, 2, [2100, 700, 90], 256, 3, timeout_s=300)
    assert all(r["topk_equal"] for r in ranks), ranks
    assert any(ranks[0]["edge_ties"]), "the keys must make equal scores at the top-k edge"
    assert sum(r["owned_positions"] for r in ranks) == ranks[0]["visible_positions"]
