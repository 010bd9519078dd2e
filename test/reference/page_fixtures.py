"""Test fixtures over plain tensors: owner-rotating logical pages, page tables, one rank's share of a
sharded pool as the views read it (``page_source.PageBuffers``), written with the pools' masked store
(``PageOwnership.store_rows``), and a batch planned over a page table (``build_slot_plan``) and begun on a
bare ``ViewMaterializer`` (``begin_batch``)."""

from __future__ import annotations

import torch

from reference.kv_formats import index_page_views
from sglang_cp_shared_kv.srt.layers.attention.nsa.debug_checks import check_plan
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer
from sglang_cp_shared_kv.srt.layers.attention.nsa.page_source import PageBuffers
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import PLAN_META_ROWS, BatchPlan, plan_batch
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    batch_kind,
    pages_for_lens,
    plan_meta_rows,
    slots_per_rank,
)
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES, mla_row_bytes
from sglang_cp_shared_kv.srt.mem_cache.placement import TRASH_PAGE, PageOwnership, debug_enabled


class RotatingPages:
    """Logical pages whose owners rotate along a request (page ``i`` of a run on owner ``(first + i) % N``),
    as SGLang's ``PageInterleavePoolAllocator`` hands them out; each owner's physical pages in order from 1
    (page 0 is every rank's trash page, so logical pages ``[0, N)`` are never handed out)."""

    def __init__(self, cp_size: int, phys_pages_per_rank: int | None = None):
        self.cp_size = cp_size
        self.phys_pages_per_rank = phys_pages_per_rank  # the pools' pages per rank, the trash page included
        self._next = [TRASH_PAGE + 1] * cp_size

    def next_owner(self, last_logical_page: int | None) -> int:
        """The owner that continues a request whose last page is ``last_logical_page`` (0 for a new one)."""
        return 0 if last_logical_page is None else (last_logical_page + 1) % self.cp_size

    def alloc(self, n_pages: int, first_owner: int = 0) -> torch.Tensor:
        """``n_pages`` logical pages cycling through owners from ``first_owner`` (past ``phys_pages_per_rank``:
        an ``AssertionError``, the test's pool is too small)."""
        pages = []
        for i in range(n_pages):
            owner = (first_owner + i) % self.cp_size
            pages.append(self._next[owner] * self.cp_size + owner)
            self._next[owner] += 1
            assert self.phys_pages_per_rank is None or self._next[owner] <= self.phys_pages_per_rank, "pool too small"
        return torch.tensor(pages, dtype=torch.int64)


def page_table(pages: list[list[int]], width: int | None = None, pad: int = 0) -> torch.Tensor:
    """int32 ``[B, width]`` page table holding each request's logical pages, ``pad`` after them."""
    width = max((len(p) for p in pages), default=0) if width is None else width
    table = torch.full((len(pages), width), pad, dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, : len(p)] = torch.tensor(list(p), dtype=torch.int32)
    return table


class PagePool(PageBuffers):
    """One rank's page buffers (``PageBuffers``, what the views read) written with the CP-shared pools' masked
    store: every rank writes the whole chunk, owned locs to their physical rows, the others to the trash page.
    With ``ownership.cp_size == 1`` it is a replicated pool indexed by logical loc.

    ``latent[layer]``: uint8 ``[pages * page_size, row_bytes]`` rows; ``index[layer]``: uint8
    ``[pages, page_size * 132]`` indexer pages (K bytes token-major, then the fp32 scales).
    """

    def __init__(
        self,
        ownership: PageOwnership,
        rank: int,
        phys_pages: int,
        layers: int,
        kv_format: str,
        with_indexer: bool = True,
        device: torch.device | str = "cpu",
    ):
        ps, row_bytes = ownership.page_size, mla_row_bytes(kv_format)
        buffers = [torch.zeros(phys_pages, ps * row_bytes, dtype=torch.uint8, device=device) for _ in range(layers)]
        index = None
        if with_indexer:
            index = [
                torch.zeros(phys_pages, ps * INDEX_TOKEN_BYTES, dtype=torch.uint8, device=device) for _ in range(layers)
            ]
        super().__init__(ownership, rank, row_bytes, buffers, index)
        self.phys_pages, self.kv_format = phys_pages, kv_format
        self.latent = [b.view(-1, row_bytes) for b in buffers]

    def store_rows(self, locs: torch.Tensor) -> torch.Tensor:
        return self.ownership.store_rows(locs.long(), self.rank, self.trash_page)[0]

    def set_latent(self, layer: int, locs: torch.Tensor, rows_u8: torch.Tensor) -> None:
        self.latent[layer].index_copy_(0, self.store_rows(locs), rows_u8.to(self.device))

    def set_index(self, layer: int, locs: torch.Tensor, k_u8: torch.Tensor, scale: torch.Tensor) -> None:
        at = self.store_rows(locs)
        k_part, scale_part = index_page_views(self.index[layer], self.page_size)
        k_part[at // self.page_size, at % self.page_size] = k_u8.to(self.device)
        scale_part[at // self.page_size, at % self.page_size] = scale.float().to(self.device)


def pack_index_records(k_u8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``k_u8 [T, 128]`` + ``scale float32 [T]`` -> ``uint8 [T, 132]``: one-token indexer pages (page size 1),
    the current chunk's records as a view's ``layer_view`` takes them."""
    return torch.cat([k_u8, scale.contiguous().view(torch.uint8).view(-1, 4)], dim=1)


def filled_pool(kv_format: str = "fp8", with_indexer: bool = True, page_size: int = 16) -> PagePool:
    """A replicated pool (10 pages, 2 layers) of random latent rows and indexer K + scale."""
    ps = page_size
    pool = PagePool(PageOwnership(1, ps), 0, 10, 2, kv_format, with_indexer=with_indexer)
    g = torch.Generator().manual_seed(3)
    locs = torch.arange(10 * ps)
    for layer in range(2):
        pool.set_latent(layer, locs, torch.randint(0, 256, (len(locs), pool.row_bytes), dtype=torch.uint8, generator=g))
        if with_indexer:
            k = torch.randint(0, 256, (len(locs), 128), dtype=torch.uint8, generator=g)
            pool.set_index(layer, locs, k, torch.rand(len(locs), generator=g))
    return pool


def plan_meta(pages: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``plan_batch``'s ``meta`` (int64 ``[6, B]``) of a batch whose pages are all planned (none staged, no
    hint): it depends on the lengths only, so a CUDA graph captures a plan with it built beforehand."""
    host = torch.tensor(plan_meta_rows(pages), dtype=torch.int64).view(len(PLAN_META_ROWS), -1)
    if torch.device(device).type == "cuda":  # pinned and non-blocking: no host sync
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def build_slot_plan(
    page_table: torch.Tensor,
    pages_per_req: list[int],
    cp_size: int,
    page_size: int,
    trash_page: int,
    pad: int = 0,
    use_triton: bool | None = None,
    meta: torch.Tensor | None = None,
) -> BatchPlan:
    """The plan of every page of a page table (logical page ids, ``[B, max_pages]``, never read back):
    ``plan_batch`` over it as a token table of page size 1, without a page map. ``page_size`` only names
    the pool's (the plan is in pages)."""
    assert page_table.dim() == 2 and page_size >= 1
    batch, max_pages = page_table.shape
    pages = [int(p) for p in pages_per_req]
    meta = plan_meta(pages, page_table.device) if meta is None else meta
    rows = torch.arange(batch, device=page_table.device)
    s = slots_per_rank(pages, cp_size)
    return plan_batch(
        page_table, rows, 1, meta, max_pages, sum(pages), cp_size, s, trash_page, None, 0, 0, pad, use_triton
    )


def begin_batch(
    mat: ViewMaterializer, page_table: torch.Tensor, seq_lens: list[int], prefix_lens: list[int], extra_pages: int = 0
):
    """Start a batch on a bare ``ViewMaterializer`` (no read state) whose view holds every page of every
    request, the current chunk's included: planned here (checked in debug mode, as the read state does),
    fenced, begun, with ``extra_pages`` past the view in every buffer. Returns its counters."""
    plan = build_slot_plan(
        page_table, pages_for_lens(seq_lens, mat.pool.page_size), mat.pool.ownership.cp_size,
        mat.pool.page_size, mat.pool.trash_page, use_triton=mat.use_triton,
    )  # fmt: skip
    if debug_enabled():
        check_plan(plan, mat.pool.trash_page, mat.group)
    counters = mat.begin_planned(plan, batch_kind(prefix_lens), extra_pages)
    mat.fence()
    return counters
