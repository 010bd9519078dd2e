"""Per-batch read state of a sharded SGLang pool: what its page table and buffers hold.

SGLang's attention backends (DSA and its indexer, FA3 for plain MLA) read a kv-shard
pool through one contract: per extend batch ``begin_shard_extend``, then
``translate_loc_to_scratch(locs)`` maps token locs to rows of the buffer returned by
``get_key_buffer(layer)`` and the indexer's page reads. ``BatchReadState.begin``
decides what that buffer is:

- **current-reuse** (no request reads a prefix): every key is in the chunk being
  computed, which every rank holds, staged page-aligned locally.
- **materialized**: the prefix pages are planned (``plan_kernels.plan_batch``) and per
  layer gathered from their owners into a dense view (``materialize``), the chunk
  staged past it: ``[prefix view (N * S pages) | current pages | trash page]``. Pages
  a request shares with an earlier one (``BatchInputs.shared_prefix``) are not
  planned again: the translation finds them through the source's slots.

Sizes come from host lengths: nothing reads device data back (debug mode aside). What
only the device sees (a plan whose pages do not rotate owners, a wrong shared-prefix
hint) is raised ``VERDICT_LAG`` batches later on every rank alike
(``slot_plan.DeviceFlagCheck``)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.srt.distributed.copy_engine import prefetch_on, view_group
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.debug_checks import check_plan
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import (
    BatchCounters,
    LayerView,
    ViewMaterializer,
    allocate_arena,
    arena_pages,
    check_arena_fits,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import translate_locs
from sglang_cp_shared_kv.srt.layers.attention.nsa.page_source import PageBuffers
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import (
    PLAN_META_ROWS,
    BatchPlan,
    plan_batch,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    DeviceFlagCheck,
    SlotOverflowError,
    batch_kind,
    overflow_message,
    pages_for_lens,
    plan_meta_rows,
    request_names,
    slots_per_rank,
)
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership, debug_enabled


@dataclass(frozen=True)
class BatchInputs:
    """One extend batch for ``BatchReadState.begin``: token ``t`` of request ``b`` is at
    loc ``req_to_token[rows[b], t]`` (int32, on the pool's device); the lengths are host
    ints; ``request_ids`` name requests in errors (None: ``#0``, ``#1``, ...);
    ``shared_prefix[b] = (source, pages)``: request ``b``'s first ``pages`` prefix pages
    are those of the earlier request ``source`` (None: no sharing known)."""

    req_to_token: torch.Tensor
    rows: torch.Tensor
    prefix_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    request_ids: tuple[str, ...] | None = None
    shared_prefix: tuple[tuple[int, int], ...] | None = None


class SharedPrefixError(RuntimeError):
    """A ``shared_prefix`` hint named pages a request does not share with its source."""


class TensorMemo:
    """``fn(t)`` once per input tensor: the very same, unmodified tensor (same object,
    same ``_version``) gets the first result again: SGLang hands every layer the same
    loc and page tensors. Holds the last ``size``; ``clear()`` when what ``fn`` reads
    changes."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], size: int = 4):
        self.fn, self.size = fn, size
        self._entries: list[tuple[torch.Tensor, int, torch.Tensor]] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        for src, version, out in self._entries:
            if src is t and version == t._version:  # host-side: nothing read back
                return out
        out = self.fn(t)
        self._entries = [(t, t._version, out), *self._entries[: self.size - 1]]
        return out

    def clear(self) -> None:
        self._entries = []


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
        on_peer_lost: Callable[[str], None] | None = None,
    ):
        self.ownership = ownership
        self.page_size = ownership.page_size
        # Latent and indexer pages as one source: one plan, gather and collective.
        indexer = index.buffers if index is not None else None
        self.source = PageBuffers(ownership, rank, latent.row_bytes, latent.buffers, indexer)
        self.group = group
        self.on_peer_lost = on_peer_lost  # the server's fail-stop (``peer_watchdog``)
        self.views: ViewMaterializer | None = None  # at the first materialized batch
        self.device = latent.device
        # Per batch: the page of the read buffer each logical page maps to.
        self.page_pos = torch.zeros(logical_pages, dtype=torch.long, device=self.device)
        self.mode: str | None = None  # None (no extend), "current" or "materialized"
        self.counters: BatchCounters | None = None
        # Per view set (two, alternating by layer, when prefetching): the latent rows
        # and indexer pages staged into.
        self._stages: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._layer_cache: dict[int, LayerView] = {}
        self.arena: dict[str, torch.Tensor] | None = None
        self.prefetch = False  # views prefetched a layer ahead (``attach_arena``)
        self.flags = DeviceFlagCheck()  # each batch's overflow and wrong-hint flags
        # This batch's plan launch (None: computed in line) and whether the copy
        # engines' fence precedes it, until queued at its first device call.
        self._deferred: tuple[Callable[[], None] | None, bool] | None = None
        # This batch's translations of the tensors every layer passes again.
        self.stage_rows = TensorMemo(lambda locs: self.translate(locs, torch.int64))
        self.translate_pages_once = TensorMemo(self.translate_pages)

    def attach_arena(self, prefix: int, chunk: int, prefetch: bool = False) -> int:
        """Allocate the view arena before the first batch (``allocate_arena``), with a
        second view set when ``prefetch``; returns its bytes."""
        if self.views is not None or self.mode is not None:
            raise RuntimeError("attach the view arena before the first batch")
        ps, src = self.page_size, self.source
        self.arena = allocate_arena(prefix, chunk, ps, src.row_bytes, src.with_indexer, self.device, prefetch)
        self.prefetch = prefetch
        return sum(t.numel() for t in self.arena.values())

    def check_overflow(self, wait: bool = False) -> None:
        """Raise ``SlotOverflowError`` or ``SharedPrefixError`` for an earlier batch
        whose flags landed; ``wait`` for those in flight too (shutdown, tests)."""
        if wait:
            self._queue_plan()
        self.flags.poll(wait=wait)

    # -- batch lifecycle --
    def begin(self, inputs: BatchInputs) -> BatchCounters:
        """Start an extend batch: its lengths checked, its plan bound (queued at its
        first device call)."""
        prefix_lens, seq_lens = list(inputs.prefix_lens), list(inputs.seq_lens)
        rows, columns = inputs.rows, inputs.req_to_token.shape[1]
        if len(prefix_lens) != len(seq_lens) or len(seq_lens) != rows.shape[0]:
            got = f"prefix_lens ({len(prefix_lens)}), seq_lens ({len(seq_lens)})"
            raise ValueError(f"{got} and req_pool_indices ({rows.shape[0]}) must agree")
        ps = self.page_size
        pages, prefix_pages = _batch_pages(prefix_lens, seq_lens, ps, columns)
        hint = _check_shared_prefix(inputs.shared_prefix, prefix_pages)
        self._queue_plan()  # the last batch's fence, even with no device call
        self.flags.next_batch()  # raises for batch VERDICT_LAG before, on every rank
        if self.views is not None:  # a layer gathered ahead reads the plan overwritten
            self.views.drain()
        self._layer_cache.clear()
        self.stage_rows.clear()
        self.translate_pages_once.clear()
        if batch_kind(prefix_pages) == "current":
            self._begin_current(inputs, pages)
        else:
            self._begin_materialized(inputs, pages, prefix_pages, hint)
        if debug_enabled():
            self._queue_plan()  # the checks read the plan
            if self.mode == "materialized":
                check_plan(self.views.plan, self.source.trash_page, self.views.group)
            # The batch's logical pages by position: each page's first token loc // ps.
            width = max(seq_lens, default=0)
            page_table = inputs.req_to_token[rows.long(), :width:ps].long() // ps
            self._check_translation(page_table, seq_lens)
        return self.counters

    def _plan(self, inputs, pages, prefix_pages, hint, s, base, fill) -> BatchPlan:
        """The batch's plan (``s`` slots per rank) and page map from one pinned buffer,
        which its deferred launch reads in place and writes flags to."""
        width, b, n = max(pages, default=0), len(pages), self.ownership.cp_size
        m = len(PLAN_META_ROWS) * b
        buf, host = self.flags.host_views(m + n + 2 + b, self.device)
        # One host write: the lengths, and the flags zeroed (the launch sets the last).
        host[:] = plan_meta_rows(pages, prefix_pages, hint) + [0] * (n + 2 + b)
        # The pages planned: the prefix pages past those shared.
        planned = sum(prefix_pages) - sum(shared for _, shared in hint)
        batch = (inputs.req_to_token, inputs.rows, self.page_size, buf[:m], width)
        slots = (planned, n, s, self.source.trash_page, self.page_pos, base, fill)
        plan, queued = plan_batch(*batch, *slots, flags=buf[m:], queue=False)
        requests = inputs.request_ids

        def fail(values: list) -> Exception | None:
            status, wrong = values[m : m + n + 1], values[m + n + 1 : -1]
            if not (status[0] or any(wrong)):
                return None
            names = request_names(requests, b)
            if status[0]:
                return SlotOverflowError(overflow_message(status, s, names))
            bad = ", ".join(
                f"{names[i]} (its first {hint[i][1]} of {prefix_pages[i]} prefix pages as {names[hint[i][0]]}'s)"
                for i, w in enumerate(wrong)
                if w
            )
            return SharedPrefixError(
                "--enable-cp-shared-kv: wrong shared-prefix hint: in the batch of "
                f"requests [{', '.join(names)}], the pages the hint shares are not the "
                f"same logical pages for {bad}; they were read from other slots, so the "
                "batch fails"
            )

        self.flags.watch(buf, fail, self.device, landed=m + n + 1 + b, array=host)
        # Fenced where there are views: peers may still read the pages reused.
        self._deferred = (queued, self.views is not None)
        return plan

    def _begin_current(self, inputs: BatchInputs, pages: list[int]) -> None:
        ps, total, arena, device = self.page_size, sum(pages), self.arena, self.device
        row_bytes = self.source.row_bytes
        # The arena's leading pages (checked before the plan writes), else new buffers.
        latent = arena_pages(arena, "latent", total + 1, ps * row_bytes, device)
        index = None
        if self.source.with_indexer:
            width = ps * INDEX_TOKEN_BYTES
            index = arena_pages(arena, "index", total + 1, width, device)
        # Staged pages follow the batch's positions from page 1; unplanned ones land on
        # page 0, SGLang's padding slot (row writers skip row 0).
        self._plan(inputs, pages, [0] * len(pages), [(-1, 0)] * len(pages), 0, 1, 0)
        self._stages = [(latent.view(-1, row_bytes), index)]
        self.counters = BatchCounters(kind="current", pages_staged=total)
        self.mode = "current"

    def _begin_materialized(self, inputs, pages, prefix_pages, hint) -> None:
        if self.views is None:
            if callable(self.group):
                self.group = self.group()
            group, src = self.group, self.source
            if self.arena is not None and group is not None:  # copy engines map arenas
                pools = None
                if not self.prefetch:  # views read in line: peers' pools mapped too
                    pools = [
                        [src.buffers[i]] + ([src.index[i]] if src.with_indexer else []) for i in range(src.num_layers)
                    ]
                arenas, on_lost = list(self.arena.values()), self.on_peer_lost
                group = view_group(group, arenas, sources=pools, on_peer_lost=on_lost)
            prefetch = prefetch_on(group, self.prefetch)  # follows the transport chosen
            arena = self.arena
            self.views = ViewMaterializer(src, group, arena=arena, prefetch=prefetch)
        n = self.ownership.cp_size
        # The planned pages: each request's prefix pages past those it shares.
        s = slots_per_rank([q - p for q, (_, p) in zip(prefix_pages, hint)], n)
        view_pages = n * s
        staged = sum(pages) - sum(prefix_pages)
        # The view holds the unshared prefixes, the current pages and trash page next.
        # A batch past the arena fails before anything is written.
        if self.arena is not None:
            check_arena_fits(self.arena, view_pages + staged + 1)
        # Prefix pages to their slots, current pages past the view, anything unplanned
        # (the write path's padding locs) to the trash page past those.
        trash = view_pages + staged
        plan = self._plan(inputs, pages, prefix_pages, hint, s, view_pages, trash)
        kind = batch_kind(prefix_pages)
        self.counters = self.views.begin_planned(plan, kind, staged + 1)
        self.counters.pages_staged = staged
        self._stages = self.views.stages
        self.mode = "materialized"

    def _queue_plan(self) -> None:
        """Queue the batch's deferred fence and plan, once."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        launch, fence = deferred
        if fence:
            self.views.fence()
        if launch is not None:
            launch()

    def end(self) -> None:
        self._queue_plan()
        self.mode = None
        self._stages = []
        self._layer_cache.clear()
        self.stage_rows.clear()
        self.translate_pages_once.clear()
        if self.views is not None:
            self.views.drain()  # a layer gathered ahead and never read: buffer reused

    # -- the buffers the write path stages the current chunk into --
    def stage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(latent rows, indexer pages)`` local ``layer`` stages its chunk into."""
        self._queue_plan()  # writes follow the fence
        return self._stages[layer % len(self._stages)]

    @property
    def stage_latent(self) -> torch.Tensor | None:
        """The first view set's latent rows (None outside a batch)."""
        return self._stages[0][0] if self._stages else None

    @property
    def stage_index(self) -> torch.Tensor | None:
        return self._stages[0][1] if self._stages else None

    # -- translation --
    def translate(self, locs: torch.Tensor, dtype: torch.dtype | None = None):
        """Token locs -> rows of this batch's read buffer (``dtype``: the locs')."""
        self._queue_plan()
        return translate_locs(self.page_pos, locs, self.page_size, dtype)

    def translate_pages(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """Logical page ids -> pages of this batch's read buffer."""
        self._queue_plan()
        return translate_locs(self.page_pos, logical_pages, 1)

    def _check_translation(self, page_table: torch.Tensor, seq_lens: list[int]) -> None:
        """Debug: every position of every request maps inside the read buffer."""
        pages = self.stage_latent.shape[0] // self.page_size
        # Current-reuse from page 1 (0: the padding slot); else all but the trash page.
        low, limit = (1, pages) if self.mode == "current" else (0, pages - 1)
        for b, p in enumerate(pages_for_lens(seq_lens, self.page_size)):
            mapped = self.page_pos[page_table[b, :p]]
            if p and bool((mapped >= limit).any() | (mapped < low).any()):
                where = f"outside the read buffer ({limit} pages)"
                raise AssertionError(f"request {b}: a page maps {where}")

    # -- buffers the kernels read --
    def latent_rows(self, layer: int) -> torch.Tensor:
        """uint8 ``[rows, row_bytes]``: the latent rows ``translate`` points into."""
        if self.mode == "current":
            return self.stage(layer)[0]
        return self._layer_view(layer).kv_rows

    def index_pages(self, layer: int) -> torch.Tensor:
        """uint8 ``[pages, ps * 132]``: the pages ``translate_pages`` points into."""
        if not self.source.with_indexer:
            raise ValueError("this pool has no indexer")
        if self.mode == "current":
            return self.stage(layer)[1]
        pages = self._layer_view(layer).index_pages
        if pages is None:
            raise ValueError(f"local layer {layer} holds no indexer pages")
        return pages

    def _layer_view(self, layer: int) -> LayerView:
        """The layer's view, gathered at its first read (which, when prefetching, starts
        gathering the next). Prefix pages predate the batch and staged pages lie past
        them, so the gather may run before or after the layer's writes."""
        view = self._layer_cache.get(layer)
        if view is None:  # the batch's first read of the layer: fence and plan first
            self._queue_plan()
            view = self._layer_cache[layer] = self.views.layer_view(layer)
        return view


def _batch_pages(prefix_lens: list[int], seq_lens: list[int], ps: int, columns: int):
    """Per request its pages and prefix pages (host ints), its lengths checked: a
    page-aligned prefix in ``[0, seq_len]``, ``seq_len`` within ``columns`` tokens."""
    pages = pages_for_lens(seq_lens, ps)
    prefix_pages = [p // ps for p in prefix_lens]
    past = any(map(operator.gt, prefix_lens, seq_lens))
    if prefix_lens and (min(prefix_lens) < 0 or max(seq_lens) > columns or past):
        raise ValueError(
            "prefix_lens must lie in [0, seq_len] and seq_lens within the token "
            f"table's {columns} columns, got prefix_lens {prefix_lens} and seq_lens "
            f"{seq_lens}"
        )
    if sum(prefix_lens) != ps * sum(prefix_pages):  # a p % ps (>= 0) is not 0
        got = f"(page size {ps}), got {prefix_lens}"
        raise ValueError(f"prefix_lens must be page-aligned {got}")
    return pages, prefix_pages


def _check_shared_prefix(shared, prefix_pages: list[int]) -> list[tuple[int, int]]:
    """``(source, pages)`` per request (``(-1, 0)``: none) from a ``shared_prefix``
    hint, checked: at most the prefix pages it and its earlier source both have."""
    if shared is None:
        return [(-1, 0)] * len(prefix_pages)
    if len(shared) != len(prefix_pages):
        got = f"({len(prefix_pages)}), got {len(shared)}"
        raise ValueError(f"shared_prefix must have one entry per request {got}")
    out = []
    for b, (src, pages) in enumerate(shared):
        src, pages = int(src), int(pages)
        fits = 0 <= src < b and 0 < pages <= min(prefix_pages[b], prefix_pages[src])
        if pages and not fits:
            raise ValueError(
                f"shared_prefix[{b}] = ({src}, {pages}): a request shares at most the "
                "prefix pages it and an earlier source request both have (prefix pages "
                f"{prefix_pages})"
            )
        out.append((src, pages) if pages > 0 else (-1, 0))
    return out
