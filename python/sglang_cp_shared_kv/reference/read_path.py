"""The standalone stack's read path: current-reuse through a compact table, else the materialized view.

Per batch it picks the kind from host lengths (``current_reuse.batch_kind``), as SGLang's wired
``read_state`` does: a batch in which no request has a prefix reads the chunk it just computed
through a compact table (``req_token_start[b] + position``, page size 1) and moves nothing; any
other batch goes to ``ViewMaterializer``. The SGLang path stages the current chunk page-aligned
instead of using the compact table.

View arena (``attach_arena``, optional, once before the first batch): as the wired path's
``BatchReadState.attach_arena``, one latent and one indexer buffer of ``prefix + chunk tokens +
one page`` (sizes from ``mem_cache.view_arena_size.arena_regions``); every materialized batch's
views are their leading pages (``ViewMaterializer(arena=...)``), and a batch past it raises
``ViewArenaError`` before anything is written. The standalone scheduler has no admission against
the arena (SGLang's has): a caller sizes it for its stream. With ``stage_current`` the buffer is
the wired path's ``[prefix view | current pages]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.current_reuse import batch_kind
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import (
    BatchCounters,
    LayerView,
    ViewMaterializer,
    allocate_arena,
    check_current_chunk,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.page_source import PageSource
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    SlotPlan,
    copy_to_device,
    pages_for_lens,
    slots_per_rank,
)
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES


def compact_row_table(extend_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 ``[B, max_len]``: row ``req_token_start[b] + j`` of position ``j`` (0 past the request).

    Built on the host from host-known lengths and copied without blocking.
    """
    host_lens = [int(n) for n in extend_lens]
    if any(n < 0 for n in host_lens):
        raise ValueError(f"extend_lens must be >= 0, got {host_lens}")
    lens = np.asarray(host_lens, dtype=np.int64)
    cols = np.arange(lens.max(initial=0), dtype=np.int64)
    starts = np.cumsum(lens) - lens
    table = torch.from_numpy(np.where(cols < lens[:, None], starts[:, None] + cols, 0).astype(np.int32))
    return copy_to_device(table, torch.device(device))


def staged_view_pages(seq_lens: Sequence[int], prefix_lens: Sequence[int], cp_size: int, page_size: int) -> int:
    """Pages of a ``stage_current`` batch's read buffer, from host lengths: the view of the prefixes,
    ``N * sum_b ceil(ceil(prefix_b / ps) / N)``, and the current pages staged past it (what an arena must hold)."""
    prefix_pages = pages_for_lens(prefix_lens, page_size)
    staged = sum(pages_for_lens(seq_lens, page_size)) - sum(prefix_pages)
    return cp_size * slots_per_rank(prefix_pages, cp_size) + staged


def pack_index_records(k_u8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``k_u8 [T, 128]`` + ``scale float32 [T]`` -> ``uint8 [T, 132]``: one-token indexer pages (page size 1)."""
    if k_u8.dtype != torch.uint8 or k_u8.dim() != 2 or k_u8.shape[1] != INDEX_TOKEN_BYTES - 4:
        raise ValueError(f"k_u8 must be uint8 [T, {INDEX_TOKEN_BYTES - 4}], got {k_u8.dtype} {tuple(k_u8.shape)}")
    if scale.dtype != torch.float32 or scale.shape != (k_u8.shape[0],):
        raise ValueError(f"scale must be float32 [{k_u8.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    return torch.cat([k_u8, scale.contiguous().view(torch.uint8).view(-1, 4)], dim=1)


def pool_view(pool, layer: int, page_table: torch.Tensor, use_triton: bool | None = None) -> LayerView:
    """The view of a replicated pool (CP size 1): its buffers as they are, the logical page table as it is."""
    if pool.ownership.cp_size != 1:
        raise ValueError(f"pool_view needs a replicated pool (cp_size 1), got {pool.ownership}")
    index = pool.index[layer] if pool.with_indexer else None
    return LayerView(pool.latent[layer], index, page_table, pool.page_size, use_triton)


class ReadPath:
    """Per batch, current-reuse (``current_reuse=True`` and no request has a prefix) or a materialized view.

    Arguments other than ``current_reuse`` go to ``ViewMaterializer``; ``plan`` and ``counters``
    are the batch's (``plan`` is ``None`` under current-reuse). ``stage_current=True`` stages the
    current chunk (the rows ``layer_view`` receives) past a view of the prefix pages only, as the
    SGLang path does; off by default, where history and mixed views cover whole sequences.
    """

    def __init__(self, pool: PageSource, group: CPGroup | None = None, *, current_reuse: bool = True, **kwargs):
        self.materializer = ViewMaterializer(pool, group, **kwargs)
        self.pool = pool
        self.current_reuse = current_reuse
        self.counters: BatchCounters | None = None
        self._compact_table: torch.Tensor | None = None
        self._num_tokens = 0
        self.arena: dict[str, torch.Tensor] | None = None

    def attach_arena(self, prefix_tokens: int, chunk_tokens: int) -> int:
        """Allocate the view arena once (``materialize.allocate_arena``: ``prefix_tokens + chunk_tokens +
        page_size`` token rows of latent and indexer bytes, a second chunk and page when prefetching; the
        wired path's ``attach_arena``; ``arena_regions`` gives the sizes). Returns its bytes. Call before
        the first batch."""
        if self.counters is not None or self.arena is not None:
            raise RuntimeError("attach the view arena once, before the first batch")
        pool = self.pool
        arena = allocate_arena(
            prefix_tokens,
            chunk_tokens,
            pool.page_size,
            pool.row_bytes,
            pool.with_indexer,
            pool.device,
            self.materializer.prefetch,
        )
        self.arena = self.materializer.arena = arena
        # As the wired path: no pipeline chunks, whose padding would outgrow the arena's prefix bound.
        self.materializer.pipeline_chunk_tokens = 0
        return sum(t.numel() for t in arena.values())

    @property
    def reusing_current(self) -> bool:
        """Whether the batch in progress reads its current chunk instead of a materialized view."""
        return self._compact_table is not None

    @property
    def plan(self) -> SlotPlan | None:
        return None if self.reusing_current else self.materializer.plan

    def begin_batch(
        self, page_table: torch.Tensor, seq_lens: Sequence[int], prefix_lens: Sequence[int]
    ) -> BatchCounters:
        """As ``ViewMaterializer.begin_batch``; a current-only batch plans nothing."""
        if self.current_reuse and len(seq_lens) == len(prefix_lens) and batch_kind(prefix_lens) == "current":
            if len(seq_lens) != page_table.shape[0]:
                raise ValueError(
                    f"seq_lens ({len(seq_lens)}), prefix_lens ({len(prefix_lens)}) and page_table rows "
                    f"({page_table.shape[0]}) must agree"
                )
            self.materializer.plan = None
            self._num_tokens = sum(int(n) for n in seq_lens)
            self._compact_table = compact_row_table(seq_lens, page_table.device)
            self.counters = BatchCounters(kind="current")
            return self.counters
        self._compact_table = None
        self.counters = self.materializer.begin_batch(page_table, seq_lens, prefix_lens)
        return self.counters

    def layer_view(
        self,
        layer: int,
        current_kv_rows: torch.Tensor | None = None,
        current_index_records: torch.Tensor | None = None,
    ) -> LayerView:
        """As ``ViewMaterializer.layer_view``; under current-reuse the view is the current chunk itself."""
        if self._compact_table is None:
            return self.materializer.layer_view(layer, current_kv_rows, current_index_records)
        pool = self.pool
        if not 0 <= layer < pool.num_layers:
            raise ValueError(f"layer must be in [0, {pool.num_layers}), got {layer!r}")
        check_current_chunk(current_kv_rows, current_index_records, self._num_tokens, pool.row_bytes, pool.with_indexer)
        self.counters.layers += 1
        self.counters.current_reuse_hits += 1
        index = current_index_records if pool.with_indexer else None
        return LayerView(current_kv_rows, index, self._compact_table, 1, self.materializer.use_triton)
