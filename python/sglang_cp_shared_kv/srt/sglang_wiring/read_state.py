"""Per-batch read state of a sharded SGLang pool: what its page table and buffers mean this batch.

SGLang's attention backends (the DSA backend and its indexer, FA3 for plain MLA) read a
"kv-shard pool" through one contract: once per extend batch ``begin_shard_extend``, then
``translate_loc_to_scratch(locs)`` maps the batch's logical token locs to rows of the buffer
that ``get_key_buffer(layer)`` (and the indexer's page reads) return. This module decides, per
batch, what that buffer is:

- **current-reuse** (no request reads a prefix): the chunk being computed is every key the
  batch can see, and every rank already holds all of it (prefill CP all-gathers it before the
  pool write). The write path stages it page-aligned into a local buffer as it stores its owned
  rows; the translation points at that buffer. Nothing is gathered or all-gathered.
- **materialized** (any prefix, including mixed batches): the batch's pages are planned
  (``slot_plan``) and, per layer, gathered from their owners and all-gathered
  (``materialize.ViewMaterializer``) into a dense owner-major view; the translation maps each
  logical page to one of its slots. Latent rows and indexer pages are materialized separately,
  because a DSA layer reads its indexer keys before it writes its latent rows.

Sizes come from host lengths; nothing reads device data back (debug mode aside). A materialized
batch whose pages do not rotate owners reads the trash page past an owner's block, and its plan
raises a device flag; ``begin`` and ``end`` (the next batch, or SGLang's end of the extend
batches) raise ``SlotOverflowError`` naming the batch's requests once that flag is on the host,
without waiting for it (``slot_plan.OverflowCheck``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.current_reuse import batch_kind
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import BatchCounters, ViewMaterializer
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import pages_for_lens, plan_vectors
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership, debug_enabled


class PageBuffers:
    """One kind of page-major per-layer buffers of a pool, shaped as ``ViewMaterializer`` reads a pool.

    ``buffers[layer]`` is a uint8 ``[pages, page_size * row_bytes]`` view of the pool's storage;
    padding slots read page 0, the pool's reserved page.
    """

    with_indexer = False
    trash_page = 0

    def __init__(self, ownership: PageOwnership, rank: int, row_bytes: int, buffers: list[torch.Tensor]):
        self.ownership = ownership
        self.rank = rank
        self.page_size = ownership.page_size
        self.row_bytes = row_bytes
        self.buffers = buffers
        self.num_layers = len(buffers)
        self.device = buffers[0].device
        self.page_bytes_per_layer = self.page_size * row_bytes

    def latent_pages(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]


class BatchReadState:
    """The read side of one sharded pool for the extend batch in progress."""

    def __init__(
        self,
        ownership: PageOwnership,
        rank: int,
        logical_pages: int,
        latent: PageBuffers,
        index: PageBuffers | None,
        group: CPGroup | Callable[[], CPGroup] | None,
    ):
        self.ownership = ownership
        self.page_size = ownership.page_size
        self.latent = latent
        self.index = index
        self.group = group
        # Built at the first materialized batch: a pool with no group (a single-process test of
        # the write path) can still serve current-reuse batches.
        self.latent_views: ViewMaterializer | None = None
        self.index_views: ViewMaterializer | None = None
        self.device = latent.device
        # Per batch: the page of the read buffer each logical page maps to.
        self.page_pos = torch.zeros(logical_pages, dtype=torch.int64, device=self.device)
        self.mode: str | None = None  # None (no extend in flight), "current" or "materialized"
        self.counters: BatchCounters | None = None
        self.stage_latent: torch.Tensor | None = None
        self.stage_index: torch.Tensor | None = None
        self._layer_cache: dict[tuple[str, int], torch.Tensor] = {}
        # Names of the next batch's requests (SGLang's rids, set by ``pool_hooks``), for errors.
        self.request_ids: Sequence[str] | None = None

    def check_overflow(self, wait: bool = False) -> None:
        """Raise ``SlotOverflowError`` for an earlier batch whose overflow flag is on the host."""
        if self.latent_views is not None:
            self.latent_views.check_overflow(wait=wait)

    # -- batch lifecycle --
    def begin(
        self,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        prefix_lens: Sequence[int],
        seq_lens: Sequence[int],
    ) -> BatchCounters:
        prefix_lens = [int(p) for p in prefix_lens]
        seq_lens = [int(n) for n in seq_lens]
        ps = self.page_size
        if len(prefix_lens) != len(seq_lens) or len(seq_lens) != req_pool_indices.shape[0]:
            raise ValueError(
                f"prefix_lens ({len(prefix_lens)}), seq_lens ({len(seq_lens)}) and req_pool_indices "
                f"({req_pool_indices.shape[0]}) must agree"
            )
        if any(p % ps for p in prefix_lens):
            raise ValueError(f"prefix_lens must be page-aligned (page size {ps}), got {prefix_lens}")
        self.check_overflow()
        max_len = max(seq_lens, default=0)
        # The batch's logical pages by position: every page's first token loc // ps.
        page_table = req_to_token[req_pool_indices.long(), :max_len:ps].long() // ps
        self._layer_cache.clear()
        if batch_kind(prefix_lens) == "current":
            self._begin_current(page_table, seq_lens)
        else:
            self._begin_materialized(page_table, seq_lens, prefix_lens)
        if debug_enabled():
            self._check_translation(page_table, seq_lens)
        return self.counters

    def _begin_current(self, page_table: torch.Tensor, seq_lens: list[int]) -> None:
        pages = pages_for_lens(seq_lens, self.page_size)
        total = sum(pages)
        positions, _ = plan_vectors(pages, page_table.shape[1], self.device)  # built on the device
        logical = page_table.reshape(-1).index_select(0, positions)
        # Staged pages follow the batch's positions from page 1; anything unplanned lands on page 0,
        # which SGLang's row writers treat as the reserved padding slot (they skip row 0).
        self.page_pos.zero_()
        self.page_pos[logical] = torch.arange(1, total + 1, dtype=torch.int64, device=self.device)
        ps = self.page_size
        self.stage_latent = torch.empty(
            ((total + 1) * ps, self.latent.row_bytes), dtype=torch.uint8, device=self.device
        )
        self.stage_index = (
            torch.empty((total + 1, ps * self.index.row_bytes), dtype=torch.uint8, device=self.device)
            if self.index is not None
            else None
        )
        self.counters = BatchCounters(kind="current")
        self.mode = "current"

    def _begin_materialized(self, page_table: torch.Tensor, seq_lens: list[int], prefix_lens: list[int]) -> None:
        if self.latent_views is None:
            if callable(self.group):
                self.group = self.group()
            self.latent_views = ViewMaterializer(self.latent, self.group)
            if self.index is not None:
                self.index_views = ViewMaterializer(self.index, self.group)
        self.counters = self.latent_views.begin_batch(page_table, seq_lens, prefix_lens, request_ids=self.request_ids)
        plan = self.latent_views.plan
        if self.index_views is not None:
            # Same pages, same trash page: one plan serves both views.
            self.index_views.begin_batch(page_table, seq_lens, prefix_lens, plan=plan)
        # A page read by two requests has two slots holding the same bytes; either serves.
        self.page_pos.zero_()
        self.page_pos[plan.logical_pages] = plan.slots
        self.stage_latent = self.stage_index = None
        self.mode = "materialized"

    def end(self) -> None:
        self.mode = None
        self.stage_latent = self.stage_index = None
        self._layer_cache.clear()
        self.check_overflow()

    # -- translation --
    def translate(self, locs: torch.Tensor) -> torch.Tensor:
        """Logical token locs -> rows of this batch's read buffer (same dtype and shape)."""
        ps = self.page_size
        locs64 = locs.long()
        rows = self.page_pos[locs64 // ps] * ps + (locs64 & (ps - 1))
        return rows.to(locs.dtype)

    def translate_pages(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """Logical page ids -> pages of this batch's read buffer."""
        return self.page_pos[logical_pages.long()].to(logical_pages.dtype)

    def _check_translation(self, page_table: torch.Tensor, seq_lens: list[int]) -> None:
        """Debug: every position of every request maps inside the read buffer."""
        if self.mode == "current":
            low, limit = 1, self.stage_latent.shape[0] // self.page_size
        else:
            low, limit = 0, self.latent_views.plan.view_pages
        for b, p in enumerate(pages_for_lens(seq_lens, self.page_size)):
            mapped = self.page_pos[page_table[b, :p]]
            if p and bool((mapped >= limit).any() | (mapped < low).any()):
                raise AssertionError(f"request {b}: a page maps outside the read buffer ({limit} pages)")

    # -- buffers the kernels read --
    def latent_rows(self, layer: int) -> torch.Tensor:
        """uint8 ``[rows, row_bytes]``: the latent rows ``translate`` points into, for local ``layer``."""
        if self.mode == "current":
            return self.stage_latent
        key = ("latent", layer)
        if key not in self._layer_cache:
            self._layer_cache[key] = self.latent_views.layer_view(layer).kv_rows
        return self._layer_cache[key]

    def index_pages(self, layer: int) -> torch.Tensor:
        """uint8 ``[pages, ps * 132]``: the indexer pages ``translate_pages`` points into."""
        if self.index is None:
            raise ValueError("this pool has no indexer")
        if self.mode == "current":
            return self.stage_index
        key = ("index", layer)
        if key not in self._layer_cache:
            rows = self.index_views.layer_view(layer).kv_rows
            self._layer_cache[key] = rows.view(-1, self.page_size * self.index.row_bytes)
        return self._layer_cache[key]
