"""``connector_bounds`` around SGLang 0.5.23's own ``CommonKVManager.update_status`` and
``CommonKVSender.clear``, on the state they use (no transfer engine): SGLang alone lets a cleared room's
late destinations open it again for good; with ``admit_status`` before the update and ``room_cleared``
after the owner's clear (what the plugin's wrappers and the series' edits do) they are dropped, and a
poisoned room is released once its window ends."""

from __future__ import annotations

import threading
import time
import types
from collections import defaultdict

import pytest

pytestmark = [pytest.mark.sglang]

WINDOW_S = 0.3


def _parts():
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVSender

    from sglang_cp_shared_kv.srt.sglang_wiring import connector_bounds

    return KVPoll, CommonKVManager, CommonKVSender, connector_bounds


def _run(bounded: bool) -> dict:
    """Room 7: opened, destinations, cleared, late destinations; room 5: poisoned, cleared, window passes."""
    KVPoll, manager, sender_cls, cb = _parts()
    mgr = types.SimpleNamespace(
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
    )
    bounds = cb.RoomBounds(WINDOW_S)

    def update(room, status):
        if not bounded or cb.admit_status(bounds, mgr, room, status):
            manager.update_status(mgr, room, status)

    def clear(room):
        sender = types.SimpleNamespace(kv_mgr=mgr, bootstrap_room=room, conclude_state=None)
        sender_cls.clear(sender)
        if bounded:
            cb.room_cleared(bounds, mgr, room)

    def destinations(room):  # what the bootstrap thread does for a decode's destinations
        mgr.transfer_infos.setdefault(room, {})["decode-0"] = object()
        mgr.req_to_decode_prefix_len[room] = 0
        update(room, KVPoll.WaitingForInput)

    update(7, KVPoll.Bootstrapping)
    destinations(7)
    clear(7)
    destinations(7)  # a late decode
    update(5, KVPoll.Bootstrapping)
    mgr._deferred_ack_poisoned_rooms.add(5)
    clear(5)
    time.sleep(WINDOW_S + 0.1)
    update(6, KVPoll.Bootstrapping)
    clear(6)  # every clear sweeps the rooms whose window ended
    return {
        "reopened": 7 in mgr.request_status or 7 in mgr.transfer_infos or 7 in mgr.req_to_decode_prefix_len,
        "poisoned": 5 in mgr._deferred_ack_poisoned_rooms,
        "counts": bounds.counts(),
    }


def test_sglang_alone_reopens_a_cleared_room_and_keeps_its_poison():
    res = _run(bounded=False)
    assert res["reopened"] and res["poisoned"], res


def test_bounded_rooms_drop_late_destinations_and_release_poison():
    res = _run(bounded=True)
    assert not res["reopened"] and not res["poisoned"], res
    assert res["counts"]["late_dropped"] == 1 and res["counts"]["poison_dropped"] == 1, res
