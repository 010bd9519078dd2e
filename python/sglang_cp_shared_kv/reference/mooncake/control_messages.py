"""Versioned control messages between owned-page senders and a decode receiver.

Every message is one JSON object ``{"v": 1, "type": ..., <fields>}``. ``decode``
checks the version, the type, the exact field set and every field's type and range,
and raises ``ControlMessageError`` (a ``ValueError``) with one line naming the
offending field; it never returns a partly valid message. Checks that need request
state (a position within the request, the owner of a page) belong to the manifest
collector, not here.

Flow (S = a sender, one per prefill CP rank; D = the decode receiver):

    S -> D  hello      rank, cp_size, engine session id, pool layout
    D -> S  bootstrap  engine session id, pool layout, page count, per-layer base addresses
    D -> S  reject     (instead of bootstrap) why the hello was refused
    D -> S  dst_pages  a request's destination page for every position
    S -> D  manifest   after the write: the request's page table and the positions sent
    S -> D  failed     the rank did not (or will no longer) write the request
    D -> S  verdict    the request is ready, or failed and why
    both    heartbeat  liveness, once a second or so
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest_codec import (
    MAX_ID_CHARS,
    MAX_REASON_CHARS,
    PROTOCOL_VERSION,
    REASON,
    REQUEST_ID,
    ControlMessageError,
    Manifest,
    decode_message,
    encode_message,
)
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest_codec import bool_field as _bool
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest_codec import int_field as _int
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest_codec import int_list_field as _int_list
from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest_codec import str_field as _str
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import KV_FORMATS

__all__ = [
    "MAX_ID_CHARS",
    "MAX_REASON_CHARS",
    "PROTOCOL_VERSION",
    "ControlMessageError",
    "Manifest",
    "decode",
    "encode",
]


@dataclass(frozen=True)
class PoolLayout:
    """What both pools must agree on for a page to mean the same bytes on both sides."""

    page_size: int
    kv_format: str
    num_layers: int
    with_indexer: bool

    @classmethod
    def of(cls, pool) -> PoolLayout:
        return cls(pool.page_size, pool.kv_format, pool.num_layers, pool.with_indexer)

    def mismatch(self, other: PoolLayout) -> str | None:
        """A one-line description of the first difference, or None."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                return f"{f.name} differs: {a!r} here, {b!r} on the peer"
        return None

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _layout(name: str, v: Any) -> PoolLayout:
    if not isinstance(v, dict) or set(v) != {"page_size", "kv_format", "num_layers", "with_indexer"}:
        raise ControlMessageError(f"{name} must be an object with page_size, kv_format, num_layers, with_indexer")
    page_size = _int(1)(f"{name}.page_size", v["page_size"])
    if page_size & (page_size - 1):
        raise ControlMessageError(f"{name}.page_size must be a power of two, got {page_size}")
    if v["kv_format"] not in KV_FORMATS:
        raise ControlMessageError(f"{name}.kv_format must be one of {KV_FORMATS}, got {v['kv_format']!r:.40}")
    return PoolLayout(
        page_size,
        v["kv_format"],
        _int(1)(f"{name}.num_layers", v["num_layers"]),
        _bool(f"{name}.with_indexer", v["with_indexer"]),
    )


_REQUEST_ID = REQUEST_ID
_REASON = REASON


@dataclass(frozen=True)
class Hello:
    rank: int
    cp_size: int
    session_id: str
    layout: PoolLayout

    TYPE = "hello"
    SCHEMA = {"rank": _int(), "cp_size": _int(1), "session_id": _str(MAX_ID_CHARS), "layout": _layout}

    def check(self) -> None:
        if self.rank >= self.cp_size:
            raise ControlMessageError(f"hello.rank must be < cp_size {self.cp_size}, got {self.rank}")


@dataclass(frozen=True)
class Bootstrap:
    session_id: str
    num_pages: int
    layout: PoolLayout
    latent_base: tuple[int, ...]
    index_base: tuple[int, ...]

    TYPE = "bootstrap"
    SCHEMA = {
        "session_id": _str(MAX_ID_CHARS),
        "num_pages": _int(1),
        "layout": _layout,
        "latent_base": _int_list,
        "index_base": _int_list,
    }

    def check(self) -> None:
        n = self.layout.num_layers
        if len(self.latent_base) != n:
            raise ControlMessageError(f"bootstrap.latent_base must hold {n} addresses, got {len(self.latent_base)}")
        want = n if self.layout.with_indexer else 0
        if len(self.index_base) != want:
            raise ControlMessageError(f"bootstrap.index_base must hold {want} addresses, got {len(self.index_base)}")


@dataclass(frozen=True)
class Reject:
    reason: str

    TYPE = "reject"
    SCHEMA = {"reason": _REASON}


@dataclass(frozen=True)
class DstPages:
    request_id: str
    dst_pages: tuple[int, ...]

    TYPE = "dst_pages"
    SCHEMA = {"request_id": _REQUEST_ID, "dst_pages": _int_list}

    def check(self) -> None:
        if len(set(self.dst_pages)) != len(self.dst_pages):
            raise ControlMessageError("dst_pages.dst_pages holds a page twice")


@dataclass(frozen=True)
class Failed:
    request_id: str
    rank: int
    reason: str

    TYPE = "failed"
    SCHEMA = {"request_id": _REQUEST_ID, "rank": _int(), "reason": _REASON}


@dataclass(frozen=True)
class Verdict:
    request_id: str
    ok: bool
    reason: str

    TYPE = "verdict"
    SCHEMA = {"request_id": _REQUEST_ID, "ok": _bool, "reason": _REASON}


@dataclass(frozen=True)
class Heartbeat:
    TYPE = "heartbeat"
    SCHEMA = {}


ControlMessage = Hello | Bootstrap | Reject | DstPages | Manifest | Failed | Verdict | Heartbeat
_TYPES = {cls.TYPE: cls for cls in (Hello, Bootstrap, Reject, DstPages, Manifest, Failed, Verdict, Heartbeat)}


def decode(data: bytes) -> ControlMessage:
    """Parse and validate one message; raise ``ControlMessageError`` if anything is off."""
    return decode_message(data, _TYPES)


def encode(msg: ControlMessage) -> bytes:
    """Serialize a message, validating it exactly as the peer will."""
    return encode_message(msg, _TYPES)
