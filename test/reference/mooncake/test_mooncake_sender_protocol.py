"""The sender against a hand-played decode side: refusals, malformed messages, and per-request failures.

A real ``OwnedPageSender`` runs in a spawned process; this process plays the decode
receiver through raw control messages, including ones a correct receiver never sends.
"""

import socket
import time

import pytest
from mooncake_procs import (
    Case,
    FramedClient,
    Worker,
    sender_close,
    sender_start,
    sender_status,
    sender_submit_nowait,
)

from sglang_cp_shared_kv.reference.mooncake import control_messages as cm

pytestmark = pytest.mark.mooncake

CASE = Case(2, 16, "fp8", 1, 16, (("a", 5, False), ("b", 5, False), ("c", 5, False)))
LAYOUT = cm.PoolLayout(CASE.page_size, CASE.kv_format, CASE.layers, True)


@pytest.fixture(scope="module")
def sender():
    w = Worker("sender")
    yield w
    w.stop()


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    sock.settimeout(30)
    yield sock, f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _until(fn, pred, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not pred(out := fn()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return out


def _connect(sender, listener, rank=0):
    """Start a sender (60 s timeout: this fake decode sends no heartbeats) and take its hello."""
    lsock, address = listener
    sender.send(sender_start, CASE, rank, address, 60.0)
    conn = FramedClient(lsock.accept()[0])
    hello = conn.expect(cm.Hello)
    assert (hello.rank, hello.cp_size, hello.layout) == (rank, 2, LAYOUT)
    return conn


@pytest.mark.parametrize(
    "reply,match",
    [
        (cm.Reject("rank 0 is already connected"), "hello refused: rank 0 is already connected"),
        (cm.Bootstrap("127.0.0.1:1", 50, cm.PoolLayout(16, "bf16", 1, True), (4096,), (8192,)), "kv_format differs"),
    ],
)
def test_start_fails_clearly_when_refused(sender, listener, reply, match):
    conn = _connect(sender, listener)
    conn.send(reply)
    with pytest.raises(RuntimeError, match=match):
        sender.recv(30)
    conn.close()


def test_bad_decode_messages_are_rejected_and_failures_stay_per_request(sender, listener):
    conn = _connect(sender, listener)
    conn.send(cm.Bootstrap("127.0.0.1:1", 50, LAYOUT, (4096,), (8192,)))
    sender.recv(30)

    conn.send(cm.DstPages("a", (0, 1, 2, 3, 4)))
    bad = [
        (b"garbage", "not valid JSON"),
        (cm.encode(cm.DstPages("b", (10, 11, 12, 13, 50))), "past the decode pool's 50"),
        (cm.encode(cm.DstPages("a", (5, 6, 7, 8, 9))), "second dst_pages for 'a'"),
        (cm.encode(cm.Manifest("a", 0, (0,), (0,), 0)), "only senders send"),
        (cm.encode(cm.Bootstrap("127.0.0.1:1", 50, LAYOUT, (4096,), (8192,))), "second bootstrap"),
    ]
    for data, _ in bad:
        conn.send_raw(data)
    conn.send(cm.Heartbeat())
    st = _until(lambda: sender.call(sender_status, []), lambda st: len(st["rejected"]) >= len(bad))
    assert len(st["rejected"]) == len(bad) and st["lost"] is None and not st["loop_errors"]
    for line, (_, match) in zip(st["rejected"], bad):
        assert match in line, (match, line)

    # a destination list of the wrong length fails that request only, and the decode side hears why
    conn.send(cm.DstPages("b", (10, 11)))
    sender.call(sender_submit_nowait, ["b"])
    failed = conn.expect(cm.Failed)
    assert (failed.request_id, failed.rank) == ("b", 0) and "gave 2 destination pages for 5 pages" in failed.reason

    # a failed verdict before submit: the sender promises at once not to write, and the submit fails
    conn.send(cm.Verdict("c", False, "decode ran out of time"))
    assert conn.expect(cm.Failed).request_id == "c"
    sender.call(sender_submit_nowait, ["c"])
    st = sender.call(sender_status, ["b", "c"])
    assert st["states"] == {"b": "FAILED", "c": "FAILED"} and "decode ran out of time" in st["reasons"]["c"]

    # a write the engine cannot deliver (no such peer) fails the request, reported with the engine's code
    sender.call(sender_submit_nowait, ["a"])
    failed = conn.expect(cm.Failed)
    assert failed.request_id == "a" and "returned -1" in failed.reason
    assert sender.call(sender_status, [])["lost"] is None  # the control connection is still fine

    # the decode side going away is noticed through the closed connection
    conn.close()
    st = _until(lambda: sender.call(sender_status, []), lambda st: st["lost"] is not None)
    assert "closed the connection" in st["lost"]
    sender.call(sender_close)
