"""Failures over the real engine: bad manifests, malformed messages, dead and frozen peers.

The decode receiver and the senders run in spawned processes with MC_TRANSFER_TIMEOUT=5.
Manifest and message checks drive a real receiver from this process through hand-made
control messages (``FakeSender``), which is how a buggy or hostile sender would look.
"""

import re
import signal
import socket
import time

import pytest
import torch
from mooncake_procs import (
    Case,
    FramedClient,
    Worker,
    call_all,
    decode_add,
    decode_close,
    decode_extra_pages,
    decode_release,
    decode_start,
    decode_status,
    decode_verify,
    decode_wait,
    decode_wait_free,
    page_tables,
    sender_close,
    sender_finish,
    sender_finish_after_submit,
    sender_start,
    sender_status,
    sender_submit,
    sender_wait_dst,
    stop_all,
)

from sglang_cp_shared_kv.reference.mooncake import control_messages as cm

pytestmark = pytest.mark.mooncake

TIMEOUT_S = 5.0  # MC_TRANSFER_TIMEOUT in the workers


class FakeSender(FramedClient):
    """A hand-driven sender connection speaking the control protocol (no engine, no writes)."""

    def __init__(self, address: str, rank: int, case: Case):
        host, port = address.rsplit(":", 1)
        super().__init__(socket.create_connection((host, int(port)), timeout=10))
        self.rank = rank
        layout = cm.PoolLayout(case.page_size, case.kv_format, case.layers, True)
        self.send(cm.Hello(rank, case.n, "127.0.0.1:1", layout))
        self.bootstrap = self.expect(cm.Bootstrap)


def _until(fn, pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        out = fn()
        if pred(out) or time.monotonic() > deadline:
            return out
        time.sleep(0.02)


@pytest.fixture(scope="module")
def senders():
    procs = [Worker(f"sender{r}") for r in range(2)]
    yield procs
    stop_all(procs)


@pytest.fixture
def decode():
    w = Worker("decode")
    yield w
    w.stop()


def _own(table, rank, n=2):
    return [p for p, lp in enumerate(table.tolist()) if lp % n == rank]


def test_bad_manifests_fail_only_their_request_and_free_pages(decode):
    rids = ["good", "out_of_range", "duplicate", "missing", "non_owner", "orphan"]
    case = Case(2, 16, "fp8", 1, 64, tuple((rid, 6, False) for rid in rids))
    tables = page_tables(case)
    page_bytes = case.page_size * (656 + 132) * case.layers
    address = decode.call(decode_start, case, 60.0, False)
    fakes = [FakeSender(address, r, case) for r in range(2)]
    dst = decode.call(decode_add, rids)
    for f in fakes:
        got = {m.request_id: list(m.dst_pages) for m in (f.expect(cm.DstPages) for _ in rids)}
        assert got == dst
    status = lambda: decode.call(decode_status, rids)  # noqa: E731
    all_free = case.decode_pages
    in_use = all_free - 6 * len(rids)

    # malformed or out-of-place messages are rejected with a reason and change nothing
    t = tables["good"]
    bad = [
        (b"\x00not json", "not valid JSON"),
        (b'{"v":2,"type":"heartbeat"}', "version must be 1"),
        (b'{"v":1,"type":"teleport"}', "type must be one of"),
        (
            b'{"v":1,"type":"manifest","request_id":"good","rank":0,"page_table":[1],"positions":[-1],"nbytes":0}',
            r"positions\[0\]",
        ),
        (
            cm.encode(cm.Manifest("good", 1, tuple(t.tolist()), tuple(_own(t, 1)), 3 * page_bytes)),
            "names rank 1 but arrived on rank 0",
        ),
        (
            cm.encode(cm.Manifest("nope", 0, tuple(t.tolist()), tuple(_own(t, 0)), 3 * page_bytes)),
            "unknown request 'nope'",
        ),
        (cm.encode(cm.Verdict("good", True, "")), "only the decode side sends"),
        (cm.encode(cm.Hello(0, 2, "x", fakes[0].bootstrap.layout)), "second hello"),
    ]
    for data, _ in bad:
        fakes[0].send_raw(data)
    st = _until(status, lambda s: len(s["rejected"]) >= len(bad))
    assert len(st["rejected"]) == len(bad)
    for line, (_, match) in zip(st["rejected"], bad):
        assert re.search(match, line), (match, line)
    assert set(st["states"].values()) == {"WAITING"} and st["free_pages"] == in_use and not st["loop_errors"]

    def manifest(rid, rank, positions):
        return cm.Manifest(rid, rank, tuple(tables[rid].tolist()), tuple(positions), len(positions) * page_bytes)

    # a correct request next to the bad ones becomes ready
    for f in fakes:
        f.send(manifest("good", f.rank, _own(tables["good"], f.rank)))
    for f in fakes:
        assert f.expect(cm.Verdict) == cm.Verdict("good", True, "")

    cases = {
        "out_of_range": (0, lambda own, other: own + [6], "position 6, out of range"),
        "duplicate": (0, lambda own, other: own + own[:1], "reported position .* twice"),
        "missing": (1, lambda own, other: own[:-1], "did not report positions"),
        "non_owner": (1, lambda own, other: sorted(own + other[:1]), "claimed position .* owned by rank 0"),
    }
    for rid, (rank, positions, match) in cases.items():
        table = tables[rid]
        fakes[rank].send(manifest(rid, rank, positions(_own(table, rank), _own(table, 1 - rank))))
        for f in fakes:
            verdict = f.expect(cm.Verdict)
            assert verdict.request_id == rid and not verdict.ok and re.search(match, verdict.reason)
        st = status()
        assert st["states"][rid] == "FAILED" and re.search(match, st["reasons"][rid])
        # the other rank was given the pages and has not reported: they stay held until it stops writing
        assert st["held"][rid] and st["free_pages"] == in_use
        other = fakes[1 - rank]
        if rid == "missing":  # a late, correct manifest also says "done writing"
            other.send(manifest(rid, other.rank, _own(table, other.rank)))
        else:  # what a real sender answers to a failed verdict
            other.send(cm.Failed(rid, other.rank, "failed by the decode side"))
        in_use += 6
        st = _until(status, lambda s, rid=rid: not s["held"][rid])
        assert not st["held"][rid] and st["free_pages"] == in_use

    # a sender whose connection drops fails the requests it was part of; pages wait for the live rank
    fakes[1].close()
    st = _until(status, lambda s: s["states"]["orphan"] == "FAILED", 3.0)
    assert st["states"]["orphan"] == "FAILED" and "sender rank 1 lost" in st["reasons"]["orphan"]
    assert st["held"]["orphan"]
    assert not fakes[0].expect(cm.Verdict).ok
    fakes[0].send(cm.Failed("orphan", 0, "ack"))
    assert _until(status, lambda s: not s["held"]["orphan"])["free_pages"] == all_free - 6

    # nothing else changed: the good request is still ready; releasing it frees everything
    assert status()["states"]["good"] == "SUCCESS"
    assert decode.call(decode_release, rids) == all_free
    fakes[0].close()
    decode.call(decode_close)


def test_silent_sender_fails_its_requests_within_the_timeout(decode):
    case = Case(2, 16, "fp8", 1, 16, (("r", 5, False),))
    address = decode.call(decode_start, case, 2.0, False)
    fakes = [FakeSender(address, r, case) for r in range(2)]
    decode.call(decode_add, ["r"])
    t0 = time.monotonic()
    # neither fake sends heartbeats: both look frozen
    st = _until(lambda: decode.call(decode_status, ["r"]), lambda s: s["states"]["r"] == "FAILED", 6.0)
    elapsed = time.monotonic() - t0
    assert st["states"]["r"] == "FAILED" and "no message for" in st["reasons"]["r"]
    assert 2.0 <= elapsed < 4.0
    assert (
        _until(lambda: decode.call(decode_status, ["r"]), lambda s: not s["held"]["r"])["free_pages"]
        == case.decode_pages
    )
    # pages the decode side takes for itself come from the same allocator, under the same lock
    pages, held, after = decode.call(decode_extra_pages, 3)
    assert (len(set(pages)), held, after) == (3, case.decode_pages - 3, case.decode_pages)
    for f in fakes:
        f.close()
    decode.call(decode_close)


# Page size 1 makes every page its own small entry: tens of thousands of entries keep the
# write busy long enough (about a second) to kill a peer in the middle of it.
BIG = Case(2, 1, "fp8", 4, 4200, (("big", 8001, True),), seed=3)


def test_killed_decode_fails_senders_within_seconds(senders, decode):
    address = decode.call(decode_start, BIG, None, False)
    call_all(senders, sender_start, [(BIG, r, address) for r in range(2)])
    decode.call(decode_add, ["big"])
    assert all(call_all(senders, sender_wait_dst, [(["big"],)] * 2))
    submitted = call_all(senders, sender_submit, [(["big"], "transferring")] * 2)
    t_kill = time.monotonic()
    decode.signal(signal.SIGKILL)
    assert [s["states"]["big"] for s in submitted] == ["TRANSFERRING"] * 2  # killed mid-write
    results = call_all(senders, sender_finish, [(["big"],)] * 2)
    for res in results:
        r = res["big"]
        assert r["state"] == "FAILED", r
        assert r["done_at"] - t_kill < 3.0
        assert res["_used_pages"] == 0  # the rank freed the request's prefill pages
    for w in senders:  # the failed write or the closed connection, whichever came first; both are seen
        assert _until(lambda w=w: w.call(sender_status, []), lambda s: s["lost"] is not None, 5.0)["lost"]
    call_all(senders, sender_close, [()] * 2)


def test_engine_usable_after_peer_death_then_frozen_decode_times_out(senders, decode):
    """Same sender processes and engines as the previous test: a new decode works; then it freezes."""
    case = Case(2, 16, "bf16", 2, 200, (("small", 9, False), ("frozen", 301, True)), seed=5)
    address = decode.call(decode_start, case)
    call_all(senders, sender_start, [(case, r, address) for r in range(2)])
    decode.call(decode_add, ["small"])
    call_all(senders, sender_submit, [(["small"],)] * 2)
    assert [res["small"]["state"] for res in call_all(senders, sender_finish, [(["small"],)] * 2)] == ["SUCCESS"] * 2
    assert decode.call(decode_wait, ["small"]) == {"small": ("SUCCESS", "")}
    assert decode.call(decode_verify, ["small"]) == {"small": True}

    decode.call(decode_add, ["frozen"])
    assert all(call_all(senders, sender_wait_dst, [(["frozen"],)] * 2))
    decode.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        results = call_all(senders, sender_finish_after_submit, [(["frozen"],)] * 2, timeout_s=30)
        for res in results:
            r = res["frozen"]
            assert r["state"] == "FAILED", r
            assert r["done_at"] - t0 <= TIMEOUT_S + 2.0, r
            assert res["_used_pages"] == 0
    finally:
        decode.signal(signal.SIGKILL)
    call_all(senders, sender_close, [()] * 2)


def test_killed_sender_fails_the_request_and_stops_the_other_rank(senders, decode):
    address = decode.call(decode_start, BIG, None, False)
    call_all(senders, sender_start, [(BIG, r, address) for r in range(2)])
    decode.call(decode_add, ["big"])
    assert all(call_all(senders, sender_wait_dst, [(["big"],)] * 2))
    call_all(senders, sender_submit, [(["big"], "transferring")] * 2)
    t_kill = time.monotonic()
    senders[1].signal(signal.SIGKILL)
    st = _until(lambda: decode.call(decode_status, ["big"]), lambda s: s["states"]["big"] == "FAILED", 5.0)
    assert st["states"]["big"] == "FAILED" and "sender rank 1 lost" in st["reasons"]["big"]
    assert time.monotonic() - t_kill < 3.0
    r0 = senders[0].call(sender_finish, ["big"])
    assert r0["big"]["state"] == "FAILED" and "sender rank 1 lost" in r0["big"]["reason"]
    # the live rank stopped between calls, acknowledged, and the decode side freed the pages
    assert r0["_used_pages"] == 0 and r0["_lost"] is None
    assert decode.call(decode_wait_free, BIG.decode_pages, 10.0) == BIG.decode_pages
    senders[0].call(sender_close)
    decode.call(decode_close)


def test_page_tables_are_owner_balanced():
    """The fixtures above rely on it: every rank owns n_pages / N pages, within one."""
    for rid, n_pages, _ in BIG.requests:
        table = page_tables(BIG)[rid]
        counts = torch.bincount(table % BIG.n, minlength=BIG.n)
        assert int(counts.max() - counts.min()) <= 1 and int(counts.sum()) == n_pages
