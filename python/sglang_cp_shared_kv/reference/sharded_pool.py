"""One CP rank's share of the MLA latent + NSA indexer KV pool.

Per layer, this rank stores only the logical pages it owns, at their physical
rows (see ``placement.PageOwnership``); physical page 0 is the trash page, as in
SGLang's pools (``phys_pages`` counts it):

- ``latent[layer]``: ``uint8 [phys_pages * ps, row_bytes]`` (656 B fp8 or 1152 B bf16 rows);
- ``index[layer]``: ``uint8 [phys_pages, ps * 132]`` page-major (``ps * 128``
  fp8 K bytes token-major, then ``ps`` fp32 scales: ``kv_formats.index_page_views``).

Writes take the whole current chunk, as every rank holds it after the CP
all-gather, and store only the owned rows: rows of other owners are redirected
into the trash page, so the store has a static shape and never syncs. The
allocator (``balanced_allocator``) never hands out logical pages ``[0, cp_size)``,
so no owned row lands on the trash page.

A replicated (unsharded) pool is the ``cp_size == 1`` case of the same class.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.srt.mem_cache.kv_formats import (
    INDEX_HEAD_DIM,
    INDEX_TOKEN_BYTES,
    index_page_views,
    mla_row_bytes,
)
from sglang_cp_shared_kv.srt.mem_cache.placement import CPSharedSpec, PageOwnership
from sglang_cp_shared_kv.srt.utils import check_int


class ShardedMLAPool:
    """MLA latent rows (and, with ``with_indexer``, NSA indexer K + scale) for one rank.

    ``rank`` is this rank's CP rank and ``phys_pages`` its page count, trash page 0 included;
    both go into ``spec`` (a ``CPSharedSpec``), built once here.
    """

    def __init__(
        self,
        ownership: PageOwnership,
        rank: int,
        phys_pages: int,
        num_layers: int,
        kv_format: str = "fp8",
        with_indexer: bool = True,
        device: torch.device | str = "cpu",
    ):
        check_int("num_layers", num_layers, 1)
        self.spec = spec = CPSharedSpec(
            cp_size=ownership.cp_size,
            cp_rank=rank,
            page_size=ownership.page_size,
            phys_pages=phys_pages,
            row_bytes=mla_row_bytes(kv_format),
            with_indexer=with_indexer,
        )
        self.ownership = ownership
        self.page_size = ps = spec.page_size
        self.phys_pages = spec.phys_pages
        self.num_layers = num_layers
        self.kv_format = kv_format
        self.row_bytes = spec.row_bytes
        self.with_indexer = spec.with_indexer
        self.device = torch.device(device)
        self.trash_page = spec.trash_page
        self.latent = [
            torch.zeros(phys_pages * ps, self.row_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(num_layers)
        ]
        self.index = (
            [
                torch.zeros(phys_pages, ps * INDEX_TOKEN_BYTES, dtype=torch.uint8, device=self.device)
                for _ in range(num_layers)
            ]
            if with_indexer
            else []
        )

    @property
    def cp_rank(self) -> int:
        return self.spec.cp_rank

    @property
    def rank(self) -> int:
        """``cp_rank``, under the name ``PageSource`` readers use."""
        return self.spec.cp_rank

    # -- byte accounting --
    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes one page occupies in one layer (latent + indexer)."""
        return self.page_size * (self.row_bytes + (INDEX_TOKEN_BYTES if self.with_indexer else 0))

    @property
    def page_bytes(self) -> int:
        return self.page_bytes_per_layer * self.num_layers

    def bytes_for_pages(self, n_pages: int) -> int:
        return n_pages * self.page_bytes

    @property
    def allocated_bytes(self) -> int:
        """Device bytes this rank's buffers hold, trash pages included."""
        return self.phys_pages * self.page_bytes

    # -- views the read path and the transfer use --
    def latent_pages(self, layer: int) -> torch.Tensor:
        """``latent[layer]`` as ``[phys_pages, ps * row_bytes]`` (a view)."""
        return self.latent[layer].view(self.phys_pages, self.page_size * self.row_bytes)

    def index_k_view(self, layer: int) -> torch.Tensor:
        """``[phys_pages, ps, 128]`` uint8 view of the fp8 K part."""
        return index_page_views(self.index[layer], self.page_size)[0]

    def index_scale_view(self, layer: int) -> torch.Tensor:
        """``[phys_pages, ps]`` float32 view of the scale part."""
        return index_page_views(self.index[layer], self.page_size)[1]

    # -- write path --
    def store_rows(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical row for every loc: its row if owned here, else a row of the trash page.

        Debug mode checks the rows (``PageOwnership.check_store_rows``).
        """
        spec = self.spec
        return self.ownership.store_rows(locs, spec.cp_rank, spec.trash_page, spec.phys_pages)[0]

    def set_latent(self, layer: int, locs: torch.Tensor, rows_u8: torch.Tensor) -> None:
        """Store the owned rows of ``rows_u8 [T, row_bytes]`` (uint8) for ``locs [T]``."""
        if rows_u8.dtype != torch.uint8 or rows_u8.shape != (locs.shape[0], self.row_bytes):
            raise ValueError(
                f"rows_u8 must be uint8 [{locs.shape[0]}, {self.row_bytes}], got {rows_u8.dtype} {tuple(rows_u8.shape)}"
            )
        self.latent[layer].index_copy_(0, self.store_rows(locs), rows_u8)

    def set_index(self, layer: int, locs: torch.Tensor, k_u8: torch.Tensor, scale: torch.Tensor) -> None:
        """Store the owned indexer K (``uint8 [T, 128]``) and scales (``float32 [T]``)."""
        if not self.with_indexer:
            raise ValueError("set_index called on a pool built with with_indexer=False")
        if k_u8.dtype != torch.uint8 or k_u8.shape != (locs.shape[0], INDEX_HEAD_DIM):
            raise ValueError(
                f"k_u8 must be uint8 [{locs.shape[0]}, {INDEX_HEAD_DIM}], got {k_u8.dtype} {tuple(k_u8.shape)}"
            )
        if scale.dtype != torch.float32 or scale.shape != (locs.shape[0],):
            raise ValueError(f"scale must be float32 [{locs.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
        rows = self.store_rows(locs)
        page, offset = rows // self.page_size, rows & (self.page_size - 1)
        self.index_k_view(layer)[page, offset] = k_u8
        self.index_scale_view(layer)[page, offset] = scale

    # -- read helpers (tests, transfer) --
    def get_latent_rows(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """Rows of owned ``locs`` (the caller guarantees ownership)."""
        return self.latent[layer][self.ownership.phys_row(locs)]

    def get_index(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.ownership.phys_row(locs)
        page, offset = rows // self.page_size, rows & (self.page_size - 1)
        return self.index_k_view(layer)[page, offset], self.index_scale_view(layer)[page, offset]
