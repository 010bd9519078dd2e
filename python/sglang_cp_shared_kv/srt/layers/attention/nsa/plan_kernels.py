"""A batch's slot plan, page map and shared-prefix check from its token table: one
Triton program (``plan_batch``) beside the plain-torch references it equals.

The batch plans ``M`` page positions, request-major: request ``b``'s ``pages_b`` prefix
pages past those it shares. Owner ``o`` of a page sends a block of ``S = sum_b
ceil(pages_b / N)`` pages; position ``(b, j)`` whose owner ``o`` has ``r`` earlier
positions in the batch takes the view slot (owner-major)::

    slot(b, j) = o * S + r

A block overflows only if a request's pages do not rotate owners (the allocator's
policy, not a law): such a position reads the trash page and the device status flags
the batch (``slot_plan.DeviceFlagCheck``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property, partial

import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.triton_launch import check_index, tl, triton, triton_enabled
from sglang_cp_shared_kv.srt.mem_cache.placement import local_page, page_owner


def plan_positions_ref(cu: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """``b * width + j`` of page ``j`` of request ``b``, request-major (``cu``: the
    cumulative page counts); ``total = cu[-1]`` comes from the host: nothing syncs."""
    cu = cu.long()
    pages = cu[1:] - cu[:-1]
    firsts = torch.arange(len(pages), device=cu.device) * width - cu[:-1]
    per_position = torch.repeat_interleave(firsts, pages, output_size=total)
    return per_position + torch.arange(total, device=cu.device)


def assign_slots_ref(
    page_table: torch.Tensor,
    positions_flat: torch.Tensor,
    cp_size: int,
    slots_per_rank: int,
    trash_page: int,
    pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logical, slots, slot_table, slot_phys, status)`` of the positions
    ``positions_flat`` of ``page_table``: ``slot_table`` is ``pad`` past them,
    ``status`` the overflow flag then the positions per owner."""
    n, s, device = cp_size, slots_per_rank, page_table.device
    logical = page_table.reshape(-1).index_select(0, positions_flat).long()
    owner = page_owner(logical, n)
    # Rank among same-owner positions: a cumsum of a one-hot [N, M] along its inner
    # dimension (CUDA scans the outer one serially).
    one_hot = (torch.arange(n, device=device).unsqueeze(1) == owner).to(torch.int32)
    running = one_hot.cumsum(1, dtype=torch.int32)
    rank = running.gather(0, owner.unsqueeze(0)).squeeze(0).long() - 1
    counts = one_hot.sum(1, dtype=torch.int64)
    # Past its owner's block, a position reads the least loaded owner's first free
    # entry (clamped into the view when no block overflows).
    fewest = counts.argmin()
    free = counts[fewest].clamp(max=max(s - 1, 0))
    slots = torch.where(rank < s, owner * s + rank, fewest * s + free)
    target = torch.where(rank < s, slots, n * s)  # n * s: a dump entry
    slot_phys = torch.full((n * s + 1,), trash_page, dtype=torch.int64, device=device)
    slot_phys.scatter_(0, target, local_page(logical, n))
    status = torch.cat([(counts.amax() > s).to(torch.int64).reshape(1), counts])
    table = torch.full(page_table.shape, pad, dtype=torch.int32, device=device)
    table.view(-1).index_copy_(0, positions_flat.long(), slots.to(torch.int32))
    return logical, slots, table, slot_phys[: n * s], status


def map_batch_pages_ref(
    page_pos: torch.Tensor,
    page_table: torch.Tensor,
    plan_table: torch.Tensor,
    meta: torch.Tensor,
    base: int,
    fill: int,
) -> torch.Tensor:
    """Fill ``page_pos`` with ``fill``, then map page ``j`` of request ``b`` to nothing
    for ``j < shared`` (its source maps it), to slot ``plan_table[b, j - shared]`` for
    ``j < prefix``, else to staged page ``base + start + j - prefix``; ``meta``: the
    first four ``PLAN_META_ROWS``. Unmapped writes go to page 0 (never handed out)."""
    shared, prefix, pages, start = (v.unsqueeze(1) for v in meta.long())
    j = torch.arange(page_table.shape[1], device=page_table.device).unsqueeze(0)
    mapped = (j >= shared) & (j < pages)
    cols = (j - shared).clamp(0, max(plan_table.shape[1] - 1, 0))
    slot = plan_table.long().gather(1, cols.expand_as(page_table))
    pos = torch.where(j < prefix, slot, base + start + j - prefix)
    page_pos.fill_(fill)
    targets = torch.where(mapped, page_table.long(), 0).reshape(-1)
    page_pos.index_put_((targets,), torch.where(mapped, pos, fill).reshape(-1))
    return page_pos


PLAN_META_ROWS = ("shared", "prefix", "pages", "start", "source", "plan_start")


@dataclass(frozen=True)
class BatchPlan:
    """Where each planned page position of a batch lives in the view, the same on every
    rank: ``plan_batch``'s device outputs and the host sizes they were built for."""

    words: torch.Tensor  # int64: positions, logical pages, slots, then send entries
    slot_table: torch.Tensor  # int32 [B, width]: view slots, pad past the positions
    flags: torch.Tensor  # int64 [N + 2 + B]: status, wrong, then the landed word (1)
    cp_size: int  # N
    num_positions: int  # M
    slots_per_rank: int  # S: every owner's block

    @property
    def view_pages(self) -> int:
        return self.cp_size * self.slots_per_rank

    @property
    def send_start(self) -> int:
        return 3 * self.num_positions

    @property
    def positions(self) -> torch.Tensor:
        """int64 ``[M]``: ``b * width + j`` of each planned position."""
        return self.words[: self.num_positions]

    @property
    def logical(self) -> torch.Tensor:
        return self.words[self.num_positions : 2 * self.num_positions]

    @property
    def slots(self) -> torch.Tensor:
        return self.words[2 * self.num_positions : 3 * self.num_positions]

    @cached_property
    def slot_phys(self) -> torch.Tensor:
        """int64 ``[N * S]``, owner-major: the physical page view slot ``x`` holds."""
        return self.words[self.send_start : self.send_start + self.view_pages]

    @property
    def status(self) -> torch.Tensor:
        return self.flags[: self.cp_size + 1]

    @property
    def wrong(self) -> torch.Tensor:
        """int64 ``[B]``: per request, its shared pages unlike its source's."""
        return self.flags[self.cp_size + 1 : -1]

    def rank_view_slots(self, rank: int) -> tuple[int, int]:
        """``[start, end)``: the view slots ``rank``'s block fills."""
        s = self.slots_per_rank
        return rank * s, (rank + 1) * s

    def send_pages(self, rank: int) -> torch.Tensor:
        """Physical pages ``rank`` copies into its send block."""
        return self.slot_phys[slice(*self.rank_view_slots(rank))]

    def slot_owner(self, slots: torch.Tensor) -> torch.Tensor:
        """The owner whose block fills each view slot."""
        return slots // max(self.slots_per_rank, 1)


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
    page_pos: torch.Tensor | None,
    base: int,
    fill: int,
    pad: int = 0,
) -> BatchPlan:
    """``plan_batch``'s plan from the references above: page ``j`` of request ``b`` is
    logical page ``tokens[rows[b], j * page_size] // page_size``, and pages ``[shared,
    prefix)`` of each request are planned."""
    lengths = meta.long().view(len(PLAN_META_ROWS), -1)
    shared, prefix, pages, start, source, plan_start = lengths
    ps = page_size
    page_table = tokens[rows.long()][:, : width * ps : ps].long() // ps
    cols = torch.arange(width, device=tokens.device).unsqueeze(0)
    past_shared = (cols + shared.unsqueeze(1)).clamp(max=max(width - 1, 0))
    plan_table = page_table.gather(1, past_shared)
    cu = torch.cat([plan_start, plan_start[-1:] + prefix[-1:] - shared[-1:]])
    positions = plan_positions_ref(cu, width, num_positions)
    logical, slots, table, phys, status = assign_slots_ref(
        plan_table, positions, cp_size, slots_per_rank, trash_page, pad
    )
    if page_pos is not None:
        map_batch_pages_ref(page_pos, page_table, table, lengths[:4], base, fill)
    differs = page_table != page_table[source.clamp(min=0)]
    wrong = (differs & (cols < shared.unsqueeze(1))).sum(1)
    flags = torch.cat([status, wrong, status.new_ones(1)])  # then the landed word
    words = torch.cat([positions, logical, slots, phys])
    return BatchPlan(words, table, flags, cp_size, num_positions, slots_per_rank)


@triton.jit
def _table_pages(tokens, tok_stride0, row, j, live, page_size):
    """Logical pages of page positions ``j`` of the request whose tokens are ``row``."""
    offs = row * tok_stride0 + j.to(tl.int64) * page_size
    return tl.load(tokens + offs, mask=live, other=0).to(tl.int64) // page_size


@triton.jit
def _owner_ranks(owner, live, before, N: tl.constexpr, NP2: tl.constexpr):
    """Rank of each live position among its owner's, in order, past ``before[o]``
    earlier ones; and this block's positions per owner."""
    owners = tl.arange(0, NP2)
    rank = tl.zeros_like(owner)
    counts = tl.zeros_like(before)
    for o in tl.static_range(N):
        mine = (owner == o) & live
        ones = mine.to(tl.int32)  # int32 scans, as every Triton target has
        first = tl.sum(tl.where(owners == o, before, 0), axis=0)
        running = tl.cumsum(ones, axis=0).to(tl.int64)
        rank = tl.where(mine, first + running - 1, rank)
        counts = tl.where(owners == o, tl.sum(ones, axis=0).to(tl.int64), counts)
    return rank, counts


_INT_ARGS = ("tok_stride0", "batch", "width", "page_size", "num_positions")
_INT_ARGS += ("slots_per_rank", "trash_page", "pad", "base", "fill", "num_pages")


@triton.jit(do_not_specialize=_INT_ARGS)  # one compiled kernel for every batch
def _plan_batch_kernel(
    tokens,
    tok_stride0,
    rows,
    meta_in,
    out,
    table_out,
    flags_out,
    page_pos,
    batch,
    width,
    page_size,
    num_positions,
    slots_per_rank,
    trash_page,
    pad,
    base,
    fill,
    num_pages,
    N: tl.constexpr,
    NP2: tl.constexpr,
    BLOCK: tl.constexpr,
    MAP: tl.constexpr,
):
    # One program walks the batch twice: the positions per owner, then each position's
    # rank, slot and stores. ``out``: positions, logical pages, slots ([M] each), send
    # entries ([N * S] and a dump entry), the lengths' device copy ([6 * B]).
    phys_out = out + 3 * num_positions
    meta = phys_out + N * slots_per_rank + 1
    wrong_out = flags_out + N + 1  # flags_out: status [N + 1], wrong [B], landed
    lanes = tl.arange(0, BLOCK)
    owners = tl.arange(0, NP2)
    # The lengths into device scratch first: each pinned host load crosses the bus.
    for i0 in range(0, 6 * batch, BLOCK):
        i = i0 + lanes
        tl.store(meta + i, tl.load(meta_in + i, mask=i < 6 * batch), mask=i < 6 * batch)
    # Every send entry the trash page, every page unmapped, until the second walk.
    for e0 in range(0, N * slots_per_rank, BLOCK):
        e = e0 + lanes
        tl.store(phys_out + e, trash_page, mask=e < N * slots_per_rank)
    if MAP:
        for p0 in range(0, num_pages, BLOCK):
            p = p0 + lanes
            tl.store(page_pos + p, fill, mask=p < num_pages)
    tl.debug_barrier()
    totals = tl.zeros([NP2], dtype=tl.int64)
    for b in range(batch):
        shared = tl.load(meta + b)
        prefix = tl.load(meta + batch + b)
        row = tl.load(rows + b).to(tl.int64)
        for j0 in range(shared, prefix, BLOCK):
            j = j0 + lanes
            live = j < prefix
            owner = _table_pages(tokens, tok_stride0, row, j, live, page_size) % N
            _, counts = _owner_ranks(owner, live, totals, N, NP2)
            totals += counts
    # The status: the overflow flag, then the positions per owner.
    tl.store(flags_out + 1 + owners, totals, mask=owners < N)
    overflow = tl.max(tl.where(owners < N, totals, 0), axis=0) > slots_per_rank
    tl.store(flags_out, overflow.to(tl.int64))
    # Past its owner's block, a position reads the least loaded owner's first free one.
    totals_o = tl.where(owners < N, totals, 1 << 62)
    fewest = tl.argmin(totals_o, axis=0).to(tl.int64)
    free = tl.minimum(tl.min(totals_o, axis=0), slots_per_rank - 1)
    spare = fewest * slots_per_rank + free
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
        # The prefix pages past the shared ones: slot, send entry, slot table, page map.
        for j0 in range(shared, prefix, BLOCK):
            j = j0 + lanes
            live = j < prefix
            lp = _table_pages(tokens, tok_stride0, row, j, live, page_size)
            owner = lp % N
            rank, counts = _owner_ranks(owner, live, seen, N, NP2)
            seen += counts
            inside = rank < slots_per_rank
            slot = tl.where(inside, owner * slots_per_rank + rank, spare)
            target = tl.where(inside, slot, N * slots_per_rank)  # else the dump entry
            at = out + first + j - shared  # its position, logical page and slot
            tl.store(at, b * width + j - shared, mask=live)
            tl.store(at + num_positions, lp, mask=live)
            tl.store(at + 2 * num_positions, slot, mask=live)
            tl.store(table_row + j - shared, slot.to(tl.int32), mask=live)
            tl.store(phys_out + target, lp // N, mask=live)
            if MAP:
                tl.store(page_pos + lp, slot, mask=live)
        for c0 in range(0, width, BLOCK):  # the slot table past the planned pages
            c = c0 + lanes
            tl.store(table_row + c, pad, mask=(c >= prefix - shared) & (c < width))
        if MAP:  # the current pages: staged past the view
            for j0 in range(prefix, pages, BLOCK):
                j = j0 + lanes
                live = j < pages
                lp = _table_pages(tokens, tok_stride0, row, j, live, page_size)
                tl.store(page_pos + lp, base + start + j - prefix, mask=live)
        src_row = tl.load(rows + tl.maximum(source, 0)).to(tl.int64)
        wrong = tl.zeros([BLOCK], dtype=tl.int64)
        for j0 in range(0, shared, BLOCK):  # the hint: shared pages are the source's
            j = j0 + lanes
            live = j < shared
            mine = _table_pages(tokens, tok_stride0, row, j, live, page_size)
            theirs = _table_pages(tokens, tok_stride0, src_row, j, live, page_size)
            wrong += (live & (mine != theirs)).to(tl.int64)
        tl.store(wrong_out + b, tl.sum(wrong, axis=0))
    # Every flag stored (and every length read) before the landed word, which the host
    # polls in pinned memory: a block-wide barrier, then a system-scope release store.
    tl.debug_barrier()
    tl.atomic_xchg(wrong_out + batch, 1, sem="release", scope="sys")


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
    page_pos: torch.Tensor | None,
    base: int,
    fill: int,
    pad: int = 0,
    use_triton: bool | None = None,
    flags: torch.Tensor | None = None,
    queue: bool = True,
) -> BatchPlan | tuple[BatchPlan, Callable[[], None] | None]:
    """``plan_batch_ref`` in one launch of one program. ``meta`` (``PLAN_META_ROWS``)
    may be pinned host memory, read in place; ``flags`` receives the status, ``wrong``,
    then a landed word (1). ``queue=False``: ``(plan, launch)``, not yet launched."""
    check_index("rows", rows, 1)
    if rows.get_device() != tokens.get_device():  # host ints: no device object a batch
        raise ValueError(f"rows must be on the token table's device, {tokens.device}")
    rows = rows.contiguous()
    check_index("tokens", tokens, 2)
    batch, m = rows.shape[0], num_positions
    n_flags, lengths = cp_size + 2 + batch, len(PLAN_META_ROWS) * batch
    if meta.dtype != torch.int64 or meta.numel() != lengths or not meta.is_contiguous():
        raise ValueError(f"meta must be contiguous int64 [6, {batch}]")
    row_stride, col_stride = tokens.stride()
    if not triton_enabled(tokens.device, use_triton) or batch == 0 or col_stride != 1:
        meta = meta.to(tokens.device, non_blocking=True)  # as the launch reads it
        args = (tokens, rows, page_size, meta, width, m, cp_size, slots_per_rank)
        plan = plan_batch_ref(*args, trash_page, page_pos, base, fill, pad)
        if flags is not None:  # the landed word in a second copy, stream-ordered after
            flags[:-1].copy_(plan.flags[:-1], non_blocking=True)
            flags[-1:].copy_(plan.flags[-1:], non_blocking=True)
            plan = replace(plan, flags=flags)
        return plan if queue else (plan, None)
    # positions, logical pages, slots, send entries and a dump entry, the lengths' copy
    words = 3 * m + cp_size * slots_per_rank + 1 + lengths
    flat = torch.empty(words, dtype=torch.int64, device=tokens.device)
    if flags is None:
        flags = torch.empty(n_flags, dtype=torch.int64, device=tokens.device)
    table = torch.empty((batch, width), dtype=torch.int32, device=tokens.device)
    mapped = page_pos is not None
    num_pages = page_pos.shape[0] if mapped else 0
    page_map = page_pos if mapped else flat  # MAP off: never written
    args = (tokens, row_stride, rows, meta, flat, table, flags, page_map, batch, width)
    args += (page_size, m, slots_per_rank, trash_page, pad, base, fill, num_pages)
    np2 = max(2, 1 << (cp_size - 1).bit_length())  # the next power of two
    consts = {"N": cp_size, "NP2": np2, "BLOCK": 1024, "MAP": mapped}
    launch = partial(_plan_batch_kernel[(1,)], *args, **consts, num_warps=8)
    if queue:
        launch()
    plan = BatchPlan(flat, table, flags, cp_size, m, slots_per_rank)
    return plan if queue else (plan, launch)
