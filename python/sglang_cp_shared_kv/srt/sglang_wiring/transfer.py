"""PD transfer of a CP-shared pool through SGLang's Mooncake connector (``docs/sglang_plugin.md``,
"Transfer" and "Manifest").

SGLang 0.5.23's connector already sends each prefill CP rank's owned pages for its own page sharding, keyed
on ``get_parallel().enable_kv_cache_sharding``, which ``pool_hooks`` sets once the CP-shared pool exists.
SGLang's sender never sends positions, so each CP rank records per request the logical page at every
position and the positions it selected (``record_sent_share``), and appends them to its Success status
message after the frames SGLang parses (``manifest_frames``): a decode without the flag reads the message
as before; one with it checks them before the request is ready (``decode_manifest``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_cp_shared_kv.srt.disaggregation.mooncake import manifest_codec as cm
from sglang_cp_shared_kv.srt.mem_cache.placement import debug_enabled, local_page, page_owner
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG, manager_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_if_any, state_of

logger = logging.getLogger(__name__)

# Marks the manifest frames appended to a prefill rank's Success status message:
# [..status frames.., MANIFEST_FRAME, cp_size, control_messages.Manifest as JSON].
MANIFEST_FRAME = b"CP_SHARED_KV_MANIFEST"


class SendShareError(AssertionError):
    """A prefill rank's sender selected pages it does not own, or missed some it does."""


def check_send_indices(sender, kv_indices, local, positions, is_last: bool) -> None:
    """Debug mode, after ``CommonKVSender._prepare_send_indices``: the ``local`` pages at ``positions`` it
    selected are this rank's owned ones, and by the last chunk all of them."""
    if not debug_enabled():
        return
    mgr = sender.kv_mgr
    rank, cp_size = mgr.kv_shard_rank, mgr.kv_shard_size
    if cp_size <= 1:
        raise SendShareError(f"{FLAG}: the KV manager is not in sharded mode (kv_shard_size={cp_size})")
    pages = np.asarray(kv_indices, dtype=np.int64)
    start = sender.curr_idx - len(pages)
    owned = page_owner(pages, cp_size) == rank
    want_local, want_pos = local_page(pages[owned], cp_size), np.arange(start, start + len(pages))[owned]
    got_pos = np.arange(positions.start, positions.stop) if isinstance(positions, slice) else np.asarray(positions)
    if not (np.array_equal(np.asarray(local, dtype=np.int64), want_local) and np.array_equal(got_pos, want_pos)):
        raise SendShareError(
            f"{FLAG}: rank {rank} selected pages/positions it does not own in room {sender.bootstrap_room}"
        )
    sent_by_room = state_of(mgr).sent  # debug only: (all logical pages in order, positions this rank sent)
    seen, sent = sent_by_room.setdefault(sender.bootstrap_room, ([], []))
    seen.extend(pages.tolist())
    sent.extend(want_pos.tolist())
    if is_last:
        sent_by_room.pop(sender.bootstrap_room, None)
        expected = [p for p, lp in enumerate(seen) if page_owner(lp, cp_size) == rank]
        if sent != expected:
            raise SendShareError(f"{FLAG}: rank {rank} sent positions {sent}, owns {expected}")
        logger.info("%s: room %s rank %d sent %d of %d pages", FLAG, sender.bootstrap_room, rank, len(sent), len(seen))


@dataclass
class SentShare:
    """What one prefill CP rank queued for one request, chunk by chunk."""

    page_table: list[int] = field(default_factory=list)  # the logical page at every position
    positions: list[int] = field(default_factory=list)  # the positions this rank selected to send
    dcp_size: int = 1  # the decode CP size its pages are routed by (1: not routed)


def latent_page_bytes(kv_args: Any) -> int:
    """Bytes of one page over every target layer's latent buffer (draft-model entries excluded)."""
    lens = list(kv_args.kv_item_lens)
    return int(sum(lens[: len(lens) - int(getattr(kv_args, "num_draft_entries", 0) or 0)]))


def sharded_prefill(mgr: Any) -> bool:
    """Whether ``mgr`` is a prefill KV manager of a CP-shared pool (flag on, pages sharded over its CP)."""
    return manager_enabled(mgr, "prefill") and mgr.kv_shard_size > 1


def record_sent_share(sender, kv_indices, positions, dcp_size: int = 1) -> None:
    """After ``CommonKVSender._prepare_send_indices``: record the chunk's logical pages (``kv_indices``), the
    ``positions`` SGLang's filter selected for this rank and the decode CP size the pages are routed by."""
    mgr = sender.kv_mgr
    if not sharded_prefill(mgr):
        return
    infos = getattr(mgr, "transfer_infos", {}).get(sender.bootstrap_room)
    if infos and all(getattr(info, "is_dummy", False) for info in infos.values()):
        # Every destination is a dummy (a decode rank that takes nothing from this one): SGLang's transfer
        # worker marks the request Success and sends no status message, so there is no manifest to record.
        return
    pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
    positions = range(positions.start, positions.stop) if isinstance(positions, slice) else positions
    shares = state_of(mgr).shares
    if sender.curr_idx == len(pages):  # the request's first chunk opens its share (a reused room starts over)
        shares[sender.bootstrap_room] = SentShare(dcp_size=dcp_size)
    share = shares.get(sender.bootstrap_room)
    if share is None:  # never opened: the request goes without a manifest and the decode fails it
        return
    share.page_table.extend(pages.tolist())
    share.positions.extend(int(p) for p in positions)


def manifest_frames(mgr, bootstrap_room: int, status) -> list[bytes]:
    """The frames a status message of ``CommonKVManager._encode_kv_status_message`` gets after SGLang's own: a
    Success carries this rank's manifest (after an empty reason frame where the backend sends none); a Failed
    drops the record; any other status leaves it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if not sharded_prefill(mgr) or status not in (KVPoll.Success, KVPoll.Failed):
        return []
    state = state_if_any(mgr)
    share = state.shares.pop(bootstrap_room, None) if state is not None else None
    if status != KVPoll.Success:
        return []
    if share is None:
        logger.warning("%s: room %s concluded with no recorded share; its manifest is missing", FLAG, bootstrap_room)
        return []
    manifest = cm.Manifest(
        request_id=str(bootstrap_room),
        rank=mgr.kv_shard_rank,
        page_table=tuple(share.page_table),
        positions=tuple(share.positions),
        nbytes=len(share.positions) * latent_page_bytes(mgr.kv_args),
        dcp_size=share.dcp_size,
    )
    reason = [] if mgr.kv_status_msg_carries_reason else [b""]
    return [*reason, MANIFEST_FRAME, str(mgr.kv_shard_size).encode("ascii"), cm.encode(manifest)]


def drop_unsent_share(sender) -> None:
    """After ``CommonKVSender.clear``: forget a request that will send no Success (a Success keeps its record:
    the sender may be cleared before the status is encoded)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    state = state_if_any(sender.kv_mgr)
    if state is None:
        return
    state.sent.pop(sender.bootstrap_room, None)
    if sender.conclude_state != KVPoll.Success:
        state.shares.pop(sender.bootstrap_room, None)
