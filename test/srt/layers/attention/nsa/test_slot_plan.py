"""The slot plan puts every page position of a batch in its owner's block, and the view built from it
holds, at each slot, exactly the page the replicated pool holds at the logical page."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_pages_ref
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    build_slot_plan,
    pages_for_lens,
    predicted_view_pages,
    slots_per_rank,
)
from sglang_cp_shared_kv.srt.mem_cache.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership
from sglang_cp_shared_kv.testing.dsa_stack import page_table_from_pages


def _batch_pages(cp_size: int, page_counts: list[int], share: list[int | None], seed: int) -> list[list[int]]:
    """Logical pages of each request from the balanced allocator; ``share[i] = j`` reuses request j's first pages."""
    rng = random.Random(seed)
    alloc = BalancedPageAllocator(PageOwnership(cp_size, 16), 4 + sum(page_counts))
    pages: list[list[int]] = []
    for i, n in enumerate(page_counts):
        src = share[i]
        shared = pages[src][: rng.randint(1, min(n, len(pages[src])))] if src is not None and n else []
        first = alloc.next_owner(shared[-1]) if shared else rng.randrange(cp_size)
        fresh = alloc.alloc(n - len(shared), first).tolist()
        pages.append(shared + fresh)
    return pages


def _page_table(pages: list[list[int]], pad: int = 0) -> torch.Tensor:
    width = max((len(p) for p in pages), default=0) + 1  # a spare column: kernels must not depend on the width
    return page_table_from_pages(pages, width, pad)


def _loop_slots(pages: list[list[int]], cp_size: int) -> list[int]:
    """The definition, spelled out: owner * S + running count of that owner's positions."""
    s = sum(-(-len(p) // cp_size) for p in pages)
    seen = [0] * cp_size
    out = []
    for req in pages:
        for lp in req:
            o = lp % cp_size
            out.append(o * s + seen[o])
            seen[o] += 1
    return out


def _check_plan(pages: list[list[int]], cp_size: int, trash: int) -> None:
    table = _page_table(pages, pad=7)
    plan = build_slot_plan(table, [len(p) for p in pages], cp_size, 16, trash, use_triton=False)
    s = plan.slots_per_rank
    assert s == sum(-(-len(p) // cp_size) for p in pages)
    flat = [lp for p in pages for lp in p]
    assert plan.num_positions == len(flat)
    assert plan.logical_pages.tolist() == flat
    assert plan.slots.tolist() == _loop_slots(pages, cp_size)
    # Every owner's positions fit in its block (balanced allocation), slots are unique.
    assert len(set(plan.slots.tolist())) == len(flat)
    assert all(slot // s == lp % cp_size for slot, lp in zip(plan.slots.tolist(), flat))
    # slot_phys: owned physical page at used slots, trash everywhere else.
    phys = plan.slot_phys.tolist()
    used = dict(zip(plan.slots.tolist(), flat))
    assert phys == [used[i] // cp_size if i in used else trash for i in range(cp_size * s)]
    # slot_table: slots at each request's positions, pad past them.
    expected = torch.zeros_like(table)
    it = iter(plan.slots.tolist())
    for b, p in enumerate(pages):
        expected[b, : len(p)] = torch.tensor([next(it) for _ in p], dtype=torch.int32)
    assert plan.slot_table.dtype == torch.int32
    assert torch.equal(plan.slot_table, expected)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_plan_matches_definition_with_shared_prefixes(cp_size):
    pages = _batch_pages(cp_size, [5, 3, 7, 1, 4, 9], [None, 0, 0, None, 2, 4], seed=cp_size)
    _check_plan(pages, cp_size, trash=41)


@settings(max_examples=60, deadline=None)
@given(
    cp_size=st.integers(1, 8),
    counts=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_plan_matches_definition_property(cp_size, counts, seed):
    rng = random.Random(seed)
    share = [rng.choice([None, *range(i)]) if i else None for i in range(len(counts))]
    share = [j if j is not None and counts[j] else None for j in share]
    _check_plan(_batch_pages(cp_size, counts, share, seed), cp_size, trash=1000)


def test_shared_prefix_pages_get_their_own_slots():
    pages = [[0, 1, 2, 3], [0, 1, 2, 5]]  # the second request shares three prefix pages
    plan = build_slot_plan(_page_table(pages), [4, 4], 2, 16, trash_page=9, use_triton=False)
    table = plan.slot_table
    assert plan.slots_per_rank == 4 and plan.view_pages == 8
    assert set(table[0, :4].tolist()).isdisjoint(table[1, :4].tolist())
    # Both slots of a shared page gather the same physical page on the same owner.
    for j in range(3):
        a, b = int(table[0, j]), int(table[1, j])
        assert plan.slot_phys[a] == plan.slot_phys[b] == pages[0][j] // 2


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_view_from_plan_equals_replicated_pages(cp_size):
    """Gather each rank's send block from its own pool, concatenate rank-major: every position's view
    page is the replicated pool's logical page, and padding slots hold each owner's trash page."""
    width = 24
    pages = _batch_pages(cp_size, [6, 2, 11, 4, 1], [None, 0, None, 2, None], seed=5)
    logical_pages = cp_size * (4 + sum(len(p) for p in pages))
    replicated = torch.randint(0, 256, (logical_pages, width), dtype=torch.uint8)
    phys = logical_pages // cp_size
    pools = []
    for r in range(cp_size):
        pool = torch.empty((phys + 1, width), dtype=torch.uint8)
        pool[:phys] = replicated[r::cp_size]  # logical page lp lives on owner lp % N at phys lp // N
        pool[phys] = 200 + r  # trash page
        pools.append(pool)
    table = _page_table(pages)
    plan = build_slot_plan(table, [len(p) for p in pages], cp_size, 16, trash_page=phys, use_triton=False)
    view = torch.cat([gather_pages_ref(pools[r], plan.send_pages(r)) for r in range(cp_size)])
    assert view.shape == (plan.view_pages, width)
    for b, p in enumerate(pages):
        for j, lp in enumerate(p):
            assert torch.equal(view[int(plan.slot_table[b, j])], replicated[lp])
    used = set(plan.slots.tolist())
    for slot in set(range(plan.view_pages)) - used:
        assert bool((view[slot] == 200 + slot // plan.slots_per_rank).all())


def test_host_sizes():
    assert pages_for_lens([1, 16, 17, 0, 64], 16) == [1, 1, 2, 0, 4]
    assert slots_per_rank([5, 3, 1], 2) == 3 + 2 + 1
    assert predicted_view_pages([5, 3, 1], 4) == 4 * (2 + 1 + 1)
    assert slots_per_rank([], 4) == 0


def test_empty_batch_plans_nothing():
    plan = build_slot_plan(torch.zeros((2, 3), dtype=torch.int64), [0, 0], 4, 16, trash_page=3, use_triton=False)
    assert plan.view_pages == 0 and plan.num_positions == 0
    assert torch.equal(plan.slot_table, torch.zeros((2, 3), dtype=torch.int32))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_table": torch.zeros((2, 3), dtype=torch.float32)}, "page_table"),
        ({"page_table": torch.zeros(3, dtype=torch.int64)}, "page_table"),
        ({"pages_per_req": [1]}, "pages_per_req"),
        ({"pages_per_req": [1, 4]}, "pages_per_req"),
        ({"pages_per_req": [-1, 1]}, "pages_per_req"),
        ({"cp_size": 0}, "cp_size"),
        ({"trash_page": -1}, "trash_page"),
        ({"page_size": 0}, "page_size"),
    ],
)
def test_bad_input_is_rejected(kwargs, message):
    args = {
        "page_table": torch.zeros((2, 3), dtype=torch.int64),
        "pages_per_req": [1, 2],
        "cp_size": 2,
        "page_size": 16,
        "trash_page": 5,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        build_slot_plan(**args, use_triton=False)
