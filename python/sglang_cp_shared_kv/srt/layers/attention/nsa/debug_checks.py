"""Syncing checks of the slot plan, on only with ``SGLANG_DEBUG_CP_SHARED_KV=1`` (they read device data back
and talk to the CP group). Each failure raises ``CPSharedKVDebugError`` with one line."""

from __future__ import annotations

import hashlib

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import BatchPlan
from sglang_cp_shared_kv.srt.mem_cache.placement import page_owner


class CPSharedKVDebugError(RuntimeError):
    """A debug-mode invariant of the sharded read path does not hold."""


def plan_digest(plan: BatchPlan) -> str:
    """A hash of everything that decides the view's layout (host sizes and device tensors)."""
    h = hashlib.sha256()
    h.update(repr((plan.cp_size, plan.num_positions, plan.slots_per_rank)).encode())
    for t in (plan.positions, plan.logical, plan.slots, plan.slot_table, plan.slot_phys):
        h.update(repr((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def check_plan_local(plan: BatchPlan, trash_page: int) -> None:
    """Slot overflow, slots inside their owner's block and unique, and ``slot_phys`` matching the pages."""
    n, s = plan.cp_size, plan.slots_per_rank
    logical = plan.logical.cpu()
    slots = plan.slots.cpu()
    owner = page_owner(logical, n)
    counts = torch.zeros(n, dtype=torch.int64).index_add_(0, owner, torch.ones_like(owner))
    if counts.numel() and int(counts.max()) > s:
        o = int(counts.argmax())
        raise CPSharedKVDebugError(
            f"slot overflow: owner {o} holds {int(counts[o])} of this batch's page positions, more than S={s} "
            "(pages of a request are not spread over owners within one page)"
        )
    outside = bool(((slots < 0) | (slots >= plan.view_pages) | (plan.slot_owner(slots) != owner)).any())
    if len(slots) and (outside or len(set(slots.tolist())) != len(slots)):
        raise CPSharedKVDebugError("slot plan is inconsistent: a slot lies outside its owner's block or is reused")
    phys = plan.slot_phys.cpu()
    expected = torch.full((n * s,), trash_page, dtype=torch.int64)
    expected[slots] = logical // n  # slot x gathers slot_phys[x]
    if not torch.equal(phys, expected):
        bad = int((phys != expected).nonzero()[0])
        raise CPSharedKVDebugError(
            f"slot plan is inconsistent: slot {bad} gathers physical page {int(phys[bad])}, "
            f"expected {int(expected[bad])}"
        )
    table = plan.slot_table.cpu().reshape(-1)
    if not torch.equal(table[plan.positions.cpu()].long(), slots):
        raise CPSharedKVDebugError("slot plan is inconsistent: the slot table does not match the slots")


def check_plan(plan: BatchPlan, trash_page: int, group: CPGroup | None) -> None:
    """Local invariants on every rank, then agreement across the group. Ranks exchange their verdicts and
    plan digests in one collective before anyone raises, so every rank raises the same error."""
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
            f"(digests {[d[:12] for d in digests]}); the batch's page tables or lengths differ between ranks"
        )
