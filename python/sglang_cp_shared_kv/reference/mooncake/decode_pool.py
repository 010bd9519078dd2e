"""The decode side's KV pool and the destination pages it hands out.

The decode server is not CP: its pool is SGLang's full decode layout (latent rows
token-major, indexer page-major), which is exactly a ``ShardedMLAPool`` built with
``PageOwnership(1, ps)``. Any page may hold any position of a request; the page
table, not the physical order, is what decode attention reads.

That freedom is used to make transfers cheap. Prefill rank ``r`` sends every N-th
position of a request (``p % N`` constant when pages were allocated owner-balanced),
so the destination pages are handed out *owner-striped*: the positions of one residue
class get consecutive pages. With a contiguous source run on the sender too, one
rank's share of a layer becomes a single transfer entry instead of one per page.
It is only an ordering: any page list is correct, striped or not.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


def make_decode_pool(
    page_size: int,
    num_pages: int,
    num_layers: int,
    kv_format: str = "fp8",
    with_indexer: bool = True,
    device: torch.device | str = "cpu",
) -> ShardedMLAPool:
    """A full (unsharded) pool in SGLang's decode byte layout, plus its trash page."""
    return ShardedMLAPool(PageOwnership(1, page_size), 0, num_pages, num_layers, kv_format, with_indexer, device)


def owner_striped(pages: torch.Tensor, n_senders: int) -> torch.Tensor:
    """Reorder ``pages`` so the positions ``p`` with one ``p % n_senders`` get ascending consecutive pages."""
    if not isinstance(n_senders, int) or n_senders < 1:
        raise ValueError(f"n_senders must be an int >= 1, got {n_senders!r}")
    n = pages.shape[0]
    positions = torch.arange(n, dtype=torch.int64)
    order = torch.argsort((positions % n_senders) * n + positions)
    out = torch.empty_like(pages)
    out[order] = pages.sort().values
    return out


class DecodePageAllocator:
    """Lowest-page-first allocator over the decode pool's pages (keeps free runs long)."""

    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self._free = np.ones(num_pages, dtype=bool)

    @property
    def free_pages(self) -> int:
        return int(self._free.sum())

    def alloc(self, n_pages: int, n_senders: int = 1) -> torch.Tensor | None:
        """``n_pages`` pages, owner-striped for ``n_senders``; ``None`` (and nothing taken) if short."""
        if not isinstance(n_pages, int) or n_pages < 0:
            raise ValueError(f"n_pages must be an int >= 0, got {n_pages!r}")
        free = np.nonzero(self._free)[0]
        if free.shape[0] < n_pages:
            return None
        take = free[:n_pages]
        self._free[take] = False
        return owner_striped(torch.from_numpy(take.astype(np.int64)), n_senders)

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
