"""The per-batch slot plan of the materialized view: where every page position of a batch lands.

A forward batch reads, for request ``b``, its logical pages ``page_table[b, :pages_b]``. Listed
request-major they are ``M = sum(pages_b)`` page positions. The dense view has ``N * S`` pages,
owner-major, with ``S = sum(ceil(pages_b / N))``::

    slot(b, j) = owner * S + (rank of (b, j) among the batch's positions with the same owner)

Owner ``o``'s block ``[o * S, (o + 1) * S)`` is exactly what rank ``o`` sends in the all-gather.
Balanced allocation spreads each request's pages over owners within one page, so no owner holds
more than ``ceil(pages_b / N)`` of request ``b``'s pages and a block never overflows (debug mode
checks it). A prefix page shared by two requests gets two slots: more bytes, static shapes.

Everything sized by the plan (``M``, ``S``, the view) comes from host-known lengths; the device
work is gathers, a one-hot cumsum and scatters with no host sync, so the plan can be built
ahead of the batch's kernels without stalling them. The plan is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import build_slot_table


def pages_for_lens(seq_lens: Sequence[int], page_size: int) -> list[int]:
    """Pages each request reads: ``ceil(seq_len / page_size)`` (host ints)."""
    return [-(-int(n) // page_size) for n in seq_lens]


def slots_per_rank(pages_per_req: Sequence[int], cp_size: int) -> int:
    """``S = sum(ceil(pages_b / N))``: the size of every owner's block of the view."""
    return sum(-(-int(p) // cp_size) for p in pages_per_req)


def predicted_view_pages(pages_per_req: Sequence[int], cp_size: int) -> int:
    """Pages of the dense view (``N * S``), padding included: what one materialized layer receives."""
    return cp_size * slots_per_rank(pages_per_req, cp_size)


@dataclass(frozen=True)
class SlotPlan:
    """Where each page position of one batch lives in the dense view (identical on every rank).

    Host-side: ``cp_size``, ``page_size``, ``pages_per_req``, ``slots_per_rank`` (``S``),
    ``trash_page``. Device-side:

    - ``positions_flat`` int64 ``[M]``: ``b * max_pages + j`` of each position, request-major;
    - ``logical_pages`` int64 ``[M]``: the page each position reads (from the batch's page table);
    - ``slots`` int64 ``[M]``: the slot of each position;
    - ``slot_table`` int32 ``[B, max_pages]``: the page table the kernels index in the view
      (``pad`` past a request's pages);
    - ``slot_phys`` int64 ``[N * S]``: each slot's physical page on its owner (``trash_page``
      for padding slots); rank ``r`` gathers ``slot_phys[r * S:(r + 1) * S]``.
    """

    cp_size: int
    page_size: int
    pages_per_req: tuple[int, ...]
    slots_per_rank: int
    trash_page: int
    positions_flat: torch.Tensor
    logical_pages: torch.Tensor
    slots: torch.Tensor
    slot_table: torch.Tensor
    slot_phys: torch.Tensor

    @property
    def num_positions(self) -> int:
        return len(self.positions_flat)

    @property
    def view_pages(self) -> int:
        return self.cp_size * self.slots_per_rank

    def send_pages(self, rank: int) -> torch.Tensor:
        """Physical pages rank ``rank`` copies into its send block, in slot order."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank!r}")
        s = self.slots_per_rank
        return self.slot_phys[rank * s : (rank + 1) * s]


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host (pinned staging for CUDA)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_to_device(vectors: Sequence[Sequence[int] | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host-built int64 vectors on ``device``, through one buffer and one non-blocking copy."""
    arrays = [np.asarray(v, dtype=np.int64) for v in vectors]
    both = torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64))
    return list(copy_to_device(both, device).split([len(a) for a in arrays]))


def plan_vectors(pages: Sequence[int], max_pages: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions_flat [M]`` and ``cu_pages [B + 1]`` from host lengths, on ``device``.

    They depend on the batch's lengths only, not on its page ids: a CUDA graph captures the plan
    with them built beforehand (``build_slot_plan(..., vectors=...)``) and replays it on new page
    tables of the same lengths.

    Built with numpy: single-threaded host work of a few microseconds, where torch's CPU ops can
    wake a thread pool for every call.
    """
    counts = np.asarray(list(pages), dtype=np.int64)
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    req = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    flat = req * max_pages + (np.arange(len(req), dtype=np.int64) - cu[req])
    positions_flat, cu_pages = host_to_device([flat, cu], device)
    return positions_flat, cu_pages


def build_slot_plan(
    page_table: torch.Tensor,
    pages_per_req: Sequence[int],
    cp_size: int,
    page_size: int,
    trash_page: int,
    pad: int = 0,
    use_triton: bool | None = None,
    vectors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SlotPlan:
    """Plan the view of one batch from its page table (logical page ids, ``[B, max_pages]``).

    ``pages_per_req`` are host ints (``pages_for_lens(seq_lens_cpu, ps)``); the page table stays
    on its device and is never read back. ``trash_page`` is the pool's padding page.
    ``vectors``: ``plan_vectors(pages_per_req, max_pages, device)`` built ahead (CUDA graphs);
    built here when omitted.
    """
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"page_table must be int32/int64 [B, max_pages], got {page_table.dtype} {tuple(page_table.shape)}"
        )
    batch, max_pages = page_table.shape
    pages = [int(p) for p in pages_per_req]
    if len(pages) != batch:
        raise ValueError(f"pages_per_req must have one entry per request ({batch}), got {len(pages)}")
    if any(p < 0 or p > max_pages for p in pages):
        raise ValueError(f"pages_per_req must lie in [0, {max_pages}] (the page table's width), got {pages}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if not isinstance(trash_page, int) or trash_page < 0:
        raise ValueError(f"trash_page must be an int >= 0, got {trash_page!r}")

    device = page_table.device
    n = cp_size
    s = slots_per_rank(pages, n)
    if vectors is None:
        vectors = plan_vectors(pages, max_pages, device)
    positions_flat, cu_pages = vectors
    if positions_flat.shape != (sum(pages),) or cu_pages.shape != (batch + 1,):
        raise ValueError(f"vectors must be plan_vectors of these lengths ([{sum(pages)}], [{batch + 1}])")

    logical = page_table.reshape(-1).index_select(0, positions_flat).long()
    owner = logical % n
    # Rank of each position among same-owner positions: a cumsum over a one-hot [N, M]. The scan
    # runs along the inner dimension: along the outer one CUDA scans each of the N columns serially.
    one_hot = (torch.arange(n, device=device).unsqueeze(1) == owner.unsqueeze(0)).to(torch.int32)
    rank_in_owner = one_hot.cumsum(1, dtype=torch.int32).gather(0, owner.unsqueeze(0)).squeeze(0).long() - 1
    slots = owner * s + rank_in_owner

    # Each slot's physical page on its owner. An overflowing position (impossible with balanced
    # allocation; debug mode reports it) is sent to a dump entry past the view instead of corrupting it.
    dump = torch.full_like(slots, n * s)
    target = torch.where(rank_in_owner < s, slots, dump)
    slot_phys = torch.full((n * s + 1,), trash_page, dtype=torch.int64, device=device)
    slot_phys.scatter_(0, target, logical // n)

    slot_table = build_slot_table(slots, cu_pages, positions_flat, batch, max_pages, pad=pad, use_triton=use_triton)
    return SlotPlan(
        cp_size=n,
        page_size=page_size,
        pages_per_req=tuple(pages),
        slots_per_rank=s,
        trash_page=trash_page,
        positions_flat=positions_flat,
        logical_pages=logical,
        slots=slots,
        slot_table=slot_table,
        slot_phys=slot_phys[: n * s],
    )
