"""ViewMaterializer in one process: what it hands the kernels, and prefetch.
(Multi-rank: test_materialize_multirank.py; the wired read state: test_read_state_ranks.py.)"""

import pytest
import torch
from page_fixtures import begin_batch
from page_fixtures import filled_pool as _filled_pool

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import batch_kind
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES

PS = 16


def test_batch_kind_from_host_prefix_lengths():
    assert batch_kind([0, 0]) == "current"
    assert batch_kind([3, 16]) == "history"
    assert batch_kind([0, 16]) == "mixed"


@pytest.mark.parametrize("with_indexer", [True, False])
def test_single_rank_view_holds_the_batch_pages_in_slot_order(with_indexer):
    pool = _filled_pool(with_indexer=with_indexer)
    table = torch.tensor([[7, 2, 9], [2, 4, 0]], dtype=torch.int32)  # page 2 read by both requests
    mat = ViewMaterializer(pool, None, use_triton=False)
    counters = begin_batch(mat, table, [3 * PS, 2 * PS - 3], [PS, 5])
    view = mat.layer_view(1)
    assert mat.plan is not None and counters.kind == "history"
    assert view.kv_rows.shape == (5 * PS, pool.row_bytes)
    for b, n in enumerate([3, 2]):
        for j in range(n):
            slot, lp = int(view.page_table[b, j]), int(table[b, j])
            assert torch.equal(view.kv_rows[slot * PS : (slot + 1) * PS], pool.latent[1][lp * PS : (lp + 1) * PS])
            if with_indexer:
                assert torch.equal(view.index_pages[slot], pool.index[1][lp])
    assert view.index_pages is None if not with_indexer else view.index_pages.shape == (5, PS * INDEX_TOKEN_BYTES)
    page_bytes = PS * (pool.row_bytes + (INDEX_TOKEN_BYTES if with_indexer else 0))
    assert (counters.view_pages, counters.pages_gathered, counters.bytes_received) == (5, 5, 0)
    assert counters.bytes_materialized == 5 * page_bytes


@pytest.mark.parametrize("with_indexer", [True, False])
def test_prefetched_views_equal_views_gathered_in_line(with_indexer):
    """With prefetch, layer l + 1 is gathered while layer l is read, into the other of two view sets; every
    view must equal the one gathered in line, pages staged past the view untouched."""
    pool = _filled_pool(with_indexer=with_indexer)
    table = torch.tensor([[7, 2, 9], [3, 4, 0]], dtype=torch.int32)
    seq_lens = prefix_lens = [2 * PS, PS]  # prefix pages only: the read state stages the chunk past them
    ahead = ViewMaterializer(pool, None, prefetch=True, use_triton=False)
    after = ViewMaterializer(pool, None, use_triton=False)
    counters = begin_batch(ahead, table, seq_lens, prefix_lens)
    begin_batch(after, table, seq_lens, prefix_lens)
    assert ahead.view_sets == 2 and after.view_sets == 1
    for layer in range(2):
        got, want = ahead.layer_view(layer), after.layer_view(layer)
        assert got.kv_rows.data_ptr() != want.kv_rows.data_ptr()
        assert torch.equal(got.kv_rows, want.kv_rows) and torch.equal(got.page_table, want.page_table)
        if with_indexer:
            assert torch.equal(got.index_pages, want.index_pages)
        if layer == 0:
            assert ahead._pending is not None and ahead._pending[0] == 1  # layer 1 gathered ahead
    assert ahead._pending is None  # the last layer starts no prefetch
    assert counters == after.counters


def test_prefetch_gather_place_is_checked():
    with pytest.raises(ValueError, match="prefetch_gather must be one of"):
        ViewMaterializer(_filled_pool(), None, prefetch=True, prefetch_gather="elsewhere")
