"""Triton kernels of the materialized read path, each beside its plain-torch reference.

- ``gather_page_buffers`` / ``gather_pages``: copy whole pages of page-major pool buffers into a
  send block, in the order a page-id vector gives; one generic copy serves latent and indexer
  pages, and one launch gathers both.
- ``build_slot_table``: the page table handed to the kernels, in slot ids: position ``j`` of
  request ``b`` gets ``slots[cu_pages[b] + j]``; positions past a request's pages get ``pad``.
- ``positions_to_view_rows``: token positions within a request (NSA top-k output, -1 padded)
  -> rows of a view, ``page_table[req, pos // ps] * ps + pos % ps``; -1 stays -1.

Each wrapper runs Triton on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1``
(the tests); otherwise it runs the reference. ``use_triton`` forces either.
None of them reads device data back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every platform we run
    triton = None


def interpreting() -> bool:
    """Whether this module's kernels were built for the Triton interpreter.

    ``triton.jit`` picks the interpreter when the module is imported with ``TRITON_INTERPRET=1``,
    so that, not the environment at call time, decides whether CPU tensors can run the kernels.
    """
    return triton is not None and not isinstance(_gather_pages_kernel, triton.runtime.JITFunction)


def triton_enabled(device: torch.device, use_triton: bool | None = None) -> bool:
    """Whether a wrapper runs its Triton kernel for tensors on ``device``."""
    runnable = triton is not None and (device.type == "cuda" or interpreting())
    if use_triton is None:
        return runnable
    if use_triton and not runnable:
        raise ValueError(
            f"use_triton=True needs triton and a CUDA device, or TRITON_INTERPRET=1 at import, for {device} tensors"
        )
    return use_triton


def _check_index(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# gather_pages
# ---------------------------------------------------------------------------------------------


def gather_pages_ref(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[page_ids[i]]`` for a page-major ``src [P, page_bytes]``."""
    if out is None:
        return src.index_select(0, page_ids.long())
    return torch.index_select(src, 0, page_ids.long(), out=out)


if triton is not None:

    @triton.jit
    def _copy_page(src, out, words, BLOCK: tl.constexpr):
        for start in range(0, words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)

    @triton.jit
    def _gather_pages_kernel(
        page_ids,
        src_a,
        out_a,
        words_a,
        src_stride_a,
        out_stride_a,
        src_b,
        out_b,
        words_b,
        src_stride_b,
        out_stride_b,
        BLOCK: tl.constexpr,
    ):
        # One program copies one slot's page of buffer a (grid column 0) or b (column 1).
        slot = tl.program_id(0).to(tl.int64)
        page = tl.load(page_ids + slot).to(tl.int64)
        if tl.program_id(1) == 0:
            _copy_page(src_a + page * src_stride_a, out_a + slot * out_stride_a, words_a, BLOCK)
        else:
            _copy_page(src_b + page * src_stride_b, out_b + slot * out_stride_b, words_b, BLOCK)


def _word_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a uint8 page buffer as int32 words when rows and base allow it (4x fewer lanes)."""
    if t.dtype == torch.uint8 and t.shape[1] % 4 == 0 and t.stride(0) % 4 == 0 and t.data_ptr() % 4 == 0:
        return t.view(torch.int32)
    return t


def _check_gather(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if src.dim() != 2 or src.stride(1) != 1:
        raise ValueError(f"src must be 2-D with contiguous rows, got shape {tuple(src.shape)} strides {src.stride()}")
    if out is None:
        return torch.empty((page_ids.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    if out.shape != (page_ids.shape[0], src.shape[1]) or out.dtype != src.dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be {src.dtype} [{page_ids.shape[0]}, {src.shape[1]}] with contiguous rows, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if page_ids.device != src.device or out.device != src.device:
        raise ValueError(
            f"src, page_ids and out must share a device, got {src.device}, {page_ids.device}, {out.device}"
        )
    return out


def gather_page_buffers(
    srcs: Sequence[torch.Tensor],
    page_ids: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
    use_triton: bool | None = None,
) -> list[torch.Tensor]:
    """Copy the same pages of one or two page-major buffers (``[P, page_bytes]`` each, rows contiguous)
    into ``outs[k][i] = srcs[k][page_ids[i]]``, in one kernel launch.

    The read path gathers a slot's latent page and its indexer page together. ``page_ids`` must
    hold valid page indices of every source (the plan points padding at the trash page).
    """
    if not 1 <= len(srcs) <= 2:
        raise ValueError(f"srcs must hold one or two buffers, got {len(srcs)}")
    if outs is not None and len(outs) != len(srcs):
        raise ValueError(f"outs must match srcs ({len(srcs)} buffers), got {len(outs)}")
    _check_index("page_ids", page_ids, 1)
    outs = [_check_gather(src, page_ids, None if outs is None else outs[k]) for k, src in enumerate(srcs)]
    if page_ids.shape[0] == 0:
        return outs
    if not triton_enabled(srcs[0].device, use_triton):
        return [gather_pages_ref(src, page_ids, out) for src, out in zip(srcs, outs)]
    args = []
    for src, out in zip(srcs, outs):
        s_words, o_words = _word_view(src), _word_view(out)
        if s_words.dtype != o_words.dtype:
            s_words, o_words = src, out
        args.append((s_words, o_words, s_words.shape[1], s_words.stride(0), o_words.stride(0)))
    block = min(4096, triton.next_power_of_2(max(a[2] for a in args)))
    grid = (page_ids.shape[0], len(args))
    a, b = args[0], args[-1]
    _gather_pages_kernel[grid](page_ids, *a, *b, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return outs


def gather_pages(
    src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None, use_triton: bool | None = None
) -> torch.Tensor:
    """Copy ``src[page_ids[i]]`` into ``out[i]``: ``gather_page_buffers`` for a single buffer."""
    return gather_page_buffers([src], page_ids, None if out is None else [out], use_triton)[0]


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
    _check_index("slots", slots, 1)
    _check_index("cu_pages", cu_pages, 1)
    if cu_pages.shape[0] != batch_size + 1:
        raise ValueError(f"cu_pages must have batch_size + 1 = {batch_size + 1} entries, got {cu_pages.shape[0]}")
    if not triton_enabled(slots.device, use_triton) or batch_size == 0 or max_pages == 0:
        return build_slot_table_ref(slots, positions_flat, batch_size, max_pages, pad)
    out = torch.empty((batch_size, max_pages), dtype=torch.int32, device=slots.device)
    block = min(1024, triton.next_power_of_2(max_pages))
    grid = (batch_size, triton.cdiv(max_pages, block))
    _slot_table_kernel[grid](slots, cu_pages, out, max_pages, pad, BLOCK=block)
    return out


# ---------------------------------------------------------------------------------------------
# positions_to_view_rows (token-level remap of NSA top-k positions)
# ---------------------------------------------------------------------------------------------


def positions_to_view_rows_ref(
    positions: torch.Tensor, q_req: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> torch.Tensor:
    """``row = page_table[q_req, pos // ps] * ps + pos % ps`` (same dtype as ``positions``); -1 stays -1."""
    pos = positions.long()
    valid = pos >= 0
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    req = q_req.long().view(-1, *([1] * (pos.dim() - 1))).expand_as(pos)
    pages = page_table.long()[req, safe // page_size]
    rows = pages * page_size + safe % page_size
    return torch.where(valid, rows, torch.full_like(rows, -1)).to(positions.dtype)


if triton is not None:

    @triton.jit
    def _positions_to_rows_kernel(positions, q_req, page_table, out, k, pt_stride, page_size, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        block = tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        inside = offs < k
        pos = tl.load(positions + t.to(tl.int64) * k + offs, mask=inside, other=-1).to(tl.int64)
        valid = pos >= 0
        safe = tl.where(valid, pos, 0)
        req = tl.load(q_req + t).to(tl.int64)
        page = tl.load(page_table + req * pt_stride + safe // page_size, mask=inside & valid, other=0).to(tl.int64)
        rows = tl.where(valid, page * page_size + safe % page_size, -1)
        tl.store(out + t.to(tl.int64) * k + offs, rows.to(out.dtype.element_ty), mask=inside)


def positions_to_view_rows(
    positions: torch.Tensor,
    q_req: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Map ``positions [T, K]`` (token positions in request ``q_req[t]``, -1 padded) to view rows."""
    _check_index("positions", positions, 2)
    _check_index("q_req", q_req, 1)
    _check_index("page_table", page_table, 2)
    if q_req.shape[0] != positions.shape[0]:
        raise ValueError(f"q_req must have one entry per query ({positions.shape[0]}), got {q_req.shape[0]}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if not triton_enabled(positions.device, use_triton) or positions.numel() == 0:
        return positions_to_view_rows_ref(positions, q_req, page_table, page_size)
    positions = positions.contiguous()
    table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
    out = torch.empty_like(positions)
    t, k = positions.shape
    block = min(1024, triton.next_power_of_2(k))
    grid = (t, triton.cdiv(k, block))
    _positions_to_rows_kernel[grid](positions, q_req, table, out, k, table.stride(0), page_size, BLOCK=block)
    return out
