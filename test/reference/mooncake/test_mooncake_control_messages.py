"""Control messages round-trip, and every malformed one is rejected with a line naming the field."""

import json

import pytest

from sglang_cp_shared_kv.reference.mooncake import control_messages as cm

LAYOUT = cm.PoolLayout(64, "fp8", 2, True)
MESSAGES = [
    cm.Hello(1, 4, "127.0.0.1:15001", LAYOUT),
    cm.Bootstrap("127.0.0.1:15002", 100, LAYOUT, (4096, 8192), (12288, 16384)),
    cm.Bootstrap("127.0.0.1:15002", 100, cm.PoolLayout(16, "bf16", 1, False), (4096,), ()),
    cm.Reject("rank 1 is already connected"),
    cm.DstPages("req-1", (5, 3, 9)),
    cm.Manifest("req-1", 2, (6, 2, 11), (0, 2), 2 * 64 * 788 * 2),
    cm.Failed("req-1", 0, "batch_transfer_sync_write returned -1"),
    cm.Verdict("req-1", True, ""),
    cm.Heartbeat(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = cm.encode(msg)
    assert json.loads(data)["v"] == cm.PROTOCOL_VERSION
    assert cm.decode(data) == msg


def _raw(**over):
    body = {
        "v": 1,
        "type": "manifest",
        "request_id": "req",
        "rank": 0,
        "page_table": [4, 5],
        "positions": [0],
        "nbytes": 7,
    }
    body.update(over)
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    "data,match",
    [
        (b"\xff\x00", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (_raw(v=2), "version must be 1"),
        (_raw(v=...), "version must be 1"),
        (_raw(type="teleport"), "type must be one of"),
        (_raw(rank=-1), r"manifest.rank must be an int >= 0"),
        (_raw(rank=True), r"manifest.rank must be an int"),
        (_raw(rank="0"), r"manifest.rank must be an int"),
        (_raw(nbytes=1.5), r"manifest.nbytes must be an int"),
        (_raw(positions=[0, -3]), r"manifest.positions\[1\] must be an int >= 0"),
        (_raw(positions="0,1"), r"manifest.positions must be a list"),
        (_raw(page_table=[4, None]), r"manifest.page_table\[1\]"),
        (_raw(request_id=""), r"manifest.request_id must be a non-empty string"),
        (_raw(request_id="x" * 300), r"manifest.request_id must be a non-empty string of at most 256"),
        (_raw(nbytes=...), r"missing \['nbytes'\]"),
        (_raw(extra=1), r"unexpected \['extra'\]"),
        (
            b'{"v":1,"type":"hello","rank":4,"cp_size":4,"session_id":"s","layout":{"page_size":64,"kv_format":"fp8","num_layers":2,"with_indexer":true}}',
            "hello.rank must be < cp_size 4",
        ),
        (
            b'{"v":1,"type":"hello","rank":0,"cp_size":4,"session_id":"s","layout":{"page_size":48,"kv_format":"fp8","num_layers":2,"with_indexer":true}}',
            "page_size must be a power of two",
        ),
        (
            b'{"v":1,"type":"hello","rank":0,"cp_size":4,"session_id":"s","layout":{"page_size":64,"kv_format":"fp4","num_layers":2,"with_indexer":true}}',
            "kv_format must be one of",
        ),
        (
            b'{"v":1,"type":"hello","rank":0,"cp_size":4,"session_id":"s","layout":{"page_size":64}}',
            "layout must be an object",
        ),
        (
            b'{"v":1,"type":"bootstrap","session_id":"s","num_pages":9,"layout":{"page_size":64,"kv_format":"fp8","num_layers":2,"with_indexer":true},"latent_base":[1],"index_base":[1,2]}',
            "latent_base must hold 2 addresses",
        ),
        (
            b'{"v":1,"type":"bootstrap","session_id":"s","num_pages":9,"layout":{"page_size":64,"kv_format":"fp8","num_layers":1,"with_indexer":false},"latent_base":[1],"index_base":[1]}',
            "index_base must hold 0 addresses",
        ),
        (b'{"v":1,"type":"dst_pages","request_id":"r","dst_pages":[3,4,3]}', "holds a page twice"),
        (b'{"v":1,"type":"verdict","request_id":"r","ok":1,"reason":""}', "verdict.ok must be a bool"),
    ],
)
def test_malformed_is_rejected(data, match):
    with pytest.raises(cm.ControlMessageError, match=match):
        cm.decode(data)


def test_encode_validates_like_the_receiver():
    with pytest.raises(cm.ControlMessageError, match="positions"):
        cm.encode(cm.Manifest("req", 0, (1, 2), (0, -1), 0))
    with pytest.raises(ValueError, match="control message"):
        cm.encode({"type": "heartbeat"})


def test_layout_mismatch_names_the_field():
    assert LAYOUT.mismatch(cm.PoolLayout(64, "fp8", 2, True)) is None
    assert "kv_format differs" in LAYOUT.mismatch(cm.PoolLayout(64, "bf16", 2, True))
