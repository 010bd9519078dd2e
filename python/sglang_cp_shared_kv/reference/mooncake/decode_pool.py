"""The decode side's KV pool and the destination pages it hands out.

The decode server is not CP: its pool is SGLang's full decode layout (latent rows
token-major, indexer page-major), which is exactly a ``ShardedMLAPool`` built with
``PageOwnership(1, ps)``. Any page may hold any position of a request; the page
table, not the physical order, is what decode attention reads.

That freedom is used to make transfers cheap. Prefill rank ``r`` sends every ``cp_size``-th
position of a request (``p % cp_size`` constant when pages were allocated owner-balanced),
so the destination pages are handed out *owner-striped*: the positions of one residue
class get consecutive pages. With a contiguous source run on the sender too, one
rank's share of a layer becomes a single transfer entry instead of one per page.
It is only an ordering: any page list is correct, striped or not.

Page 0 is the pool's trash page, as in every pool here; a ``cp_size == 1`` pool owns every
loc, so no foreign row is ever stored there, and the decode allocator lends it like any page.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership
from sglang_cp_shared_kv.srt.utils import check_int


def make_decode_pool(
    page_size: int,
    num_pages: int,
    num_layers: int,
    kv_format: str = "fp8",
    with_indexer: bool = True,
    device: torch.device | str = "cpu",
) -> ShardedMLAPool:
    """A full (unsharded) pool of ``num_pages`` pages in SGLang's decode byte layout."""
    return ShardedMLAPool(PageOwnership(1, page_size), 0, num_pages, num_layers, kv_format, with_indexer, device)


def owner_striped(pages: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Reorder ``pages`` so the positions ``p`` with one ``p % cp_size`` get ascending consecutive pages.

    ``cp_size``: the number of prefill CP ranks sending the request.
    """
    check_int("cp_size", cp_size, 1)
    n_pages = pages.shape[0]
    positions = torch.arange(n_pages, dtype=torch.int64)
    order = torch.argsort((positions % cp_size) * n_pages + positions)
    out = torch.empty_like(pages)
    out[order] = pages.sort().values
    return out


class DecodePageAllocator:
    """Lowest-page-first allocator over the decode pool's pages (keeps free runs long)."""

    def __init__(self, num_pages: int):
        check_int("num_pages", num_pages, 1)
        self.num_pages = num_pages
        self._free = np.ones(num_pages, dtype=bool)

    @property
    def free_pages(self) -> int:
        return int(self._free.sum())

    def alloc(self, n_pages: int, cp_size: int = 1) -> torch.Tensor | None:
        """``n_pages`` pages, owner-striped for ``cp_size`` senders; ``None`` (and nothing taken) if short."""
        check_int("n_pages", n_pages, 0)
        free = np.nonzero(self._free)[0]
        if free.shape[0] < n_pages:
            return None
        take = free[:n_pages]
        self._free[take] = False
        return owner_striped(torch.from_numpy(take.astype(np.int64)), cp_size)

    def free(self, pages: torch.Tensor | list[int]) -> None:
        """Return pages; rejects out-of-range, repeated or not-allocated pages before freeing any."""
        idx = np.asarray(pages.tolist() if isinstance(pages, torch.Tensor) else pages, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_pages):
            raise ValueError(f"pages holds a page outside [0, {self.num_pages})")
        if np.unique(idx).shape[0] != idx.shape[0]:
            raise ValueError("pages holds a page twice")
        if self._free[idx].any():
            raise ValueError(f"pages holds page {int(idx[self._free[idx]][0])}, which is not allocated")
        self._free[idx] = True
