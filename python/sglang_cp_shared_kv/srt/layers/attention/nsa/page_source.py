"""What the view materializer reads from a pool: one rank's per-layer page buffers."""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


class PageBuffers:
    """``buffers[layer]``: uint8 ``[pages, page_size * row_bytes]``; ``index``: the
    same pages' indexer buffers (optional; empty for a layer that skips top-k)."""

    trash_page = 0

    def __init__(
        self,
        ownership: PageOwnership,
        rank: int,
        row_bytes: int,
        buffers: list[torch.Tensor],
        index: list[torch.Tensor] | None = None,
    ):
        layers = len(buffers)
        if index is not None and len(index) != layers:
            raise ValueError(f"index must have one buffer per layer ({layers}), got {len(index)}")
        self.ownership = ownership
        self.rank = rank
        self.page_size = ownership.page_size
        self.row_bytes = row_bytes
        self.buffers = buffers
        self.index = index
        self.with_indexer = index is not None
        self.num_layers = layers
        self.has_index = tuple(index is not None and index[k].shape[0] > 0 for k in range(layers))
        self.device = buffers[0].device

    def latent_pages(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]
