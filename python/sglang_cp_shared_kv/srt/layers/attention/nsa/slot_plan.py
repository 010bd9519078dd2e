"""The per-batch slot plan of the materialized view: where every page position of a batch lands.

A forward batch reads, for request ``b``, its logical pages ``page_table[b, :pages_b]``. Listed
request-major they are ``M = sum(pages_b)`` page positions. Owner ``o`` of a page sends a block
of ``S = sum(ceil(pages_b / N))`` pages; position ``(b, j)`` with owner ``o`` and rank
``r`` among the batch's positions with the same owner is entry ``r`` of that block.

The view (``N * S`` pages) is the all-gather of those blocks, owner-major::

    slot(b, j) = o * S + r

Balanced allocation spreads each request's pages over owners within one page, so no owner holds
more than ``ceil(pages_b / N)`` of request ``b``'s pages and a block never overflows. That is the
allocator's policy, not a law: a position past its owner's block (pages that do not rotate
owners) gets a slot holding the trash page, never one past the view, and the plan's ``status``
(a device tensor, no host sync) flags it. ``OverflowCheck`` reads the flag where the batch
synchronizes anyway and fails the batch (``SlotOverflowError``). A prefix page shared by two
requests gets two slots: more bytes, static shapes.

Everything sized by the plan (``M``, ``S``, the view) comes from host-known lengths; the
host work is O(batch size) and the device work (page-position list, per-owner scan, scatters)
never syncs, so the plan can be built ahead of the batch's kernels without stalling them, or
captured in a CUDA graph. The plan is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import PLAN_META_ROWS, BatchPlan, plan_batch
from sglang_cp_shared_kv.srt.utils import check_int, current_stream


def pages_for_lens(seq_lens: Sequence[int], page_size: int) -> list[int]:
    """Pages each request reads: ``ceil(seq_len / page_size)`` (host ints)."""
    return [-(-int(n) // page_size) for n in seq_lens]


def slots_per_rank(pages_per_req: Sequence[int], cp_size: int) -> int:
    """``sum(ceil(pages_b / N))``: the pages every owner sends (its block)."""
    return sum(-(-int(p) // cp_size) for p in pages_per_req)


def predicted_view_pages(pages_per_req: Sequence[int], cp_size: int) -> int:
    """Pages of the dense view (``N * S``), padding included: what one materialized layer receives."""
    return cp_size * slots_per_rank(pages_per_req, cp_size)


@dataclass(frozen=True)
class SlotPlan:
    """Where each page position of one batch lives in the dense view (identical on every rank).

    Host-side: ``cp_size``, ``page_size``, ``pages_per_req``, ``slots_per_rank`` (``S``, every
    owner's block) and ``trash_page``. Device-side (views of ``outputs``, the ``plan_batch`` outputs,
    taken when asked for: SGLang's read path takes none of them, its view launches read the send
    entries by offset):

    - ``positions_flat`` int64 ``[M]``: ``b * max_pages + j`` of each position, request-major;
    - ``logical_pages`` int64 ``[M]``: the page each position reads (from the batch's page table);
    - ``slots`` int64 ``[M]``: the view slot of each position;
    - ``slot_table`` int32 ``[B, max_pages]``: the page table the kernels index in the view
      (``pad`` past a request's pages);
    - ``slot_phys`` int64 ``[N * S]``: every owner's send block, owner-major, so entry ``x`` is
      what view slot ``x`` holds: entry ``r`` of owner ``o``'s block is the physical page (on
      ``o``) of its ``r``-th position, or ``trash_page`` for padding. Rank ``o`` gathers
      ``send_pages(o)`` into view slots ``o * S + [0, S)``.
    - ``status`` int64 ``[N + 1]``: ``status[0]`` is 1 when an owner holds more positions than its
      block (those positions read a trash slot), ``status[1 + o]`` the positions owner ``o`` holds.
    """

    cp_size: int
    page_size: int
    pages_per_req: tuple[int, ...]
    slots_per_rank: int
    trash_page: int
    outputs: BatchPlan
    status: torch.Tensor | None = None  # None: a plan built without the overflow report

    @property
    def slot_table(self) -> torch.Tensor:
        return self.outputs.slot_table

    @property
    def slot_phys(self) -> torch.Tensor:
        return self.outputs.slot_phys

    @property
    def positions_flat(self) -> torch.Tensor:
        return self.outputs.positions

    @property
    def logical_pages(self) -> torch.Tensor:
        return self.outputs.logical

    @property
    def slots(self) -> torch.Tensor:
        return self.outputs.slots

    @property
    def num_positions(self) -> int:
        return self.outputs.num_positions

    @property
    def view_pages(self) -> int:
        return self.cp_size * self.slots_per_rank

    def send_pages(self, rank: int) -> torch.Tensor:
        """Physical pages rank ``rank`` copies into its send block, in block order."""
        return self.slot_phys[slice(*self.rank_view_slots(rank))]

    def rank_view_slots(self, rank: int) -> tuple[int, int]:
        """``[start, end)``: the view slots ``rank``'s block fills (host ints)."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank!r}")
        s = self.slots_per_rank
        return rank * s, (rank + 1) * s

    def slot_owner(self, slots: torch.Tensor) -> torch.Tensor:
        """The owner whose block fills each view slot."""
        return slots // max(self.slots_per_rank, 1)


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host (pinned staging for CUDA)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_to_device(vectors: Sequence[Sequence[int] | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host-built int64 vectors on ``device``, through one buffer and one non-blocking copy."""
    arrays = [np.asarray(v, dtype=np.int64) for v in vectors]
    both = torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64))
    return list(copy_to_device(both, device).split([len(a) for a in arrays]))


def plan_meta_rows(
    pages: Sequence[int],
    prefix_pages: Sequence[int] | None = None,
    hint: Sequence[tuple[int, int]] | None = None,
) -> list[int]:
    """``plan_batch``'s ``meta`` as host ints, row after row (rows ``PLAN_META_ROWS``, ``B`` each).

    Request ``b`` has ``pages[b]`` pages, the first ``prefix_pages[b]`` of them prefix pages (default:
    all, none staged), the first ``hint[b] = (source, shared)`` of those the source's (default: none).
    """
    prefix_pages = pages if prefix_pages is None else prefix_pages
    b = len(pages)
    shared = [0] * b if hint is None else [s for _, s in hint]
    # Plain ints for a batch's few requests (host time: no numpy call per row).
    starts, plan_starts, start, plan_start = [], [], 0, 0
    for total, prefix, skip in zip(pages, prefix_pages, shared):
        starts.append(start)
        plan_starts.append(plan_start)
        start += total - prefix
        plan_start += prefix - skip
    sources = [-1] * b if hint is None else [src for src, _ in hint]
    return [*shared, *prefix_pages, *pages, *starts, *sources, *plan_starts]


def plan_meta(
    pages: Sequence[int],
    device: torch.device,
    prefix_pages: Sequence[int] | None = None,
    hint: Sequence[tuple[int, int]] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``plan_meta_rows`` as ``plan_batch``'s ``meta`` (int64 ``[6, B]`` on ``device``), written into one
    (pinned, on CUDA) host buffer and copied in one non-blocking copy; with ``out`` (int64 host ``[6 * B]``,
    pinned on CUDA) written there and returned as is, for a launch that reads it in place (nothing copied;
    the buffer stays untouched until that launch has run).

    Without a hint and prefix pages it depends on the lengths only, not on the page ids: a CUDA graph
    captures the plan with it built beforehand (``build_slot_plan(..., meta=...)``) and replays it on new
    page tables of the same lengths. (The read path writes the rows straight into the pinned buffer its
    launch reads in place: ``read_state``.)
    """
    rows = plan_meta_rows(pages, prefix_pages, hint)
    if out is not None:
        out.numpy()[:] = rows  # sync-ok: a host tensor, filled before any launch reads it
        return out
    host = torch.empty((len(PLAN_META_ROWS), len(pages)), dtype=torch.int64, pin_memory=device.type == "cuda")
    host.numpy().reshape(-1)[:] = rows  # sync-ok: a host tensor, filled before any launch reads it
    return host.to(device, non_blocking=True)


def slot_plan_of(
    plan: BatchPlan,
    cp_size: int,
    page_size: int,
    pages_per_req: Sequence[int],
    slots: int,
    trash_page: int,
    with_status: bool = True,
) -> SlotPlan:
    """The ``SlotPlan`` of ``plan_batch``'s outputs for a batch of ``pages_per_req`` planned pages; without
    ``status`` for a caller that reads the plan's flags itself (``with_status=False``)."""
    return SlotPlan(
        cp_size=cp_size,
        page_size=page_size,
        pages_per_req=tuple(pages_per_req),
        slots_per_rank=slots,
        trash_page=trash_page,
        outputs=plan,
        status=plan.status if with_status else None,
    )


def build_slot_plan(
    page_table: torch.Tensor,
    pages_per_req: Sequence[int],
    cp_size: int,
    page_size: int,
    trash_page: int,
    pad: int = 0,
    use_triton: bool | None = None,
    meta: torch.Tensor | None = None,
) -> SlotPlan:
    """Plan the view of one batch from its page table (logical page ids, ``[B, max_pages]``): ``plan_batch``
    over the table as a token table of page size 1, without a page map.

    ``pages_per_req`` are host ints (``pages_for_lens(seq_lens_cpu, ps)``); the page table stays
    on its device and is never read back. ``trash_page`` is the pool's padding page.
    ``meta``: ``plan_meta(pages_per_req, device)`` built ahead (CUDA graphs); built here when omitted.
    """
    if page_table.dim() != 2 or page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"page_table must be int32/int64 [B, max_pages], got {page_table.dtype} {tuple(page_table.shape)}"
        )
    batch, max_pages = page_table.shape
    pages = [int(p) for p in pages_per_req]
    if len(pages) != batch:
        raise ValueError(f"pages_per_req must have one entry per request ({batch}), got {len(pages)}")
    if pages and (min(pages) < 0 or max(pages) > max_pages):
        raise ValueError(f"pages_per_req must lie in [0, {max_pages}] (the page table's width), got {pages}")
    check_int("cp_size", cp_size, 1)
    check_int("page_size", page_size, 1)
    check_int("trash_page", trash_page, 0)

    s = slots_per_rank(pages, cp_size)
    if meta is None:
        meta = plan_meta(pages, page_table.device)
    if meta.shape != (len(PLAN_META_ROWS), batch):
        raise ValueError(
            f"meta must be plan_meta of these lengths ([{len(PLAN_META_ROWS)}, {batch}]), got {tuple(meta.shape)}"
        )
    rows = torch.arange(batch, device=page_table.device)
    out = plan_batch(
        page_table, rows, 1, meta, max_pages, sum(pages), cp_size, s, trash_page, None, 0, 0, pad, use_triton
    )
    return slot_plan_of(out, cp_size, page_size, pages, s, trash_page)


# ---------------------------------------------------------------------------------------------
# Overflow: read the plan's device flag where the batch synchronizes anyway
# ---------------------------------------------------------------------------------------------


class SlotOverflowError(RuntimeError):
    """A batch's page positions overflowed an owner's block: they read the trash page, the batch is wrong."""


def overflow_message(status: Sequence[int], slots_per_rank: int, requests: Sequence[str]) -> str:
    """One line naming the batch's requests and the owners' page counts (``status`` read on the host)."""
    counts = [int(c) for c in status[1:]]
    return (
        f"--enable-cp-shared-kv: slot overflow: the batch of requests [{', '.join(requests)}] reads "
        f"{counts} page positions from owners 0..{len(counts) - 1}, more than the {slots_per_rank} pages "
        "of an owner's block (the pages of a request do not rotate owners); those positions read the trash "
        "page, so the batch fails"
    )


def request_names(requests: Sequence[object] | None, count: int) -> list[str]:
    """The names an error gives a batch's ``count`` requests: their ids, else ``#0``, ``#1``, ..."""
    names = [str(r) for r in requests] if requests is not None else []
    return names if len(names) == count else [f"#{b}" for b in range(count)]


def _no_error(host: list) -> None:
    """A dropped record's ``fail``: its buffer is only waited for, its values ignored."""
    return None


class DeviceFlagCheck:
    """Device flags read on the host only once they have landed, never waited for.

    ``record(flags, fail)`` once the work that sets ``flags`` (a small device tensor) is queued: on
    CUDA a non-blocking copy into pinned host memory and an event; on CPU the tensor itself.
    ``watch(host, fail)`` is ``record`` for flags the queued work writes straight into a pinned
    buffer of ``host_buffer`` (a kernel reaches pinned memory through unified addressing): one event,
    no copy; ``watch(host, fail, landed=i)`` for work that also sets ``host[i]`` to 1 once every other
    word is written: no event either, the host reads that word. ``poll()`` hands the host values of
    every record that has landed (``Event.query`` or the landed word: never a wait), oldest first, to
    its ``fail``, and raises the exception ``fail`` returns (``None``: nothing wrong), dropping the
    values of the records still pending (their buffers held until they land); ``poll(wait=True)`` waits
    for them all, for a caller that synchronizes there anyway (the end of a run, a test). A landed
    record's event and buffer serve later records: nothing is allocated per batch once they exist.
    """

    def __init__(self) -> None:
        # Per record: its host values (a tensor and the same memory as a numpy array), its event (None: on
        # CPU, or watched by a landed word), that word's index (None: none), whether the values are a
        # pinned buffer of ``host_buffer`` (kept for later records once landed), and ``fail``.
        self._pending: list[tuple[torch.Tensor, np.ndarray, torch.cuda.Event | None, int | None, bool, Callable]] = []
        # Events and pinned buffers of landed records, for later ones (created at first need).
        self._spare: list[torch.cuda.Event] = []
        self._buffers: list[torch.Tensor] = []
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}

    def host_buffer(self, numel: int, device: torch.device) -> torch.Tensor:
        """int64 ``[numel]`` for a ``watch`` record: pinned memory, one of a landed record's when one is
        large enough, on a CUDA ``device``; a plain tensor on CPU (the work writing it runs in line)."""
        return self.host_views(numel, device, numel)[0]

    def host_views(self, numel: int, device: torch.device, split: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """``host_buffer(numel, device)``, its words from ``split`` on, and the buffer as a numpy array (the
        same memory, for host writes and ``watch``), kept per buffer, length and split: a batch's sizes
        recur (host time: no slicing op per batch)."""
        buffers = self._buffers
        if buffers and buffers[-1].numel() >= numel:  # the buffer landed last (host time: no search)
            base = buffers.pop()
        else:
            i = next((i for i, b in enumerate(buffers) if b.numel() >= numel), None)
            if i is None:
                base = torch.empty(max(numel, 64), dtype=torch.int64, pin_memory=device.type == "cuda")
            else:
                base = buffers.pop(i)
        # Keyed by the buffer's identity: a cached view holds its buffer, so no other object takes its id.
        key = (id(base), numel, split)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 64:
                self._views.clear()
            buf = base[:numel]
            views = self._views[key] = (buf, buf[split:], buf.numpy())  # sync-ok: host memory
        return views

    def record(self, flags: torch.Tensor, fail: Callable[[list], Exception | None]) -> None:
        host = flags
        if flags.device.type == "cuda":
            host = self.host_buffer(flags.numel(), flags.device).view(flags.shape)
            host.copy_(flags, non_blocking=True)
        self.watch(host, fail, flags.device)

    def watch(
        self,
        host: torch.Tensor,
        fail: Callable[[list], Exception | None],
        device: torch.device,
        landed: int | None = None,
        array: np.ndarray | None = None,
    ) -> None:
        """Read ``host`` (from ``host_buffer``) once the work queued so far on ``device``'s current stream is
        done; with ``landed``, once that work has set ``host[landed]``, 0 when it was queued, to 1 (no
        event); on CPU at the next poll. ``array``: ``host`` as numpy (``host_views``), else taken here."""
        event, cuda = None, device.type == "cuda"
        if cuda and landed is None:
            event = self._spare.pop() if self._spare else torch.cuda.Event()
            event.record(current_stream(device))
        array = host.numpy() if array is None else array  # sync-ok: a host tensor
        self._pending.append((host, array, event, landed, cuda, fail))

    def poll(self, wait: bool = False) -> None:
        while self._pending:
            flags, array, event, landed, pinned, fail = self._pending[0]
            if not (array[landed] == 1 if landed is not None else event is None or event.query()):
                if not wait:
                    return  # not landed yet: read at a later poll, never waited for
                self._wait(event)
            self._pending.pop(0)
            host = array.tolist()  # sync-ok: host memory (its writes landed, or a CPU tensor)
            if event is not None:
                self._spare.append(event)
            if pinned:  # the pinned buffer serves later records
                self._buffers.append(flags if flags._base is None else flags._base)
            error = fail(host)
            if error is not None:
                # The later records are dropped, but their buffers stay held until they land: the launches
                # still in flight read and write them.
                self._pending = [(f, a, e, i, p, _no_error) for f, a, e, i, p, _ in self._pending if p]
                raise error

    @staticmethod
    def _wait(event: torch.cuda.Event | None) -> None:
        """Until the record lands (``poll(wait=True)`` only, where the caller synchronizes anyway)."""
        if event is not None:
            event.synchronize()  # sync-ok: see above
        else:  # a landed word not yet set: a CUDA launch queued to set it (on CPU it ran in line)
            torch.cuda.synchronize()  # sync-ok: see above

    @property
    def pending(self) -> int:
        return len(self._pending)


class OverflowCheck:
    """The overflow flags of planned batches, read only once they are on the host without waiting.

    ``record(plan, requests)`` after a batch is planned records the plan's ``status``
    (``DeviceFlagCheck``). ``poll()`` raises ``SlotOverflowError`` for the first recorded batch
    whose flag is set, among those whose copy has landed; ``poll(wait=True)`` waits for them all.
    """

    def __init__(self) -> None:
        self._flags = DeviceFlagCheck()

    def record(self, plan: SlotPlan, requests: Sequence[str] | None = None) -> None:
        if plan.status is None:
            return
        names = request_names(requests, len(plan.pages_per_req))
        slots = plan.slots_per_rank

        def fail(host: list) -> SlotOverflowError | None:
            return SlotOverflowError(overflow_message(host, slots, names)) if host[0] else None

        self._flags.record(plan.status, fail)

    def poll(self, wait: bool = False) -> None:
        self._flags.poll(wait=wait)

    @property
    def pending(self) -> int:
        return self._flags.pending
