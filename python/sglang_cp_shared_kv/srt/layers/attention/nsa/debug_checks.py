"""Syncing checks of the slot plan, on only with ``SGLANG_DEBUG_CP_SHARED_KV=1``: they
read device data back and talk to the CP group."""

from __future__ import annotations

import hashlib

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import BatchPlan
from sglang_cp_shared_kv.srt.mem_cache.placement import page_owner


class CPSharedKVDebugError(RuntimeError):
    """A debug-mode invariant of the sharded read path does not hold."""


def _inconsistent(what: str) -> CPSharedKVDebugError:
    return CPSharedKVDebugError(f"slot plan is inconsistent: {what}")


def plan_digest(plan: BatchPlan) -> str:
    """A hash of everything that decides the view's layout."""
    h = hashlib.sha256()
    h.update(repr((plan.cp_size, plan.num_positions, plan.slots_per_rank)).encode())
    fields = (plan.positions, plan.logical, plan.slots, plan.slot_table, plan.slot_phys)
    for t in fields:
        h.update(repr((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def check_plan_local(plan: BatchPlan, trash_page: int) -> None:
    """No owner's block overflows, slots are unique and in their owner's block, and
    ``slot_phys`` and the slot table match the pages."""
    n, s = plan.cp_size, plan.slots_per_rank
    logical, slots = plan.logical.cpu(), plan.slots.cpu()
    owner = page_owner(logical, n)
    counts = torch.bincount(owner, minlength=n)
    o = int(counts.argmax())
    if int(counts[o]) > s:
        raise CPSharedKVDebugError(
            f"slot overflow: owner {o} holds {int(counts[o])} of this batch's page "
            f"positions, more than S={s} (a request's pages do not rotate owners)"
        )
    outside = (slots < 0) | (slots >= n * s) | (plan.slot_owner(slots) != owner)
    if bool(outside.any()) or len(set(slots.tolist())) != len(slots):
        raise _inconsistent("a slot lies outside its owner's block or is reused")
    expected = torch.full((n * s,), trash_page, dtype=torch.int64)
    expected[slots] = logical // n  # slot x gathers slot_phys[x]
    for x, (got, want) in enumerate(zip(plan.slot_phys.tolist(), expected.tolist())):
        if got != want:
            raise _inconsistent(f"slot {x} gathers page {got}, expected {want}")
    table = plan.slot_table.cpu().reshape(-1)
    if not torch.equal(table[plan.positions.cpu()].long(), slots):
        raise _inconsistent("the slot table does not match")


def check_plan(plan: BatchPlan, trash_page: int, group: CPGroup | None) -> None:
    """Local invariants, then agreement across the group: one collective exchanges
    every rank's verdict and digest before any raises, so all raise the same error."""
    if group is None:
        return check_plan_local(plan, trash_page)
    try:
        check_plan_local(plan, trash_page)
        local_error = None
    except CPSharedKVDebugError as e:
        local_error = str(e)
    verdicts = group.all_gather_object((plan_digest(plan), local_error))
    for r, (_, err) in enumerate(verdicts):
        if err is not None:
            raise CPSharedKVDebugError(f"rank {r}: {err}")
    digests = [d for d, _ in verdicts]
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise CPSharedKVDebugError(
            f"slot plan differs across CP ranks: rank(s) {differ} disagree with rank 0 "
            f"(digests {[d[:12] for d in digests]}): page tables or lengths differ"
        )
