"""Length-prefixed frames over non-blocking TCP, driven by one selector thread.

Plain sockets rather than ZMQ because the failure signal matters here: a peer
process that dies closes its sockets, so the other side sees end-of-file at once
and fails the affected requests without waiting for a timeout. A frozen peer keeps
its sockets open; heartbeats (in the sender and receiver) catch that.

All socket work happens on the loop thread. Other threads hand work to it with
``call_soon``; the loop sleeps in ``select`` with a bounded timeout and wakes on a
socketpair, so it never spins.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 64 << 20
_READ_CHUNK = 1 << 18


class FramedConnection:
    """One TCP connection carrying ``[u32 length][payload]`` frames."""

    def __init__(self, sock: socket.socket, peer: str = ""):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self.closed = False
        self.eof = False
        self.context: object = None  # what the owner knows about this peer (e.g. its rank)
        self._in = bytearray()
        self._out = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    def queue(self, payload: bytes) -> None:
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"payload of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
        self._out += _HEADER.pack(len(payload))
        self._out += payload

    def flush(self) -> None:
        """Send what the socket takes now; raise ``ConnectionError`` if the peer is gone."""
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                raise ConnectionError(f"send to {self.peer} failed: {e}") from None
            del self._out[:sent]

    def read_frames(self) -> list[bytes]:
        """Every complete frame available now (``eof`` is set once the peer closed); ``ConnectionError`` on an oversized frame."""
        while True:
            try:
                chunk = self.sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                raise ConnectionError(f"recv from {self.peer} failed: {e}") from None
            if not chunk:
                self.eof = True
                break
            self._in += chunk
            if len(chunk) < _READ_CHUNK:
                break
        frames = []
        while len(self._in) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._in)
            if n > MAX_FRAME_BYTES:
                raise ConnectionError(f"{self.peer} sent a {n}-byte frame (limit {MAX_FRAME_BYTES})")
            if len(self._in) < _HEADER.size + n:
                break
            frames.append(bytes(self._in[_HEADER.size : _HEADER.size + n]))
            del self._in[: _HEADER.size + n]
        return frames

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


class ControlLoop:
    """A selector loop on a daemon thread. Subclasses override the ``on_*`` hooks (loop thread only)."""

    def __init__(self, name: str, tick_s: float = 0.1):
        self.name = name
        self.tick_s = tick_s
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.loop_errors: list[str] = []  # bugs caught in hooks, kept for diagnosis

    # -- any thread --
    def start_loop(self) -> None:
        self._thread.start()

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake byte is already pending, or the loop is gone

    def stop_loop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self.call_soon(lambda: None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def loop_alive(self) -> bool:
        return self._thread.is_alive()

    # -- loop thread --
    def listen(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, "listen")

    def watch(self, conn: FramedConnection) -> None:
        self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def send(self, conn: FramedConnection, payload: bytes) -> None:
        if conn.closed:
            return
        conn.queue(payload)
        try:
            conn.flush()
        except ConnectionError as e:
            self.drop(conn, str(e))
            return
        self._sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write else 0), conn)

    def drop(self, conn: FramedConnection, reason: str) -> None:
        """Close ``conn`` and tell the subclass, once."""
        if conn.closed:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.close()
        self._guard(self.on_closed, conn, reason)

    # -- hooks --
    def on_accept(self, conn: FramedConnection) -> None:
        pass

    def on_frame(self, conn: FramedConnection, data: bytes) -> None:
        pass

    def on_closed(self, conn: FramedConnection, reason: str) -> None:
        pass

    def on_tick(self, now: float) -> None:
        pass

    def on_stop(self) -> None:
        pass

    # -- internals --
    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a bug in a hook must not kill the loop that enforces timeouts
            logger.exception("%s: %s failed", self.name, getattr(fn, "__name__", fn))
            self.loop_errors.append(f"{getattr(fn, '__name__', fn)}: {type(e).__name__}: {e}")

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stopping:
            timeout = max(0.0, next_tick - time.monotonic())
            for key, events in self._sel.select(timeout):
                if key.data is None:
                    try:
                        self._wake_r.recv(4096)
                    except (BlockingIOError, OSError):
                        pass
                elif key.data == "listen":
                    self._accept(key.fileobj)
                else:
                    self._service(key.data, events)
            while self._calls:
                self._guard(self._calls.popleft())
            now = time.monotonic()
            if now >= next_tick:
                self._guard(self.on_tick, now)
                next_tick = now + self.tick_s
        self._guard(self.on_stop)
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, FramedConnection):
                key.data.close()
            elif key.data == "listen":
                key.fileobj.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept(self, lsock: socket.socket) -> None:
        try:
            sock, addr = lsock.accept()
        except (BlockingIOError, OSError):
            return
        conn = FramedConnection(sock, peer=f"{addr[0]}:{addr[1]}")
        self.watch(conn)
        self._guard(self.on_accept, conn)

    def _service(self, conn: FramedConnection, events: int) -> None:
        if conn.closed:
            return
        try:
            if events & selectors.EVENT_WRITE:
                conn.flush()
                if not conn.wants_write:
                    self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
            if events & selectors.EVENT_READ:
                for frame in conn.read_frames():
                    self._guard(self.on_frame, conn, frame)
                    if conn.closed:
                        return
                if conn.eof:
                    self.drop(conn, f"{conn.peer} closed the connection")
        except ConnectionError as e:
            self.drop(conn, str(e))
