"""Balanced allocation: per-request owner counts within one, clean admission failure, frees go home."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


@settings(max_examples=50, deadline=None)
@given(
    n=st.sampled_from([1, 2, 4, 8]),
    ops=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=30),
)
def test_requests_stay_balanced_and_capacity_is_n_times(n, ops):
    alloc = BalancedPageAllocator(PageOwnership(n, 16), phys_pages_per_rank=10)
    assert alloc.logical_capacity_pages == 10 * n
    live: list[list[int]] = []
    for n_pages, extend_chunks in ops:
        req: list[int] = []
        for _ in range(1 + extend_chunks):  # chunked prefill extends the same request
            got = alloc.alloc(n_pages, alloc.next_owner(req[-1] if req else None))
            if got is None:
                break
            req += got.tolist()
        live.append(req)
        owners = [p % n for p in req]
        counts = [owners.count(r) for r in range(n)]
        assert max(counts) - min(counts) <= 1
        assert all((b - a) % n == 1 % n for a, b in zip(owners, owners[1:]))  # consecutive owners
        all_pages = [p for r in live for p in r]
        assert len(all_pages) == len(set(all_pages))
        assert sum(alloc.used_pages(r) for r in range(n)) == len(all_pages)
        if len(live) > 3:
            alloc.free(live.pop(0))


def test_admission_fails_without_partial_allocation():
    alloc = BalancedPageAllocator(PageOwnership(4, 16), phys_pages_per_rank=3)  # page 0 of each rank: trash
    assert alloc.alloc(3, first_owner=1).tolist() == [5, 6, 7]
    # owners 1,2,3 have one page left each, owner 0 has two: 5 pages from owner 1 need two of owner 1.
    before = [alloc.free_pages(r) for r in range(4)]
    assert alloc.alloc(5, first_owner=1) is None
    assert [alloc.free_pages(r) for r in range(4)] == before
    assert alloc.alloc(5, first_owner=0).tolist() == [4, 9, 10, 11, 8]


def test_free_returns_pages_to_their_owner():
    alloc = BalancedPageAllocator(PageOwnership(2, 16), phys_pages_per_rank=4)  # page 0 of each rank: trash
    pages = alloc.alloc(4).tolist()
    assert [alloc.used_pages(r) for r in range(2)] == [2, 2]
    alloc.free(torch.tensor(pages[:1]))
    assert [alloc.used_pages(r) for r in range(2)] == [1, 2]
    assert alloc.alloc(1, first_owner=0).tolist() == [6]  # owner 0's next free physical page (3)
    assert alloc.alloc(1, first_owner=0).tolist() == [2]  # then the freed one


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a: a.alloc(-1), "n_pages"),
        (lambda a: a.alloc(1, first_owner=2), "first_owner"),
        (lambda a: a.free([99]), "logical_pages holds 99, out of range"),
        (lambda a: a.free([1]), "logical_pages holds page 1, which is not allocated"),
        (lambda a: BalancedPageAllocator(PageOwnership(2, 16), 0), "phys_pages_per_rank"),
    ],
)
def test_bad_input_is_rejected_and_changes_nothing(call, match):
    alloc = BalancedPageAllocator(PageOwnership(2, 16), phys_pages_per_rank=3)
    alloc.alloc(1)
    with pytest.raises(ValueError, match=match) as exc:
        call(alloc)
    assert "\n" not in str(exc.value)
    assert [alloc.used_pages(r) for r in range(2)] == [1, 0]


def test_double_free_in_one_call_frees_nothing():
    alloc = BalancedPageAllocator(PageOwnership(2, 16), phys_pages_per_rank=3)
    pages = alloc.alloc(2).tolist()
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages + pages[:1])
    assert [alloc.used_pages(r) for r in range(2)] == [1, 1]
