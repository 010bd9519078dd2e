"""A prefill KV manager's rooms do not outlive their request beyond a window.

Destinations that reach a prefill rank after the request's sender was cleared (a
retried or slow decode) used to open the room again in ``transfer_infos``,
``req_to_decode_prefix_len`` and ``request_status``, with no sender left to clear it;
a poisoned room stayed poisoned for ever. Here ``CommonKVManager.update_status`` and
``CommonKVSender.clear`` run on the state they use (no transfer engine), with a short
window.
"""

import threading
import time
import types
import unittest
from collections import defaultdict

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVSender
from sglang.srt.disaggregation.common.room_bounds import RoomBounds
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

WINDOW_S = 0.3


class _State:
    """A manager's or sender's state without its engine (hashable and
    weak-referenceable, as they are)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _prefill_manager() -> _State:
    return _State(
        request_status={},
        transfer_infos={},
        req_to_decode_prefix_len={},
        _deferred_ack_targets={},
        _deferred_ack_poisoned_rooms=set(),
        _staging_outstanding=defaultdict(int),
        _staging_ctx=None,
        deferred_bootstrap=None,
        failure_lock=threading.Lock(),
        _maybe_ack_drained_abort=lambda room: None,
        _room_bounds=RoomBounds(WINDOW_S),
    )


def _sender(mgr, room: int) -> _State:
    sender = _State(kv_mgr=mgr, bootstrap_room=room, conclude_state=None)
    sender._owns_bootstrap_room = True
    sender._clear_room = types.MethodType(CommonKVSender._clear_room, sender)
    return sender


def _destinations_arrive(mgr, room: int) -> None:
    """What the bootstrap thread does for a decode's destinations."""
    mgr.transfer_infos.setdefault(room, {})["decode-0"] = object()
    mgr.req_to_decode_prefix_len[room] = 0
    CommonKVManager.update_status(mgr, room, KVPoll.WaitingForInput)


class TestPrefillRoomBounds(CustomTestCase):
    def test_late_destinations_of_a_cleared_room_are_dropped(self):
        mgr = _prefill_manager()
        CommonKVManager.update_status(
            mgr, 7, KVPoll.Bootstrapping
        )  # the sender opens the room
        _destinations_arrive(mgr, 7)
        CommonKVSender.clear(_sender(mgr, 7))
        _destinations_arrive(mgr, 7)  # a late decode
        self.assertEqual(
            (mgr.request_status, mgr.transfer_infos, mgr.req_to_decode_prefix_len),
            ({}, {}, {}),
        )
        self.assertEqual(mgr._room_bounds.counts()["late_dropped"], 1)

    def test_a_room_no_sender_claims_is_dropped_after_the_window(self):
        mgr = _prefill_manager()
        _destinations_arrive(mgr, 8)  # destinations may precede their sender
        self.assertIn(8, mgr.request_status)
        time.sleep(WINDOW_S + 0.1)
        CommonKVManager.update_status(mgr, 9, KVPoll.Bootstrapping)
        CommonKVSender.clear(_sender(mgr, 9))  # every clear sweeps the expired rooms
        self.assertNotIn(8, mgr.request_status)
        self.assertNotIn(8, mgr.transfer_infos)

    def test_a_poisoned_room_is_released_when_its_window_ends(self):
        mgr = _prefill_manager()
        CommonKVManager.update_status(mgr, 5, KVPoll.Bootstrapping)
        mgr._deferred_ack_poisoned_rooms.add(5)
        CommonKVSender.clear(_sender(mgr, 5))
        self.assertIn(5, mgr._deferred_ack_poisoned_rooms)  # still inside its window
        time.sleep(WINDOW_S + 0.1)
        CommonKVManager.update_status(mgr, 6, KVPoll.Bootstrapping)
        CommonKVSender.clear(_sender(mgr, 6))
        self.assertNotIn(5, mgr._deferred_ack_poisoned_rooms)


if __name__ == "__main__":
    unittest.main()
