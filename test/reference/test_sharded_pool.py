"""Single-process checks of the sharded pool: masked store, byte accounting, bad input."""

import ast
import inspect

import pytest
import torch

from sglang_cp_shared_kv.reference import sharded_pool
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import quantize_index_k, quantize_mla_fp8
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


def test_foreign_rows_land_in_the_trash_page_only():
    own = PageOwnership(4, 16)
    pool = ShardedMLAPool(own, rank=2, phys_pages=4, num_layers=1, kv_format="fp8")  # page 0: the trash page
    locs = torch.arange(4 * 16, 16 * 16)  # logical pages 4..15 ([0, 4) are reserved): this rank owns 6, 10, 14
    rows = quantize_mla_fp8(torch.randn(len(locs), 512), torch.randn(len(locs), 64))
    k_u8, scale = quantize_index_k(torch.randn(len(locs), 128))
    pool.set_latent(0, locs, rows)
    pool.set_index(0, locs, k_u8, scale)
    for phys, lp in enumerate([6, 10, 14], start=1):
        i = lp - 4  # the chunk starts at logical page 4
        assert torch.equal(pool.latent[0][phys * 16 : (phys + 1) * 16], rows[i * 16 : (i + 1) * 16])
        assert torch.equal(pool.index_k_view(0)[phys], k_u8[i * 16 : (i + 1) * 16])
        assert torch.equal(pool.index_scale_view(0)[phys], scale[i * 16 : (i + 1) * 16])
    assert pool.trash_page == 0


def test_byte_accounting():
    pool = ShardedMLAPool(PageOwnership(8, 64), 0, phys_pages=11, num_layers=3, kv_format="fp8")  # trash page included
    assert pool.page_bytes_per_layer == 64 * (656 + 132)
    assert pool.page_bytes == 3 * 64 * 788
    assert pool.allocated_bytes == 11 * pool.page_bytes
    bf16 = ShardedMLAPool(PageOwnership(8, 64), 0, phys_pages=11, num_layers=1, kv_format="bf16", with_indexer=False)
    assert bf16.page_bytes == 64 * 1152
    assert bf16.latent[0].numel() == 11 * 64 * 1152


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=4), "rank must be in"),
        (dict(phys_pages=0), "phys_pages"),
        (dict(num_layers=0), "num_layers"),
        (dict(kv_format="fp16"), "kv_format"),
    ],
)
def test_bad_construction(kwargs, match):
    args = dict(ownership=PageOwnership(4, 16), rank=0, phys_pages=2, num_layers=1, kv_format="fp8") | kwargs
    with pytest.raises(ValueError, match=match) as exc:
        ShardedMLAPool(**args)
    assert "\n" not in str(exc.value)


def test_bad_writes_change_nothing():
    pool = ShardedMLAPool(PageOwnership(2, 16), 0, phys_pages=2, num_layers=1, kv_format="bf16")
    locs = torch.arange(16)
    with pytest.raises(ValueError, match="rows_u8 must be uint8"):
        pool.set_latent(0, locs, torch.ones(16, 656, dtype=torch.uint8))
    with pytest.raises(ValueError, match="k_u8 must be uint8"):
        pool.set_index(0, locs, torch.ones(15, 128, dtype=torch.uint8), torch.ones(16))
    with pytest.raises(ValueError, match="scale must be float32"):
        pool.set_index(0, locs, torch.ones(16, 128, dtype=torch.uint8), torch.ones(16, dtype=torch.float64))
    assert not pool.latent[0].any() and not pool.index[0].any()


def test_debug_mode_rejects_locs_beyond_this_ranks_pages(monkeypatch):
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "1")
    pool = ShardedMLAPool(PageOwnership(2, 16), 0, phys_pages=2, num_layers=1, kv_format="bf16")
    with pytest.raises(ValueError, match="loc 64 maps past this rank's 2 physical pages"):
        pool.set_latent(0, torch.tensor([0, 64]), torch.zeros(2, 1152, dtype=torch.uint8))
    assert not pool.latent[0].any()


FORBIDDEN = {"nonzero", "unique", "item", "tolist", "bincount", "cpu", "masked_select", "argwhere"}


def test_write_path_has_no_host_sync_calls():
    """The store path stays static-shape: no data-dependent shapes, no device->host reads."""
    for fn in (
        PageOwnership.store_rows,
        ShardedMLAPool.store_rows,
        ShardedMLAPool.set_latent,
        ShardedMLAPool.set_index,
    ):
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert not calls & FORBIDDEN, (fn.__name__, calls & FORBIDDEN)
    assert "nonzero" not in inspect.getsource(sharded_pool.ShardedMLAPool.store_rows)
