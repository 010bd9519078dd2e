"""Prefill side of the transfer: one sender per CP rank writes the pages that rank owns.

Lifecycle (on every prefill CP rank, with that rank's ``ShardedMLAPool``)::

    sender = OwnedPageSender(pool, engine, decode_address).start()  # hello -> bootstrap
    ...  # the decode side's add_request() pushes each request's destination pages here
    sender.submit("req-1", page_table)        # after the request's last prefill chunk
    sender.poll("req-1") / sender.wait("req-1", timeout_s) -> TransferState
    result = sender.pop("req-1")              # once finished: state, reason, bytes, entries, calls
    sender.close()

``page_table`` is the request's logical pages by position, the same on every rank.
The sender keeps the positions whose page this rank owns, coalesces pages that are
contiguous in its pool and in the destination into single entries, and writes every
layer's latent rows and indexer page with ``batch_transfer_sync_write`` (at most
``engine.max_entries_per_call`` entries a call) from the registered pool buffers.
It then reports a manifest (page table, positions, bytes) and waits for the decode
side's verdict: SUCCESS means the decode side checked all cp_size manifests.

Failures end in FAILED with a one-line reason, within ``timeout_s`` (default
``MC_TRANSFER_TIMEOUT``, at least 5 s): a failed write (dead peer: at once; frozen
peer: the engine's timeout), the decode side closing the connection or staying
silent for ``timeout_s``, destination pages or a verdict not arriving within
``timeout_s``, or a failed verdict. Other requests and the engine stay usable.
Freeing the request's prefill pages is the caller's job (every CP rank must free
the same pages in the same order: agree on the state first, e.g. an all-reduce MIN).
Writes run on one worker thread per sender, at the lowest CPU priority by default
(``low_priority_writes``): the engine's sync call spins while its transport threads
copy, and with several ranks on few cores the spinning would starve the copying.

A request can turn FAILED while its write still has one call in flight; that call
only reads the source pages, and the decode side keeps the destination pages until
this rank reports that it stopped (or its connection is gone), so freeing at once is safe.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from sglang_cp_shared_kv.reference.mooncake import control_messages as cm
from sglang_cp_shared_kv.reference.mooncake.control_channel import ControlLoop, FramedConnection
from sglang_cp_shared_kv.reference.mooncake.engine import MooncakeEngine, TransferError, transfer_timeout_s
from sglang_cp_shared_kv.reference.mooncake.page_runs import (
    BufferPair,
    coalesce_runs,
    owned_positions,
    transfer_entries,
)
from sglang_cp_shared_kv.reference.mooncake.transfer_state import TransferState
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.mem_cache.placement import debug_enabled

logger = logging.getLogger(__name__)

_POPPED_MEMORY = 4096


@dataclass
class SendResult:
    """What one request's transfer did on this rank."""

    request_id: str
    state: TransferState
    reason: str = ""
    pages: int = 0  # owned pages sent
    nbytes: int = 0
    entries: int = 0
    calls: int = 0
    write_s: float = 0.0  # time inside batch_transfer_sync_write calls
    total_s: float = 0.0  # submit -> finished


@dataclass
class _Request:
    request_id: str
    page_table: torch.Tensor
    submitted: float
    result: SendResult
    deadline: float  # for the current waiting state
    reported: bool = False  # manifest or failed sent to the decode side


class OwnedPageSender(ControlLoop):
    """Sends this CP rank's owned pages of finished requests to one decode receiver."""

    def __init__(
        self,
        pool: ShardedMLAPool,
        engine: MooncakeEngine,
        decode_address: str,
        timeout_s: float | None = None,
        heartbeat_s: float | None = None,
        low_priority_writes: bool = True,
    ):
        host, _, port = decode_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"decode_address must be 'host:port', got {decode_address!r}")
        self.timeout_s = transfer_timeout_s() if timeout_s is None else float(timeout_s)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.heartbeat_s = min(1.0, self.timeout_s / 5) if heartbeat_s is None else float(heartbeat_s)
        super().__init__(f"cp-kv-sender-rank{pool.rank}", tick_s=min(0.1, self.heartbeat_s))
        self.pool = pool
        self.engine = engine
        self.rank = pool.rank
        self.cp_size = pool.ownership.cp_size
        self.decode_address = (host, int(port))
        self.layout = cm.PoolLayout.of(pool)
        self._buffers = list(pool.latent) + list(pool.index)
        for buf in self._buffers:
            engine.register(buf)
        self._lock = threading.Condition()
        self._conn: FramedConnection | None = None
        self._bootstrap: cm.Bootstrap | None = None
        self._lost: str | None = None  # why the decode side is gone; set once
        self._last_seen = 0.0
        self._last_sent = 0.0
        self._requests: dict[str, _Request] = {}
        self._dst: dict[str, tuple[int, ...]] = {}  # destination pages, possibly before submit
        self._early_verdicts: dict[str, str] = {}  # failed verdicts for requests not submitted yet
        self._popped: OrderedDict[str, None] = OrderedDict()  # recently forgotten ids: late verdicts are no news
        self.rejected: list[str] = []
        self._work: queue.Queue[str | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work_loop, name=f"cp-kv-sender-worker{self.rank}", daemon=True)
        self._low_priority_writes = low_priority_writes
        self._closed = False

    def __repr__(self) -> str:
        return f"OwnedPageSender(rank={self.rank}/{self.cp_size}, decode={self.decode_address})"

    # ------------------------------------------------------------------ API (any thread)
    def start(self, connect_timeout_s: float | None = None) -> OwnedPageSender:
        """Connect, say hello, and wait for the decode side's bootstrap; raise if refused or silent."""
        limit = self.timeout_s if connect_timeout_s is None else connect_timeout_s
        deadline = time.monotonic() + limit
        sock = None
        while sock is None:
            try:
                sock = socket.create_connection(self.decode_address, timeout=max(0.1, deadline - time.monotonic()))
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"cannot reach decode receiver at {self.decode_address}: {e}") from None
                time.sleep(0.1)
        self._conn = FramedConnection(sock, peer="decode {}:{}".format(*self.decode_address))
        self._last_seen = time.monotonic()
        hello = cm.encode(cm.Hello(self.rank, self.cp_size, self.engine.session_id, self.layout))

        def greet() -> None:
            self.watch(self._conn)
            self.send(self._conn, hello)

        self.call_soon(greet)
        self.start_loop()
        self._worker.start()
        with self._lock:
            self._lock.wait_for(
                lambda: self._bootstrap is not None or self._lost is not None, max(0.0, deadline - time.monotonic())
            )
            if self._bootstrap is None:
                reason = self._lost or f"no bootstrap within {limit:g} s"
        if self._bootstrap is None:
            self.close()
            raise ConnectionError(f"rank {self.rank}: decode receiver did not accept this sender: {reason}")
        return self

    def submit(self, request_id: str, page_table: torch.Tensor) -> None:
        """Send ``request_id``'s owned pages once its destination pages are known. Never blocks."""
        cm._REQUEST_ID("request_id", request_id)
        if (
            not isinstance(page_table, torch.Tensor)
            or page_table.dim() != 1
            or page_table.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError("page_table must be a 1-D int32/int64 tensor of logical pages")
        table = page_table.to(device="cpu", dtype=torch.int64)
        if table.numel() == 0 or int(table.min()) < 0:
            raise ValueError("page_table must be non-empty with logical pages >= 0")
        phys = self.pool.ownership.phys_page(table[self.pool.ownership.owner(table) == self.rank])
        if phys.numel() and int(phys.max()) >= self.pool.phys_pages:
            raise ValueError(f"page_table holds a page past this rank's {self.pool.phys_pages} physical pages")
        now = time.monotonic()
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} was already submitted")
            req = _Request(request_id, table, now, SendResult(request_id, TransferState.WAITING), now + self.timeout_s)
            self._requests[request_id] = req
            if self._closed or self._lost is not None:
                self._set_failed(req, f"decode side lost: {self._lost or 'sender closed'}")
                return
            early = self._early_verdicts.pop(request_id, None)
            if early is not None:
                req.reported = True  # the decode side already has our 'failed' for it
                self._set_failed(req, f"decode side failed the request: {early}")
                return
            if request_id in self._dst:
                self._start_transfer(req)

    def poll(self, request_id: str) -> TransferState:
        with self._lock:
            return self._get(request_id).result.state

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferState:
        """Block until SUCCESS or FAILED (or ``timeout_s``, default twice the transfer timeout)."""
        limit = 2 * self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            req = self._get(request_id)
            self._lock.wait_for(lambda: req.result.state.finished, limit)
            return req.result.state

    def result(self, request_id: str) -> SendResult:
        with self._lock:
            r = self._get(request_id).result
            return SendResult(**vars(r))

    def pop(self, request_id: str) -> SendResult:
        """Forget a finished request and return its result."""
        with self._lock:
            req = self._get(request_id)
            if not req.result.state.finished:
                raise ValueError(f"request {request_id!r} is still {req.result.state.name}")
            del self._requests[request_id]
            self._dst.pop(request_id, None)
            self._popped[request_id] = None
            if len(self._popped) > _POPPED_MEMORY:
                self._popped.popitem(last=False)
            return SendResult(**vars(req.result))

    def destination_pages(self, request_id: str) -> tuple[int, ...] | None:
        """The decode pages announced for ``request_id`` (position ``p`` goes to ``[p]``), or None yet."""
        with self._lock:
            return self._dst.get(request_id)

    @property
    def decode_lost(self) -> str | None:
        """Why the decode side is gone, or None while it is connected."""
        with self._lock:
            return self._lost

    def close(self) -> None:
        """Stop the threads, fail pending requests, unregister the pool (the engine stays usable)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._work.put(None)
        self.stop_loop()
        if self._worker.is_alive():
            self._worker.join(2 * self.timeout_s)
        with self._lock:
            for req in self._requests.values():
                if not req.result.state.finished:
                    self._set_failed(req, "sender closed")
        for buf in self._buffers:
            self.engine.unregister(buf)

    # ------------------------------------------------------------------ loop thread
    def on_frame(self, conn: FramedConnection, data: bytes) -> None:
        try:
            msg = cm.decode(data)
        except cm.ControlMessageError as e:
            self._reject(str(e))
            return
        with self._lock:
            self._last_seen = time.monotonic()
            if isinstance(msg, cm.Bootstrap):
                self._on_bootstrap(msg)
            elif isinstance(msg, cm.Reject):
                self._lose(f"hello refused: {msg.reason}")
            elif self._bootstrap is None:
                self._reject(f"{msg.TYPE} before bootstrap")
            elif isinstance(msg, cm.DstPages):
                self._on_dst(msg)
            elif isinstance(msg, cm.Verdict):
                self._on_verdict(msg)
            elif not isinstance(msg, cm.Heartbeat):
                self._reject(f"decode side sent a {msg.TYPE} message, which only senders send")

    def on_closed(self, conn: FramedConnection, reason: str) -> None:
        with self._lock:
            self._lose(reason)

    def on_tick(self, now: float) -> None:
        with self._lock:
            if self._lost is None and self._conn is not None:
                if now - self._last_seen > self.timeout_s:
                    self.drop(
                        self._conn,
                        f"decode side silent for {now - self._last_seen:.1f} s (timeout {self.timeout_s:g} s)",
                    )
                    return
                if now - self._last_sent >= self.heartbeat_s:
                    self._last_sent = now
                    self.send(self._conn, cm.encode(cm.Heartbeat()))
            for req in self._requests.values():
                state = req.result.state
                if state in (TransferState.WAITING, TransferState.WAITING_VERDICT) and now > req.deadline:
                    what = "destination pages" if state == TransferState.WAITING else "a verdict"
                    self._set_failed(req, f"no {what} from the decode side within {self.timeout_s:g} s")
                    self._report_failed(req)

    # ------------------------------------------------------------------ handlers (loop thread, lock held)
    def _on_bootstrap(self, msg: cm.Bootstrap) -> None:
        if self._bootstrap is not None:
            self._reject("second bootstrap")
            return
        problem = self.layout.mismatch(msg.layout)
        if problem is not None:
            self._lose(f"decode pool layout does not match: {problem}")
            return
        self._bootstrap = msg
        self._lock.notify_all()

    def _on_dst(self, msg: cm.DstPages) -> None:
        if max(msg.dst_pages, default=0) >= self._bootstrap.num_pages:
            self._reject(
                f"dst_pages for {msg.request_id!r} names a page past the decode pool's {self._bootstrap.num_pages}"
            )
            return
        if msg.request_id in self._dst:
            self._reject(f"second dst_pages for {msg.request_id!r}")
            return
        self._dst[msg.request_id] = msg.dst_pages
        req = self._requests.get(msg.request_id)
        if req is not None and req.result.state == TransferState.WAITING:
            self._start_transfer(req)

    def _on_verdict(self, msg: cm.Verdict) -> None:
        req = self._requests.get(msg.request_id)
        if req is None:
            if not msg.ok and msg.request_id not in self._popped:  # not submitted yet: promise not to write it
                self._early_verdicts[msg.request_id] = msg.reason
                self.send(
                    self._conn,
                    cm.encode(cm.Failed(msg.request_id, self.rank, "failed by the decode side before submit")),
                )
            return
        if req.result.state.finished:
            return
        if msg.ok:
            if req.result.state != TransferState.WAITING_VERDICT:
                self._reject(f"success verdict for {msg.request_id!r} before this rank reported it")
                return
            req.result.state = TransferState.SUCCESS
            req.result.total_s = time.monotonic() - req.submitted
            self._lock.notify_all()
            return
        was = req.result.state
        self._set_failed(req, f"decode side failed the request: {msg.reason}")
        if was == TransferState.WAITING:
            self._report_failed(req)  # nothing in flight: acknowledge now
        # TRANSFERRING: the worker stops before its next call and acknowledges

    def _lose(self, reason: str) -> None:
        if self._lost is not None:
            return
        self._lost = reason
        logger.warning("rank %d: decode side lost: %s", self.rank, reason)
        if self._conn is not None:
            self.drop(self._conn, reason)
        for req in self._requests.values():
            if not req.result.state.finished:
                self._set_failed(req, f"decode side lost: {reason}")
        self._lock.notify_all()

    def _reject(self, reason: str) -> None:
        logger.warning("rank %d: rejected control message: %s", self.rank, reason)
        self.rejected.append(reason)

    # ------------------------------------------------------------------ shared (lock held)
    def _start_transfer(self, req: _Request) -> None:
        dst = self._dst[req.request_id]
        if len(dst) != req.page_table.numel():
            self._set_failed(req, f"decode side gave {len(dst)} destination pages for {req.page_table.numel()} pages")
            self._report_failed_soon(req)
            return
        req.result.state = TransferState.TRANSFERRING
        self._work.put(req.request_id)

    def _set_failed(self, req: _Request, reason: str) -> None:
        if req.result.state.finished:
            return
        req.result.state, req.result.reason = TransferState.FAILED, reason
        req.result.total_s = time.monotonic() - req.submitted
        self._lock.notify_all()

    def _report_failed(self, req: _Request) -> None:
        """Tell the decode side this rank will not write ``req`` (loop thread)."""
        if req.reported or self._lost is not None or self._conn is None:
            return
        req.reported = True
        self.send(self._conn, cm.encode(cm.Failed(req.request_id, self.rank, req.result.reason[: cm.MAX_REASON_CHARS])))

    def _send_to_decode(self, payload: bytes) -> None:
        if self._conn is not None and self._lost is None:
            self.send(self._conn, payload)

    def _report_failed_soon(self, req: _Request) -> None:
        self.call_soon(lambda: self._locked(self._report_failed, req))

    def _locked(self, fn, *args) -> None:
        with self._lock:
            fn(*args)

    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return req

    # ------------------------------------------------------------------ worker thread
    def _work_loop(self) -> None:
        if self._low_priority_writes:
            # batch_transfer_sync_write spins on the batch status until the engine's own
            # threads finish the copy. At the lowest priority (this thread only) the spin
            # takes no CPU that the transport threads, here or in a co-located decode
            # server, could use; the call's latency stays the same.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (AttributeError, OSError):
                pass
        while True:
            request_id = self._work.get()
            if request_id is None:
                return
            try:
                self._transfer(request_id)
            except Exception as e:  # keep serving other requests
                logger.exception("rank %d: transfer of %s crashed", self.rank, request_id)
                with self._lock:
                    req = self._requests.get(request_id)
                    if req is not None:
                        self._set_failed(req, f"sender error: {type(e).__name__}: {e}")
                        self._report_failed_soon(req)

    def _plan(self, req: _Request) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        boot, pool, own = self._bootstrap, self.pool, self.pool.ownership
        positions = owned_positions(req.page_table, own, self.rank)
        src_pages = own.phys_page(req.page_table[positions]).numpy()
        dst_pages = np.asarray(self._dst[req.request_id], dtype=np.int64)[positions.numpy()]
        runs = coalesce_runs(src_pages, dst_pages)
        ps = pool.page_size
        buffers = [
            BufferPair(pool.latent[i].data_ptr(), boot.latent_base[i], ps * pool.row_bytes)
            for i in range(pool.num_layers)
        ]
        buffers += [
            BufferPair(pool.index[i].data_ptr(), boot.index_base[i], ps * INDEX_TOKEN_BYTES)
            for i in range(len(pool.index))
        ]
        src, dst, lengths = transfer_entries(runs, buffers)
        if debug_enabled():  # every source byte must lie in memory this engine registered
            bad = [i for i in range(src.size) if not self.engine.is_registered(int(src[i]), int(lengths[i]))]
            if bad:
                raise AssertionError(
                    f"rank {self.rank}: {len(bad)} entries read outside registered memory (first {bad[0]})"
                )
        return positions.numpy(), src, dst, lengths

    def _transfer(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.result.state != TransferState.TRANSFERRING:
                return
            positions, src, dst, lengths = self._plan(req)
            peer = self._bootstrap.session_id
        res = req.result
        res.pages, res.entries, res.nbytes = int(positions.size), int(src.size), int(lengths.sum())
        t0 = time.monotonic()
        error = None
        try:
            res.calls = self.engine.write(
                peer, src, dst, lengths, lambda: req.result.state == TransferState.TRANSFERRING
            )
        except TransferError as e:
            error, res.calls = str(e), e.calls
        res.write_s = time.monotonic() - t0
        manifest = None
        with self._lock:
            if error is None and res.state == TransferState.TRANSFERRING:
                res.state = TransferState.WAITING_VERDICT
                req.deadline = time.monotonic() + self.timeout_s
                manifest = cm.Manifest(
                    request_id, self.rank, tuple(req.page_table.tolist()), tuple(positions.tolist()), res.nbytes
                )
                req.reported = True
            else:
                self._set_failed(req, error or res.reason)
        if manifest is not None:
            payload = cm.encode(manifest)
            self.call_soon(lambda: self._send_to_decode(payload))
        else:
            self._report_failed_soon(req)
