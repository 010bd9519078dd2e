"""Per-layer dense views of a sharded MLA/DSA pool's pages, built from a batch's plan.

SGLang's indexer and MLA kernels read one dense buffer through a page table. A layer's
view (``plan_kernels.BatchPlan``: ``N * S`` pages, owner-major) is each rank's owned
pages gathered in slot order and all-gathered in place, or, over a copy-engine group
that mapped the peers' pools, read from every owner's pool in one launch. Prefetching
builds layer ``l + 1``'s view while layer ``l`` computes: it holds prefix pages only,
written before the batch, so it equals one gathered in line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_page_buffers, pull_launch, word_view
from sglang_cp_shared_kv.srt.layers.attention.nsa.page_source import PageBuffers
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import BatchPlan
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.utils import check_int

# A view arena: uint8 page buffers by name, "latent" and (with an indexer) "index".
Arena = dict[str, torch.Tensor]


@dataclass
class BatchCounters:
    """What one forward batch cost this rank's read path, summed over its layers."""

    kind: str  # ``slot_plan.batch_kind``
    layers: int = 0  # layer views served
    view_pages: int = 0  # N * S (0 under current-reuse)
    pages_gathered: int = 0  # S per layer, padding included (latent + indexer: one)
    bytes_materialized: int = 0  # N * S pages per layer, latent and indexer bytes
    bytes_received: int = 0  # the part of bytes_materialized from other ranks
    pages_staged: int = 0  # current-chunk pages staged locally past the view


# The side stream's default priority, the device's highest (torch clamps it).
HIGHEST_STREAM_PRIORITY = -(1 << 10)
# Where a prefetched layer's own-page gather runs: "compute" (the side stream only
# transfers: no SM work beside the layer's kernels) or "side".
PREFETCH_GATHER_PLACES = ("compute", "side")


@dataclass(eq=False, slots=True)
class LayerView:
    """What the indexer and MLA kernels read for one layer: ``kv_rows`` uint8
    ``[R, row_bytes]``, ``index_pages`` uint8 ``[P, page_size * 132]`` (or None) and
    the plan's slot table ``page_table`` int32 ``[B, max_pages]`` into both."""

    kv_rows: torch.Tensor
    index_pages: torch.Tensor | None
    page_table: torch.Tensor


class ViewArenaError(RuntimeError):
    """A batch's read buffer would not fit the view arena (admission let it through)."""


def page_widths(page_size: int, row_bytes: int, with_indexer: bool) -> dict[str, int]:
    """Bytes per page of each view buffer, by its ``Arena`` name."""
    widths = {"latent": page_size * row_bytes}
    if with_indexer:
        widths["index"] = page_size * INDEX_TOKEN_BYTES
    return widths


def arena_pages(arena: Arena | None, key: str, pages: int, width: int, device, part: int = 0) -> torch.Tensor:
    """View set ``part`` of ``pages`` pages of ``arena[key]`` (uint8 ``[P, width]``),
    ``ViewArenaError`` if even one set does not fit; without an arena, a new buffer."""
    if arena is None:
        return torch.empty((pages, width), dtype=torch.uint8, device=device)
    check_arena_fits(arena, pages)
    return arena[key][part * pages : (part + 1) * pages]


def check_arena_fits(arena: Arena, pages: int) -> None:
    """``ViewArenaError`` unless every buffer of ``arena`` holds ``pages`` pages."""
    have = min(buf.shape[0] for buf in arena.values())
    if pages > have:
        raise ViewArenaError(
            f"--enable-cp-shared-kv: this batch's read buffer needs {pages} pages, "
            f"more than the view arena's {have}: the batch was admitted past the arena "
            "(SGLang's scratch admission is bypassed or sized for another arena); "
            "nothing was allocated or written"
        )


def arena_tokens(prefix: int, chunk: int, page_size: int, prefetch: bool) -> int:
    """Token rows of a view arena: one batch's largest read buffer (view, staged chunk,
    trash page), and for a prefetching reader a second chunk and trash page."""
    return prefix + (2 if prefetch else 1) * (chunk + page_size)


def allocate_arena(
    prefix_tokens: int,
    chunk_tokens: int,
    page_size: int,
    row_bytes: int,
    with_indexer: bool,
    device,
    prefetch: bool = False,
) -> Arena:
    """A view arena of ``arena_tokens`` rows."""
    tokens = {"prefix_tokens": prefix_tokens, "chunk_tokens": chunk_tokens}
    for name, value in tokens.items():
        check_int(name, value, 0)
        if value % page_size:
            raise ValueError(f"{name} {value} is not page-aligned (page size {page_size})")
    pages = arena_tokens(prefix_tokens, chunk_tokens, page_size, prefetch) // page_size
    widths = page_widths(page_size, row_bytes, with_indexer)
    return {k: arena_pages(None, k, pages, w, device) for k, w in widths.items()}


class ViewMaterializer:
    """Builds, per batch and layer, the dense view a sharded pool's kernels read.

    ``group``: the CP group owning the pool's pages (None only for one rank), or a
    ``copy_engine.CopyEngineGroup`` registered over ``arena``. With an arena every
    batch's views are its leading pages: a batch whose views do not fit raises
    ``ViewArenaError`` before anything is written; one whose two view sets do not fit
    is not prefetched."""

    def __init__(
        self,
        pool: PageBuffers,
        group: CPGroup | None = None,
        *,
        prefetch: bool = False,
        use_triton: bool | None = None,
        arena: Arena | None = None,
        prefetch_gather: str = "compute",
        prefetch_priority: int = HIGHEST_STREAM_PRIORITY,
    ):
        n = pool.ownership.cp_size
        if prefetch_gather not in PREFETCH_GATHER_PLACES:
            got = f"{PREFETCH_GATHER_PLACES}, got {prefetch_gather!r}"
            raise ValueError(f"prefetch_gather must be one of {got}")
        if group is None and n != 1:
            raise ValueError(f"group is required for a pool sharded over {n} ranks")
        if group is not None and (group.size != n or group.rank != pool.rank):
            got = f"group (rank {group.rank} of {group.size})"
            raise ValueError(f"{got} does not match the pool (rank {pool.rank} of {n})")
        self.pool = pool
        self.group = group
        self.arena = arena
        self.prefetch = prefetch
        self.prefetch_gather = prefetch_gather
        self.prefetch_priority = prefetch_priority  # the side stream's
        self.use_triton = use_triton
        self.plan: BatchPlan | None = None
        self.counters: BatchCounters | None = None
        # Per view set: its buffers, latent rows, the caller's stages, and
        # (page ids, this rank's part, the views) to all-gather.
        self._views: list[dict[str, torch.Tensor]] = []
        self._rows: list[torch.Tensor] = []
        self.stages: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._parts: list[tuple[torch.Tensor, list, list]] = []
        self._pending: tuple | None = None  # (layer, view set, CUDA event or None)
        self._side_stream: torch.cuda.Stream | None = None
        self._prefetched = self._fork = self._gathered = None  # side-stream events
        self._unacked = False  # the last transfer did not wait for the peers' reads
        self._source_table = None if prefetch else getattr(group, "source_table", None)

    def begin_planned(self, plan: BatchPlan, kind: str, extra: int) -> BatchCounters:
        """Start a batch of ``plan``, ``extra`` pages staged past its view: its view sets,
        and the parts this rank gathers into and all-gathers."""
        self.drain()  # a gather still in flight writes buffers this batch replaces
        self.counters = BatchCounters(kind=kind)
        self.plan = plan
        pool, arena = self.pool, self.arena
        self._parts = []
        pages, copies = plan.view_pages + extra, 2 if self.prefetch else 1
        widths = page_widths(pool.page_size, pool.row_bytes, pool.with_indexer)
        if arena is not None:  # as many view sets as the arena holds (at least 1)
            have = min(buf.shape[0] for buf in arena.values())
            copies = max(1, min(copies, have // max(pages, 1)))
        self._views = []
        for part in range(copies):
            views = {}
            for key, width in widths.items():
                views[key] = arena_pages(arena, key, pages, width, pool.device, part)
            self._views.append(views)
        self._rows = [v["latent"].view(-1, pool.row_bytes) for v in self._views]
        self.stages = [(r, v.get("index")) for r, v in zip(self._rows, self._views)]
        if self._source_table is None:
            send = plan.send_pages(pool.rank)
            start, end = plan.rank_view_slots(pool.rank)
            for views in self._views:
                mine = [v[start:end] for v in views.values()]
                whole = [v[: plan.view_pages] for v in views.values()]
                self._parts.append((send, mine, whole))
        return self.counters

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
    def view_sets(self) -> int:
        """View sets of the batch in progress: 2 when prefetched, else 1."""
        return len(self._views)

    # -- the gather, now or ahead --
    def _gather(self, layer: int, slot: int, side=None, ack: bool = True) -> None:
        """Gather ``layer``'s owned pages into view set ``slot`` and all-gather them, on
        the current stream or after the gather on the ``side`` stream (``ack``:
        ``CopyEngineGroup.all_gather_into_many``'s)."""
        plan, group, pool = self.plan, self.group, self.pool
        if self._source_table is not None:
            page_bytes = self._pull(layer)
        else:
            sources = [pool.latent_pages(layer)]
            if pool.has_index[layer]:
                sources.append(pool.index[layer])
            page_ids, mine, whole = self._parts[slot]
            mine, whole = mine[: len(sources)], whole[: len(sources)]
            gather_page_buffers(sources, page_ids, mine, self.use_triton)
            page_bytes = sum(src.shape[1] for src in sources)
            if group is not None and plan.slots_per_rank:  # else every page is staged
                if side is None:
                    group.all_gather_into_many(whole, mine)
                else:
                    self._gathered.record(torch.cuda.current_stream(pool.device))
                    self._gathered.wait(side)
                    if ack or group.backend != "copy_engine":
                        group.all_gather_into_many(whole, mine, stream=side)
                    else:
                        group.all_gather_into_many(whole, mine, stream=side, ack=False)
                        self._unacked = True
        counters = self.counters
        counters.view_pages = plan.view_pages
        counters.pages_gathered += plan.slots_per_rank
        counters.bytes_materialized += plan.view_pages * page_bytes
        counters.bytes_received += (plan.view_pages - plan.slots_per_rank) * page_bytes

    @property
    def reads_pools(self) -> bool:
        """Whether each layer's view is read from the owners' pools (no all-gather)."""
        return self._source_table is not None

    def _pull(self, layer: int) -> int:
        """``layer``'s view read from the owners' pools, one launch; its page bytes."""
        plan, used = self.plan, 2 if self.pool.has_index[layer] else 1
        views = list(self._views[0].values())[:used]
        page_bytes = sum(v.shape[1] for v in views)
        s, start, view_pages = plan.slots_per_rank, plan.send_start, plan.view_pages
        if s:
            words = [word_view(v[:view_pages]) for v in views]
            strides = self.group.source_strides[:used]
            table, ids = self._source_table, plan.words
            pull_launch(table, ids, s, words, strides, layer, start, view_pages)()
            self.group.bytes_received += (view_pages - s) * page_bytes
        return page_bytes

    def fence(self) -> None:
        """``CopyEngineGroup.fence`` at each batch's start where views are read from the
        peers' pools: a batch reads only pages written before it started."""
        if self._source_table is not None:
            self.group.fence()

    def _start_prefetch(self, layer: int, slot: int) -> None:
        device = self.pool.device
        if device.type == "cuda":
            side = self._side_stream
            if side is None:
                priority = self.prefetch_priority
                side = self._side_stream = torch.cuda.Stream(device, priority=priority)
                self._fork, self._prefetched = torch.cuda.Event(), torch.cuda.Event()
                self._gathered = torch.cuda.Event()
            if self.prefetch_gather == "compute":
                # The gather in line between the compute stream's kernels, the transfer
                # on the side stream.
                last = layer + 1 == self.pool.num_layers
                self._gather(layer, slot, side, ack=last)
            else:
                # The side stream starts after everything queued so far (pool writes,
                # readers of this view set).
                main = torch.cuda.current_stream(device)
                self._fork.record(main)
                self._fork.wait(side)
                torch.cuda.set_stream(side)
                try:
                    self._gather(layer, slot)
                finally:
                    torch.cuda.set_stream(main)
            self._prefetched.record(side)
        else:
            self._gather(layer, slot)
        self._pending = (layer, slot, self._prefetched)  # None off CUDA

    def _wait(self) -> tuple[int, int] | None:
        """Order the current stream after the gather started ahead, if any; returns
        its ``(layer, view set)``."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[2] is not None:
            pending[2].wait(torch.cuda.current_stream(self.pool.device))
        return None if pending is None else pending[:2]

    def drain(self) -> None:
        """Order what the caller queues next after a gather started ahead, and after
        the peers' reads of this rank's views where the last transfer did not wait."""
        self._wait()
        if self._unacked:  # copy engines only
            self._unacked = False
            self.group.finish_reads()
