"""Ownership arithmetic: a bijection whose owners partition every page set; clear errors on bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership, local_page, page_owner

cp_sizes = st.sampled_from([1, 2, 3, 4, 8])
page_sizes = st.sampled_from([1, 2, 16, 64])
dtypes = st.sampled_from([torch.int32, torch.int64])


@settings(max_examples=60, deadline=None)
@given(n=cp_sizes, ps=page_sizes, dtype=dtypes, locs=st.lists(st.integers(0, 2**20), min_size=1, max_size=200))
def test_loc_map_is_a_bijection(n, ps, dtype, locs):
    own = PageOwnership(n, ps)
    locs_t = torch.tensor(locs, dtype=dtype)
    owner, row = own.loc_owner(locs_t), own.phys_row(locs_t)
    assert owner.dtype == dtype and row.dtype == dtype
    assert torch.equal(own.logical_loc(owner, row), locs_t)
    # Injective: distinct locs never share (owner, row).
    pairs = {(o, r) for o, r in zip(owner.tolist(), row.tolist())}
    assert len(pairs) == len(set(locs))
    # Formulas of the docstring.
    lp = locs_t // ps
    assert torch.equal(owner, lp % n)
    assert torch.equal(row, (lp // n) * ps + locs_t % ps)


@pytest.mark.sglang
@settings(max_examples=40, deadline=None)
@given(
    n=st.sampled_from([2, 3, 4, 8]), ps=st.sampled_from([1, 16, 64]), locs=st.lists(st.integers(0, 2**20), max_size=200)
)
def test_ownership_is_sglangs_page_interleave_placement(n, ps, locs):
    """``page_owner`` / ``local_page`` (and the pool's row map built on them) agree with SGLang's own
    ``PageInterleavePlacement`` on every loc, so SGLang's allocator, sender and decode see our store's pages."""
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec

    spec = PageShardSpec(shard_rank=0, shard_size=n, page_size=ps, max_prefix_tokens=0, chunk_tokens=0)
    theirs = PageInterleavePlacement(spec)
    locs_t = torch.tensor(locs, dtype=torch.int64)
    lp = locs_t // ps
    assert torch.equal(page_owner(lp, n), theirs.owner_of(locs_t))
    assert torch.equal(local_page(lp, n) * ps + locs_t % ps, theirs.local_index(locs_t))
    own = PageOwnership(n, ps)
    assert torch.equal(own.loc_owner(locs_t), theirs.owner_of(locs_t))
    assert torch.equal(own.phys_row(locs_t), theirs.local_index(locs_t))


@settings(max_examples=60, deadline=None)
@given(n=cp_sizes, pages=st.sets(st.integers(0, 10_000), min_size=1, max_size=300))
def test_owners_partition_every_page_set(n, pages):
    own = PageOwnership(n, 16)
    lp = torch.tensor(sorted(pages))
    owner, phys = own.owner(lp), own.phys_page(lp)
    parts = [set(lp[owner == r].tolist()) for r in range(n)]
    assert set().union(*parts) == set(pages)
    assert sum(len(p) for p in parts) == len(pages)
    for r in range(n):
        sel = owner == r
        assert torch.equal(phys[sel] * n + r, lp[sel])  # (owner, physical page) is a bijection


def test_int32_stays_int32_near_its_limit():
    own = PageOwnership(8, 64)
    locs = torch.tensor([2**31 - 1, 2**31 - 64], dtype=torch.int32)
    assert torch.equal(own.logical_loc(own.loc_owner(locs), own.phys_row(locs)), locs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(cp_size=0, page_size=16), "cp_size"),
        (dict(cp_size=2, page_size=24), "page_size"),
        (dict(cp_size=2, page_size=0), "page_size"),
        (dict(cp_size=2, page_size=16, logical_pages=-1), "logical_pages"),
    ],
)
def test_bad_construction_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name) as exc:
        PageOwnership(**kwargs)
    assert "\n" not in str(exc.value)


def test_bad_locs_rejected_in_debug_mode(monkeypatch):
    own = PageOwnership(2, 16, logical_pages=4)
    with pytest.raises(ValueError, match="locs must be int32 or int64"):
        own.phys_row(torch.tensor([1.0]))
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "0")
    own.phys_row(torch.tensor([-1, 64]))  # not checked: checking would sync
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "1")
    with pytest.raises(ValueError, match=r"locs holds a negative value \(-1\)"):
        own.phys_row(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match=r"locs holds 64, out of range \[0, 64\)"):
        own.loc_owner(torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="logical_pages holds 4"):
        own.owner(torch.tensor([4]))
    with pytest.raises(ValueError, match="owner must be in"):
        own.logical_loc(2, torch.tensor([0]))


def test_spec_is_checked_once_and_frozen():
    from dataclasses import FrozenInstanceError

    from sglang_cp_shared_kv.srt.mem_cache.placement import TRASH_PAGE, CPSharedSpec

    spec = CPSharedSpec(cp_size=4, cp_rank=3, page_size=16, phys_pages=5, row_bytes=656, with_indexer=True)
    assert spec.trash_page == TRASH_PAGE == 0
    assert spec.logical_pages == 20
    own = spec.ownership()
    assert (own.cp_size, own.page_size, own.logical_pages) == (4, 16, 20)
    with pytest.raises(FrozenInstanceError):
        spec.cp_rank = 0
    base = dict(cp_size=4, cp_rank=0, page_size=16, phys_pages=5, row_bytes=656, with_indexer=False)
    for bad, match in [
        (dict(cp_size=0), "cp_size must be an int >= 1, got 0"),
        (dict(cp_rank=4), r"cp_rank must be in \[0, 4\), got 4"),
        (dict(page_size=24), "page_size must be a power of two, got 24"),
        (dict(phys_pages=0), "phys_pages must be an int >= 1, got 0"),
        (dict(row_bytes=2.0), "row_bytes must be an int >= 1, got 2.0"),
    ]:
        with pytest.raises(ValueError, match=match):
            CPSharedSpec(**(base | bad))


def test_check_int_message():
    from sglang_cp_shared_kv.srt.utils import check_int

    check_int("n", 3, 3)
    for value in (2, "3", 3.0, None):
        with pytest.raises(ValueError, match=f"n must be an int >= 3, got {value!r}"):
            check_int("n", value, 3)


def test_masked_store_debug_check_rejects_an_owned_row_on_the_trash_page(monkeypatch):
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "1")
    own = PageOwnership(2, 16)
    locs = torch.tensor([2 * 16 + 1, 3 * 16 + 1, 16 + 1])  # owners 0, 1, 1 (page 1: reserved, on the trash page)
    rows, mine = own.store_rows(locs, 1, trash_page=0, phys_pages=2)
    assert rows.tolist() == [1, 16 + 1, 1] and mine.tolist() == [False, True, True]
    with pytest.raises(AssertionError, match="maps onto the trash page"):
        own.check_store_rows(torch.tensor([3 * 16 + 1]), torch.tensor([1]), torch.tensor([True]), 1, 0, 2)
    with pytest.raises(ValueError, match="loc 80 maps past this rank's 2 physical pages"):
        own.store_rows(torch.tensor([80]), 1, trash_page=0, phys_pages=2)
