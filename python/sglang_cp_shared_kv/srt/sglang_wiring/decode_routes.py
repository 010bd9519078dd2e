"""PD from a CP-shared prefill into a decode whose pool is sharded by the same page ownership.

A decode rank ``d`` of ``D`` (``D > 1``) registers SGLang's ``dst_dcp_size`` / ``dst_dcp_rank`` and sends
the request's logical destination pages, the same on every decode rank. Each prefill rank sends it only
the pages it owns whose destination logical page ``l`` has ``l % D == d``, to that rank's physical page
``l // D`` (``route_to_owner``), latent and indexer pages alike: every page once, from its prefill
owner to its decode owner, whole, for any ``D`` (not SGLang's token relayout). Each rank's manifest names the
``D`` it routed by (``routed_dcp_size``) and the decode refuses any other. A decode server with the flag
and ``--dcp-size D`` builds such a pool (``decode_server``), as do the demo's ``--decode-cp-size`` ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sglang_cp_shared_kv.srt.mem_cache.placement import local_page, page_owner
from sglang_cp_shared_kv.srt.sglang_wiring.transfer import sharded_prefill


def decode_owner(mgr: Any, session_id: str) -> tuple[int, int] | None:
    """``(D, d)`` of a destination decode rank ``d`` of ``D`` (``D > 1``: its pool sharded by page ownership)
    a sharded prefill writes to over ``session_id``; None for any other destination or manager."""
    if not sharded_prefill(mgr):
        return None
    info = mgr.decode_kv_args_table.get(session_id)
    size = getattr(info, "dst_dcp_size", 1)
    return (size, info.dst_dcp_rank) if size > 1 else None


def routed_dcp_size(mgr: Any, room: int) -> int:
    """The decode CP size ``D`` a sharded prefill routes request ``room``'s pages by (1: not routed)."""
    infos = getattr(mgr, "transfer_infos", {}).get(room) or {}
    owners = [
        decode_owner(mgr, info.mooncake_session_id) for info in infos.values() if not getattr(info, "is_dummy", False)
    ]
    return max((owner[0] for owner in owners if owner is not None), default=1)


def route_to_owner(src, dst, owner: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ``(src[i], dst[i])`` whose destination logical page lives on decode rank ``d`` of ``D``
    (``owner``), each destination made that rank's physical page ``dst[i] // D``."""
    size, rank = owner
    dst = np.asarray(dst, dtype=np.int64)
    keep = page_owner(dst, size) == rank
    return np.asarray(src)[keep], local_page(dst[keep], size).astype(np.int32)


def route_state_to_owner(mgr: Any, req: Any, state_indices: list, owner: tuple[int, int]) -> tuple[Any, list]:
    """``(req, state_indices)`` for ``MooncakeKVManager.maybe_send_extra`` with the DSA indexer pages routed
    as ``route_to_owner`` routes latent pages (SGLang's own filter then keeps this rank's); a page count
    that differs from the destination's is left for SGLang's check to refuse."""
    from sglang.srt.disaggregation.base.conn import StateType

    src, dst = list(state_indices), list(req.dst_state_indices)
    for i, kind in enumerate(getattr(mgr.kv_args, "state_types", [])):
        if kind == StateType.DSA and i < min(len(src), len(dst)) and src[i] is not None:
            if len(src[i]) == len(dst[i]):
                src[i], dst[i] = route_to_owner(src[i], dst[i], owner)
    return dataclasses.replace(req, dst_state_indices=dst), src
