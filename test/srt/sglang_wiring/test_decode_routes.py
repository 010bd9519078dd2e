"""Routing a CP-shared prefill's pages to a decode sharded by page ownership: every page once, to the decode
rank owning its destination, at that rank's physical page; the indexer pages alike; nothing for others."""

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_cp_shared_kv.srt.sglang_wiring import decode_routes

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("cp_size, size", [(2, 2), (2, 3), (3, 2), (8, 8)])
def test_each_page_goes_once_to_its_decode_owner(cp_size, size):
    rng = np.random.default_rng(cp_size * 10 + size)
    table = rng.permutation(np.arange(size, 200))[:37]  # a request's prefill logical pages
    dst = rng.permutation(np.arange(size, 300))[:37]  # its decode logical pages
    seen = []
    for rank in range(cp_size):
        mine = table % cp_size == rank
        for d in range(size):
            src, phys = decode_routes.route_to_owner(table[mine], dst[mine], (size, d))
            seen += [(int(a), int(b) * size + d) for a, b in zip(src, phys)]
    assert sorted(seen) == sorted(zip(table.tolist(), dst.tolist()))


def test_only_a_sharded_prefill_routes_and_only_to_a_sharded_decode(monkeypatch):
    mgr = SimpleNamespace(decode_kv_args_table={"a": SimpleNamespace(dst_dcp_size=4, dst_dcp_rank=1),
                                                "b": SimpleNamespace(dst_dcp_size=1, dst_dcp_rank=0)})  # fmt: skip
    monkeypatch.setattr(decode_routes, "sharded_prefill", lambda m: m is mgr)
    assert decode_routes.decode_owner(mgr, "a") == (4, 1)
    assert decode_routes.decode_owner(mgr, "b") is None  # a decode holding every page
    assert decode_routes.decode_owner(mgr, "unknown") is None
    assert decode_routes.decode_owner(SimpleNamespace(), "a") is None  # not a sharded prefill


def test_indexer_pages_are_routed_and_other_state_is_left():
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    mgr = SimpleNamespace(kv_args=SimpleNamespace(state_types=[StateType.DSA, StateType.MAMBA]))
    req = TransferInfo.__new__(TransferInfo)
    req.__dict__.update({f.name: None for f in TransferInfo.__dataclass_fields__.values()})
    req.dst_state_indices = [np.array([10, 11, 12, 13]), np.array([7])]
    req2, src = decode_routes.route_state_to_owner(mgr, req, [np.array([4, 5, 6, 7]), np.array([3])], (2, 1))
    assert src[0].tolist() == [5, 7] and req2.dst_state_indices[0].tolist() == [5, 6]
    assert src[1].tolist() == [3] and req2.dst_state_indices[1].tolist() == [7]
    assert req.dst_state_indices[0].tolist() == [10, 11, 12, 13]  # the request itself is left as it was


def test_the_manifest_names_the_decode_cp_size_the_room_was_routed_by(monkeypatch):
    table = {"a": SimpleNamespace(dst_dcp_size=4, dst_dcp_rank=1), "b": SimpleNamespace(dst_dcp_size=1, dst_dcp_rank=0)}
    info = lambda sid, dummy=False: SimpleNamespace(mooncake_session_id=sid, is_dummy=dummy)  # noqa: E731
    rooms = {7: {"a": info("a")}, 8: {"b": info("b")}, 9: {"a": info("a", dummy=True)}}
    mgr = SimpleNamespace(decode_kv_args_table=table, transfer_infos=rooms)
    monkeypatch.setattr(decode_routes, "sharded_prefill", lambda m: m is mgr)
    sizes = [decode_routes.routed_dcp_size(mgr, room) for room in (7, 8, 9, 10)]
    assert sizes == [4, 1, 1, 1]  # routed; a whole-page decode; only a dummy destination; no room
