"""The manifest on the wire: one versioned, fully validated JSON object.

A prefill CP rank reports, after its write, ``Manifest(request_id, rank, page_table, positions,
nbytes)``; the decode side checks it with ``manifest.ManifestCollector``. On the wire it is
``{"v": 1, "type": "manifest", <fields>}``. ``decode_message`` checks the version, the type, the
exact field set and every field's type and range, and raises ``ControlMessageError`` (a
``ValueError``) with one line naming the offending field; it never returns a partly valid
message. Checks that need request state (a position within the request, the owner of a page)
belong to the collector, not here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
MAX_ID_CHARS = 256
MAX_REASON_CHARS = 4096
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


def str_field(max_chars: int, allow_empty: bool = False) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or len(v) > max_chars or (not v and not allow_empty):
            raise ControlMessageError(
                f"{name} must be a {'' if allow_empty else 'non-empty '}string of at most {max_chars} chars, got {v!r:.80}"
            )
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


REQUEST_ID = str_field(MAX_ID_CHARS)
REASON = str_field(MAX_REASON_CHARS, allow_empty=True)


@dataclass(frozen=True)
class Manifest:
    """What one prefill CP rank wrote for one request: the page table and the positions it sent."""

    request_id: str
    rank: int
    page_table: tuple[int, ...]
    positions: tuple[int, ...]
    nbytes: int

    TYPE = "manifest"
    SCHEMA = {
        "request_id": REQUEST_ID,
        "rank": int_field(),
        "page_table": int_list_field,
        "positions": int_list_field,
        "nbytes": int_field(),
    }


def _build(cls, body: dict) -> Any:
    missing = set(cls.SCHEMA) - set(body)
    extra = set(body) - set(cls.SCHEMA)
    if missing or extra:
        raise ControlMessageError(
            f"{cls.TYPE} message fields wrong: missing {sorted(missing)}, unexpected {sorted(extra)[:5]}"
        )
    msg = cls(**{name: check(f"{cls.TYPE}.{name}", body[name]) for name, check in cls.SCHEMA.items()})
    if hasattr(msg, "check"):
        msg.check()
    return msg


def decode_message(data: bytes, types: Mapping[str, type]) -> Any:
    """Parse and validate one message of one of ``types`` (``TYPE`` -> class); raise ``ControlMessageError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ControlMessageError(f"control message must be bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ControlMessageError(f"control message has {len(data)} bytes, at most {MAX_MESSAGE_BYTES} allowed")
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ControlMessageError(f"control message is not valid JSON: {e}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise ControlMessageError("control message is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ControlMessageError(f"control message must be a JSON object, got {type(obj).__name__}")
    version = obj.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:  # not 1.0, not true
        raise ControlMessageError(f"control message version must be {PROTOCOL_VERSION}, got {version!r:.40}")
    kind = obj.pop("type", None)
    cls = types.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ControlMessageError(f"control message type must be one of {sorted(types)}, got {kind!r:.40}")
    return _build(cls, obj)


def encode_message(msg: Any, types: Mapping[str, type]) -> bytes:
    """Serialize a message of one of ``types``, validating it exactly as the peer will."""
    cls = type(msg)
    if cls not in types.values():
        raise ValueError(f"msg must be a control message, got {cls.__name__}")
    body = {}
    for name in cls.SCHEMA:
        value = getattr(msg, name)
        body[name] = (
            value.to_json() if hasattr(value, "to_json") else list(value) if isinstance(value, tuple) else value
        )
    _build(cls, dict(body))  # the same checks the receiver runs
    return json.dumps({"v": PROTOCOL_VERSION, "type": cls.TYPE, **body}, separators=(",", ":")).encode()


_MANIFEST_ONLY = {Manifest.TYPE: Manifest}


def decode(data: bytes) -> Manifest:
    """Parse and validate one manifest; anything else raises ``ControlMessageError``."""
    return decode_message(data, _MANIFEST_ONLY)


def encode(msg: Manifest) -> bytes:
    """Serialize a manifest, validating it exactly as the decode side will."""
    return encode_message(msg, _MANIFEST_ONLY)
