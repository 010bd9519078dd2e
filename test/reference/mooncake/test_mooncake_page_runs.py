"""Owned positions, run coalescing, transfer entries and owner-striped destination pages."""

import numpy as np
import pytest
import torch

from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.reference.mooncake.decode_pool import DecodePageAllocator, owner_striped
from sglang_cp_shared_kv.reference.mooncake.page_runs import (
    BufferPair,
    coalesce_runs,
    owned_positions,
    transfer_entries,
)
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


def _expand(runs):
    """Every (src, dst) page pair the runs cover."""
    pairs = []
    for s, d, n in zip(runs.src_page.tolist(), runs.dst_page.tolist(), runs.length.tolist()):
        pairs += [(s + i, d + i) for i in range(n)]
    return sorted(pairs)


def _min_runs(src, dst):
    """Brute force: a pair continues a run iff (src-1, dst-1) is also a pair."""
    pairs = set(zip(src.tolist(), dst.tolist()))
    return sum((s - 1, d - 1) not in pairs for s, d in pairs)


@pytest.mark.parametrize("seed", range(20))
def test_coalesce_covers_every_pair_with_fewest_runs(seed):
    g = np.random.default_rng(seed)
    n = int(g.integers(0, 60))
    src = g.permutation(80)[:n] if seed % 2 else np.arange(n) + 3
    dst = g.permutation(100)[:n] if seed % 3 == 0 else src + 7
    runs = coalesce_runs(src, dst)
    assert _expand(runs) == sorted(zip(src.tolist(), dst.tolist()))
    assert runs.num_runs == _min_runs(src, dst)
    assert runs.num_pages == n


def test_contiguous_share_is_one_run():
    runs = coalesce_runs(np.array([7, 5, 6, 8]), np.array([12, 10, 11, 13]))
    assert (runs.src_page.tolist(), runs.dst_page.tolist(), runs.length.tolist()) == ([5], [10], [4])


def test_entries_are_buffer_major_and_byte_exact():
    runs = coalesce_runs(np.array([0, 1, 5]), np.array([3, 4, 9]))
    bufs = [BufferPair(1000, 50_000, 10), BufferPair(2000, 90_000, 4)]
    src, dst, length = transfer_entries(runs, bufs)
    assert src.tolist() == [1000, 1050, 2000, 2020]
    assert dst.tolist() == [50_030, 50_090, 90_012, 90_036]
    assert length.tolist() == [20, 10, 8, 4]
    assert [a.size for a in transfer_entries(coalesce_runs(np.array([]), np.array([])), bufs)] == [0, 0, 0]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_owned_positions_partition_the_request(n):
    own = PageOwnership(n, 16)
    table = BalancedPageAllocator(own, 40).alloc(37, first_owner=n - 1)
    parts = [owned_positions(table, own, r) for r in range(n)]
    assert sorted(torch.cat(parts).tolist()) == list(range(37))
    for r, pos in enumerate(parts):
        assert bool((table[pos] % n == r).all())
        assert abs(pos.numel() - 37 / n) < 1


@pytest.mark.parametrize("n,n_pages,first_owner", [(2, 9, 0), (4, 37, 3), (4, 2, 1), (1, 5, 0)])
def test_owner_striped_pages_make_one_run_per_rank(n, n_pages, first_owner):
    dst = owner_striped(torch.arange(100, 100 + n_pages), n)
    assert sorted(dst.tolist()) == list(range(100, 100 + n_pages))
    own = PageOwnership(n, 16)
    table = BalancedPageAllocator(own, 40).alloc(n_pages, first_owner)
    for r in range(n):
        pos = owned_positions(table, own, r)
        runs = coalesce_runs(own.phys_page(table[pos]).numpy(), dst[pos].numpy())
        assert runs.num_runs == (1 if pos.numel() else 0)


def test_decode_allocator_lowest_first_and_checked_free():
    alloc = DecodePageAllocator(10)
    a = alloc.alloc(4, cp_size=2)
    assert a.tolist() == [0, 2, 1, 3] and alloc.free_pages == 6
    assert alloc.alloc(7) is None and alloc.free_pages == 6
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([3, 5])
    with pytest.raises(ValueError, match="twice"):
        alloc.free([3, 3])
    with pytest.raises(ValueError, match="outside"):
        alloc.free([10])
    assert alloc.free_pages == 6
    alloc.free(a)
    assert alloc.free_pages == 10
