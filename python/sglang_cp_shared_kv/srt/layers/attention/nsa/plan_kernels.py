"""A batch's slot plan: one Triton kernel (``plan_batch``) beside the plain-torch references it equals.

From a token table (SGLang's ``req_to_token``, or a page table with page size 1), ``plan_batch`` computes
the slot plan (``assign_slots_ref``), optionally the batch's page map (``map_batch_pages_ref``), and the
check of a shared-prefix hint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property, partial

import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.triton_launch import check_index, tl, triton, triton_enabled
from sglang_cp_shared_kv.srt.mem_cache.placement import local_page, page_owner


def build_slot_table_ref(
    slots: torch.Tensor, positions_flat: torch.Tensor, batch_size: int, max_pages: int, pad: int = 0
) -> torch.Tensor:
    """``table.view(-1)[positions_flat[i]] = slots[i]``; every other entry is ``pad``. int32 ``[B, max_pages]``."""
    table = torch.full((batch_size * max_pages,), pad, dtype=torch.int32, device=slots.device)
    table.index_copy_(0, positions_flat.long(), slots.to(torch.int32))
    return table.view(batch_size, max_pages)


def plan_positions_ref(cu_pages: torch.Tensor, max_pages: int, num_positions: int) -> torch.Tensor:
    """``b * max_pages + j`` for page ``j`` of request ``b``, request-major: int64 ``[num_positions]``
    (``cu_pages[-1]``, given from the host so nothing syncs)."""
    cu = cu_pages.long()
    counts = cu[1:] - cu[:-1]
    base = torch.arange(len(counts), device=cu.device) * max_pages - cu[:-1]  # b * max_pages - first position
    per_position = torch.repeat_interleave(base, counts, output_size=num_positions)
    return per_position + torch.arange(num_positions, device=cu.device)


def assign_slots_ref(
    page_table: torch.Tensor,
    positions_flat: torch.Tensor,
    cp_size: int,
    slots_per_rank: int,
    trash_page: int,
    pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot plan: ``(logical [M], slots [M], slot_table [B, W] int32, slot_phys [N * S], status [N + 1])``.

    Position ``i`` reads logical page ``lp = page_table.view(-1)[positions_flat[i]]`` owned by ``o = lp % N``,
    ``r``-th among the positions ``o`` owns: its view slot is ``o * S + r``, whose send entry in ``slot_phys``
    holds ``lp // N`` (unused entries: ``trash_page``). ``slot_table[b, j]``: the slot of page ``j`` of
    request ``b``, ``pad`` past its pages. A position with ``r >= S`` sends nothing and reads the first unused
    entry of the least loaded owner (it exists: ``M <= N * S``); ``status``: the overflow flag, then the
    positions per owner.
    """
    n, s = cp_size, slots_per_rank
    device = page_table.device
    logical = page_table.reshape(-1).index_select(0, positions_flat).long()
    owner = page_owner(logical, n)
    # Rank among same-owner positions: a cumsum over a one-hot [N, M] along the inner dimension (CUDA scans
    # the outer one serially).
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
    table = build_slot_table_ref(slots, positions_flat, batch, max_pages, pad)
    return logical, slots, table, slot_phys[: n * s], status


if triton is not None:

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
        """``(view slot, send entry)`` of positions with these owners and ranks (``assign_slots_ref``; send entry
        ``N * S`` is the dump), ``totals`` ``[NP2]`` the batch's positions per owner."""
        owners = tl.arange(0, NP2)
        totals_o = tl.where(owners < N, totals, 1 << 62)
        fewest = tl.argmin(totals_o, axis=0).to(tl.int64)
        free = tl.minimum(tl.min(totals_o, axis=0), slots_per_rank - 1)
        inside = rank < slots_per_rank
        slot = tl.where(inside, owner * slots_per_rank + rank, fewest * slots_per_rank + free)
        return slot, tl.where(inside, slot, N * slots_per_rank)

    @triton.jit
    def _fill_unused_entries(
        phys_out, totals, slots_per_rank, trash_page, N: tl.constexpr, NP2: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Send entry ``(o, r)`` with ``r >= totals[o]`` holds the trash page."""
        owners = tl.arange(0, NP2)
        lanes = tl.arange(0, BLOCK)
        send_entries = N * slots_per_rank
        for start in range(0, send_entries, BLOCK):
            idx = start + lanes
            inside = idx < send_entries
            o_idx = idx // slots_per_rank
            count = tl.zeros([BLOCK], dtype=tl.int64)
            for o in tl.static_range(N):
                count = tl.where(o_idx == o, tl.sum(tl.where(owners == o, totals, 0), axis=0), count)
            unused = inside & (idx - o_idx * slots_per_rank >= count)
            tl.store(phys_out + idx, tl.zeros([BLOCK], dtype=tl.int64) + trash_page, mask=unused)


def map_batch_pages_ref(
    page_pos: torch.Tensor, page_table: torch.Tensor, plan_table: torch.Tensor, meta: torch.Tensor, base: int, fill: int
) -> torch.Tensor:
    """Fill ``page_pos`` (int64 ``[logical pages]``) with ``fill``, then map the batch's pages into it.

    ``meta`` int64 ``[4, B]``: per request ``shared``, ``prefix``, ``pages`` and ``start`` (its first staged
    page). Page ``j`` of request ``b`` maps to nothing for ``j < shared[b]`` (its source maps it), to its view
    slot ``plan_table[b, j - shared[b]]`` for ``j < prefix[b]``, else to staged page ``base + start[b] + j -
    prefix[b]``. A page two requests read is written twice, with slots of the same bytes; unmapped writes go
    to logical page 0 (never handed out).
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


PLAN_META_ROWS = ("shared", "prefix", "pages", "start", "source", "plan_start")  # ``plan_batch``'s ``meta``


@dataclass(frozen=True)
class BatchPlan:
    """Where each planned page position of one batch lives in the dense view (identical on every rank):
    ``plan_batch``'s device outputs and the host sizes they were built for."""

    words: torch.Tensor  # int64 [>= 3 * M + N * S]: positions, logical pages, slots, send entries
    slot_table: torch.Tensor  # int32 [B, width]: the kernels' page table, in view slots (pad past a request's pages)
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
        """int64 ``[N * S]``: every owner's send block, owner-major: entry ``x`` is what view slot ``x`` holds."""
        start = self.send_start
        return self.words[start : start + self.view_pages]

    @property
    def status(self) -> torch.Tensor:
        return self.flags[: self.cp_size + 1]

    @property
    def wrong(self) -> torch.Tensor:
        """int64 ``[B]``: per request, its shared pages that differ from its source's."""
        return self.flags[self.cp_size + 1 : -1]

    def rank_view_slots(self, rank: int) -> tuple[int, int]:
        """``[start, end)``: the view slots ``rank``'s block fills (host ints)."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank!r}")
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
    """A batch's whole plan from its token table, composed of the references above.

    Page ``j`` of request ``b`` is logical page ``tokens[rows[b], j * page_size] // page_size``. ``meta`` int64
    ``[6, B]`` (or flat): per request the ``PLAN_META_ROWS`` (``slot_plan.plan_meta_rows``). The plan covers
    pages ``[shared, prefix)`` of each request; ``page_pos`` (None: no map) receives the page map."""
    shared, prefix, pages, start, source, plan_start = meta.long().view(len(PLAN_META_ROWS), -1)
    page_table = tokens[rows.long()][:, : width * page_size : page_size].long() // page_size
    cols = torch.arange(width, device=tokens.device).unsqueeze(0)
    plan_table = page_table.gather(1, (cols + shared.unsqueeze(1)).clamp(max=max(width - 1, 0)))
    plan_pages = prefix - shared
    cu = torch.cat([plan_start, (plan_start[-1:] + plan_pages[-1:])])
    positions = plan_positions_ref(cu, width, num_positions)
    logical, slots, table, phys, status = assign_slots_ref(
        plan_table, positions, cp_size, slots_per_rank, trash_page, pad
    )
    if page_pos is not None:
        map_batch_pages_ref(page_pos, page_table, table, torch.stack([shared, prefix, pages, start]), base, fill)
    differs = page_table != page_table[source.clamp(min=0)]
    wrong = (differs & (cols < shared.unsqueeze(1))).sum(1)
    flags = torch.cat([status, wrong, torch.ones(1, dtype=torch.int64, device=status.device)])
    words = torch.cat([positions, logical, slots, phys])
    return BatchPlan(words, table, flags, cp_size, num_positions, slots_per_rank)


_INT_ARGS = ("tok_stride0", "batch", "width", "page_size", "num_positions", "slots_per_rank", "trash_page")
_INT_ARGS += ("pad", "base", "fill", "num_pages")

if triton is not None:

    @triton.jit
    def _table_pages(tokens, tok_stride0, row, j, live, page_size):
        """Logical pages of page positions ``j`` of the request whose tokens are row ``row``."""
        offs = row * tok_stride0 + j.to(tl.int64) * page_size
        return tl.load(tokens + offs, mask=live, other=0).to(tl.int64) // page_size

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
        # One program walks the batch twice: the positions per owner first, then each position's rank, slot
        # and stores. ``out``, int64: positions, logical pages and slots ([M] each), the send entries ([N * S]
        # and a dump entry), the host lengths' device copy ([6 * B]); ``flags_out``: status, wrong, landed.
        positions_out = out
        logical_out = out + num_positions
        slots_out = out + 2 * num_positions
        phys_out = out + 3 * num_positions
        meta = phys_out + N * slots_per_rank + 1
        status_out = flags_out
        wrong_out = flags_out + N + 1
        lanes = tl.arange(0, BLOCK)
        # The host lengths into device scratch first: loads of pinned host memory cost a bus round trip each.
        for i0 in range(0, 6 * batch, BLOCK):
            i = i0 + lanes
            tl.store(meta + i, tl.load(meta_in + i, mask=i < 6 * batch), mask=i < 6 * batch)
        if MAP:  # every page unmapped until the batch's pages are mapped below
            for p0 in range(0, num_pages, BLOCK):
                p = p0 + lanes
                tl.store(page_pos + p, tl.zeros([BLOCK], dtype=tl.int64) + fill, mask=p < num_pages)
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
                _, counts = _owner_ranks(owner, live, totals, N, NP2, BLOCK)
                totals += counts
        owners = tl.arange(0, NP2)  # the status: the overflow flag, then the positions per owner
        tl.store(status_out + 1 + owners, totals, mask=owners < N)
        overflow = tl.max(tl.where(owners < N, totals, 0), axis=0) > slots_per_rank
        tl.store(status_out, overflow.to(tl.int64))
        _fill_unused_entries(phys_out, totals, slots_per_rank, trash_page, N, NP2, BLOCK)
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
                if MAP:
                    tl.store(page_pos + lp, slot, mask=live)
            for c0 in range(0, width, BLOCK):  # the slot table past the planned pages
                c = c0 + lanes
                tl.store(
                    table_row + c, tl.zeros([BLOCK], dtype=tl.int32) + pad, mask=(c >= prefix - shared) & (c < width)
                )
            if MAP:
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
        # Every flag stored (and every length read) before the landed word, which a host thread polls in
        # pinned memory: a block-wide barrier, then one store ordered after it at system scope.
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
    """``plan_batch_ref`` in one launch of one program (Triton where ``triton_enabled``, else the reference).

    ``meta`` may be pinned host memory, read in place. ``flags`` (int64 ``[N + 2 + B]``; default: a device
    buffer, or pinned host memory) receives ``status``, ``wrong`` and last a landed word (1 once the words
    before it are written). ``queue=False``: returns ``(plan, launch)``, the launch not queued (None: the reference ran)."""
    check_index("rows", rows, 1)
    if rows.get_device() != tokens.get_device():  # host ints: no device object per batch
        raise ValueError(f"rows must be on the token table's device ({tokens.device}), got {rows.device}")
    if not rows.is_contiguous():
        rows = rows.contiguous()
    batch, m = rows.shape[0], num_positions
    check_index("tokens", tokens, 2)
    lengths = len(PLAN_META_ROWS) * batch
    if meta.dtype != torch.int64 or meta.numel() != lengths or not meta.is_contiguous():
        raise ValueError(
            f"meta must be contiguous int64 [{len(PLAN_META_ROWS)}, {batch}] (or flat), got {tuple(meta.shape)}"
        )
    if page_pos is not None and (page_pos.dtype != torch.int64 or page_pos.dim() != 1):
        raise ValueError(f"page_pos must be int64 [logical pages], got {page_pos.dtype} {tuple(page_pos.shape)}")
    if num_positions and slots_per_rank < 1:
        raise ValueError(f"slots_per_rank must be >= 1 for a batch with page positions, got {slots_per_rank}")
    if flags is not None and (flags.dtype != torch.int64 or flags.shape != (cp_size + 2 + batch,)):
        raise ValueError(f"flags must be int64 [{cp_size + 2 + batch}], got {flags.dtype} {tuple(flags.shape)}")
    if not triton_enabled(tokens.device, use_triton) or batch == 0 or tokens.stride(1) != 1:
        lengths_in = meta.to(tokens.device, non_blocking=True)  # host lengths the launch would read in place
        args = (tokens, rows, page_size, lengths_in, width, num_positions, cp_size, slots_per_rank, trash_page)
        plan = plan_batch_ref(*args, page_pos, base, fill, pad)
        if flags is not None:
            # The landed word in a second copy: stream order lands it after the flags.
            flags[:-1].copy_(plan.flags[:-1], non_blocking=True)
            flags[-1:].copy_(plan.flags[-1:], non_blocking=True)
            plan = replace(plan, flags=flags)
        return plan if queue else (plan, None)
    # positions, logical, slots, send entries (and the dump entry), the host lengths' device copy: one buffer.
    words = 3 * m + cp_size * slots_per_rank + 1 + lengths
    if flags is None:
        flags = torch.empty(cp_size + 2 + batch, dtype=torch.int64, device=tokens.device)
    flat = torch.empty(words, dtype=torch.int64, device=tokens.device)
    table = torch.empty((batch, width), dtype=torch.int32, device=tokens.device)
    num_pages = 0 if page_pos is None else page_pos.shape[0]
    args = (tokens, tokens.stride(0), rows, meta, flat, table, flags, flat if page_pos is None else page_pos)
    args += (batch, width, page_size, m, slots_per_rank, trash_page, pad, base, fill, num_pages)
    np2 = max(2, 1 << (cp_size - 1).bit_length())  # the next power of two (host time: no Triton helper)
    launch = partial(
        _plan_batch_kernel[(1,)], *args, N=cp_size, NP2=np2, BLOCK=1024, MAP=page_pos is not None, num_warps=8
    )
    if queue:
        launch()
    plan = BatchPlan(flat, table, flags, cp_size, m, slots_per_rank)
    return plan if queue else (plan, launch)
