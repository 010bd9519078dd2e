"""The slot plan puts every page position of a batch in its owner's block, and the view built from it
holds, at each slot, exactly the page the replicated pool holds at the logical page."""

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from page_fixtures import RotatingPages, build_slot_plan, page_table, plan_meta

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_pages_ref
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    DeviceFlagCheck,
    FlagWaitTimeout,
    pages_for_lens,
    slots_per_rank,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.triton_launch import triton_enabled


def _batch_pages(cp_size: int, page_counts: list[int], share: list[int | None], seed: int) -> list[list[int]]:
    """Owner-rotating logical pages of each request; ``share[i] = j`` reuses request j's first pages."""
    rng = random.Random(seed)
    alloc = RotatingPages(cp_size)
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
    return page_table(pages, width, pad)


# The plan's paths: the torch formulation, and the Triton kernels where they run (interpreter or CUDA).
PATHS = [False, True] if triton_enabled(torch.device("cpu")) else [False]


def _loop_slots(pages: list[list[int]], cp_size: int) -> list[int]:
    """The definition, spelled out: each position's rank r among its owner's positions gives its
    view slot (and send entry) ``o * S + r``."""
    s = sum(-(-len(p) // cp_size) for p in pages)
    seen = [0] * cp_size
    slots = []
    for req in pages:
        for lp in req:
            o, r = lp % cp_size, seen[lp % cp_size]
            slots.append(o * s + r)
            seen[o] += 1
    return slots


def _check_plan(pages: list[list[int]], cp_size: int, trash: int, use_triton: bool = False) -> None:
    table = _page_table(pages, pad=7)
    plan = build_slot_plan(table, [len(p) for p in pages], cp_size, 16, trash, use_triton=use_triton)
    s = plan.slots_per_rank
    assert s == sum(-(-len(p) // cp_size) for p in pages)
    assert plan.view_pages == cp_size * slots_per_rank([len(p) for p in pages], cp_size)
    flat = [lp for p in pages for lp in p]
    assert plan.num_positions == len(flat)
    assert plan.logical.tolist() == flat
    slots = _loop_slots(pages, cp_size)
    assert plan.slots.tolist() == slots
    # Every owner's positions fit in its block (balanced allocation), slots are unique and in the view.
    assert len(set(slots)) == len(flat) and all(0 <= x < plan.view_pages for x in slots)
    assert plan.slot_owner(plan.slots).tolist() == [lp % cp_size for lp in flat]
    # Each owner's block fills its own range of the view.
    for x, lp in zip(slots, flat):
        lo, hi = plan.rank_view_slots(lp % cp_size)
        assert lo <= x < hi
    # slot_phys: owned physical page at used send entries, trash everywhere else.
    phys = plan.slot_phys.tolist()
    used = dict(zip(slots, flat))
    assert phys == [used[i] // cp_size if i in used else trash for i in range(cp_size * s)]
    # slot_table: slots at each request's positions, pad past them.
    expected = torch.zeros_like(table)
    it = iter(plan.slots.tolist())
    for b, p in enumerate(pages):
        expected[b, : len(p)] = torch.tensor([next(it) for _ in p], dtype=torch.int32)
    assert plan.slot_table.dtype == torch.int32
    assert torch.equal(plan.slot_table, expected)


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_plan_matches_definition_with_shared_prefixes(cp_size, use_triton):
    pages = _batch_pages(cp_size, [5, 3, 7, 1, 4, 9], [None, 0, 0, None, 2, 4], seed=cp_size)
    _check_plan(pages, cp_size, trash=41, use_triton=use_triton)


@settings(max_examples=60, deadline=None)
@given(
    cp_size=st.integers(1, 8),
    counts=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    use_triton=st.sampled_from(PATHS),
)
def test_plan_matches_definition_property(cp_size, counts, seed, use_triton):
    rng = random.Random(seed)
    share = [rng.choice([None, *range(i)]) if i else None for i in range(len(counts))]
    share = [j if j is not None and counts[j] else None for j in share]
    _check_plan(_batch_pages(cp_size, counts, share, seed), cp_size, trash=1000, use_triton=use_triton)


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
    """Gather each rank's send block from its own pool and lay the blocks out as the all-gather does
    (rank-major): every position's view page is the replicated pool's logical page, and padding
    slots hold each owner's trash page."""
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
    plan = build_slot_plan(table, [len(p) for p in pages], cp_size, 16, trash_page=phys)
    view = torch.cat([gather_pages_ref(pools[r], plan.send_pages(r)) for r in range(cp_size)])
    assert view.shape == (plan.view_pages, width)
    for b, p in enumerate(pages):
        for j, lp in enumerate(p):
            assert torch.equal(view[int(plan.slot_table[b, j])], replicated[lp])
    used = set(plan.slots.tolist())
    for slot in set(range(plan.view_pages)) - used:
        assert bool((view[slot] == 200 + int(plan.slot_owner(torch.tensor(slot)))).all())


def test_host_sizes():
    assert pages_for_lens([1, 16, 17, 0, 64], 16) == [1, 1, 2, 0, 4]
    assert slots_per_rank([5, 3, 1], 2) == 3 + 2 + 1
    assert slots_per_rank([], 4) == 0


@pytest.mark.parametrize("use_triton", PATHS)
def test_plan_meta_and_the_flat_positions(use_triton):
    pages = [3, 0, 2, 5]
    meta = plan_meta(pages, torch.device("cpu"))
    # Per request: no shared page, every page a prefix page, none staged, no source, its first position.
    assert meta.tolist() == [[0] * 4, pages, pages, [0] * 4, [-1] * 4, [0, 3, 3, 5]]
    table = torch.randint(0, 64, (4, 6))
    plan = build_slot_plan(table, pages, 4, 16, 99, meta=meta, use_triton=use_triton)
    assert plan.positions.tolist() == [0, 1, 2, 12, 13, 18, 19, 20, 21, 22]
    # Built ahead (as for CUDA graphs) it gives the same plan.
    fresh = build_slot_plan(table, pages, 4, 16, 99, use_triton=use_triton)
    assert torch.equal(plan.slots, fresh.slots) and torch.equal(plan.slot_table, fresh.slot_table)


def test_empty_batch_plans_nothing():
    plan = build_slot_plan(torch.zeros((2, 3), dtype=torch.int64), [0, 0], 4, 16, trash_page=3, use_triton=False)
    assert plan.view_pages == 0 and plan.num_positions == 0
    assert torch.equal(plan.slot_table, torch.zeros((2, 3), dtype=torch.int32))


def test_flags_are_acted_on_two_batches_later_whatever_their_landing():
    """``DeviceFlagCheck``: batch ``k``'s records are read when batch ``k + 2`` begins, oldest first, never
    earlier even once landed, waiting for one not landed yet (its word set by another thread, as the
    device would); a ``fail`` that returns an error raises it, once; one that never lands times out."""
    check, seen = DeviceFlagCheck(), []
    cpu = torch.device("cpu")
    first, second = check.host_views(4, cpu)[0], check.host_views(4, cpu)[0]
    check.next_batch()  # batch 1
    first[:] = torch.tensor([0, 7, 0, 0])  # flags 0, 7, 0 and the landed word, not yet set
    check.watch(first, lambda host: seen.append(host) or None, cpu, landed=3)
    check.next_batch()  # batch 2: batch 0 is due, it has no record
    second[:] = torch.tensor([1, 0, 0, 1])  # landed, and its first flag set
    check.watch(second, lambda host: RuntimeError(f"flag {host[0]}") if host[0] else None, cpu, landed=3)
    check.poll()  # the landed records only: the second waits behind the first
    assert seen == [] and check.pending == 2
    setter = threading.Timer(0.3, first.__setitem__, (3, 1))
    setter.start()
    start = time.monotonic()
    check.next_batch()  # batch 3: batch 1's record is due, waited for; batch 2's landed one is not due
    assert seen == [[0, 7, 0, 1]] and check.pending == 1 and time.monotonic() - start >= 0.25
    with pytest.raises(RuntimeError, match="flag 1"):
        check.next_batch()  # batch 4: batch 2's
    check.next_batch()  # raised once
    assert check.pending == 0

    stuck = DeviceFlagCheck(deadline_s=0.2)
    word = stuck.host_views(2, cpu)[0]
    word[:] = 0
    stuck.watch(word, lambda host: None, cpu, landed=1)  # batch 0, never lands
    stuck.next_batch()
    with pytest.raises(FlagWaitTimeout, match=r"batch 0's plan has not run on this rank after 0.2 s"):
        stuck.next_batch()
