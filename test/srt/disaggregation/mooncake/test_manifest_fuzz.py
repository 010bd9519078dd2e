"""Hostile manifests: the codec and the decode side's check fed random and malformed messages.

Property tests (hypothesis) over the product path:

- ``manifest.decode`` on arbitrary bytes, arbitrary JSON and mutated manifests: it returns a
  fully valid ``Manifest`` or raises ``ControlMessageError`` with one line, nothing else;
- a request's status messages as the decode receives them (SGLang's status frames, then the
  manifest frames of ``transfer.manifest_frames``), with any subset of the prefill ranks hostile
  (truncated, oversized or non-JSON manifests, wrong field types, out-of-range or duplicate
  positions, another request's id or page table, a rank claiming pages it does not own or leaving
  out pages it owns, a wrong byte count, a wrong rank or CP size, missing or extra frames), checked
  by ``decode_manifest._judge`` and the request's ``ManifestCollector`` as the hooked parser
  does: a request with a hostile rank never completes and carries one one-line error naming the
  request; an honest request completes; nothing raises.

``test_plugin_decode_manifest`` feeds this file's requests to SGLang's decode manager (the hooked
``parse_kv_status_message``, then SGLang's ``apply_prefill_status``): a request with a hostile rank
ends ``Failed`` with the one-line reason (SGLang then fails it and releases its pages as for any
failed transfer), an honest one ``Success``, and the decode pool's bytes are unchanged.

``CP_SHARED_KV_FUZZ_EXAMPLES`` sets the examples per property (CI: 300; the long run: 20000).
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.srt.disaggregation.mooncake import manifest as cm
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest import ManifestCollector, ManifestError

EXAMPLES = int(os.environ.get("CP_SHARED_KV_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The frames of a status message after SGLang's (room, status, prefill rank, reason).
MANIFEST_FRAME = b"CP_SHARED_KV_MANIFEST"
SUCCESS = b"4"  # int(KVPoll.Success) in SGLang 0.5.23 (test_plugin_decode_manifest feeds these to SGLang)

MUTATIONS = [
    "truncate",
    "not_json",
    "random_json",
    "deep_nesting",
    "wrong_version",
    "wrong_type",
    "missing_field",
    "extra_field",
    "field_wrong_type",
    "int_out_of_range",
    "duplicate_position",
    "position_out_of_range",
    "foreign_position",
    "missing_position",
    "other_request",
    "other_table",
    "wrong_nbytes",
    "wrong_rank",
    "wrong_cp_size",
    "wrong_dcp_size",
    "no_manifest",
    "extra_frame",
    "garbage_cp_frame",
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def one_line(e: BaseException) -> bool:
    return "\n" not in str(e) and 0 < len(str(e)) <= 600


# ------------------------------------------------------------------------------ the codec
@FUZZ
@given(data=st.binary(max_size=512) | json_values.map(lambda v: json.dumps(v).encode()))
def test_codec_returns_a_valid_manifest_or_one_clear_error(data):
    try:
        m = cm.decode(data)
    except cm.ControlMessageError as e:
        assert one_line(e), str(e)
        return
    assert isinstance(m, cm.Manifest)
    assert cm.decode(cm.encode(m)) == m  # what it returned passes every check again


@FUZZ
@given(
    body=st.fixed_dictionaries(
        {
            "v": st.just(cm.PROTOCOL_VERSION),
            "type": st.just("manifest"),
            "request_id": st.one_of(st.text(min_size=1, max_size=300), json_values),
            "rank": st.one_of(st.integers(-(2**70), 2**70), json_values),
            "page_table": st.one_of(st.lists(st.integers(-(2**40), 2**66), max_size=6), json_values),
            "positions": st.one_of(st.lists(st.integers(-3, 2**33), max_size=6), json_values),
            "nbytes": st.one_of(st.integers(-(2**70), 2**70), st.floats(), json_values),
            "dcp_size": st.one_of(st.integers(-3, 2**33), json_values),
        }
    ),
    drop=st.sets(st.sampled_from(["v", "type", "request_id", "rank", "page_table", "positions", "nbytes", "dcp_size"])),
)
def test_codec_checks_every_field(body, drop):
    for k in drop:
        body.pop(k)
    try:
        m = cm.decode(json.dumps(body).encode())
    except cm.ControlMessageError as e:
        assert one_line(e), str(e)
        return
    # Accepted only when every field is present and in range.
    assert not drop
    assert 0 < len(m.request_id) <= cm.MAX_ID_CHARS and 0 <= m.rank <= cm.MAX_INT and 0 <= m.nbytes <= cm.MAX_INT
    assert all(0 <= x <= cm.MAX_INDEX for x in (*m.page_table, *m.positions))
    assert 1 <= m.dcp_size <= cm.MAX_INDEX


def test_codec_refuses_oversized_and_deeply_nested_messages():
    with pytest.raises(cm.ControlMessageError, match="bytes, at most"):
        cm.decode(b" " * (cm.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(cm.ControlMessageError, match="nested too deeply"):
        cm.decode(b"[" * 200_000)
    with pytest.raises(cm.ControlMessageError, match=r"page_table\[0\] must be an int in \[0, 2147483647\]"):
        cm.decode(json.dumps({"v": cm.PROTOCOL_VERSION, "type": "manifest", "request_id": "1", "rank": 0, "page_table": [2**70], "positions": [0], "nbytes": 0, "dcp_size": 1}).encode())  # fmt: skip
    # An integer past Python's digit limit for str -> int: json raises a plain ValueError for it.
    with pytest.raises(cm.ControlMessageError, match="not valid JSON: Exceeds the limit"):
        cm.decode(b'{"v": 2, "type": "manifest", "rank": ' + b"9" * 4301 + b"}")


# ------------------------------------------------------------------------------ one request's messages
@st.composite
def requests(draw):
    """(room, cp_size, page table, page bytes): a request as the decode and its prefill ranks know it."""
    cp_size = draw(st.integers(1, 4))
    n_pages = draw(st.integers(1, 24))
    table = draw(st.lists(st.integers(0, 4 * n_pages + 8), min_size=n_pages, max_size=n_pages, unique=True))
    return draw(st.integers(1, 2**62)), cp_size, table, draw(st.integers(1, 4096))


def honest_body(room: int, rank: int, cp_size: int, table: list[int], page_bytes: int) -> dict:
    """What ``transfer.manifest_frames`` sends for rank ``rank``: the table and the positions it owns."""
    positions = [p for p, lp in enumerate(table) if lp % cp_size == rank]
    return {
        "v": cm.PROTOCOL_VERSION,
        "type": "manifest",
        "request_id": str(room),
        "rank": rank,
        "page_table": list(table),
        "positions": positions,
        "nbytes": len(positions) * page_bytes,
        "dcp_size": 1,
    }


def honest_raw(room: int, rank: int, cp_size: int, table: list[int], page_bytes: int) -> bytes:
    """The honest manifest as the prefill's codec encodes it."""
    body = honest_body(room, rank, cp_size, table, page_bytes)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in body.items() if k not in ("v", "type")}
    return cm.encode(cm.Manifest(**fields))


def status(room: int, prank: int, tail: list[bytes]) -> list[bytes]:
    return [str(room).encode(), SUCCESS, str(prank).encode(), b"", *tail]


def hostile_message(draw, kind: str, room: int, rank: int, cp_size: int, table: list[int], pb: int):
    """Rank ``rank``'s Success status with a manifest that ``kind`` makes wrong (None: not applicable here)."""
    body = honest_body(room, rank, cp_size, table, pb)
    n = len(table)
    owned = body["positions"]
    cp_frame = str(cp_size).encode()

    def frames(raw: bytes) -> list[bytes]:
        return status(room, rank, [MANIFEST_FRAME, cp_frame, raw])

    def enc(b: dict) -> list[bytes]:
        return frames(json.dumps(b).encode())

    if kind == "truncate":
        raw = json.dumps(body).encode()
        return frames(raw[: draw(st.integers(0, len(raw) - 1))])
    if kind == "not_json":
        return frames(draw(st.binary(max_size=64)).replace(b"{", b"("))
    if kind == "random_json":
        return frames(json.dumps(draw(json_values)).encode())
    if kind == "deep_nesting":
        depth = draw(st.integers(5_000, 50_000))
        return frames(b'{"v":2,"type":"manifest","request_id":' + b"[" * depth + b"]" * depth + b"}")
    if kind == "wrong_version":
        return enc({**body, "v": draw(st.sampled_from([0, 1, 3, "2", None, 2.0, True]))})
    if kind == "wrong_type":
        return enc({**body, "type": draw(st.sampled_from(["hello", "Manifest", "", None, 7]))})
    if kind == "missing_field":
        k = draw(st.sampled_from(["request_id", "rank", "page_table", "positions", "nbytes", "dcp_size"]))
        return enc({f: v for f, v in body.items() if f != k})
    if kind == "extra_field":
        return enc({**body, draw(st.sampled_from(["pages", "Rank", "x", ""])): draw(json_values)})
    if kind == "field_wrong_type":
        k = draw(st.sampled_from(["request_id", "rank", "page_table", "positions", "nbytes", "dcp_size"]))
        bad = {
            "request_id": st.sampled_from([room, None, "", [str(room)], "x" * 300]),
            "rank": st.sampled_from([str(rank), float(rank) + 0.5, None, True, [rank]]),
            "page_table": st.sampled_from([None, "1,2", {"0": 1}, [str(x) for x in table] or ["0"], [0.5]]),
            "positions": st.sampled_from([None, "0", {"0": 0}, [[0]], [True], [1.5]]),
            "nbytes": st.sampled_from([None, "0", 1.5, [0], False]),
            "dcp_size": st.sampled_from([None, "1", 1.5, [1], True]),
        }[k]
        return enc({**body, k: draw(bad)})
    if kind == "int_out_of_range":
        k = draw(st.sampled_from(["rank", "nbytes", "page_table", "positions", "dcp_size"]))
        v = draw(st.sampled_from([-1, -(2**63), 2**63, 2**80] + ([0] if k == "dcp_size" else [])))
        if k in ("page_table", "positions"):
            lst = list(body[k]) or [0]
            lst[draw(st.integers(0, len(lst) - 1))] = v if v < 0 or k == "positions" else max(v, 2**31)
            return enc({**body, k: lst})
        return enc({**body, k: v})
    if kind == "duplicate_position":
        pos = owned or list(range(n))
        p = draw(st.sampled_from(pos))
        return enc({**body, "positions": [*owned, p]})
    if kind == "position_out_of_range":
        return enc({**body, "positions": [*owned, n + draw(st.integers(0, 2**31 - 1 - n))]})
    if kind == "foreign_position":
        foreign = [p for p, lp in enumerate(table) if lp % cp_size != rank]
        if not foreign:
            return None
        return enc({**body, "positions": sorted([*owned, draw(st.sampled_from(foreign))])})
    if kind == "missing_position":
        if not owned:
            return None
        drop = draw(st.sampled_from(owned))
        return enc({**body, "positions": [p for p in owned if p != drop], "nbytes": (len(owned) - 1) * pb})
    if kind == "other_request":
        return enc({**body, "request_id": str(room + draw(st.integers(1, 10)))})
    if kind == "other_table":
        # Another request's pages: a different table of the same length. A lone rank's table cannot
        # be cross-checked (the decode never sees the prefill's logical pages), so only with N > 1.
        if cp_size == 1:
            return None
        other = draw(st.lists(st.integers(0, 4 * n + 8), min_size=n, max_size=n, unique=True))
        if other == table:
            return None
        return enc(honest_body(room, rank, cp_size, other, pb))
    if kind == "wrong_nbytes":
        return enc(
            {**body, "nbytes": body["nbytes"] + draw(st.sampled_from([-1, 1, pb]))} if owned else {**body, "nbytes": pb}
        )
    if kind == "wrong_rank":
        return enc({**body, "rank": draw(st.sampled_from([r for r in range(cp_size + 2) if r != rank]))})
    if kind == "wrong_cp_size":
        return status(room, rank, [MANIFEST_FRAME, str(draw(st.sampled_from([0, cp_size + 1, 2 * cp_size + 1]))).encode(), json.dumps(body).encode()])  # fmt: skip
    if kind == "wrong_dcp_size":  # routed for a decode CP the decode (non-CP here) does not run
        return enc({**body, "dcp_size": draw(st.sampled_from([2, 3, 8]))})
    if kind == "no_manifest":
        return status(room, rank, [])
    if kind == "extra_frame":
        return status(room, rank, [MANIFEST_FRAME, cp_frame, json.dumps(body).encode(), b"x"])
    if kind == "garbage_cp_frame":
        return status(room, rank, [MANIFEST_FRAME, draw(st.sampled_from([b"", b"two", b"\xff", b"2.0", b"9" * 5000])), json.dumps(body).encode()])  # fmt: skip
    raise AssertionError(kind)


@st.composite
def request_messages(draw):
    """One request and its N status messages in arrival order; which ranks are hostile, and how."""
    room, cp_size, table, pb = draw(requests())
    hostile: dict[int, str] = {}
    for rank in draw(st.sets(st.integers(0, cp_size - 1))):
        kind = draw(st.sampled_from(MUTATIONS))
        hostile[rank] = kind
    if len(hostile) == cp_size and set(hostile.values()) == {"other_table"}:
        # Every rank sending one other table (equal draws) is a consistent request the decode cannot tell
        # from an honest one (it never sees the prefill's logical pages): one rank stays honest to disagree.
        del hostile[0]
    messages = []
    for rank in range(cp_size):
        msg = hostile_message(draw, hostile[rank], room, rank, cp_size, table, pb) if rank in hostile else None
        if msg is None:
            hostile.pop(rank, None)
            msg = status(
                room, rank, [MANIFEST_FRAME, str(cp_size).encode(), honest_raw(room, rank, cp_size, table, pb)]
            )
        messages.append((rank, msg))
    order = draw(st.permutations(range(cp_size)))
    return room, cp_size, table, pb, hostile, [messages[i] for i in order]


@FUZZ
@given(case=request_messages())
def test_the_decode_check_fails_every_request_with_a_hostile_rank(case):
    from sglang_cp_shared_kv.srt.sglang_wiring.decode_manifest import RoomCheck, _judge

    room, cp_size, table, pb, hostile, messages = case
    check = RoomCheck(ManifestCollector(str(room), len(table), cp_size, pb), senders=cp_size)
    for prank, msg in messages:
        _judge(check, msg, room, prank)  # the hooked parser's step for one Success status; never raises
    if not hostile:
        assert check.error is None and check.collector.complete
        return
    assert check.error is not None, hostile
    assert "\n" not in check.error and check.error.startswith(f"request {room}"), check.error
    assert len(check.reported) == cp_size  # every sender counted, so the failure is released
    assert not check.collector.complete  # a hostile rank's manifest was never taken


@FUZZ
@given(req=requests(), data=st.data())
def test_a_rejected_manifest_changes_nothing_in_the_collector(req, data):
    """Interleave honest and hostile manifests: a rejected one leaves the collector as it was; an
    accepted one is exactly its rank's honest share; the request completes only with all of them."""
    room, cp_size, table, pb = req
    c = ManifestCollector(str(room), len(table), cp_size, pb)
    accepted = set()
    for _ in range(data.draw(st.integers(1, 3 * cp_size))):
        rank = data.draw(st.integers(0, cp_size - 1))
        kind = data.draw(st.sampled_from(["honest", *MUTATIONS]))
        msg = None if kind == "honest" else hostile_message(data.draw, kind, room, rank, cp_size, table, pb)
        body = honest_body(room, rank, cp_size, table, pb)
        raw = json.dumps(body).encode() if msg is None else msg[-1]
        before = (dict(c.reported_by), None if c.page_table is None else c.page_table.copy())
        try:
            m = cm.decode(raw)
            if msg is not None and msg[-3:-1] != [MANIFEST_FRAME, str(cp_size).encode()]:
                raise ManifestError("frames")  # a frame-level fault: decode_manifest._read rejects it first
            c.add(m)
        except (cm.ControlMessageError, ManifestError) as e:
            assert one_line(e)
            assert before[0] == c.reported_by
            assert (before[1] is None and c.page_table is None) or (before[1] == c.page_table).all()
            continue
        # Accepted: exactly the honest share of its rank under the table the collector holds (a
        # table no other rank contradicts yet cannot be checked: the decode never sees logical pages).
        agreed = c.page_table.tolist()
        assert m == cm.decode(honest_raw(room, m.rank, cp_size, agreed, pb)), (kind, m)
        accepted.add(m.rank)
    assert c.complete == (accepted == set(range(cp_size)))
