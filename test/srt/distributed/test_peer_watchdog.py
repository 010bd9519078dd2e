"""``PeerWatchdog`` on the host: a device wait that outlives its deadline fails the group with one line naming
the peer, stops the server first, then releases the waits; waits that pass never fail it. (Its use on
the copy engines, with a peer killed mid-batch, is ``test_fail_stop_gpu.py``.)"""

from __future__ import annotations

import re
import threading
import time

import pytest

from sglang_cp_shared_kv.srt.distributed.peer_watchdog import PeerLost, PeerWatchdog


def test_waits_that_pass_in_time_never_fail_the_group():
    released = []
    dog = PeerWatchdog(0.3, lambda what: [1], lambda: released.append(1), poll_s=0.01)
    for k in range(20):
        passed_at = time.monotonic() + 0.05
        dog.watch(lambda t=passed_at: time.monotonic() > t, ("fence", k))
        time.sleep(0.03)
    time.sleep(0.5)
    dog.check()
    assert dog.failed is None and released == []
    dog.close()


def test_a_wait_past_its_deadline_stops_the_server_then_releases_and_every_later_call_raises():
    events: list[tuple[str, float]] = []
    released = threading.Event()

    def release() -> None:
        events.append(("release", time.monotonic()))
        released.set()

    dog = PeerWatchdog(
        0.4,
        lambda what: [2] if what == ("all-gather", 7) else [],
        release,
        on_failure=lambda line: events.append((line, time.monotonic())),
        poll_s=0.01,
    )
    dog.watch(lambda: True, ("fence", 3))  # passed
    start = time.monotonic()
    dog.watch(released.is_set, ("all-gather", 7))  # passes only once released
    assert released.wait(timeout=5)
    line = events[0][0]
    assert re.fullmatch(
        r"--enable-cp-shared-kv: CP peer lost: rank 2 did not reach this rank's all-gather 7 within 0.4 s "
        r"\(waited 0\.\d s\); this rank fails its batch",
        line,
    ), events
    assert events[1][0] == "release" and 0.4 <= events[0][1] - start < 1.0, events
    with pytest.raises(PeerLost) as err:
        dog.check()
    assert str(err.value) == line
    time.sleep(0.1)
    assert len(events) == 2  # released once: the wait passed
    dog.close()


def test_a_failure_reading_the_peers_still_gives_the_line():
    def laggards(what):
        raise RuntimeError("the device is gone")

    dog = PeerWatchdog(0.05, laggards, lambda: None, poll_s=0.01)
    dog.watch(lambda: False, ("fence", 1))
    deadline = time.monotonic() + 5
    while dog.failed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.failed.startswith(
        "--enable-cp-shared-kv: CP peer lost: unknown peers (the device is gone) did not reach this rank's fence 1"
    )
    dog.close()


def test_a_device_error_while_waiting_fails_the_group_with_that_error():
    def done():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dog = PeerWatchdog(10.0, lambda what: [], lambda: None, poll_s=0.01)
    dog.watch(done, ("fence", 2))
    deadline = time.monotonic() + 5
    while dog.failed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(PeerLost, match="the device failed while this rank waited for its CP peers: CUDA error"):
        dog.check()
    dog.close()


def test_a_wait_the_release_does_not_free_is_named_in_a_second_line(caplog):
    dog = PeerWatchdog(0.05, lambda what: [1], lambda: None, poll_s=0.01)
    with caplog.at_level("ERROR", logger="sglang_cp_shared_kv.srt.distributed.peer_watchdog"):
        dog.watch(lambda: False, ("fence", 5))
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("--enable-cp-shared-kv: CP peer lost: rank 1 did not reach this rank's fence 5")
    assert lines[1] == "--enable-cp-shared-kv: this rank's fence 5 is still pending after its waits were released"
    dog.close()
