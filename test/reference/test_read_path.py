"""The standalone stack's read path in one process: current-reuse through the compact table, the
materialized fallback, and how bad input is rejected (by ``ReadPath`` and the ``ViewMaterializer`` under it)."""

import pytest
import torch
from pool_workload import filled_pool as _filled_pool

from sglang_cp_shared_kv.reference.read_path import ReadPath, compact_row_table, pack_index_records, pool_view
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

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
