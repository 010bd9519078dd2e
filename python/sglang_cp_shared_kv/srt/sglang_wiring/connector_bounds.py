"""Bounded per-request state in a prefill's KV manager.

Two of the manager's tables outlive the requests they describe: **late destinations** that
reach a prefill rank after its sender was cleared make SGLang's bootstrap thread record the room again
(``transfer_infos``, ``req_to_decode_prefix_len``, ``request_status``) with no sender left to clear it;
and ``_deferred_ack_poisoned_rooms`` keeps a failed batch's room for ever.

Per prefill manager (its ``RoomBounds``), a room is *live* from its sender's opening status until
``CommonKVSender.clear``, then *closed* for ``window_s`` (SGLang's waiting and deferred-release timeouts plus
a margin): destinations that reach a closed room are dropped at once; destinations for a room neither live
nor closed open it as SGLang does (they may precede their sender) and are dropped if no sender opens it
within ``window_s``; when a closed room's window ends, its poison is dropped (the decode has released its
pages by then). Closed rooms beyond ``MAX_CLOSED`` are forgotten oldest first, keeping their poison.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)


MARGIN_S = 5.0
MAX_CLOSED = 1 << 16


def window_s() -> float:
    """How long a cleared room stays closed, and how long destinations may wait for their sender."""
    from sglang.srt.environ import envs

    waiting = float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())
    release = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
    return waiting + release + MARGIN_S


class RoomBounds:
    """One prefill manager's rooms: live, closed (until), unclaimed (until)."""

    def __init__(self, window: float):
        self.window = window
        self.lock = threading.Lock()  # the bootstrap thread and the scheduler both call in
        self.live: set[int] = set()
        self.closed: OrderedDict[int, float] = OrderedDict()  # room -> end of its window, oldest first
        self.unclaimed: OrderedDict[int, float] = OrderedDict()  # destinations with no sender yet
        self.late_dropped = 0  # destinations dropped for a closed room
        self.unclaimed_dropped = 0  # rooms opened by destinations that no sender claimed
        self.poison_dropped = 0  # poisoned rooms released after their window

    def counts(self) -> dict[str, int]:
        return {
            "live": len(self.live),
            "closed": len(self.closed),
            "unclaimed": len(self.unclaimed),
            "late_dropped": self.late_dropped,
            "unclaimed_dropped": self.unclaimed_dropped,
            "poison_dropped": self.poison_dropped,
        }


def _forget_room(mgr: Any, room: int) -> None:
    """Pop a room with no sender from the tables the bootstrap thread fills."""
    mgr.transfer_infos.pop(room, None)
    mgr.req_to_decode_prefix_len.pop(room, None)
    mgr.request_status.pop(room, None)


def admit_status(bounds: RoomBounds, mgr: Any, bootstrap_room: int, status: Any) -> bool:
    """Before a prefill manager's ``update_status``: track live rooms; False for destinations that reach a
    closed room (their tables popped, the room not opened: the caller drops the status)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    with bounds.lock:
        if status == KVPoll.Bootstrapping:  # a sender opens the room (only CommonKVSender.__init__ sets it)
            bounds.live.add(bootstrap_room)
            bounds.closed.pop(bootstrap_room, None)
            bounds.unclaimed.pop(bootstrap_room, None)
        elif (
            status == KVPoll.WaitingForInput
            and bootstrap_room not in bounds.live
            and bootstrap_room not in mgr.request_status
        ):
            if bootstrap_room in bounds.closed:  # destinations of a cleared request: nobody will send
                _forget_room(mgr, bootstrap_room)
                bounds.late_dropped += 1
                logger.debug("dropped late destinations of cleared room %s", bootstrap_room)
                return False
            bounds.unclaimed[bootstrap_room] = time.monotonic() + bounds.window
    return True


def room_cleared(bounds: RoomBounds, mgr: Any, bootstrap_room: int) -> None:
    """After the room's own sender cleared it: the room closes for a window, then expired rooms are swept."""
    with bounds.lock:
        bounds.live.discard(bootstrap_room)
        bounds.unclaimed.pop(bootstrap_room, None)
        bounds.closed.pop(bootstrap_room, None)
        bounds.closed[bootstrap_room] = time.monotonic() + bounds.window
    sweep(bounds, mgr)


def sweep(b: RoomBounds, mgr: Any, now: float | None = None) -> None:
    """Release the rooms whose window has ended: poison of closed rooms, unclaimed destinations."""
    now = time.monotonic() if now is None else now
    with b.lock:
        while b.closed:
            room, until = next(iter(b.closed.items()))
            over_cap = len(b.closed) > MAX_CLOSED
            if until > now and not over_cap:
                break
            del b.closed[room]
            if until <= now and room not in b.live:
                if room in mgr._deferred_ack_poisoned_rooms:
                    mgr._deferred_ack_poisoned_rooms.discard(room)
                    b.poison_dropped += 1
                if room in mgr.request_status or room in mgr.transfer_infos:  # re-opened by another path
                    _forget_room(mgr, room)
        while b.unclaimed:
            room, until = next(iter(b.unclaimed.items()))
            if until > now:
                break
            del b.unclaimed[room]
            if room not in b.live:
                _forget_room(mgr, room)
                b.unclaimed_dropped += 1
                logger.info("dropped destinations of room %s: no request claimed them in %.0fs", room, b.window)
