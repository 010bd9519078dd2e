"""Debug mode (``SGLANG_DEBUG_CP_SHARED_KV=1``) catches broken plans with one clear error; off, it costs nothing."""

import dataclasses
import os

import pytest
import torch
from page_fixtures import PagePool, begin_batch, build_slot_plan, page_table

from reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.debug_checks import (
    CPSharedKVDebugError,
    check_plan,
    check_plan_local,
    plan_digest,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

PS = 16
# Two requests, pages cycling through owners as the balanced allocator hands them out.
PAGES = [[0, 1, 2], [3, 4, 5, 6, 7]]


def _plan(pages, n=2):
    table = page_table(pages)
    return build_slot_plan(table, [len(p) for p in pages], n, PS, trash_page=99, use_triton=False)


def test_valid_plan_passes():
    plan = _plan(PAGES)
    check_plan_local(plan, 99)
    check_plan(plan, 99, None)
    assert plan_digest(plan) == plan_digest(_plan(PAGES))
    assert plan_digest(plan) != plan_digest(_plan([[0, 1, 2], [3, 4, 5, 6, 9]]))


def test_unbalanced_pages_overflow_a_block():
    # Every page lives on owner 0 (not what the balanced allocator does): S = ceil(3/2) + ceil(1/2) = 3,
    # but owner 0 holds all 4 positions.
    plan = _plan([[0, 2, 4], [6]])
    with pytest.raises(CPSharedKVDebugError, match=r"slot overflow: owner 0 holds 4 .* S=3"):
        check_plan_local(plan, 99)


@pytest.mark.parametrize("field", ["slot_table", "slot_phys", "slots"])
def test_corrupted_plan_is_inconsistent(field):
    plan = _plan(PAGES)
    if field == "slots":  # a view of the plan's outputs: swap two of them there
        words, m = plan.words.clone(), plan.num_positions
        words[[2 * m, 2 * m + 1]] = words[[2 * m + 1, 2 * m]]
        broken = dataclasses.replace(plan, words=words)
        assert not torch.equal(broken.slots, plan.slots)
    elif field == "slot_phys":  # the send entries, in the same buffer
        words, start = plan.words.clone(), plan.send_start
        words[[start, start + 1]] = words[[start + 1, start]]
        broken = dataclasses.replace(plan, words=words)
        assert not torch.equal(broken.slot_phys, plan.slot_phys)
    else:
        swapped = plan.slot_table.clone()
        swapped[[0, 1]] = swapped[[1, 0]]
        broken = dataclasses.replace(plan, slot_table=swapped)
    with pytest.raises(CPSharedKVDebugError, match="slot plan is inconsistent"):
        check_plan_local(broken, 99)


def _rank_corrupt(rank, world_size, debug):
    """Every rank runs the same batch except rank 1, whose page table differs (same owner, other page)."""
    os.environ["SGLANG_DEBUG_CP_SHARED_KV"] = "1" if debug else "0"
    pool = PagePool(PageOwnership(world_size, PS), rank, 8, 1, "fp8")
    mat = ViewMaterializer(pool, CPGroup(), use_triton=False)
    pages = [list(p) for p in PAGES]
    if rank == 1:
        pages[1][4] += 2 * world_size  # locally consistent, different from the peers
    try:
        begin_batch(mat, page_table(pages), [PS * len(p) for p in pages], [PS] * len(pages))
        mat.layer_view(0)
    except CPSharedKVDebugError as e:
        return str(e)
    return None


def _rank_broken_plan(rank, world_size):
    """Rank 1's slot table is scrambled after planning; its own check fails, and every rank hears of it."""
    plan = _plan(PAGES, world_size)
    if rank == 1:
        flipped = plan.slot_table.flip(1).contiguous()
        plan = dataclasses.replace(plan, slot_table=flipped)
    try:
        check_plan(plan, 99, CPGroup())
    except CPSharedKVDebugError as e:
        return str(e)
    return None


@pytest.mark.multirank
def test_debug_mode_catches_a_rank_with_a_different_plan():
    errors = spawn_ranks(_rank_corrupt, 3, True)
    assert all(e is not None and "slot plan differs across CP ranks: rank(s) [1] disagree" in e for e in errors), errors


@pytest.mark.multirank
def test_debug_mode_catches_a_rank_with_a_broken_plan():
    errors = spawn_ranks(_rank_broken_plan, 2)
    assert all(e is not None and e.startswith("rank 1: slot plan is inconsistent") for e in errors), errors


@pytest.mark.multirank
def test_checks_are_off_by_default():
    assert spawn_ranks(_rank_corrupt, 2, False) == [None, None]
