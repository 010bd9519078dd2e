"""The per-batch slot plan's host side: its sizes and lengths from host ints, and the
device flags it raises, read back ``VERDICT_LAG`` batches later on every rank alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np
import torch

from sglang_cp_shared_kv.srt.environ import envs


def pages_for_lens(seq_lens: Sequence[int], page_size: int) -> list[int]:
    """Pages each request reads: ``ceil(seq_len / page_size)``."""
    return [-(-int(n) // page_size) for n in seq_lens]


def batch_kind(prefix_lens: Sequence[int]) -> str:
    """``current`` (no request reads a prefix: nothing is gathered), ``history`` (every
    request reads one) or ``mixed``."""
    with_prefix = [int(p) > 0 for p in prefix_lens]
    if not any(with_prefix):
        return "current"
    return "history" if all(with_prefix) else "mixed"


def slots_per_rank(pages_per_req: Sequence[int], cp_size: int) -> int:
    """``sum(ceil(pages_b / N))``: the pages every owner sends (its block)."""
    return sum(-(-int(p) // cp_size) for p in pages_per_req)


def plan_meta_rows(
    pages: Sequence[int],
    prefix_pages: Sequence[int] | None = None,
    hint: Sequence[tuple[int, int]] | None = None,
) -> list[int]:
    """``plan_batch``'s ``meta``: request ``b`` has ``pages[b]`` pages, the first
    ``prefix_pages[b]`` of them prefix pages (default: all), the first ``shared`` of
    those its source's, ``hint[b] = (source, shared)`` (default: none)."""
    prefix_pages = pages if prefix_pages is None else prefix_pages
    hint = [(-1, 0)] * len(pages) if hint is None else hint
    sources, shared = [src for src, _ in hint], [s for _, s in hint]
    starts = list(accumulate((t - p for t, p in zip(pages, prefix_pages)), initial=0))
    firsts = list(accumulate((p - s for p, s in zip(prefix_pages, shared)), initial=0))
    return [*shared, *prefix_pages, *pages, *starts[:-1], *sources, *firsts[:-1]]


class SlotOverflowError(RuntimeError):
    """A batch's page positions overflowed an owner's block and read the trash page."""


def overflow_message(status: Sequence[int], block: int, requests: Sequence[str]) -> str:
    """One line naming the batch's requests and the owners' page counts."""
    counts = [int(c) for c in status[1:]]
    return (
        "--enable-cp-shared-kv: slot overflow: the batch of requests "
        f"[{', '.join(requests)}] reads {counts} page positions from owners "
        f"0..{len(counts) - 1}, more than the {block} pages of an owner's "
        "block (the pages of a request do not rotate owners); those positions read "
        "the trash page, so the batch fails"
    )


def request_names(requests: Sequence[object] | None, count: int) -> list[str]:
    """The names an error gives a batch's ``count`` requests: their ids, else ``#b``."""
    names = [str(r) for r in requests] if requests is not None else []
    return names if len(names) == count else [f"#{b}" for b in range(count)]


VERDICT_LAG = 2  # batch k's flags are acted on when batch k + VERDICT_LAG begins


class FlagWaitTimeout(RuntimeError):
    """A batch's flags had not landed by their deadline: the device is stuck."""


class DeviceFlagCheck:
    """Device flags read on the host at a batch fixed in advance, so that every rank of
    a CP group raises at the same batch, before its collectives, whatever its timing.

    ``watch(host, fail)`` records a buffer from ``host_views`` that queued work fills;
    ``next_batch()`` starts batch ``k`` and hands the records of batches up to ``k -
    VERDICT_LAG`` to their ``fail``, oldest first, raising what it returns."""

    def __init__(self, deadline_s: float | None = None) -> None:
        if deadline_s is None:
            deadline_s = envs.SGLANG_CP_SHARED_KV_PEER_TIMEOUT.get()
        self.deadline_s = deadline_s
        self.batch = 0  # the batch in progress (``next_batch`` calls so far)
        # Per record: batch, host tensor, its numpy array, event (None: CPU or a landed
        # word), that word's index, whether pinned, fail.
        self._pending: list[tuple] = []
        self._spare: list[torch.cuda.Event] = []  # events of read records
        self._buffers: list[torch.Tensor] = []  # buffers of read records

    def host_views(self, numel: int, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
        """int64 ``[numel]``, pinned on a CUDA ``device``, and its memory as numpy."""
        i = next((i for i, b in enumerate(self._buffers) if b.numel() >= numel), None)
        if i is None:
            pin = device.type == "cuda"
            base = torch.empty(max(numel, 64), dtype=torch.int64, pin_memory=pin)
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
        """Record ``host`` for the current batch, filled by the work queued so far on
        ``device``'s current stream; with ``landed``, that work sets ``host[landed]``
        (0 when queued) to 1 last. ``array``: ``host`` as numpy."""
        event, cuda = None, device.type == "cuda"
        if cuda and landed is None:
            event = self._spare.pop() if self._spare else torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        array = host.numpy() if array is None else array  # sync-ok: a host tensor
        self._pending.append((self.batch, host, array, event, landed, cuda, fail))

    def next_batch(self) -> None:
        self.batch += 1
        self._read(self.batch - VERDICT_LAG)

    def poll(self, wait: bool = False) -> None:
        """Act on every record that has landed (``wait``: on every record)."""
        self._read(self.batch if wait else None)

    def _read(self, due: int | None) -> None:
        """Act on the records of batches ``<= due``, waiting up to ``deadline_s`` for
        each (host polling: no device sync); with ``due=None``, on those landed."""
        while self._pending:
            batch, flags, array, event, word, pinned, fail = self._pending[0]
            if due is not None and batch > due:
                return
            deadline = time.monotonic() + self.deadline_s
            while not (event.query() if event else word is None or array[word] == 1):
                if due is None:
                    return
                if time.monotonic() > deadline:
                    raise FlagWaitTimeout(
                        f"--enable-cp-shared-kv: batch {batch}'s plan has not run on "
                        f"this rank after {self.deadline_s:g} s: the device is stuck "
                        "(a fence waits for a peer that stopped?)"
                    )
                time.sleep(50e-6)
            self._pending.pop(0)
            if event is not None:
                self._spare.append(event)
            if pinned:  # the pinned buffer serves later records
                self._buffers.append(flags if flags._base is None else flags._base)
            error = fail(array.tolist())  # sync-ok: host memory, its writes landed
            if error is not None:
                # Later records: values dropped, buffers held (launches may use them).
                pinned_only = [r[:-1] for r in self._pending if r[5]]
                self._pending = [(*r, lambda _: None) for r in pinned_only]
                raise error

    @property
    def pending(self) -> int:
        return len(self._pending)
