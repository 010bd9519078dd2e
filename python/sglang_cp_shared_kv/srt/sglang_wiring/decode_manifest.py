"""The decode's check of the prefill CP ranks' manifests (PD from a CP-shared pool).

A Success status passes only if the request's ``ManifestCollector`` accepts its manifest, so SGLang's N
successes (its only condition for ``KVPoll.Success``) come exactly when the manifests cover the request.
A refused one is held until every sender reported (none still writes the pages), then fails.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from sglang_cp_shared_kv.srt.disaggregation.mooncake import manifest as mf
from sglang_cp_shared_kv.srt.mem_cache.placement import debug_enabled
from sglang_cp_shared_kv.srt.sglang_wiring import metrics
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG, manager_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_of
from sglang_cp_shared_kv.srt.sglang_wiring.transfer import latent_page_bytes

logger = logging.getLogger(__name__)
_LOCK = threading.Lock()  # the decode thread and the scheduler share the checks


@dataclass
class RoomCheck:
    """One request's manifests, as they arrive."""

    collector: mf.ManifestCollector
    senders: int  # the Success statuses SGLang waits for
    reported: set[int] = field(default_factory=set)  # prefill ranks whose Success came
    error: str | None = None  # the first thing found wrong
    logged: bool = False  # the error logged and counted (once per request)


def arm_manifest_check(receiver, n_pages: int) -> None:
    """Before ``CommonKVReceiver.send_metadata`` sends a request's ``n_pages`` pages."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr, info = receiver.kv_mgr, getattr(receiver, "prefill_info", None)
    failed = receiver.conclude_state == KVPoll.Failed
    if failed or info is None or not manager_enabled(mgr, "decode"):
        return
    room, n = receiver.bootstrap_room, info.attn_cp_size
    page_bytes, dcp_size = latent_page_bytes(mgr.kv_args), getattr(mgr, "dcp_size", 1)
    collector = mf.ManifestCollector(str(room), n_pages, n, page_bytes, dcp_size or 1)
    check = RoomCheck(collector, senders=int(info.required_prefill_response_num))
    if check.senders != n:
        waits = f"SGLang waits for {check.senders} prefill senders"
        has = f"the prefill at {receiver.bootstrap_addr} has {n} CP ranks"
        check.error = f"request {room}: {waits} but {has} (is it running {FLAG}?)"
    with _LOCK:
        state_of(mgr).checks[room] = check


def _read(msg: list[bytes], room: int, prank: int, n: int) -> mf.Manifest:
    """The manifest in prefill rank ``prank``'s Success ``msg``, or ``ManifestError``."""
    who = f"request {room}: prefill rank {prank}"
    if mf.MANIFEST_FRAME not in msg[3:]:
        hint = f"(is the prefill running {FLAG}?)"
        raise mf.ManifestError(f"{who} sent no CP shared-KV manifest {hint}")
    tail = msg[msg.index(mf.MANIFEST_FRAME, 3) + 1 :]
    if len(tail) != 2:
        raise mf.ManifestError(f"{who}'s manifest has {len(tail)} frames, expected 2")
    try:
        sent_n, manifest = int(tail[0].decode("ascii")), mf.decode(tail[1])
    except ValueError as e:  # a UnicodeDecodeError or ControlMessageError too
        raise mf.ManifestError(f"{who}'s manifest is malformed: {e}") from None
    if sent_n != n:
        raise mf.ManifestError(f"{who} shards over {sent_n} CP ranks, not {n}")
    if manifest.rank != prank % n:
        raise mf.ManifestError(f"{who} sent the manifest of rank {manifest.rank}")
    return manifest


def _judge(check: RoomCheck, msg: list[bytes], room: int, prank: int) -> None:
    """Feed one Success status's manifest to the collector; record the first error."""
    check.reported.add(prank)
    c = check.collector
    if check.error is not None:
        return
    try:
        c.add(_read(msg, room, prank, c.cp_size))
    except mf.ManifestError as e:
        check.error = str(e)
        return
    if c.complete and debug_enabled():
        covered = "%s: room %s: %d manifests cover its %d pages"
        logger.info(covered, FLAG, room, c.cp_size, c.n_pages)


def check_status_message(mgr, msg: list[bytes], parsed):
    """``parsed`` of ``CommonKVManager.parse_kv_status_message`` on a decode, but a refused
    manifest's Success is ``None`` until every sender reported, then Failed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if not parsed or parsed[1] != KVPoll.Success or not manager_enabled(mgr, "decode"):
        return parsed
    room, _status, prank, _reason = parsed
    with _LOCK:
        check = state_of(mgr).checks.get(room)
        if check is None and room not in mgr.request_status:
            return parsed  # a late status: SGLang drops it
        if check is None:
            early = "reported success before the decode sent its destination pages"
            error = f"request {room}: prefill rank {prank} {early}"
        else:
            _judge(check, msg, room, prank)
            if check.error is None:
                return parsed
            if not check.logged:  # once, at the first Success
                check.logged = True
                logger.error("%s: manifest check failed: %s", FLAG, check.error)
                metrics.count_manifest_rejection()
            if len(check.reported) < check.senders:
                return None  # hold: another rank may still write the pages
            error = check.error
    reason = f"{FLAG}: manifest check failed: {error}".replace("\n", " ")
    return room, int(KVPoll.Failed), prank, reason


def forget_room(receiver) -> None:
    """After ``CommonKVReceiver.clear``: drop the request's check."""
    with _LOCK:
        state_of(receiver.kv_mgr).checks.pop(receiver.bootstrap_room, None)
