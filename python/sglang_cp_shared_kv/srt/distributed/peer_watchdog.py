"""A deadline on the device waits a CP rank queues for its peers (fail-stop).

A stream wait for a peer's signal has no timeout: a dead peer blocks it for ever. A
host thread polls each queued wait; one pending past ``deadline_s`` logs one ERROR
line, calls ``on_failure``, releases this rank's waits, and makes every later
``check`` raise ``PeerLost``. Every live rank waits for the dead one, so all fail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A CP peer stopped answering; the message names it and the wait."""


class PeerWatchdog:
    """Fails a CP group whose device wait outlived ``deadline_s``. ``laggards(what)``:
    the peers behind a wait; ``release()`` frees this rank's waits; ``on_failure(line)``
    stops the server. Polls from the first ``watch``."""

    def __init__(
        self,
        deadline_s: float,
        laggards: Callable[[tuple[str, int]], list[int]],
        release: Callable[[], None],
        on_failure: Callable[[str], None] | None = None,
        poll_s: float = 0.05,
    ):
        self.deadline_s, self.poll_s = deadline_s, poll_s
        self._laggards, self._release, self._on_failure = laggards, release, on_failure
        self._waits: deque[tuple[float, Callable[[], bool], tuple[str, int]]] = deque()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None
        self.failed: str | None = None

    def watch(self, done: Callable[[], bool], what: tuple[str, int]) -> None:
        """Watch a wait just queued, passed once ``done()``; ``what`` names it."""
        with self._lock:
            self._waits.append((time.monotonic(), done, what))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cp-shared-kv-peer-watchdog", daemon=True)
            self._thread.start()

    def check(self) -> None:
        if self.failed is not None:
            raise PeerLost(self.failed)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 1)

    def _oldest_pending(self) -> tuple[float, tuple[str, int]] | None:
        with self._lock:
            while self._waits and self._waits[0][1]():
                self._waits.popleft()
            return (self._waits[0][0], self._waits[0][2]) if self._waits else None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                pending = self._oldest_pending()
            except Exception as e:  # sticky CUDA error: the next sync raises it too
                self.failed = f"--enable-cp-shared-kv: the device failed while this rank waited for its CP peers: {e}"
                logger.error("%s", self.failed)
                return
            if pending is not None and time.monotonic() - pending[0] > self.deadline_s:
                self._fail(*pending)
                return

    def _fail(self, since: float, what: tuple[str, int]) -> None:
        who = "no peer known"
        try:
            if behind := self._laggards(what):
                who = f"rank {behind[0]}" if len(behind) == 1 else f"ranks {behind}"
        except Exception as e:  # the line goes out whatever the device says
            who = f"unknown peers ({e})"
        self.failed = (
            f"--enable-cp-shared-kv: CP peer lost: {who} did not reach this rank's {what[0]} {what[1]} within {self.deadline_s:g} s "
            f"(waited {time.monotonic() - since:.1f} s); this rank fails its batch"
        )
        logger.error("%s", self.failed)
        if self._on_failure is not None:
            self._on_failure(self.failed)
        # Release the waits queued so far and until the rank stops (for a bounded time).
        end = time.monotonic() + max(self.deadline_s, 1.0)
        while time.monotonic() < end:
            self._release()
            pending = self._oldest_pending()
            if pending is None:
                return
            time.sleep(self.poll_s)
        logger.error(
            "--enable-cp-shared-kv: this rank's %s %d is still pending after its waits were released", *pending[1]
        )
