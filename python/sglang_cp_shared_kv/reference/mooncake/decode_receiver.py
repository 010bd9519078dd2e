"""Decode side of the owned-page transfer: hands out destination pages, collects manifests.

Lifecycle::

    pool = make_decode_pool(page_size, num_pages, num_layers, kv_format)
    receiver = DecodeReceiver(pool, engine, cp_size).start()   # listens on receiver.address
    receiver.wait_for_senders(timeout_s)                           # the cp_size prefill ranks said hello
    dst = receiver.add_request("req-1", n_pages)                   # pages, or None if the pool is full
    receiver.wait("req-1", timeout_s)  -> TransferState.SUCCESS | FAILED
    ... decode reads pool pages dst[0 .. n_pages-1] ...
    receiver.release("req-1")                                      # pages back to the allocator
    receiver.close()

The receiver owns the pool's page allocator (its loop thread frees failed requests'
pages); take other pages through ``alloc_pages`` / ``free_pages``, which share its lock.

``add_request`` sends the destination page list to every connected sender (and to
any that connects later), so a sender knows ``dst`` before its prefill ends.

A request becomes SUCCESS only when all cp_size manifests pass ``ManifestCollector``.
It FAILS, with a one-line reason, on a bad manifest, a ``failed`` report, the loss
of any sender (closed connection, or silence for ``timeout_s``), a sender that
stays silent ``timeout_s`` after another reported, or its own deadline. A failed
request's pages go back to the allocator as soon as no sender can still be writing
them: every rank has reported (manifest or failed) or is gone. Malformed messages
are dropped and listed in ``rejected``; they change nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from sglang_cp_shared_kv.reference.mooncake import control_messages as cm
from sglang_cp_shared_kv.reference.mooncake.control_channel import ControlLoop, FramedConnection
from sglang_cp_shared_kv.reference.mooncake.decode_pool import DecodePageAllocator
from sglang_cp_shared_kv.reference.mooncake.engine import MooncakeEngine, transfer_timeout_s
from sglang_cp_shared_kv.reference.mooncake.transfer_state import TransferState
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest import ManifestCollector, ManifestError
from sglang_cp_shared_kv.srt.utils import check_int

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    conn: FramedConnection
    last_seen: float
    last_sent: float = 0.0


@dataclass
class _Request:
    request_id: str
    dst: torch.Tensor
    collector: ManifestCollector
    deadline: float | None
    state: TransferState = TransferState.WAITING
    reason: str = ""
    first_report: float | None = None
    finished_at: float | None = None
    reported: set[int] = field(default_factory=set)  # ranks that sent manifest or failed: done writing
    sent_to: set[int] = field(default_factory=set)  # ranks that were given dst
    pages_held: bool = True
    released: bool = False


class DecodeReceiver(ControlLoop):
    """Receives one request's KV from ``cp_size`` owned-page senders into a full decode pool."""

    def __init__(
        self,
        pool: ShardedMLAPool,
        engine: MooncakeEngine,
        cp_size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float | None = None,
        heartbeat_s: float | None = None,
    ):
        if pool.ownership.cp_size != 1:
            raise ValueError(f"pool must be a full decode pool (cp_size 1), got cp_size {pool.ownership.cp_size}")
        check_int("cp_size", cp_size, 1)
        self.timeout_s = transfer_timeout_s() if timeout_s is None else float(timeout_s)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.heartbeat_s = min(1.0, self.timeout_s / 5) if heartbeat_s is None else float(heartbeat_s)
        super().__init__("cp-kv-decode-receiver", tick_s=min(0.1, self.heartbeat_s))
        self.pool = pool
        self.engine = engine
        self.cp_size = cp_size
        self.layout = cm.PoolLayout.of(pool)
        self.allocator = DecodePageAllocator(pool.phys_pages)
        self._buffers = list(pool.latent) + list(pool.index)
        for buf in self._buffers:
            engine.register(buf)
        self._bootstrap = cm.encode(
            cm.Bootstrap(
                session_id=engine.session_id,
                num_pages=pool.phys_pages,
                layout=self.layout,
                latent_base=tuple(t.data_ptr() for t in pool.latent),
                index_base=tuple(t.data_ptr() for t in pool.index),
            )
        )
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, port))
        self._lsock.listen(64)
        self.address = f"{host}:{self._lsock.getsockname()[1]}"
        self._lock = threading.Condition()
        self._peers: dict[int, _Peer] = {}
        self._unnamed: dict[FramedConnection, float] = {}  # accepted, no hello yet
        self._requests: dict[str, _Request] = {}
        self.rejected: deque[str] = deque(maxlen=256)  # malformed or out-of-place messages, newest last
        self._closed = False

    def __repr__(self) -> str:
        return f"DecodeReceiver(address={self.address!r}, cp_size={self.cp_size}, senders={sorted(self._peers)})"

    # ------------------------------------------------------------------ API (any thread)
    def start(self) -> DecodeReceiver:
        self.call_soon(lambda: self.listen(self._lsock))
        self.start_loop()
        return self

    def wait_for_senders(self, timeout_s: float) -> bool:
        """Block until all ``cp_size`` senders are connected (True) or ``timeout_s`` passes (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._peers) == self.cp_size, timeout_s)

    @property
    def connected_ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._peers)

    def add_request(self, request_id: str, n_pages: int, deadline_s: float | None = None) -> torch.Tensor | None:
        """Allocate destination pages for ``request_id`` and announce them to the senders.

        Returns the pages (position ``p`` goes to ``pages[p]``), or ``None`` if the pool
        lacks ``n_pages`` free pages. ``deadline_s`` (optional) fails the request if it
        is not complete that many seconds from now.
        """
        cm._REQUEST_ID("request_id", request_id)
        check_int("n_pages", n_pages, 1)
        with self._lock:
            if self._closed:
                raise RuntimeError("receiver is closed")
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already registered")
            dst = self.allocator.alloc(n_pages, self.cp_size)
            if dst is None:
                return None
            collector = ManifestCollector(request_id, n_pages, self.cp_size, self.pool.page_bytes)
            deadline = None if deadline_s is None else time.monotonic() + deadline_s
            self._requests[request_id] = _Request(request_id, dst, collector, deadline)
        self.call_soon(lambda: self._announce(request_id))
        return dst

    def poll(self, request_id: str) -> TransferState:
        with self._lock:
            return self._get(request_id).state

    def wait(self, request_id: str, timeout_s: float) -> TransferState:
        """Block until the request is SUCCESS or FAILED, or ``timeout_s`` passes; return its state."""
        with self._lock:
            req = self._get(request_id)
            self._lock.wait_for(lambda: req.state.finished, timeout_s)
            return req.state

    def failure_reason(self, request_id: str) -> str:
        with self._lock:
            return self._get(request_id).reason

    def dst_pages(self, request_id: str) -> torch.Tensor:
        with self._lock:
            return self._get(request_id).dst

    def pages_held(self, request_id: str) -> bool:
        """Whether the request still holds decode pages (False once a failed request's pages are freed)."""
        with self._lock:
            return self._get(request_id).pages_held

    def release(self, request_id: str) -> None:
        """The caller is done with ``request_id``: free its pages (now, or once no sender can write them)."""
        with self._lock:
            req = self._get(request_id)
            req.released = True
            if req.state == TransferState.SUCCESS:
                self._free(req)
            self._forget_if_done(req)
            waiting = req.state == TransferState.WAITING
        if waiting:  # failing tells the senders: socket work belongs to the loop thread
            self.call_soon(lambda: self._fail_if_waiting(request_id, "released by the caller before it was complete"))

    def _fail_if_waiting(self, request_id: str, reason: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None and req.state == TransferState.WAITING:
                self._fail(req, reason)

    # -- pages outside transfers (e.g. for tokens decode appends), under the receiver's lock --
    def alloc_pages(self, n_pages: int) -> torch.Tensor | None:
        """``n_pages`` pool pages for the caller's own use, or None; give them back with ``free_pages``."""
        with self._lock:
            return self.allocator.alloc(n_pages)

    def free_pages(self, pages: torch.Tensor | list[int]) -> None:
        with self._lock:
            self.allocator.free(pages)

    @property
    def free_page_count(self) -> int:
        with self._lock:
            return self.allocator.free_pages

    def close(self) -> None:
        """Stop the control loop, fail what is pending, unregister the pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.stop_loop()
        with self._lock:
            for req in self._requests.values():
                if req.state == TransferState.WAITING:
                    req.state, req.reason = TransferState.FAILED, "receiver closed"
            self._lock.notify_all()
        for buf in self._buffers:
            self.engine.unregister(buf)

    # ------------------------------------------------------------------ loop thread
    def on_accept(self, conn: FramedConnection) -> None:
        with self._lock:
            self._unnamed[conn] = time.monotonic()

    def on_frame(self, conn: FramedConnection, data: bytes) -> None:
        try:
            msg = cm.decode(data)
        except cm.ControlMessageError as e:
            self._reject(conn, str(e))
            return
        with self._lock:
            rank = conn.context
            if isinstance(msg, cm.Hello):
                self._on_hello(conn, msg)
                return
            if rank is None:
                self._reject(conn, f"{msg.TYPE} before hello")
                return
            self._peers[rank].last_seen = time.monotonic()
            if isinstance(msg, cm.Heartbeat):
                return
            if isinstance(msg, (cm.Manifest, cm.Failed)):
                self._on_report(rank, msg)
            else:
                self._reject(conn, f"rank {rank} sent a {msg.TYPE} message, which only the decode side sends")

    def on_closed(self, conn: FramedConnection, reason: str) -> None:
        with self._lock:
            self._unnamed.pop(conn, None)
            rank = conn.context
            if rank is None or rank not in self._peers or self._peers[rank].conn is not conn:
                return
            del self._peers[rank]
            for req in list(self._requests.values()):
                if req.state == TransferState.WAITING and rank in req.sent_to:
                    self._fail(req, f"sender rank {rank} lost: {reason}")
                self._maybe_free(req)
                self._forget_if_done(req)

    def on_tick(self, now: float) -> None:
        hb = cm.encode(cm.Heartbeat())
        with self._lock:
            for peer in list(self._peers.values()):
                if now - peer.last_seen > self.timeout_s:
                    self.drop(peer.conn, f"no message for {now - peer.last_seen:.1f} s (timeout {self.timeout_s:g} s)")
                elif now - peer.last_sent >= self.heartbeat_s:
                    peer.last_sent = now
                    self.send(peer.conn, hb)
            for conn, since in list(self._unnamed.items()):
                if now - since > self.timeout_s:
                    self.drop(conn, "no hello")
            for req in list(self._requests.values()):
                if req.state != TransferState.WAITING:
                    continue
                if req.first_report is not None and now - req.first_report > self.timeout_s:
                    missing = sorted(set(range(self.cp_size)) - req.reported)
                    self._fail(req, f"ranks {missing} sent no manifest within {self.timeout_s:g} s of the first")
                elif req.deadline is not None and now > req.deadline:
                    self._fail(req, "deadline passed before every manifest arrived")

    def on_stop(self) -> None:
        self._lsock.close()

    # ------------------------------------------------------------------ handlers (loop thread, lock held)
    def _on_hello(self, conn: FramedConnection, msg: cm.Hello) -> None:
        if conn.context is not None:  # the connection keeps its rank; a protocol slip, not a refusal
            self._reject(conn, "second hello on one connection")
            return
        problem = None
        if msg.cp_size != self.cp_size:
            problem = f"cp_size {msg.cp_size} does not match the {self.cp_size} senders this receiver expects"
        elif msg.rank in self._peers:
            problem = f"rank {msg.rank} is already connected"
        else:
            problem = self.layout.mismatch(msg.layout)
        if problem is not None:
            self._reject(conn, f"hello refused: {problem}")
            self.send(conn, cm.encode(cm.Reject(problem)))
            return
        self._unnamed.pop(conn, None)
        conn.context = msg.rank
        self._peers[msg.rank] = _Peer(conn, time.monotonic())
        self.send(conn, self._bootstrap)
        for req in self._requests.values():
            if req.state == TransferState.WAITING:
                self._send_dst(req, msg.rank)
        self._lock.notify_all()

    def _announce(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state != TransferState.WAITING:
                return
            for rank in list(self._peers):
                self._send_dst(req, rank)

    def _send_dst(self, req: _Request, rank: int) -> None:
        peer = self._peers.get(rank)  # a failed send can drop a peer while we iterate
        if peer is None or rank in req.sent_to:
            return
        req.sent_to.add(rank)
        self.send(peer.conn, cm.encode(cm.DstPages(req.request_id, tuple(req.dst.tolist()))))

    def _on_report(self, rank: int, msg: cm.Manifest | cm.Failed) -> None:
        if msg.rank != rank:
            self._reject(None, f"{msg.TYPE} names rank {msg.rank} but arrived on rank {rank}'s connection")
            return
        req = self._requests.get(msg.request_id)
        if req is None or rank not in req.sent_to:
            if isinstance(msg, cm.Manifest):
                self._reject(None, f"rank {rank} sent a manifest for unknown request {msg.request_id!r}")
            return
        if rank in req.reported:
            self._reject(None, f"rank {rank} reported request {msg.request_id!r} twice")
            return
        req.reported.add(rank)
        if req.first_report is None:
            req.first_report = time.monotonic()
        if req.state == TransferState.WAITING:
            if isinstance(msg, cm.Failed):
                self._fail(req, f"sender rank {rank} failed: {msg.reason}")
            else:
                try:
                    if req.collector.add(msg):
                        self._finish(req, TransferState.SUCCESS, "")
                except ManifestError as e:
                    self._fail(req, str(e))
        self._maybe_free(req)
        self._forget_if_done(req)

    def _finish(self, req: _Request, state: TransferState, reason: str) -> None:
        req.state, req.reason, req.finished_at = state, reason, time.monotonic()
        verdict = cm.encode(cm.Verdict(req.request_id, state == TransferState.SUCCESS, reason[: cm.MAX_REASON_CHARS]))
        for rank in req.sent_to:
            if rank in self._peers:
                self.send(self._peers[rank].conn, verdict)
        self._lock.notify_all()

    def _fail(self, req: _Request, reason: str) -> None:
        logger.warning("request %s failed: %s", req.request_id, reason)
        self._finish(req, TransferState.FAILED, reason)
        self._maybe_free(req)
        self._forget_if_done(req)

    def _maybe_free(self, req: _Request) -> None:
        """Free a failed request's pages once every rank that knows them has stopped writing or is gone."""
        if req.state != TransferState.FAILED or not req.pages_held:
            return
        if all(rank in req.reported or rank not in self._peers for rank in req.sent_to):
            self._free(req)

    def _free(self, req: _Request) -> None:
        if req.pages_held:
            self.allocator.free(req.dst)
            req.pages_held = False
            self._lock.notify_all()

    def _forget_if_done(self, req: _Request) -> None:
        if req.released and not req.pages_held:
            self._requests.pop(req.request_id, None)

    def _reject(self, conn: FramedConnection | None, reason: str) -> None:
        who = "" if conn is None or conn.context is None else f"rank {conn.context}: "
        logger.warning("rejected control message: %s%s", who, reason)
        self.rejected.append(f"{who}{reason}")

    def _get(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        return req
