"""The manifest on the wire: one versioned, fully validated JSON object.

On the wire a ``Manifest`` is ``{"v": 1, "type": "manifest", <fields>}``. ``decode`` checks the version,
the type, the exact field set and every field's type and range, and raises ``ControlMessageError`` (a
``ValueError``) naming the offending field; checks that need request state belong to
``manifest.ManifestCollector``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 2  # 2: dcp_size
MAX_ID_CHARS = 256
MAX_MESSAGE_BYTES = 64 << 20  # a manifest of ~3M pages; anything larger is refused unparsed
MAX_INT = (1 << 63) - 1  # every int fits an int64 (the collector's arrays)
MAX_INDEX = (1 << 31) - 1  # pages and positions are SGLang's int32 KV indices


class ControlMessageError(ValueError):
    """A control message is malformed; nothing was changed because of it."""


# -- field validators: each returns the normalized value or raises ControlMessageError --
def int_field(lo: int = 0, hi: int = MAX_INT) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ControlMessageError(f"{name} must be an int >= {lo} and <= {hi}, got {v!r:.40}")
        return v

    return check


def str_field(max_chars: int) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or not 0 < len(v) <= max_chars:
            raise ControlMessageError(f"{name} must be a non-empty string of at most {max_chars} chars, got {v!r:.80}")
        return v

    return check


def int_list_field(name: str, v: Any) -> tuple[int, ...]:
    """A list of SGLang KV indices: ints in [0, MAX_INDEX]."""
    if not isinstance(v, (list, tuple)):
        raise ControlMessageError(f"{name} must be a list of ints >= 0 and <= {MAX_INDEX}, got {type(v).__name__}")
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_INDEX:
            raise ControlMessageError(f"{name}[{i}] must be an int >= 0 and <= {MAX_INDEX}, got {x!r:.40}")
    return tuple(v)


@dataclass(frozen=True)
class Manifest:
    """What one prefill CP rank wrote for one request: the page table, the positions it sent, and the
    decode CP size it routed them by (each page to the decode rank owning its destination; 1: not routed)."""

    request_id: str
    rank: int
    page_table: tuple[int, ...]
    positions: tuple[int, ...]
    nbytes: int
    dcp_size: int = 1

    TYPE = "manifest"
    SCHEMA = {
        "request_id": str_field(MAX_ID_CHARS),
        "rank": int_field(),
        "page_table": int_list_field,
        "positions": int_list_field,
        "nbytes": int_field(),
        "dcp_size": int_field(1, MAX_INDEX),
    }


def _build(body: dict) -> Manifest:
    missing, extra = set(Manifest.SCHEMA) - set(body), set(body) - set(Manifest.SCHEMA)
    if missing or extra:
        raise ControlMessageError(
            f"{Manifest.TYPE} message fields wrong: missing {sorted(missing)}, unexpected {sorted(extra)[:5]}"
        )
    return Manifest(**{name: check(f"{Manifest.TYPE}.{name}", body[name]) for name, check in Manifest.SCHEMA.items()})


def decode(data: bytes) -> Manifest:
    """Parse and validate one manifest; anything else raises ``ControlMessageError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ControlMessageError(f"control message must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ControlMessageError(f"control message has {len(data)} bytes, at most {MAX_MESSAGE_BYTES} allowed")
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except ValueError as e:  # bad UTF-8, bad JSON, or an integer past Python's digit limit
        raise ControlMessageError(f"control message is not valid JSON: {str(e)[:200]}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise ControlMessageError("control message is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ControlMessageError(f"control message must be a JSON object, got {type(obj).__name__}")
    version = obj.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # an int: not 2.0, not true
        raise ControlMessageError(f"control message version must be {PROTOCOL_VERSION}, got {version!r:.40}")
    kind = obj.pop("type", None)
    if kind != Manifest.TYPE:
        raise ControlMessageError(f"control message type must be one of {[Manifest.TYPE]}, got {kind!r:.40}")
    return _build(obj)


def encode(msg: Manifest) -> bytes:
    """Serialize a manifest, validating it exactly as the decode side will."""
    if type(msg) is not Manifest:
        raise ValueError(f"msg must be a control message, got {type(msg).__name__}")
    body = {name: getattr(msg, name) for name in Manifest.SCHEMA}
    body = {name: list(v) if isinstance(v, tuple) else v for name, v in body.items()}
    _build(dict(body))  # the same checks the receiver runs
    return json.dumps({"v": PROTOCOL_VERSION, "type": Manifest.TYPE, **body}, separators=(",", ":")).encode()
