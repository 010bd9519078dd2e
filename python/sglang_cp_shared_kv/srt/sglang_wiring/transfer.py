"""PD transfer of a CP-shared pool through SGLang's Mooncake connector.

SGLang 0.5.23's Mooncake connector already carries sharded-KV transfers for its own page
sharding, with the ownership arithmetic of ``PageOwnership`` (logical page ``lp`` on group
rank ``lp % N`` as local page ``lp // N``) over the same group (the attention-CP group when
prefill CP is on):

- each prefill CP rank's sender keeps the request pages it owns and sends them as local pages
  to the decode destinations at their positions in the request
  (``disaggregation.utils.filter_kv_indices_for_shard_rank`` from
  ``CommonKVSender._prepare_send_indices``; DSA indexer pages likewise in
  ``MooncakeKVManager.maybe_send_extra``);
- the prefill advertises the sharding in its bootstrap info, so a stock decode server pulls
  from all N prefill CP ranks and waits for N completions.

Those paths key on ``get_parallel().enable_kv_cache_sharding``. ``enable_sharded_transfer``
sets it for this process once the CP-shared pool and its allocator exist (after the only pool
builders that read it), so SGLang's KV manager, created later, takes them. Nothing else reads
the flag in a prefill scheduler after that point except the FlashInfer autotune, which it then
skips (its dummy decode batch would read logical locs outside a planned batch).

Not wired: our decode-side manifest check. A stock decode marks a request ready after N
successes; it does not see which positions each rank sent. With ``SGLANG_DEBUG_CP_SHARED_KV=1``
each prefill rank checks its own share instead (``check_send_indices``).
"""

from __future__ import annotations

import logging

import numpy as np

from sglang_cp_shared_kv.srt.mem_cache.placement import debug_enabled
from sglang_cp_shared_kv.srt.server_args_hook import FLAG, runtime_enabled

logger = logging.getLogger(__name__)


def enable_sharded_transfer() -> None:
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(enable_kv_cache_sharding=True)
    logger.info("%s: Mooncake transfers send each CP rank's owned pages (SGLang's sharded sender path)", FLAG)


class SendShareError(AssertionError):
    """A prefill rank's sender selected pages it does not own, or missed some it does."""


# Debug only: per bootstrap room, (all logical pages in order, positions this rank sent).
_SENT: dict[int, tuple[list[int], list[int]]] = {}


def owned_share(pages: np.ndarray, positions: np.ndarray, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """What rank ``rank`` must send of a chunk: (local pages, positions) of the pages it owns."""
    owned = pages % size == rank
    return pages[owned] // size, positions[owned]


def check_send_indices(result, sender, kv_indices, state_indices=None):
    """AFTER hook on ``CommonKVSender._prepare_send_indices`` (debug mode, flag on).

    Checks every chunk's selection against ``owned_share`` and, on the last chunk, that this
    rank sent exactly the positions of the request it owns: its share of the manifest.
    """
    if not (debug_enabled() and runtime_enabled()):
        return None
    mgr = sender.kv_mgr
    rank, size = mgr.kv_shard_rank, mgr.kv_shard_size
    if size <= 1:
        raise SendShareError(f"{FLAG}: the KV manager is not in sharded mode (kv_shard_size={size})")
    local, positions, is_last, skip = result
    pages = np.asarray(kv_indices, dtype=np.int64)
    start = sender.curr_idx - len(pages)
    want_local, want_pos = owned_share(pages, np.arange(start, start + len(pages)), rank, size)
    got_pos = np.arange(positions.start, positions.stop) if isinstance(positions, slice) else np.asarray(positions)
    if not (np.array_equal(np.asarray(local, dtype=np.int64), want_local) and np.array_equal(got_pos, want_pos)):
        raise SendShareError(
            f"{FLAG}: rank {rank} selected pages/positions it does not own in room {sender.bootstrap_room}"
        )
    seen, sent = _SENT.setdefault(sender.bootstrap_room, ([], []))
    seen.extend(pages.tolist())
    sent.extend(want_pos.tolist())
    if is_last:
        _SENT.pop(sender.bootstrap_room, None)
        expected = [p for p, lp in enumerate(seen) if lp % size == rank]
        if sent != expected:
            raise SendShareError(f"{FLAG}: rank {rank} sent positions {sent}, owns {expected}")
        logger.info("%s: room %s rank %d sent %d of %d pages", FLAG, sender.bootstrap_room, rank, len(sent), len(seen))
    return None


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.common.conn.CommonKVSender._prepare_send_indices",
        check_send_indices,
        HookType.AFTER,
    )
