"""What the view materializer reads from a pool: page-major per-layer buffers and their layout.

SGLang's wired pools implement it (``layers.attention.nsa.read_state.PageBuffers``, one for the latent
rows and one for the indexer pages); ``materialize`` imports no pool class.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


class PageSource(Protocol):
    """One rank's share of a sharded pool, as ``ViewMaterializer`` reads it.

    - ``ownership``: which rank owns which logical page; ``rank``: this rank.
    - ``latent_pages(layer)``: uint8 ``[pages, page_size * row_bytes]``, this rank's physical pages.
    - ``index[layer]`` (only with ``with_indexer``): uint8 ``[pages, page_size * 132]``, the same pages'
      indexer K + scale; ``has_index[layer]``: whether that buffer holds pages (a layer that skips top-k
      has none).
    - ``trash_page``: the physical page padding slots read.
    - ``page_bytes_per_layer``: bytes of one page in one layer, latent and indexer together.
    """

    ownership: PageOwnership
    rank: int
    page_size: int
    row_bytes: int
    num_layers: int
    device: torch.device
    trash_page: int
    with_indexer: bool
    has_index: tuple[bool, ...]
    page_bytes_per_layer: int

    def latent_pages(self, layer: int) -> torch.Tensor: ...
