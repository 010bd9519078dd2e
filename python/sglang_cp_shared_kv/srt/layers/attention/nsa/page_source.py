"""What the view materializer reads from a pool: one rank's page-major per-layer buffers and their layout."""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


class PageBuffers:
    """Page-major per-layer buffers of a pool: ``buffers[layer]`` uint8 ``[pages, page_size * row_bytes]``;
    ``index`` (optional) the same pages' indexer buffers (empty for a layer that skips top-k)."""

    trash_page = 0

    def __init__(
        self,
        ownership: PageOwnership,
        rank: int,
        row_bytes: int,
        buffers: list[torch.Tensor],
        index: list[torch.Tensor] | None = None,
    ):
        self.ownership = ownership
        self.rank = rank
        self.page_size = ownership.page_size
        self.row_bytes = row_bytes
        self.buffers = buffers
        self.index = index
        self.with_indexer = index is not None
        if index is not None and len(index) != len(buffers):
            raise ValueError(f"index must have one buffer per layer ({len(buffers)}), got {len(index)}")
        self.num_layers = len(buffers)
        # Per layer, whether it holds indexer pages (empty for a layer that skips top-k): read once (host time).
        self.has_index = tuple(index is not None and index[k].shape[0] > 0 for k in range(self.num_layers))
        self.device = buffers[0].device

    def latent_pages(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]
