"""ViewMaterializer in one process: what it hands the kernels, prefetch and shared plans.
(Multi-rank: test_materialize_multirank.py; the wired read state: test_read_state_ranks.py.)"""

import pytest
import torch
from page_fixtures import PagePool, pack_index_records
from page_fixtures import filled_pool as _filled_pool

from sglang_cp_shared_kv.srt.layers.attention.nsa.current_reuse import batch_kind
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

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
    counters = mat.begin_batch(table, [3 * PS, 2 * PS - 3], [PS, 5])
    view = mat.layer_view(1)
    assert mat.plan is not None and counters.kind == "history"
    assert view.page_size == PS and view.kv_rows.shape == (5 * PS, pool.row_bytes)
    for b, n in enumerate([3, 2]):
        for j in range(n):
            slot, lp = int(view.page_table[b, j]), int(table[b, j])
            assert torch.equal(view.kv_rows[slot * PS : (slot + 1) * PS], pool.latent[1][lp * PS : (lp + 1) * PS])
            if with_indexer:
                assert torch.equal(view.index_pages[slot], pool.index[1][lp])
    assert view.index_pages is None if not with_indexer else view.index_pages.shape == (5, PS * INDEX_TOKEN_BYTES)
    # Position 17 of request 0 is row 1 of its second page.
    rows = view.rows(torch.tensor([[17, -1]], dtype=torch.int32), torch.tensor([0]))
    assert rows.tolist() == [[int(view.page_table[0, 1]) * PS + 1, -1]]
    page_bytes = PS * (pool.row_bytes + (INDEX_TOKEN_BYTES if with_indexer else 0))
    assert (counters.view_pages, counters.pages_gathered, counters.bytes_received) == (5, 5, 0)
    assert counters.bytes_materialized == 5 * page_bytes


@pytest.mark.parametrize("with_indexer", [True, False])
def test_prefetched_views_equal_views_gathered_after_the_write(with_indexer):
    """With prefetch, layer l + 1 is gathered before its current chunk is written; the current rows
    are then copied in. Every view must equal the one gathered after the write."""
    pool, plain_pool = _filled_pool(with_indexer=with_indexer), _filled_pool(with_indexer=with_indexer)
    table = torch.tensor([[7, 2, 9], [3, 4, 0]], dtype=torch.int32)
    seq_lens, prefix_lens = [2 * PS + 5, 2 * PS - 1], [PS + 3, 0]  # a history and a fresh request
    req = [b for b, (p, n) in enumerate(zip(prefix_lens, seq_lens)) for _ in range(n - p)]
    pos = [i for p, n in zip(prefix_lens, seq_lens) for i in range(p, n)]
    locs = torch.tensor([int(table[b, i // PS]) * PS + i % PS for b, i in zip(req, pos)])
    ahead = ViewMaterializer(pool, None, prefetch=True, use_triton=False)
    after = ViewMaterializer(plain_pool, None, use_triton=False)
    counters = ahead.begin_batch(table, seq_lens, prefix_lens)
    after.begin_batch(table, seq_lens, prefix_lens)
    g = torch.Generator().manual_seed(11)
    for layer in range(2):
        rows = torch.randint(0, 256, (len(locs), pool.row_bytes), dtype=torch.uint8, generator=g)
        k = torch.randint(0, 256, (len(locs), 128), dtype=torch.uint8, generator=g)
        scale = torch.rand(len(locs), generator=g)
        for p in (pool, plain_pool):
            p.set_latent(layer, locs, rows)
            if with_indexer:
                p.set_index(layer, locs, k, scale)
        records = pack_index_records(k, scale) if with_indexer else None
        got, want = ahead.layer_view(layer, rows, records), after.layer_view(layer)
        assert torch.equal(got.kv_rows, want.kv_rows) and torch.equal(got.page_table, want.page_table)
        if with_indexer:
            assert torch.equal(got.index_pages, want.index_pages)
    assert ahead._pending is None  # the last layer starts no prefetch
    assert counters == after.counters


def test_prefetch_needs_the_current_chunk():
    mat = ViewMaterializer(_filled_pool(), None, prefetch=True, use_triton=False)
    mat.begin_batch(torch.zeros((1, 2), dtype=torch.int32), [20], [16])
    with pytest.raises(ValueError, match="current_kv_rows"):
        mat.layer_view(0)
    with pytest.raises(ValueError, match="prefetch_gather must be one of"):
        ViewMaterializer(_filled_pool(), None, prefetch=True, prefetch_gather="elsewhere")


def test_a_plan_built_by_one_materializer_serves_another_of_the_same_batch():
    pool = _filled_pool()
    table = torch.tensor([[7, 2, 9], [2, 4, 0]], dtype=torch.int32)
    seq, prefix = [3 * PS, 2 * PS - 3], [PS, 5]
    first, second = ViewMaterializer(pool, None, use_triton=False), ViewMaterializer(pool, None, use_triton=False)
    first.begin_batch(table, seq, prefix)
    second.begin_batch(table, seq, prefix, plan=first.plan)
    assert second.plan is first.plan
    a, b = first.layer_view(0), second.layer_view(0)
    assert torch.equal(a.kv_rows, b.kv_rows) and torch.equal(a.index_pages, b.index_pages)
    with pytest.raises(ValueError, match="plan was built for another batch"):
        second.begin_batch(table, [3 * PS, 3 * PS], prefix, plan=first.plan)  # other lengths
    other = PagePool(PageOwnership(1, 2 * PS), 0, 12, 2, "fp8")  # another page size (the trash page is 0 in all)
    with pytest.raises(ValueError, match="plan was built for another batch"):
        ViewMaterializer(other, None, use_triton=False).begin_batch(table, seq, prefix, plan=first.plan)
