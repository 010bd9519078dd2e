"""The standalone stack's read path in one process: current-reuse through the compact table, the
materialized fallback, the view arena, and how bad input is rejected (by ``ReadPath`` and the
``ViewMaterializer`` under it)."""

import pytest
import torch
from pool_workload import filled_pool as _filled_pool

from sglang_cp_shared_kv.reference.read_path import (
    ReadPath,
    compact_row_table,
    pack_index_records,
    pool_view,
    staged_view_pages,
)
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewArenaError
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership
from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_regions

PS = 16


def test_compact_row_table():
    assert compact_row_table([3, 1, 2]).tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    with pytest.raises(ValueError, match="extend_lens"):
        compact_row_table([2, -1])


def test_current_batch_reads_the_current_chunk():
    pool = _filled_pool()
    mat = ReadPath(pool, None, use_triton=False)
    counters = mat.begin_batch(torch.tensor([[1, 0], [3, 4]], dtype=torch.int32), [5, 20], [0, 0])
    assert mat.reusing_current and mat.plan is None
    rows = torch.randint(0, 256, (25, pool.row_bytes), dtype=torch.uint8)
    records = pack_index_records(torch.randint(0, 256, (25, 128), dtype=torch.uint8), torch.rand(25))
    for layer in range(2):
        view = mat.layer_view(layer, rows, records)
        assert view.kv_rows is rows and view.index_pages is records and view.page_size == 1
    assert view.rows(torch.tensor([[4, 0, -1], [19, 2, 0]]), torch.tensor([0, 1])).tolist() == [[4, 0, -1], [24, 7, 5]]
    assert (counters.current_reuse_hits, counters.layers, counters.bytes_materialized, counters.pages_gathered) == (
        2,
        2,
        0,
        0,
    )


def test_current_batch_can_be_materialized_instead():
    pool = _filled_pool()
    mat = ReadPath(pool, None, current_reuse=False, use_triton=False)
    counters = mat.begin_batch(torch.tensor([[1, 0], [3, 4]], dtype=torch.int32), [5, 20], [0, 0])
    view = mat.layer_view(0)
    assert not mat.reusing_current and counters.kind == "current" and counters.view_pages == 3
    assert torch.equal(view.kv_rows[int(view.page_table[1, 1]) * PS], pool.latent[0][4 * PS])


def test_bad_input_is_rejected():
    pool = _filled_pool()
    sharded = ShardedMLAPool(PageOwnership(2, PS), 0, 4, 1, "fp8")
    with pytest.raises(ValueError, match="group is required"):
        ReadPath(sharded, None)
    with pytest.raises(ValueError, match="replicated pool"):
        pool_view(sharded, 0, torch.zeros((1, 1), dtype=torch.int32))
    mat = ReadPath(pool, None, use_triton=False)
    with pytest.raises(ValueError, match="before begin_batch"):
        mat.layer_view(0)
    table = torch.zeros((2, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="must agree"):
        mat.begin_batch(table, [3], [0])
    with pytest.raises(ValueError, match="prefix_lens"):
        mat.begin_batch(table, [3, 4], [0, 5])
    mat.begin_batch(table, [3, 4], [0, 0])
    with pytest.raises(ValueError, match="current_kv_rows"):
        mat.layer_view(0)
    with pytest.raises(ValueError, match="current_index_records"):
        mat.layer_view(0, torch.zeros((7, pool.row_bytes), dtype=torch.uint8), torch.zeros((7, 3), dtype=torch.uint8))
    with pytest.raises(ValueError, match="layer"):
        mat.layer_view(5)


def test_view_arena_holds_every_view_and_refuses_a_batch_past_it():
    """``attach_arena`` as the wired path's: sized by ``arena_regions``, allocated once, views are its pages."""
    pool = _filled_pool()
    page_bytes = PS * (pool.row_bytes + INDEX_TOKEN_BYTES)
    prefix, chunk = arena_regions(1, PS, 3 * PS + 5, 2 * PS - 3, 2)
    assert (prefix, chunk) == (8 * PS, 2 * PS)
    mat = ReadPath(pool, None, stage_current=True, use_triton=False)
    assert mat.attach_arena(prefix, chunk) == 11 * page_bytes
    arena = mat.arena
    assert {k: tuple(v.shape) for k, v in arena.items()} == {
        "latent": (11, PS * pool.row_bytes),
        "index": (11, PS * INDEX_TOKEN_BYTES),
    }
    # A history batch: two prefix pages gathered into the arena, the current page staged after them.
    rows = torch.randint(0, 256, (PS, pool.row_bytes), dtype=torch.uint8)
    records = pack_index_records(torch.randint(0, 256, (PS, 128), dtype=torch.uint8), torch.rand(PS))
    counters = mat.begin_batch(torch.tensor([[1, 2, 3]], dtype=torch.int32), [3 * PS], [2 * PS])
    view = mat.layer_view(0, rows, records)
    assert view.kv_rows.data_ptr() == arena["latent"].data_ptr()
    assert view.index_pages.data_ptr() == arena["index"].data_ptr()
    got = view.kv_rows[view.rows(torch.arange(3 * PS).unsqueeze(0), torch.tensor([0]))[0].long()]
    assert torch.equal(got[: 2 * PS], pool.latent[0][PS : 3 * PS]) and torch.equal(got[2 * PS :], rows)
    assert (counters.view_pages, counters.pages_staged, counters.current_chunk_bytes_gathered) == (2, 1, 0)
    assert staged_view_pages([3 * PS], [2 * PS], 1, PS) == 3
    # Prefix pages [2, 0] (a part-filled one viewed): 4 x 1 view pages; staged (4 - 2) + 1.
    assert staged_view_pages([3 * PS + 1, PS], [PS + 1, 0], 4, PS) == 4 * 1 + 2 + 1
    assert counters.bytes_materialized == 2 * page_bytes and counters.bytes_received == 0
    # 9 prefix pages + 3 staged: past the arena's 11 pages, refused when the batch begins.
    table = torch.tensor([list(range(10)) + [0, 0]], dtype=torch.int32)
    assert staged_view_pages([12 * PS], [9 * PS], 1, PS) == 12
    with pytest.raises(ViewArenaError, match="needs 12 pages, more than the view arena's 11"):
        mat.begin_batch(table, [12 * PS], [9 * PS])
    with pytest.raises(RuntimeError, match="once, before the first batch"):
        mat.attach_arena(prefix, chunk)
    with pytest.raises(ValueError, match="page-aligned"):
        ReadPath(pool, None).attach_arena(PS + 1, PS)
    # Prefetching: room for a second chunk and trash page (two view sets of the usual batch).
    assert ReadPath(pool, None, prefetch=True).attach_arena(PS, PS) == 5 * page_bytes
