"""The per-batch slot plan of the materialized view: where every page position of a batch lands.

A forward batch reads, for request ``b``, its logical pages ``page_table[b, :pages_b]``: request-major,
``M = sum(pages_b)`` page positions. Owner ``o`` of a page sends a block of ``S = sum(ceil(pages_b / N))``
pages; position ``(b, j)`` with owner ``o`` and rank ``r`` among the batch's positions with that owner is
entry ``r`` of the block. The view (``N * S`` pages) is the all-gather of the blocks, owner-major::

    slot(b, j) = o * S + r

The owner-rotating allocator spreads each request's pages over owners within one page, so a block never
overflows; that is its policy, not a law: a position past its owner's block gets a slot holding the trash
page and the plan's device ``status`` flags it, read ``VERDICT_LAG`` batches later on every rank at the same
batch (``DeviceFlagCheck``: ``SlotOverflowError``). Everything the plan sizes comes from host lengths: its
device work never syncs, and it is the same on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from sglang_cp_shared_kv.srt.environ import envs


def pages_for_lens(seq_lens: Sequence[int], page_size: int) -> list[int]:
    """Pages each request reads: ``ceil(seq_len / page_size)`` (host ints)."""
    return [-(-int(n) // page_size) for n in seq_lens]


def batch_kind(prefix_lens: Sequence[int]) -> str:
    """``current`` (no request reads a prefix: the chunk every rank holds after prefill CP's all-gather is
    all it reads, nothing is gathered), ``history`` (every request reads one) or ``mixed``; host ints."""
    with_prefix = [int(p) > 0 for p in prefix_lens]
    if not any(with_prefix):
        return "current"
    return "history" if all(with_prefix) else "mixed"


def slots_per_rank(pages_per_req: Sequence[int], cp_size: int) -> int:
    """``sum(ceil(pages_b / N))``: the pages every owner sends (its block)."""
    return sum(-(-int(p) // cp_size) for p in pages_per_req)


def plan_meta_rows(
    pages: Sequence[int], prefix_pages: Sequence[int] | None = None, hint: Sequence[tuple[int, int]] | None = None
) -> list[int]:
    """``plan_batch``'s ``meta`` as host ints, rows ``PLAN_META_ROWS`` of ``B`` each: request ``b`` has
    ``pages[b]`` pages, the first ``prefix_pages[b]`` prefix pages (default: all), the first ``hint[b] =
    (source, shared)`` of those the source's (default: none)."""
    prefix_pages = pages if prefix_pages is None else prefix_pages
    b = len(pages)
    shared = [0] * b if hint is None else [s for _, s in hint]
    starts, plan_starts, start, plan_start = [], [], 0, 0  # plain ints (host time)
    for total, prefix, skip in zip(pages, prefix_pages, shared):
        starts.append(start)
        plan_starts.append(plan_start)
        start += total - prefix
        plan_start += prefix - skip
    sources = [-1] * b if hint is None else [src for src, _ in hint]
    return [*shared, *prefix_pages, *pages, *starts, *sources, *plan_starts]


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


VERDICT_LAG = 2  # batches: batch k's flags are acted on when batch k + VERDICT_LAG begins


class FlagWaitTimeout(RuntimeError):
    """A batch's flags had not landed by their deadline: the device is stuck (e.g. a fence waiting on a peer)."""


class DeviceFlagCheck:
    """Device flags read on the host at a batch fixed in advance: one verdict per batch on every rank.

    ``host_views`` hands a buffer (pinned on CUDA) that queued work fills with flags; ``watch(host, fail)``
    records it for the current batch. ``next_batch()`` starts batch ``k`` and hands every record of batches
    ``<= k - lag`` to its ``fail``, oldest first, raising what ``fail`` returns. The ranks of a CP group run
    the same batches, so they raise at the same batch whatever their timing, before its collectives. Under
    SGLang's overlap scheduler a batch's outputs reach the host before the batch after next is scheduled, so
    with ``lag = 2`` due records have landed; one still pending is waited for up to ``deadline_s`` (then
    ``FlagWaitTimeout``). Read records' events and buffers serve later records.
    """

    def __init__(self, lag: int = VERDICT_LAG, deadline_s: float | None = None) -> None:
        self.lag = lag
        self.deadline_s = envs.SGLANG_CP_SHARED_KV_PEER_TIMEOUT.get() if deadline_s is None else deadline_s
        self.batch = 0  # the batch in progress (``next_batch`` calls so far)
        # Per record: batch, host values (tensor, numpy), event (None: CPU or a landed word), that word, pinned, fail.
        self._pending: list[tuple[int, torch.Tensor, np.ndarray, torch.cuda.Event | None, int | None, bool, Callable]]
        self._pending = []
        self._spare: list[torch.cuda.Event] = []  # events of read records
        self._buffers: list[torch.Tensor] = []  # buffers of read records

    def host_views(self, numel: int, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
        """int64 ``[numel]`` for a ``watch`` record (pinned on a CUDA ``device``), and the same memory as numpy."""
        i = next((i for i, b in enumerate(self._buffers) if b.numel() >= numel), None)
        if i is None:
            base = torch.empty(max(numel, 64), dtype=torch.int64, pin_memory=device.type == "cuda")
        else:
            base = self._buffers.pop(i)
        buf = base[:numel]
        return buf, buf.numpy()  # sync-ok: host memory

    def watch(
        self,
        host: torch.Tensor,
        fail: Callable[[list], Exception | None],
        device: torch.device,
        landed: int | None = None,
        array: np.ndarray | None = None,
    ) -> None:
        """Record ``host`` for the current batch, filled by the work queued so far on ``device``'s current
        stream; with ``landed``, that work sets ``host[landed]`` (0 when queued) to 1 last. ``array``: ``host``
        as numpy."""
        event, cuda = None, device.type == "cuda"
        if cuda and landed is None:
            event = self._spare.pop() if self._spare else torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        array = host.numpy() if array is None else array  # sync-ok: a host tensor
        self._pending.append((self.batch, host, array, event, landed, cuda, fail))

    def next_batch(self) -> None:
        self.batch += 1
        self._read(self.batch - self.lag)

    def poll(self, wait: bool = False) -> None:
        """Act on every record that has landed (``wait``: on every record, waiting for them)."""
        self._read(self.batch if wait else None)

    def _read(self, due: int | None) -> None:
        """Read the records of batches ``<= due`` (waiting for them), or with ``due=None`` those landed."""
        while self._pending:
            batch, flags, array, event, landed, pinned, fail = self._pending[0]
            if due is not None and batch > due:
                return
            if not self._landed(array, event, landed):
                if due is None:
                    return
                self._wait(batch, array, event, landed)
            self._pending.pop(0)
            host = array.tolist()  # sync-ok: host memory (its writes landed, or a CPU tensor)
            if event is not None:
                self._spare.append(event)
            if pinned:  # the pinned buffer serves later records
                self._buffers.append(flags if flags._base is None else flags._base)
            error = fail(host)
            if error is not None:
                # Later records' values are dropped; their pinned buffers stay held (launches in flight use them).
                self._pending = [(k, f, a, e, i, p, lambda _: None) for k, f, a, e, i, p, _ in self._pending if p]
                raise error

    @staticmethod
    def _landed(array: np.ndarray, event: torch.cuda.Event | None, landed: int | None) -> bool:
        return bool(array[landed] == 1) if landed is not None else event is None or event.query()

    def _wait(self, batch: int, array: np.ndarray, event: torch.cuda.Event | None, landed: int | None) -> None:
        """Until the record lands, at most ``deadline_s`` (host polling: no device-wide sync)."""
        deadline = time.monotonic() + self.deadline_s
        while not self._landed(array, event, landed):
            if time.monotonic() > deadline:
                raise FlagWaitTimeout(
                    f"--enable-cp-shared-kv: batch {batch}'s plan has not run on this rank after "
                    f"{self.deadline_s:g} s: the device is stuck (a fence waits for a peer that stopped?)"
                )
            time.sleep(50e-6)

    @property
    def pending(self) -> int:
        return len(self._pending)
