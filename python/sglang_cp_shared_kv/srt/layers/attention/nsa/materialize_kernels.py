"""Triton kernels of the materialized read path, each beside its plain-torch reference.

Each wrapper runs Triton where ``triton_launch.triton_enabled`` says."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.triton_launch import check_index, nothing, tl, triton, triton_enabled


def gather_pages_ref(src: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[page_ids[i]]`` for a page-major ``src [P, page_bytes]``."""
    return torch.index_select(src, 0, page_ids.long(), out=out)


def pull_pages_ref(
    sources: Sequence[torch.Tensor], slot_phys: torch.Tensor, slots_per_rank: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[x] = sources[x // S][slot_phys[x]]``: owner ``o``'s block of the view read
    from its page-major buffer ``sources[o]`` (``S``: ``slots_per_rank``)."""
    s, ids = slots_per_rank, slot_phys.long()
    view = torch.cat([src[ids[o * s : (o + 1) * s]] for o, src in enumerate(sources)])
    return view if out is None else out.copy_(view)


@triton.jit
def _copy_page(src, out, words, BLOCK: tl.constexpr):
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < words
        tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _gather_pages_kernel(
    page_ids,
    num_slots,
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
    # Program (i, k) copies slots i, i + G, ... of buffer a (k = 0) or b (k = 1).
    first = tl.program_id(0).to(tl.int64)
    for slot in range(first, num_slots, tl.num_programs(0)):
        page = tl.load(page_ids + slot).to(tl.int64)
        if tl.program_id(1) == 0:
            _copy_page(src_a + page * src_stride_a, out_a + slot * out_stride_a, words_a, BLOCK)
        else:
            _copy_page(src_b + page * src_stride_b, out_b + slot * out_stride_b, words_b, BLOCK)


@triton.jit(do_not_specialize=["start", "layer"])
def _pull_pages_kernel(
    slot_phys,
    start,
    num_slots,
    slots_per_rank,
    table,
    layer,
    cp_size,
    out_a,
    words_a,
    stride_a,
    out_b,
    words_b,
    stride_b,
    BLOCK: tl.constexpr,
):
    # table: int64 [layers, 2, cp_size], owner o's buffer k per layer. Program
    # (i, k) copies slots i, i + G, ... of buffer k, each from its block's owner.
    first = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    owners = table + (layer.to(tl.int64) * 2 + k) * cp_size
    for slot in range(first, num_slots, tl.num_programs(0)):
        page = tl.load(slot_phys + start + slot).to(tl.int64)
        src = tl.load(owners + slot // slots_per_rank).to(tl.pointer_type(tl.int32))
        if k == 0:
            _copy_page(src + page * stride_a, out_a + slot * words_a, words_a, BLOCK)
        else:
            _copy_page(src + page * stride_b, out_b + slot * words_b, words_b, BLOCK)


def word_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 page buffer as int32 words where rows and base allow (4x fewer lanes)."""
    if t.dtype != torch.uint8 or t.shape[1] % 4 or t.stride(0) % 4 or t.data_ptr() % 4:
        return t
    return t.view(torch.int32)


def _check_gather(src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None):
    """``out`` (None: a new buffer), checked to take pages ``ids`` of ``src``."""
    if src.dim() != 2 or src.stride(1) != 1:
        got = f"{tuple(src.shape)} strides {src.stride()}"
        raise ValueError(f"src must be 2-D with contiguous rows, got {got}")
    shape = (ids.shape[0], src.shape[1])
    if out is None:
        return torch.empty(shape, dtype=src.dtype, device=src.device)
    if out.shape != shape or out.dtype != src.dtype or out.stride(1) != 1:
        want, got = f"{src.dtype} {list(shape)}", f"{out.dtype} {tuple(out.shape)}"
        raise ValueError(f"out must be {want} with contiguous rows, got {got}")
    if ids.device != src.device or out.device != src.device:
        got = f"{src.device}, {ids.device}, {out.device}"
        raise ValueError(f"src, page_ids and out must share a device, got {got}")
    return out


def gather_page_buffers(
    srcs: Sequence[torch.Tensor],
    page_ids: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
    use_triton: bool | None = None,
) -> list[torch.Tensor]:
    """``outs[k][i] = srcs[k][page_ids[i]]`` for one or two page-major buffers."""
    outs, launch = prepare_gather(srcs, page_ids, outs, use_triton)
    launch()
    return outs


def prepare_gather(
    srcs: Sequence[torch.Tensor],
    page_ids: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
    use_triton: bool | None = None,
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """``(outs, launch)``: ``gather_page_buffers`` checked once, run by ``launch()``."""
    if not 1 <= len(srcs) <= 2:
        raise ValueError(f"srcs must hold one or two buffers, got {len(srcs)}")
    if outs is not None and len(outs) != len(srcs):
        raise ValueError(f"outs must match srcs ({len(srcs)} buffers), got {len(outs)}")
    check_index("page_ids", page_ids, 1)
    given = [None] * len(srcs) if outs is None else outs
    outs = [_check_gather(s, page_ids, o) for s, o in zip(srcs, given)]
    if page_ids.shape[0] == 0:
        return outs, nothing
    if not triton_enabled(srcs[0].device, use_triton):
        pairs = list(zip(srcs, outs))
        return outs, lambda: [gather_pages_ref(s, page_ids, o) for s, o in pairs]
    return outs, gather_launch([word_pair(s, o) for s, o in zip(srcs, outs)], page_ids)


def word_pair(src: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(src, out)`` as int32 words where both allow it (``word_view``), else as is."""
    s_words, o_words = word_view(src), word_view(out)
    return (s_words, o_words) if s_words.dtype == o_words.dtype else (src, out)


def gather_launch(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], page_ids: torch.Tensor, programs: int | None = None
) -> Callable[[], None]:
    """The launch copying pages ``page_ids`` of each ``(src, out)`` (``word_pair``) of
    ``pairs``; ``programs`` per buffer (None: one per slot): fewer hold fewer SMs."""
    args = [(s, o, s.shape[1], s.stride(0), o.stride(0)) for s, o in pairs]
    slots = page_ids.shape[0]
    grid0 = slots if programs is None else max(1, min(slots, programs))
    words = max(a[2] for a in args)
    return _copy_launch(_gather_pages_kernel, grid0, (page_ids, slots), args, words)


def _copy_launch(kernel, grid0: int, head: tuple, buffers: list[tuple], words: int):
    """A copy kernel's launch: ``head``, buffer a's then b's arguments (b: a if one)."""
    block = min(4096, triton.next_power_of_2(words))
    args = (*head, *buffers[0], *buffers[-1])
    warps = 8 if block >= 2048 else 4
    return partial(kernel[(grid0, len(buffers))], *args, BLOCK=block, num_warps=warps)


def pull_launch(
    table: torch.Tensor,
    slot_phys: torch.Tensor,
    slots_per_rank: int,
    outs: Sequence[torch.Tensor],
    source_strides: Sequence[int],
    layer: int = 0,
    start: int = 0,
    slots: int | None = None,
) -> Callable[[], None]:
    """The launch filling views ``outs`` (int32 words ``[N * S, W]``) of ``layer`` from
    every owner's pool through ``table`` (``CopyEngineGroup.source_table``), the send
    entries ``slot_phys[start : start + slots]`` (default: all past ``start``)."""
    if table.dim() != 3 or table.shape[1] != 2:
        got = tuple(table.shape)
        raise ValueError(f"table must be int64 [layers, 2, cp_size], got {got}")
    args = [(o, o.shape[1], stride) for o, stride in zip(outs, source_strides)]
    n = slot_phys.shape[0]
    slots = n - start if slots is None else slots
    if start < 0 or slots < 0 or start + slots > n:
        raise ValueError(f"entries [{start}, {start + slots}) past slot_phys ({n})")
    head = (slot_phys, start, slots, slots_per_rank, table, layer, table.shape[2])
    return _copy_launch(_pull_pages_kernel, slots, head, args, max(a[1] for a in args))


def translate_locs_ref(
    page_pos: torch.Tensor, locs: torch.Tensor, page_size: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``page_pos[loc // ps] * ps + loc % ps`` per loc (``out_dtype`` or the locs')."""
    loc = locs.long()
    rows = page_pos[loc // page_size] * page_size + loc % page_size
    return rows.to(out_dtype or locs.dtype)


@triton.jit(do_not_specialize=["n", "ps", "num_pages"])
def _translate_kernel(page_pos, locs, out, n, ps, num_pages, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    loc = tl.load(locs + i, mask=live, other=0).to(tl.int64)
    # As torch indexes: floor division, and negative pages from the end.
    offset = loc % ps
    offset = tl.where(offset < 0, offset + ps, offset)
    page = (loc - offset) // ps
    page = tl.where(page < 0, page + num_pages, page)
    row = tl.load(page_pos + page, mask=live, other=0) * ps + offset
    tl.store(out + i, row.to(out.dtype.element_ty), mask=live)


def translate_locs(
    page_pos: torch.Tensor,
    locs: torch.Tensor,
    page_size: int,
    out_dtype: torch.dtype | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``translate_locs_ref`` in one launch (page ids with ``page_size`` 1)."""
    check_index("locs", locs, locs.dim())
    if locs.device != page_pos.device:  # the kernel takes addresses: one device
        devices = f"locs on {locs.device}, the page map on {page_pos.device}"
        raise ValueError(f"{devices}: translate on one device")
    if not triton_enabled(page_pos.device, use_triton) or locs.numel() == 0:
        return translate_locs_ref(page_pos, locs, page_size, out_dtype)
    flat = locs.contiguous()  # walked as flat memory (SGLang's tables are contiguous)
    out = torch.empty_like(flat, dtype=out_dtype)  # None: the locs' dtype
    n, block = flat.numel(), 1024
    args = (page_pos, flat, out, n, page_size, page_pos.shape[0])
    _translate_kernel[(triton.cdiv(n, block),)](*args, BLOCK=block)
    return out
