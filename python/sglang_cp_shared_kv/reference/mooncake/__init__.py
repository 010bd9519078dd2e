"""Prefill -> decode KV transfer over Mooncake for a CP-sharded pool.

Each prefill CP rank runs an ``OwnedPageSender`` that writes only the pages it owns,
tagged with their positions in the request; a non-CP decode server runs one
``DecodeReceiver`` that hands out destination pages and marks a request ready only
when the cp_size ranks' manifests rebuild it exactly.
"""

from sglang_cp_shared_kv.reference.mooncake.control_messages import ControlMessageError, PoolLayout
from sglang_cp_shared_kv.reference.mooncake.decode_pool import (
    DecodePageAllocator,
    make_decode_pool,
    owner_striped,
)
from sglang_cp_shared_kv.reference.mooncake.decode_receiver import DecodeReceiver
from sglang_cp_shared_kv.reference.mooncake.engine import (
    MAX_ENTRIES_PER_CALL,
    MooncakeEngine,
    TransferError,
    transfer_timeout_s,
)
from sglang_cp_shared_kv.reference.mooncake.owned_page_sender import OwnedPageSender, SendResult
from sglang_cp_shared_kv.reference.mooncake.transfer_state import TransferState, agree_across_ranks
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest import ManifestCollector, ManifestError

__all__ = [
    "MAX_ENTRIES_PER_CALL",
    "ControlMessageError",
    "DecodePageAllocator",
    "DecodeReceiver",
    "ManifestCollector",
    "ManifestError",
    "MooncakeEngine",
    "OwnedPageSender",
    "PoolLayout",
    "SendResult",
    "TransferError",
    "TransferState",
    "agree_across_ranks",
    "make_decode_pool",
    "owner_striped",
    "transfer_timeout_s",
]
