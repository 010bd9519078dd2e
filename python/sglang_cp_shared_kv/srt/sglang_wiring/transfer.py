"""PD from a CP-shared pool, prefill side: each CP rank's manifest of what it sent.

SGLang's Mooncake connector sends each prefill CP rank's owned pages (under
``get_parallel().enable_kv_cache_sharding``) but never says at which positions. Each rank records them
(``record_sent_share``) and appends its manifest to its Success status after SGLang's frames.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from sglang_cp_shared_kv.srt.disaggregation.mooncake import manifest as mf
from sglang_cp_shared_kv.srt.mem_cache import placement
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG, manager_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_of

logger = logging.getLogger(__name__)


class SendShareError(AssertionError):
    """Debug mode: a prefill rank's sender selected other pages than exactly its own."""


@dataclass
class SentShare:
    """What one prefill CP rank queued for one request, chunk by chunk."""

    page_table: list[int] = field(default_factory=list)  # the page at every position
    positions: list[int] = field(default_factory=list)  # the positions it selected
    dcp_size: int = 1  # the decode CP size its pages are routed by (1: not routed)


def latent_page_bytes(kv_args) -> int:
    """Bytes of one page over the target layers' latent buffers (no draft model's)."""
    lens, drafts = list(kv_args.kv_item_lens), getattr(kv_args, "num_draft_entries", 0)
    return int(sum(lens[: len(lens) - int(drafts or 0)]))


def sharded_prefill(mgr) -> bool:
    """Whether ``mgr`` is a prefill KV manager of a (sharded) CP-shared pool."""
    return manager_enabled(mgr, "prefill") and mgr.kv_shard_size > 1


def check_send_indices(sender, kv_indices, local, positions) -> None:
    """Debug mode, after ``CommonKVSender._prepare_send_indices``: it selected exactly this
    rank's pages of the chunk ``kv_indices``."""
    if not placement.debug_enabled():
        return
    rank, n = sender.kv_mgr.kv_shard_rank, sender.kv_mgr.kv_shard_size
    if n <= 1:
        raise SendShareError(f"{FLAG}: the KV manager is not sharded ({n} ranks)")
    pages = np.asarray(kv_indices, dtype=np.int64)
    owned = placement.page_owner(pages, n) == rank
    want = np.arange(sender.curr_idx - len(pages), sender.curr_idx)[owned]
    ok = np.array_equal(local, placement.local_page(pages[owned], n))
    if not (ok and np.array_equal(np.r_[positions], want)):  # a slice or an array
        room = sender.bootstrap_room
        raise SendShareError(f"{FLAG}: rank {rank} sent others' pages in room {room}")


def record_sent_share(sender, kv_indices, positions, dcp_size: int = 1) -> None:
    """After ``CommonKVSender._prepare_send_indices``: record the chunk's pages, the ``positions``
    selected for this rank, and the decode CP size they are routed by."""
    mgr, room = sender.kv_mgr, sender.bootstrap_room
    if not sharded_prefill(mgr):
        return
    infos = getattr(mgr, "transfer_infos", {}).get(room)
    if infos and all(getattr(i, "is_dummy", False) for i in infos.values()):
        return  # only dummy destinations: SGLang sends no status, so no manifest
    pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
    shares = state_of(mgr).shares
    if sender.curr_idx == len(pages):  # the first chunk (a reused room starts over)
        shares[room] = SentShare(dcp_size=dcp_size)
    if room in shares:  # else no manifest: the decode fails the request
        shares[room].page_table.extend(pages.tolist())
        shares[room].positions.extend(np.r_[positions].tolist())  # a slice or an array


def manifest_frames(mgr, room: int, status) -> list[bytes]:
    """The frames after SGLang's in ``CommonKVManager._encode_kv_status_message``: a Success
    carries this rank's manifest (after an empty reason frame where the backend sends none);
    Success and Failed drop the record."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if not sharded_prefill(mgr) or status not in (KVPoll.Success, KVPoll.Failed):
        return []
    share = state_of(mgr).shares.pop(room, None)
    if status == KVPoll.Success and share is None:
        logger.warning("%s: room %s has no share recorded: no manifest", FLAG, room)
    if status != KVPoll.Success or share is None:
        return []
    nbytes = len(share.positions) * latent_page_bytes(mgr.kv_args)
    sent = (share.page_table, share.positions, nbytes, share.dcp_size)
    manifest = mf.encode(mf.Manifest(str(room), mgr.kv_shard_rank, *sent))
    reason = [] if mgr.kv_status_msg_carries_reason else [b""]
    return [*reason, mf.MANIFEST_FRAME, str(mgr.kv_shard_size).encode(), manifest]


def drop_unsent_share(sender) -> None:
    """After ``CommonKVSender.clear``: forget a request that sends no Success (a Success may
    clear its sender before its status is encoded)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if sender.conclude_state != KVPoll.Success:
        state_of(sender.kv_mgr).shares.pop(sender.bootstrap_room, None)
