"""Per-batch materialized read path over a sharded MLA/NSA pool.

SGLang's indexer and MLA kernels index a page table into one dense buffer. This module builds one per layer
from the batch's plan (``plan_kernels.BatchPlan``: ``N * S`` pages, owner-major): this rank copies its owned
pages in slot order into its part of the view and the CP group all-gathers the parts in place; or, over a
copy-engine group that mapped the peers' pools, one launch reads every owner's block from its pool.

``prefetch=True`` also builds layer ``l + 1``'s view while layer ``l`` computes: the view holds prefix
pages only, in the pool before the batch starts, so it equals one gathered in line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import prepare_gather, pull_launch, word_view
from sglang_cp_shared_kv.srt.layers.attention.nsa.page_source import PageBuffers
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import BatchPlan
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.utils import check_int


@dataclass
class BatchCounters:
    """What one forward batch cost this rank's read path, summed over the layers it served (``S``: the
    plan's ``slots_per_rank``)."""

    kind: str  # ``current_reuse.batch_kind``
    layers: int = 0  # layer views served
    view_pages: int = 0  # N * S (0 under current-reuse)
    pages_gathered: int = 0  # S per materialized layer, padding included (latent and indexer page count once)
    bytes_materialized: int = 0  # N * S * ps * (row_bytes + 132) per layer (row_bytes alone without an indexer)
    bytes_received: int = 0  # the part of bytes_materialized from other ranks, (N - 1) / N of it
    pages_staged: int = 0  # current-chunk pages staged locally next to the view (not gathered)


# The side stream's default priority, the device's highest (torch clamps it to its range).
HIGHEST_STREAM_PRIORITY = -(1 << 10)
# Where a prefetched layer's own-page gather runs: on the compute stream, the side stream only transferring
# ("compute": no SM work of the view beside the layer's kernels), or on the side stream.
PREFETCH_GATHER_PLACES = ("compute", "side")


@dataclass(eq=False, slots=True)
class LayerView:
    """What the indexer and MLA kernels read for one layer: ``kv_rows`` uint8 ``[R, row_bytes]``; ``index_pages``
    uint8 ``[P, page_size * 132]`` (None: no indexer pages); ``page_table`` int32 ``[B, max_pages]`` into both
    (the plan's slot table)."""

    kv_rows: torch.Tensor
    index_pages: torch.Tensor | None
    page_table: torch.Tensor


class ViewArenaError(RuntimeError):
    """A batch's read buffer would not fit the view arena (admission let through a batch too large)."""


def arena_pages(
    arena: dict[str, torch.Tensor] | None, key: str, pages: int, width: int, device, part: int = 0
) -> torch.Tensor:
    """View set ``part`` of ``pages`` pages of ``arena[key]`` (uint8 ``[P, width]``), or ``ViewArenaError`` if
    even one set does not fit; without an arena, a new buffer."""
    if arena is None:
        return torch.empty((pages, width), dtype=torch.uint8, device=device)
    buf = arena.get(key)
    if buf is None or buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != width:
        got = None if buf is None else f"{buf.dtype} {tuple(buf.shape)}"
        raise ValueError(f"arena[{key!r}] must be uint8 [pages, {width}], got {got}")
    check_arena_fits(arena, pages)
    if (part + 1) * pages > buf.shape[0]:
        raise ValueError(f"view set {part} of {pages} pages lies past the arena's {buf.shape[0]}")
    return buf[part * pages : (part + 1) * pages]


def check_arena_fits(arena: dict[str, torch.Tensor], pages: int) -> None:
    """``ViewArenaError`` unless every buffer of ``arena`` holds a read buffer of ``pages`` pages (host sizes)."""
    have = min(buf.shape[0] for buf in arena.values())
    if pages > have:
        raise ViewArenaError(
            f"--enable-cp-shared-kv: this batch's read buffer needs {pages} pages, more than the view arena's "
            f"{have}: the batch was admitted past the arena (SGLang's scratch admission is bypassed or "
            "sized for another arena); nothing was allocated or written"
        )


def arena_tokens(prefix_tokens: int, chunk_tokens: int, page_size: int, prefetch: bool = False) -> int:
    """Token rows of a view arena: one batch's read buffer at its largest (``prefix_tokens`` of view,
    ``chunk_tokens`` staged, a trash page), plus, for a prefetching reader, a second chunk and trash page."""
    return prefix_tokens + (2 if prefetch else 1) * (chunk_tokens + page_size)


def allocate_arena(
    prefix_tokens: int,
    chunk_tokens: int,
    page_size: int,
    row_bytes: int,
    with_indexer: bool,
    device,
    prefetch: bool = False,
) -> dict[str, torch.Tensor]:
    """A view arena of ``arena_tokens`` rows: ``"latent"`` and (``with_indexer``) ``"index"`` page buffers."""
    for name, value in (("prefix_tokens", prefix_tokens), ("chunk_tokens", chunk_tokens)):
        check_int(name, value, 0)
        if value % page_size:
            raise ValueError(f"{name} must be page-aligned (page size {page_size}), got {value}")
    pages = arena_tokens(prefix_tokens, chunk_tokens, page_size, prefetch) // page_size
    arena = {"latent": torch.empty((pages, page_size * row_bytes), dtype=torch.uint8, device=device)}
    if with_indexer:
        arena["index"] = torch.empty((pages, page_size * INDEX_TOKEN_BYTES), dtype=torch.uint8, device=device)
    return arena


class ViewMaterializer:
    """Builds, per batch and layer, the dense view a sharded pool's kernels read. ``group``: the CP group
    owning the pool's pages (None only for a single-rank pool), or a ``copy_engine.CopyEngineGroup``
    registered over the arena. ``arena`` (``allocate_arena``): every batch's views are its leading pages; a
    batch whose views do not fit raises ``ViewArenaError`` before anything is written, one whose two view
    sets do not fit is not prefetched."""

    def __init__(
        self,
        pool: PageBuffers,
        group: CPGroup | None = None,
        *,
        prefetch: bool = False,
        use_triton: bool | None = None,
        arena: dict[str, torch.Tensor] | None = None,
        prefetch_gather: str = "compute",
        prefetch_priority: int = HIGHEST_STREAM_PRIORITY,
    ):
        n = pool.ownership.cp_size
        if prefetch_gather not in PREFETCH_GATHER_PLACES:
            raise ValueError(f"prefetch_gather must be one of {PREFETCH_GATHER_PLACES}, got {prefetch_gather!r}")
        if group is None and n != 1:
            raise ValueError(f"group is required for a pool sharded over {n} ranks")
        if group is not None and (group.size != n or group.rank != pool.rank):
            raise ValueError(
                f"group (rank {group.rank} of {group.size}) does not match the pool (rank {pool.rank} of {n})"
            )
        self.pool = pool
        self.group = group
        self.arena = arena
        self.prefetch = prefetch
        self.prefetch_gather = prefetch_gather
        self.prefetch_priority = prefetch_priority
        self.use_triton = use_triton
        self.plan: BatchPlan | None = None
        self.counters: BatchCounters | None = None
        # Per view set: its buffers, its latent rows, the caller's stages, (page ids, this rank's part, views).
        self._views: list[dict[str, torch.Tensor]] = []
        self._rows: list[torch.Tensor] = []
        self.stages: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._parts: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
        self._pending: tuple[int, int, torch.cuda.Event | None] | None = None  # (layer, buffer set, done)
        self._side_stream: torch.cuda.Stream | None = None
        self._prefetched = self._fork = self._gathered = None  # CUDA events, made with the side stream
        self._unacked = False  # the last transfer left out its wait for the peers' reads (``_gather``)
        self._source_table = None if prefetch else getattr(group, "source_table", None)

    def begin_planned(self, plan: BatchPlan, kind: str, extra_pages: int) -> BatchCounters:
        """Start a batch of this plan and ``current_reuse.batch_kind``, ``extra_pages`` staged past the view."""
        self.drain()  # a gather still in flight writes buffers this batch replaces
        self.counters = BatchCounters(kind=kind)
        self.plan = plan
        self._allocate(plan, 2 if self.prefetch else 1, extra_pages)
        return self.counters

    def _allocate(self, plan: BatchPlan, copies: int, extra_pages: int) -> None:
        """The view buffers, and the slices this rank gathers into and the in-place all-gather fills."""
        pool = self.pool
        self._parts = []
        pages = plan.view_pages + extra_pages
        widths = {"latent": pool.page_size * pool.row_bytes}
        if pool.with_indexer:
            widths["index"] = pool.page_size * INDEX_TOKEN_BYTES
        arena = self.arena
        if arena is not None:  # as many view sets as the arena holds (at least 1)
            copies = max(1, min(copies, min(buf.shape[0] for buf in arena.values()) // max(pages, 1)))
        self._views = [
            {k: arena_pages(arena, k, pages, w, pool.device, part) for k, w in widths.items()} for part in range(copies)
        ]
        self._rows = [v["latent"].view(-1, pool.row_bytes) for v in self._views]
        self.stages = [(r, v.get("index")) for r, v in zip(self._rows, self._views)]
        if self._source_table is None:
            send, (start, end) = plan.send_pages(pool.rank), plan.rank_view_slots(pool.rank)
            for views in self._views:
                mine = [v[start:end] for v in views.values()]
                self._parts.append((send, mine, [v[: plan.view_pages] for v in views.values()]))

    def layer_view(self, layer: int) -> LayerView:
        if self.counters is None:
            raise ValueError("layer_view called before begin_planned")
        pool = self.pool
        if not 0 <= layer < pool.num_layers:
            raise ValueError(f"layer must be in [0, {pool.num_layers}), got {layer!r}")
        slot = layer % len(self._views)
        if self._wait() != (layer, slot):  # not gathered ahead
            self._gather(layer, slot)
        if len(self._views) > 1 and layer + 1 < pool.num_layers:
            self._start_prefetch(layer + 1, (layer + 1) % len(self._views))
        self.counters.layers += 1
        index = self._views[slot].get("index") if pool.has_index[layer] else None
        return LayerView(self._rows[slot], index, self.plan.slot_table)

    @property
    def reads_pools(self) -> bool:
        """Whether each layer's view is read straight from the owners' pools (no all-gather)."""
        return self._source_table is not None

    @property
    def view_sets(self) -> int:
        """View sets of the batch in progress: 2 when it is prefetched (layers alternate), else 1."""
        return len(self._views)

    # -- the gather, now or ahead --
    def _gather(
        self, layer: int, slot: int, transfer_stream: torch.cuda.Stream | None = None, ack: bool = True
    ) -> None:
        """Gather ``layer``'s owned pages into view set ``slot`` and all-gather them, on the current stream or,
        after the gather, on ``transfer_stream`` (``ack``: ``CopyEngineGroup.all_gather_into_many``'s)."""
        plan, group = self.plan, self.group
        if self._source_table is not None:
            page_bytes = self._pull(layer)
        else:
            launch, whole, mine, page_bytes = self._prepare_gather(layer, slot)
            launch()
            if group is not None and plan.slots_per_rank:  # nothing to move when every page is staged
                if transfer_stream is None:
                    group.all_gather_into_many(whole, mine)
                else:
                    gathered = self._gathered
                    gathered.record(torch.cuda.current_stream(self.pool.device))
                    gathered.wait(transfer_stream)
                    if ack or group.backend != "copy_engine":
                        group.all_gather_into_many(whole, mine, stream=transfer_stream)
                    else:
                        group.all_gather_into_many(whole, mine, stream=transfer_stream, ack=False)
                        self._unacked = True
        counters = self.counters
        counters.view_pages = plan.view_pages
        counters.pages_gathered += plan.slots_per_rank
        counters.bytes_materialized += plan.view_pages * page_bytes
        counters.bytes_received += (plan.view_pages - plan.slots_per_rank) * page_bytes

    def _prepare_gather(self, layer: int, slot: int) -> tuple[Callable[[], None], list, list, int]:
        """``(launch, the views to all-gather, this rank's part of them, one slot's page bytes)`` of ``layer``."""
        pool = self.pool
        sources = [pool.latent_pages(layer)] + ([pool.index[layer]] if self.pool.has_index[layer] else [])
        used = len(sources)
        page_ids, mine, whole = self._parts[slot]
        _, launch = prepare_gather(sources, page_ids, mine[:used], use_triton=self.use_triton)
        return launch, whole[:used], mine[:used], sum(src.shape[1] for src in sources)

    def _pull(self, layer: int) -> int:
        """``layer``'s whole view read from the owners' pools in one launch; returns one slot's page bytes."""
        plan, used = self.plan, 2 if self.pool.has_index[layer] else 1
        views = list(self._views[0].values())[:used]
        page_bytes = sum(v.shape[1] for v in views)
        if plan.slots_per_rank:
            words = [word_view(v[: plan.view_pages]) for v in views]
            strides = self.group.source_strides[:used]
            s, start = plan.slots_per_rank, plan.send_start
            pull_launch(self._source_table, plan.words, s, words, strides, layer, start, plan.view_pages)()
            self.group.bytes_received += (plan.view_pages - s) * page_bytes
        return page_bytes

    def fence(self) -> None:
        """Where views are read straight from the peers' pools, ``CopyEngineGroup.fence`` at each batch's start:
        a batch reads only pages written before it started."""
        if self._source_table is not None:
            self.group.fence()

    def _start_prefetch(self, layer: int, slot: int) -> None:
        device = self.pool.device
        event = None
        if device.type == "cuda":
            side = self._side_stream
            if side is None:
                side = self._side_stream = torch.cuda.Stream(device, priority=self.prefetch_priority)
                self._fork, self._prefetched = torch.cuda.Event(), torch.cuda.Event()
                self._gathered = torch.cuda.Event()
            if self.prefetch_gather == "compute":
                # The gather in line here, between the compute stream's kernels; the transfer on the side stream.
                self._gather(layer, slot, transfer_stream=side, ack=layer + 1 == self.pool.num_layers)
            else:
                # The side stream starts after everything queued so far (pool writes, readers of this view set).
                main = torch.cuda.current_stream(device)
                self._fork.record(main)
                self._fork.wait(side)
                torch.cuda.set_stream(side)
                try:
                    self._gather(layer, slot)
                finally:
                    torch.cuda.set_stream(main)
            event = self._prefetched
            event.record(side)
        else:
            self._gather(layer, slot)
        self._pending = (layer, slot, event)

    def _wait(self) -> tuple[int, int] | None:
        """Order the current stream after the gather started ahead, if any; returns its ``(layer, view set)``."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[2] is not None:
            pending[2].wait(torch.cuda.current_stream(self.pool.device))
        return None if pending is None else pending[:2]

    def drain(self) -> None:
        """Order what the caller queues next after a gather started ahead, and after the peers' reads of this
        rank's views where the last transfer did not wait for them."""
        self._wait()
        if self._unacked:  # copy engines only
            self._unacked = False
            self.group.finish_reads()
