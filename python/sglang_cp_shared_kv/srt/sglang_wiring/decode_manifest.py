"""The decode side's manifest check, inside SGLang's Mooncake KV receiver (``docs/sglang_plugin.md``,
"Manifest").

A decode server run with ``--enable-cp-shared-kv --disaggregation-mode decode`` stays non-CP; the flag
means "expect CP shared-KV manifests" (``transfer.manifest_frames``). Each request gets a
``ManifestCollector`` before its destination pages leave; a Success status passes only if the collector
accepts its manifest, so SGLang's N successes, its only condition for ``KVPoll.Success``, are reached
exactly when the collector is complete. A refused one is held back until every expected sender has
reported (no prefill rank still writes into the request's pages), then turned into ``KVPoll.Failed``. A
rank that never reports is left to SGLang's waiting timeout.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from sglang_cp_shared_kv.srt.disaggregation.mooncake import manifest_codec as cm
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest import ManifestCollector, ManifestError
from sglang_cp_shared_kv.srt.mem_cache.placement import debug_enabled
from sglang_cp_shared_kv.srt.sglang_wiring import metrics
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG, manager_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_if_any, state_of
from sglang_cp_shared_kv.srt.sglang_wiring.transfer import MANIFEST_FRAME, latent_page_bytes

logger = logging.getLogger(__name__)


# The decode thread (status messages) and the scheduler (metadata, clear) share the tables.
_LOCK = threading.Lock()


@dataclass
class RoomCheck:
    """One request's manifests, as they arrive."""

    collector: ManifestCollector
    senders: int  # success statuses SGLang waits for before it marks the request ready
    reported: set[int] = field(default_factory=set)  # prefill ranks whose Success arrived
    error: str | None = None  # the first thing found wrong
    logged: bool = False  # the error logged and counted (once per request)


def arm_manifest_check(receiver, n_pages: int) -> None:
    """Before ``CommonKVReceiver.send_metadata`` sends a request's ``n_pages`` destination pages."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = receiver.kv_mgr
    info = getattr(receiver, "prefill_info", None)
    if manager_enabled(mgr, "decode") and info is not None and receiver.conclude_state != KVPoll.Failed:
        room = receiver.bootstrap_room
        page_bytes, dcp_size = latent_page_bytes(mgr.kv_args), getattr(mgr, "dcp_size", 1) or 1
        collector = ManifestCollector(str(room), n_pages, info.attn_cp_size, page_bytes, dcp_size)
        check = RoomCheck(collector, senders=int(info.required_prefill_response_num))
        if check.senders != info.attn_cp_size:
            check.error = (
                f"request {room}: SGLang waits for {check.senders} prefill senders but the prefill at "
                f"{receiver.bootstrap_addr} has {info.attn_cp_size} CP ranks (is it running {FLAG}?)"
            )
        with _LOCK:
            state_of(mgr).checks[room] = check


def read_manifest(msg: list[bytes], prefill_rank: int) -> tuple[int, cm.Manifest]:
    """The (cp_size, manifest) frames of a status message; ``ManifestError`` if absent or malformed."""
    try:
        at = msg.index(MANIFEST_FRAME, 3)
    except ValueError:
        raise ManifestError(
            f"prefill rank {prefill_rank} reported success without a CP shared-KV manifest "
            f"(is the prefill running {FLAG}?)"
        ) from None
    if len(msg) != at + 3:
        raise ManifestError(f"prefill rank {prefill_rank}'s manifest has {len(msg) - at - 1} frames, expected 2")
    try:
        cp_size = int(msg[at + 1].decode("ascii"))
        manifest = cm.decode(msg[at + 2])
    except (UnicodeDecodeError, ValueError) as e:  # ControlMessageError is a ValueError
        raise ManifestError(f"prefill rank {prefill_rank}'s manifest is malformed: {e}") from None
    if not isinstance(manifest, cm.Manifest):
        raise ManifestError(f"prefill rank {prefill_rank} sent a {manifest.TYPE} message instead of a manifest")
    return cp_size, manifest


def _judge(check: RoomCheck, msg: list[bytes], room: int, prefill_rank: int) -> None:
    """Feed one Success status's manifest to the collector; record the first error."""
    check.reported.add(prefill_rank)
    if check.error is not None:
        return
    collector = check.collector
    try:
        try:
            cp_size, manifest = read_manifest(msg, prefill_rank)
            if cp_size != collector.cp_size:
                raise ManifestError(
                    f"prefill rank {prefill_rank} shards over {cp_size} CP ranks, its bootstrap info says {collector.cp_size}"
                )
            if manifest.rank != prefill_rank % cp_size:
                raise ManifestError(f"the manifest of rank {manifest.rank} arrived from prefill rank {prefill_rank}")
        except ManifestError as e:
            raise ManifestError(f"request {room}: {e}") from None
        collector.add(manifest)  # its errors name the request already
    except ManifestError as e:
        check.error = str(e)


def check_status_message(mgr, msg: list[bytes], parsed):
    """What a decode's ``CommonKVManager.parse_kv_status_message`` returns for ``msg``: ``parsed``, but a refused
    manifest's Success is ``None`` (ignored) until every sender reported, then a Failed with the reason."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if parsed is None or parsed[1] != KVPoll.Success or not manager_enabled(mgr, "decode"):
        return parsed
    room, _status, prefill_rank, _reason = parsed
    failed = int(KVPoll.Failed)
    with _LOCK:
        check = state_of(mgr).checks.get(room)
        if check is None:
            if room not in mgr.request_status:  # a late status for a cleared room: SGLang drops it
                return parsed
            why = f"request {room}: prefill rank {prefill_rank} reported success before the decode sent its destination pages"
            return room, failed, prefill_rank, f"{FLAG}: manifest check failed: {why}"
        _judge(check, msg, room, prefill_rank)
        if check.error is None:
            c = check.collector
            if c.complete and debug_enabled():
                logger.info("%s: room %s: %d manifests cover its %d pages", FLAG, room, c.cp_size, c.n_pages)
            return parsed
        if not check.logged:  # found here or when the check was armed: reported at the first Success
            check.logged = True
            logger.error("%s: manifest check failed: %s", FLAG, check.error)
            metrics.count_manifest_rejection()
        if len(check.reported) < check.senders:
            return None  # hold: another prefill rank may still be writing into these pages
        return room, failed, prefill_rank, f"{FLAG}: manifest check failed: {check.error}".replace("\n", " ")


def forget_room(receiver) -> None:
    """After ``CommonKVReceiver.clear``: drop the request's collector."""
    state = state_if_any(receiver.kv_mgr)
    checks = state.checks if state is not None else None
    if checks:
        with _LOCK:
            checks.pop(receiver.bootstrap_room, None)
