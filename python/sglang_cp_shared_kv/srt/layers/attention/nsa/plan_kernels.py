"""Triton kernels of a batch's slot plan, each beside its plain-torch reference.

- ``build_slot_table``: the page table handed to the kernels, in slot ids: position ``j`` of
  request ``b`` gets ``slots[cu_pages[b] + j]``; positions past a request's pages get ``pad``.
- ``plan_positions``: the flat page-table index ``b * max_pages + j`` of every page position of
  a batch, request-major, from the prefix sum of its pages per request (on device).
- ``assign_slots``: the slot plan of a page table in one launch of one program when the batch has
  at most ``FUSED_PLAN_MAX_POSITIONS`` page positions: each position's logical page, owner, rank
  among the positions with the same owner (a block scan), view slot, the slot table and every send
  entry's physical page. Larger batches run it in blocks, with per-block owner counts and their
  prefix sum (three launches and a small cumsum); ``assign_slots_ref`` is the torch formulation.
- ``plan_batch``: what a sharded pool's batch needs, in one launch of one program, straight from
  SGLang's ``req_to_token``: the slot plan of the prefix pages (``assign_slots``' rule, through the
  same Triton helpers), the batch's page map (``map_batch_pages_ref``: logical page -> page of its
  read buffer, a prefix page to its view slot, a current-chunk page to its staged page, anything
  else to a fill value) and the check of a shared-prefix hint.

Each wrapper runs Triton on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` (the
tests); otherwise it runs the reference. ``use_triton`` forces either. None of them reads device
data back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import check_index, launch, triton_enabled
from sglang_cp_shared_kv.srt.mem_cache.placement import local_page, page_owner

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every platform we run
    triton = None


# ---------------------------------------------------------------------------------------------
# build_slot_table (the page-table remap)
# ---------------------------------------------------------------------------------------------


def build_slot_table_ref(
    slots: torch.Tensor, positions_flat: torch.Tensor, batch_size: int, max_pages: int, pad: int = 0
) -> torch.Tensor:
    """``table.view(-1)[positions_flat[i]] = slots[i]``; every other entry is ``pad``. int32 ``[B, max_pages]``."""
    table = torch.full((batch_size * max_pages,), pad, dtype=torch.int32, device=slots.device)
    table.index_copy_(0, positions_flat.long(), slots.to(torch.int32))
    return table.view(batch_size, max_pages)


if triton is not None:

    @triton.jit
    def _slot_table_kernel(slots, cu_pages, out, max_pages, pad, BLOCK: tl.constexpr):
        req = tl.program_id(0)
        block = tl.program_id(1)
        start = tl.load(cu_pages + req)
        n_pages = tl.load(cu_pages + req + 1) - start
        j = block * BLOCK + tl.arange(0, BLOCK)
        inside = j < max_pages
        mine = j < n_pages
        slot = tl.load(slots + start + j, mask=mine, other=pad)
        tl.store(out + req.to(tl.int64) * max_pages + j, slot.to(tl.int32), mask=inside)


def build_slot_table(
    slots: torch.Tensor,
    cu_pages: torch.Tensor,
    positions_flat: torch.Tensor,
    batch_size: int,
    max_pages: int,
    pad: int = 0,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Scatter request-major ``slots [M]`` into an int32 page table ``[B, max_pages]``.

    ``cu_pages [B + 1]`` (device) is the prefix sum of pages per request, ``positions_flat [M]``
    the same layout as flat ``b * max_pages + j`` indices (the reference uses it; the kernel
    reads ``cu_pages``). Both come from host-known lengths.
    """
    check_index("slots", slots, 1)
    check_index("cu_pages", cu_pages, 1)
    if cu_pages.shape[0] != batch_size + 1:
        raise ValueError(f"cu_pages must have batch_size + 1 = {batch_size + 1} entries, got {cu_pages.shape[0]}")
    if not triton_enabled(slots.device, use_triton) or batch_size == 0 or max_pages == 0:
        return build_slot_table_ref(slots, positions_flat, batch_size, max_pages, pad)
    out = torch.empty((batch_size, max_pages), dtype=torch.int32, device=slots.device)
    block = min(1024, triton.next_power_of_2(max_pages))
    grid = (batch_size, triton.cdiv(max_pages, block))
    launch(_slot_table_kernel, grid, (slots, cu_pages, out, max_pages, pad), {"BLOCK": block})
    return out


# ---------------------------------------------------------------------------------------------
# plan_positions and assign_slots (the slot plan)
# ---------------------------------------------------------------------------------------------

# Batches up to this many page positions are planned by one program (a block-wide scan); larger
# ones in blocks spread over the GPU.
FUSED_PLAN_MAX_POSITIONS = 8192


def plan_positions_ref(cu_pages: torch.Tensor, max_pages: int, num_positions: int) -> torch.Tensor:
    """``b * max_pages + j`` for page ``j`` of request ``b``, request-major: int64 ``[num_positions]``.

    ``num_positions`` (``cu_pages[-1]``, known on the host) sizes the output, so nothing syncs.
    """
    cu = cu_pages.long()
    counts = cu[1:] - cu[:-1]
    base = torch.arange(len(counts), device=cu.device) * max_pages - cu[:-1]  # b * max_pages - first position
    per_position = torch.repeat_interleave(base, counts, output_size=num_positions)
    return per_position + torch.arange(num_positions, device=cu.device)


if triton is not None:

    @triton.jit(do_not_specialize=["max_pages"])
    def _plan_positions_kernel(cu_pages, out, max_pages, BLOCK: tl.constexpr):
        req = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        start = tl.load(cu_pages + req)
        n_pages = tl.load(cu_pages + req + 1) - start
        tl.store(out + start + j, req.to(tl.int64) * max_pages + j, mask=j < n_pages)


def plan_positions(
    cu_pages: torch.Tensor, max_pages: int, num_positions: int, use_triton: bool | None = None
) -> torch.Tensor:
    """Flat page-table index of every page position (``plan_positions_ref``), in one launch."""
    check_index("cu_pages", cu_pages, 1)
    batch = cu_pages.shape[0] - 1
    if not triton_enabled(cu_pages.device, use_triton) or num_positions == 0 or batch < 1:
        return plan_positions_ref(cu_pages, max_pages, num_positions)
    out = torch.empty(num_positions, dtype=torch.int64, device=cu_pages.device)
    block = min(1024, triton.next_power_of_2(max_pages))
    launch(_plan_positions_kernel, (batch, triton.cdiv(max_pages, block)), (cu_pages, out, max_pages), {"BLOCK": block})
    return out


def assign_slots_ref(
    page_table: torch.Tensor,
    positions_flat: torch.Tensor,
    cu_pages: torch.Tensor,
    cp_size: int,
    slots_per_rank: int,
    trash_page: int,
    pad: int = 0,
    use_triton: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot plan in torch ops: ``(logical [M], slots [M], slot_table [B, W] int32, slot_phys [N * S],
    status [N + 1])``.

    Position ``i`` reads logical page ``lp = page_table.view(-1)[positions_flat[i]]`` owned by
    ``o = lp % N``; ``r`` is its rank among the positions owned by ``o`` (request-major). With
    ``S = slots_per_rank``:

    - its view slot is ``o * S + r`` (owner-major), and its send entry, the same index of
      ``slot_phys``, holds its physical page ``lp // N``; unused entries hold ``trash_page``;
    - ``slot_table[b, j]`` is the slot of page ``j`` of request ``b``, ``pad`` past its pages.

    **Overflow**: a position with ``r >= S`` (its owner holds more of the batch's positions than
    a block has room for: the pages do not rotate owners) gets no send entry, and its slot is the
    first unused entry of the owner with the fewest positions. One exists
    (``M <= N * S``, so when one block overflows another has room), and it holds ``trash_page``:
    the view is never read past its end. ``status`` (int64, on the device, no host sync) reports
    it: ``status[0]`` is 1 when some owner overflows, ``status[1 + o]`` the positions owner ``o``
    holds (``slot_plan.raise_on_overflow`` reads it where the batch synchronizes anyway).

    ``use_triton`` is passed to ``build_slot_table`` (the reference proper keeps it False).
    """
    n, s = cp_size, slots_per_rank
    device = page_table.device
    logical = page_table.reshape(-1).index_select(0, positions_flat).long()
    owner = page_owner(logical, n)
    # Rank among same-owner positions: a cumsum over a one-hot [N, M], scanned along the inner
    # dimension (along the outer one CUDA scans each of the N columns serially).
    one_hot = (torch.arange(n, device=device).unsqueeze(1) == owner.unsqueeze(0)).to(torch.int32)
    running = one_hot.cumsum(1, dtype=torch.int32)
    rank = running.gather(0, owner.unsqueeze(0)).squeeze(0).long() - 1
    counts = one_hot.sum(1, dtype=torch.int64)
    # The first free entry of the least-loaded owner (clamped into the view when no block overflows).
    fewest = counts.argmin()
    free = counts[fewest].clamp(max=max(s - 1, 0))
    slots = torch.where(rank < s, owner * s + rank, fewest * s + free)
    target = torch.where(rank < s, slots, torch.full_like(rank, n * s))  # n * s: a dump entry
    slot_phys = torch.full((n * s + 1,), trash_page, dtype=torch.int64, device=device)
    slot_phys.scatter_(0, target, local_page(logical, n))
    status = torch.cat([(counts.amax() > s).to(torch.int64).reshape(1), counts])
    batch, max_pages = page_table.shape
    table = build_slot_table(slots, cu_pages, positions_flat, batch, max_pages, pad=pad, use_triton=use_triton)
    return logical, slots, table, slot_phys[: n * s], status


if triton is not None:

    @triton.jit
    def _block_owners(
        page_table, pt_stride0, pt_stride1, positions, num_positions, max_pages, N: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Page-table index, logical page and owner of the positions of this program's block."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < num_positions
        flat = tl.load(positions + i, mask=live, other=0).to(tl.int64)
        req = flat // max_pages
        lp = tl.load(page_table + req * pt_stride0 + (flat - req * max_pages) * pt_stride1, mask=live, other=0)
        lp = lp.to(tl.int64)
        return i, live, flat, lp, lp % N

    @triton.jit
    def _owner_ranks(owner, live, before, N: tl.constexpr, NP2: tl.constexpr, BLOCK: tl.constexpr):
        """Rank of each live position among the same owner's, in order, past ``before[o]`` earlier ones
        (``[NP2]``); and this block's positions per owner."""
        owners = tl.arange(0, NP2)
        rank = tl.zeros([BLOCK], dtype=tl.int64)
        counts = tl.zeros([NP2], dtype=tl.int64)
        for o in tl.static_range(N):
            mine = (owner == o) & live
            first = tl.sum(tl.where(owners == o, before, 0), axis=0)
            running = tl.cumsum(mine.to(tl.int32), axis=0).to(tl.int64)  # int32 scans, as every Triton target has
            rank = tl.where(mine, first + running - 1, rank)
            counts = tl.where(owners == o, tl.sum(mine.to(tl.int32), axis=0).to(tl.int64), counts)
        return rank, counts

    @triton.jit
    def _slot_of(owner, rank, totals, slots_per_rank, N: tl.constexpr, NP2: tl.constexpr):
        """``(view slot, send entry)`` of positions with these owners and ranks, ``totals`` ``[NP2]`` the batch's
        positions per owner: past its owner's block a position reads the first free entry of the least
        loaded owner and sends nothing (entry ``N * S``, the dump; ``assign_slots_ref``)."""
        owners = tl.arange(0, NP2)
        totals_o = tl.where(owners < N, totals, 1 << 62)
        fewest = tl.argmin(totals_o, axis=0).to(tl.int64)
        free = tl.minimum(tl.min(totals_o, axis=0), slots_per_rank - 1)
        inside = rank < slots_per_rank
        slot = tl.where(inside, owner * slots_per_rank + rank, fewest * slots_per_rank + free)
        return slot, tl.where(inside, slot, N * slots_per_rank)

    @triton.jit
    def _store_status(status_out, totals, slots_per_rank, N: tl.constexpr, NP2: tl.constexpr):
        """``status``: the overflow flag, then the positions per owner."""
        owners = tl.arange(0, NP2)
        tl.store(status_out + 1 + owners, totals, mask=owners < N)
        overflow = tl.max(tl.where(owners < N, totals, 0), axis=0) > slots_per_rank
        tl.store(status_out, overflow.to(tl.int64))

    @triton.jit
    def _fill_unused_entries(
        phys_out,
        totals,
        slots_per_rank,
        trash_page,
        first,
        stride,
        N: tl.constexpr,
        NP2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Send entry ``(o, r)`` with ``r >= totals[o]`` holds the trash page (entries ``first + k * stride`` on)."""
        owners = tl.arange(0, NP2)
        lanes = tl.arange(0, BLOCK)
        send_entries = N * slots_per_rank
        for start in range(first, send_entries, stride):
            idx = start + lanes
            inside = idx < send_entries
            o_idx = idx // slots_per_rank
            count = tl.zeros([BLOCK], dtype=tl.int64)
            for o in tl.static_range(N):
                count = tl.where(o_idx == o, tl.sum(tl.where(owners == o, totals, 0), axis=0), count)
            unused = inside & (idx - o_idx * slots_per_rank >= count)
            tl.store(phys_out + idx, tl.zeros([BLOCK], dtype=tl.int64) + trash_page, mask=unused)

    @triton.jit(do_not_specialize=["pt_stride0", "pt_stride1", "num_positions", "max_pages"])
    def _owner_counts_kernel(
        page_table,
        pt_stride0,
        pt_stride1,
        positions,
        counts_out,
        num_positions,
        max_pages,
        N: tl.constexpr,
        NP2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # counts_out[block, o]: positions of this block owned by o.
        _, live, _, _, owner = _block_owners(
            page_table, pt_stride0, pt_stride1, positions, num_positions, max_pages, N, BLOCK
        )
        owners = tl.arange(0, NP2)
        counts = tl.zeros([NP2], dtype=tl.int64)
        for o in tl.static_range(N):
            counts = tl.where(owners == o, tl.sum(((owner == o) & live).to(tl.int32), axis=0), counts)
        tl.store(counts_out + tl.program_id(0) * N + owners, counts, mask=owners < N)

    @triton.jit(
        do_not_specialize=[
            "pt_stride0",
            "pt_stride1",
            "num_positions",
            "table_entries",
            "max_pages",
            "slots_per_rank",
            "trash_page",
            "pad",
        ]
    )
    def _assign_slots_kernel(
        page_table,
        pt_stride0,
        pt_stride1,
        positions,
        cu_pages,
        offsets,
        totals,
        logical_out,
        slots_out,
        table_out,
        phys_out,
        status_out,
        num_positions,
        table_entries,
        max_pages,
        slots_per_rank,
        trash_page,
        pad,
        N: tl.constexpr,
        NP2: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCKED: tl.constexpr,
    ):
        # Single program (BLOCKED False): it holds every position, so per-owner ranks are block scans
        # and per-owner totals stay in registers. Blocked: each program scans its block and adds
        # offsets[block, owner], the positions of that owner in earlier blocks (totals: per owner).
        i, live, flat, lp, owner = _block_owners(
            page_table, pt_stride0, pt_stride1, positions, num_positions, max_pages, N, BLOCK
        )
        owners = tl.arange(0, NP2)
        before = tl.zeros([NP2], dtype=tl.int64)
        if BLOCKED:
            before = tl.load(offsets + tl.program_id(0) * N + owners, mask=owners < N, other=0).to(tl.int64)
        rank, counts = _owner_ranks(owner, live, before, N, NP2, BLOCK)
        if BLOCKED:
            totals_o = tl.load(totals + owners, mask=owners < N, other=0).to(tl.int64)
        else:
            totals_o = counts
        slot, target = _slot_of(owner, rank, totals_o, slots_per_rank, N, NP2)
        if tl.program_id(0) == 0:
            _store_status(status_out, totals_o, slots_per_rank, N, NP2)
        tl.store(logical_out + i, lp, mask=live)
        tl.store(slots_out + i, slot, mask=live)
        tl.store(table_out + flat, slot.to(tl.int32), mask=live)
        tl.store(phys_out + target, lp // N, mask=live)

        # Entries no position writes, written here so that no two stores meet: send entry
        # (o, r) is unused when r >= count(o); table entry (b, j) when j >= pages of b.
        # The programs share them out in strides.
        lanes = tl.arange(0, BLOCK)
        first_idx = tl.program_id(0) * BLOCK
        stride = tl.num_programs(0) * BLOCK
        _fill_unused_entries(phys_out, totals_o, slots_per_rank, trash_page, first_idx, stride, N, NP2, BLOCK)
        for start in range(first_idx, table_entries, stride):
            idx = start + lanes
            inside = idx < table_entries
            b = idx // max_pages
            first = tl.load(cu_pages + b, mask=inside, other=0)
            end = tl.load(cu_pages + b + 1, mask=inside, other=0)
            past = inside & (idx - b * max_pages >= end - first)
            tl.store(table_out + idx, tl.zeros([BLOCK], dtype=tl.int32) + pad, mask=past)


# Positions per program of the blocked plan (batches over FUSED_PLAN_MAX_POSITIONS).
BLOCKED_PLAN_BLOCK = 2048


def assign_slots(
    page_table: torch.Tensor,
    positions_flat: torch.Tensor,
    cu_pages: torch.Tensor,
    cp_size: int,
    slots_per_rank: int,
    trash_page: int,
    pad: int = 0,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``assign_slots_ref`` in Triton: one launch of one program for a batch of at most
    ``FUSED_PLAN_MAX_POSITIONS`` page positions; above that, blocks of ``BLOCKED_PLAN_BLOCK``
    positions (per-block owner counts, their prefix sum over blocks, then the blocked kernel).
    Without Triton, the torch formulation."""
    check_index("page_table", page_table, 2)
    check_index("positions_flat", positions_flat, 1)
    check_index("cu_pages", cu_pages, 1)
    num_positions = positions_flat.shape[0]
    batch, max_pages = page_table.shape
    if cu_pages.shape[0] != batch + 1:
        raise ValueError(f"cu_pages must have batch_size + 1 = {batch + 1} entries, got {cu_pages.shape[0]}")
    if num_positions and slots_per_rank < 1:
        raise ValueError(f"slots_per_rank must be >= 1 for a batch with page positions, got {slots_per_rank}")
    if num_positions == 0 or not triton_enabled(page_table.device, use_triton):
        args = (cp_size, slots_per_rank, trash_page, pad)
        return assign_slots_ref(page_table, positions_flat, cu_pages, *args, use_triton=use_triton)
    device = page_table.device
    send_entries = cp_size * slots_per_rank
    # logical, slots, slot_phys (plus its dump entry) and the overflow status share one allocation.
    flat = torch.empty(2 * num_positions + send_entries + 1 + cp_size + 1, dtype=torch.int64, device=device)
    logical, slots = flat[:num_positions], flat[num_positions : 2 * num_positions]
    slot_phys = flat[2 * num_positions : 2 * num_positions + send_entries + 1]
    status = flat[2 * num_positions + send_entries + 1 :]
    table = torch.empty((batch, max_pages), dtype=torch.int32, device=device)
    table_args = (page_table, page_table.stride(0), page_table.stride(1), positions_flat)
    np2 = max(2, triton.next_power_of_2(cp_size))
    if num_positions <= FUSED_PLAN_MAX_POSITIONS:
        block = max(16, triton.next_power_of_2(num_positions))
        grid, offsets, totals = 1, flat, flat  # unused by the single program
    else:
        block = BLOCKED_PLAN_BLOCK
        grid = triton.cdiv(num_positions, block)
        counts = torch.empty((grid, cp_size), dtype=torch.int64, device=device)
        launch(
            _owner_counts_kernel,
            (grid,),
            (*table_args, counts, num_positions, max_pages),
            {"N": cp_size, "NP2": np2, "BLOCK": block},
            num_warps=8,
        )
        inclusive = counts.cumsum(0)
        offsets, totals = inclusive - counts, inclusive[-1]
    launch(
        _assign_slots_kernel,
        (grid,),
        (*table_args, cu_pages, offsets, totals, logical, slots, table, slot_phys, status, num_positions)
        + (batch * max_pages, max_pages, slots_per_rank, trash_page, pad),
        {"N": cp_size, "NP2": np2, "BLOCK": block, "BLOCKED": grid > 1},
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
    )
    return logical, slots, table, slot_phys[:send_entries], status


# ---------------------------------------------------------------------------------------------
# plan_batch (the whole batch plan in one launch)
# ---------------------------------------------------------------------------------------------


def map_batch_pages_ref(
    page_pos: torch.Tensor,
    page_table: torch.Tensor,
    plan_table: torch.Tensor,
    meta: torch.Tensor,
    base: int,
    fill: int,
) -> torch.Tensor:
    """Fill ``page_pos`` (int64 ``[logical pages]``) with ``fill``, then map the batch's pages into it.

    ``meta`` int64 ``[4, B]`` holds per request ``shared``, ``prefix`` and ``pages`` (page counts) and
    ``start`` (the request's first staged page among the batch's). Page ``j`` of request ``b``
    (logical page ``page_table[b, j]``) maps to:

    - nothing for ``j < shared[b]`` (the page is the source request's, mapped by it),
    - ``plan_table[b, j - shared[b]]`` for ``j < prefix[b]`` (its view slot),
    - ``base + start[b] + j - prefix[b]`` for ``j < pages[b]`` (its staged page).

    A page two requests both read is written twice with slots holding the same bytes; either serves.
    Unmapped writes go to logical page 0 with ``fill`` (the allocator never hands page 0 out).
    """
    width = page_table.shape[1]
    shared, prefix, pages, start = (v.unsqueeze(1) for v in meta.long())
    j = torch.arange(width, device=page_table.device).unsqueeze(0)
    mapped = (j >= shared) & (j < pages)
    slot = plan_table.long().gather(1, (j - shared).clamp(0, max(plan_table.shape[1] - 1, 0)).expand_as(page_table))
    pos = torch.where(j < prefix, slot, base + start + j - prefix)
    page_pos.fill_(fill)
    targets = torch.where(mapped, page_table.long(), torch.zeros_like(pos))
    page_pos.index_put_((targets.reshape(-1),), torch.where(mapped, pos, torch.full_like(pos, fill)).reshape(-1))
    return page_pos


# Rows of ``plan_batch``'s per-request ``meta``.
PLAN_META_ROWS = ("shared", "prefix", "pages", "start", "source", "plan_start")


@dataclass(frozen=True)
class BatchPlan:
    """``plan_batch``'s device outputs (``assign_slots_ref``'s, the positions, the hint's counts)."""

    positions: torch.Tensor  # int64 [M]: b * width + j of each planned position
    logical: torch.Tensor  # int64 [M]
    slots: torch.Tensor  # int64 [M]
    slot_table: torch.Tensor  # int32 [B, width]
    slot_phys: torch.Tensor  # int64 [N * S]
    status: torch.Tensor  # int64 [N + 1]
    wrong: torch.Tensor  # int64 [B]: request b's shared pages that differ from its source's


def plan_batch_ref(
    tokens: torch.Tensor,
    rows: torch.Tensor,
    page_size: int,
    meta: torch.Tensor,
    width: int,
    num_positions: int,
    cp_size: int,
    slots_per_rank: int,
    trash_page: int,
    page_pos: torch.Tensor,
    base: int,
    fill: int,
    pad: int = 0,
) -> BatchPlan:
    """A batch's whole plan from its token table, composed of the references above.

    Page ``j`` of request ``b`` is logical page ``tokens[rows[b], j * page_size] // page_size`` (SGLang's
    ``req_to_token`` and page size; a page table with ``page_size`` 1). ``meta`` int64 ``[6, B]`` holds per
    request (``PLAN_META_ROWS``) its shared, prefix and total pages, its first staged page, the source of
    its shared pages (-1: none) and its first planned position. The plan covers pages ``[shared, prefix)``
    of each request (``assign_slots_ref`` over the table shifted left by ``shared``), ``page_pos`` is the
    batch's page map (``map_batch_pages_ref``), and ``wrong[b]`` counts request ``b``'s first ``shared``
    pages that are not its source's.
    """
    shared, prefix, pages, start, source, plan_start = meta.long()
    page_table = tokens[rows.long()][:, : width * page_size : page_size].long() // page_size
    cols = torch.arange(width, device=tokens.device).unsqueeze(0)
    plan_table = page_table.gather(1, (cols + shared.unsqueeze(1)).clamp(max=max(width - 1, 0)))
    plan_pages = prefix - shared
    cu = torch.cat([plan_start, (plan_start[-1:] + plan_pages[-1:])])
    positions = plan_positions_ref(cu, width, num_positions)
    logical, slots, table, phys, status = assign_slots_ref(
        plan_table, positions, cu, cp_size, slots_per_rank, trash_page, pad
    )
    map_batch_pages_ref(page_pos, page_table, table, torch.stack([shared, prefix, pages, start]), base, fill)
    differs = page_table != page_table[source.clamp(min=0)]
    wrong = (differs & (cols < shared.unsqueeze(1))).sum(1)
    return BatchPlan(positions, logical, slots, table, phys, status, wrong)


if triton is not None:

    @triton.jit
    def _table_pages(tokens, tok_stride0, row, j, live, page_size):
        """Logical pages of page positions ``j`` of the request whose tokens are row ``row``."""
        offs = row * tok_stride0 + j.to(tl.int64) * page_size
        return tl.load(tokens + offs, mask=live, other=0).to(tl.int64) // page_size

    @triton.jit(
        do_not_specialize=[
            "tok_stride0",
            "batch",
            "width",
            "page_size",
            "slots_per_rank",
            "trash_page",
            "pad",
            "base",
        ]
    )
    def _plan_batch_kernel(
        tokens,
        tok_stride0,
        rows,
        meta,
        batch,
        width,
        page_size,
        positions_out,
        logical_out,
        slots_out,
        table_out,
        phys_out,
        status_out,
        wrong_out,
        page_pos,
        slots_per_rank,
        trash_page,
        pad,
        base,
        N: tl.constexpr,
        NP2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program walks the batch request by request (positions in request-major order), twice: the
        # positions per owner first, then each position's rank, slot and stores (the tokens' column
        # stride is 1: SGLang's req_to_token rows are contiguous, checked by the wrapper).
        lanes = tl.arange(0, BLOCK)
        totals = tl.zeros([NP2], dtype=tl.int64)
        for b in range(batch):
            shared = tl.load(meta + b)
            prefix = tl.load(meta + batch + b)
            row = tl.load(rows + b).to(tl.int64)
            for j0 in range(shared, prefix, BLOCK):
                j = j0 + lanes
                live = j < prefix
                owner = _table_pages(tokens, tok_stride0, row, j, live, page_size) % N
                _, counts = _owner_ranks(owner, live, totals, N, NP2, BLOCK)
                totals += counts
        _store_status(status_out, totals, slots_per_rank, N, NP2)
        _fill_unused_entries(phys_out, totals, slots_per_rank, trash_page, 0, BLOCK, N, NP2, BLOCK)
        seen = tl.zeros([NP2], dtype=tl.int64)
        for b in range(batch):
            shared = tl.load(meta + b)
            prefix = tl.load(meta + batch + b)
            pages = tl.load(meta + 2 * batch + b)
            start = tl.load(meta + 3 * batch + b)
            source = tl.load(meta + 4 * batch + b)
            first = tl.load(meta + 5 * batch + b)
            row = tl.load(rows + b).to(tl.int64)
            table_row = table_out + b * width
            # The prefix pages past the shared ones: rank, slot, send entry, slot table, page map.
            for j0 in range(shared, prefix, BLOCK):
                j = j0 + lanes
                live = j < prefix
                lp = _table_pages(tokens, tok_stride0, row, j, live, page_size)
                owner = lp % N
                rank, counts = _owner_ranks(owner, live, seen, N, NP2, BLOCK)
                seen += counts
                slot, target = _slot_of(owner, rank, totals, slots_per_rank, N, NP2)
                i = first + j - shared
                tl.store(positions_out + i, b * width + j - shared, mask=live)
                tl.store(logical_out + i, lp, mask=live)
                tl.store(slots_out + i, slot, mask=live)
                tl.store(table_row + j - shared, slot.to(tl.int32), mask=live)
                tl.store(phys_out + target, lp // N, mask=live)
                tl.store(page_pos + lp, slot, mask=live)
            for c0 in range(0, width, BLOCK):  # the slot table past the planned pages
                c = c0 + lanes
                tl.store(
                    table_row + c, tl.zeros([BLOCK], dtype=tl.int32) + pad, mask=(c >= prefix - shared) & (c < width)
                )
            for j0 in range(prefix, pages, BLOCK):  # the current pages: staged past the view
                j = j0 + lanes
                live = j < pages
                lp = _table_pages(tokens, tok_stride0, row, j, live, page_size)
                tl.store(page_pos + lp, base + start + j - prefix, mask=live)
            src_row = tl.load(rows + tl.maximum(source, 0)).to(tl.int64)
            wrong = tl.zeros([BLOCK], dtype=tl.int64)
            for j0 in range(0, shared, BLOCK):  # the hint: shared pages equal to the source's
                j = j0 + lanes
                live = j < shared
                mine = _table_pages(tokens, tok_stride0, row, j, live, page_size)
                theirs = _table_pages(tokens, tok_stride0, src_row, j, live, page_size)
                wrong += (live & (mine != theirs)).to(tl.int64)
            tl.store(wrong_out + b, tl.sum(wrong, axis=0))


def plan_batch(
    tokens: torch.Tensor,
    rows: torch.Tensor,
    page_size: int,
    meta: torch.Tensor,
    width: int,
    num_positions: int,
    cp_size: int,
    slots_per_rank: int,
    trash_page: int,
    page_pos: torch.Tensor,
    base: int,
    fill: int,
    pad: int = 0,
    use_triton: bool | None = None,
) -> BatchPlan:
    """``plan_batch_ref`` in one launch of one program after a fill of ``page_pos``: two allocations, no
    read-back. ``num_positions`` (``sum(prefix - shared)``) and ``slots_per_rank`` are host ints."""
    check_index("tokens", tokens, 2)
    check_index("rows", rows, 1)
    batch = rows.shape[0]
    if meta.dtype != torch.int64 or meta.shape != (len(PLAN_META_ROWS), batch) or not meta.is_contiguous():
        raise ValueError(f"meta must be contiguous int64 [{len(PLAN_META_ROWS)}, {batch}], got {tuple(meta.shape)}")
    if page_pos.dtype != torch.int64 or page_pos.dim() != 1:
        raise ValueError(f"page_pos must be int64 [logical pages], got {page_pos.dtype} {tuple(page_pos.shape)}")
    if num_positions and slots_per_rank < 1:
        raise ValueError(f"slots_per_rank must be >= 1 for a batch with page positions, got {slots_per_rank}")
    args = (tokens, rows, page_size, meta, width, num_positions, cp_size, slots_per_rank, trash_page, page_pos)
    if not triton_enabled(tokens.device, use_triton) or batch == 0 or tokens.stride(1) != 1:
        return plan_batch_ref(*args, base, fill, pad)
    m, send = num_positions, cp_size * slots_per_rank
    # positions, logical, slots, send entries (and the dump entry), status and the hint's counts: one allocation.
    flat = torch.empty(3 * m + send + 1 + cp_size + 1 + batch, dtype=torch.int64, device=tokens.device)
    positions, logical, slots, phys, status, wrong = flat.split([m, m, m, send + 1, cp_size + 1, batch])
    table = torch.empty((batch, width), dtype=torch.int32, device=tokens.device)
    page_pos.fill_(fill)
    launch(
        _plan_batch_kernel,
        (1,),
        (tokens, tokens.stride(0), rows, meta, batch, width, page_size, positions, logical, slots, table, phys)
        + (status, wrong, page_pos, slots_per_rank, trash_page, pad, base),
        {"N": cp_size, "NP2": max(2, triton.next_power_of_2(cp_size)), "BLOCK": 1024},
        num_warps=8,
    )
    return BatchPlan(positions, logical, slots, table, phys[:send], status, wrong)
