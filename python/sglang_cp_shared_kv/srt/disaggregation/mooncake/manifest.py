"""A prefill CP rank's manifest of its write to a PD decode: wire form and check.

A request is complete only when every prefill rank ``0 .. N-1`` reported once, all the same table of
distinct pages, each exactly the positions whose page it owns: every position, once.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from sglang_cp_shared_kv.srt.mem_cache.placement import page_owner
from sglang_cp_shared_kv.srt.utils import check_int

# Marks a Success status's frames after SGLang's: [MANIFEST_FRAME, cp_size, manifest].
MANIFEST_FRAME = b"CP_SHARED_KV_MANIFEST"
PROTOCOL_VERSION = 2  # 2: dcp_size
MAX_MESSAGE_BYTES = 64 << 20  # ~3M pages; anything larger is refused unparsed
MAX_ID_CHARS = 256
MAX_INT = (1 << 63) - 1  # every int fits an int64 (the collector's arrays)
MAX_INDEX = (1 << 31) - 1  # pages and positions are SGLang's int32 KV indices
_RANGES = {"rank": (0, MAX_INT), "nbytes": (0, MAX_INT), "dcp_size": (1, MAX_INDEX)}
_RANGES.update(page_table=(0, MAX_INDEX), positions=(0, MAX_INDEX))  # lists of ints
_LISTS, _FIELDS = ("page_table", "positions"), ("request_id", *_RANGES)


class ControlMessageError(ValueError):
    """A manifest is malformed; nothing was changed because of it."""


class ManifestError(ValueError):
    """A manifest contradicts its request: the request must fail."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """One prefill CP rank's write: the page table, the positions it sent, their bytes, and
    the decode CP size it routed by (1: none). Checked when made."""

    request_id: str
    rank: int
    page_table: tuple[int, ...]
    positions: tuple[int, ...]
    nbytes: int
    dcp_size: int = 1

    def __post_init__(self):
        for name in _LISTS:
            if isinstance(v := getattr(self, name), list):
                object.__setattr__(self, name, tuple(v))
        wrong = self._wrong()
        if wrong:
            raise ControlMessageError(f"manifest.{wrong}")

    def _wrong(self) -> str | None:
        rid = self.request_id
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_ID_CHARS:
            return f"request_id must be 1 to {MAX_ID_CHARS} chars, got {rid!r:.80}"
        for name, (lo, hi) in _RANGES.items():
            v, many = getattr(self, name), name in _LISTS
            if many and not isinstance(v, tuple):
                return f"{name} must be a list, got {type(v).__name__}"
            for i, x in enumerate(v) if many else [(None, v)]:
                if type(x) is not int or not lo <= x <= hi:  # bools are not ints
                    at = "" if i is None else f"[{i}]"
                    return f"{name}{at} must be an int in [{lo}, {hi}], got {x!r:.40}"
        return None


def decode(data: bytes) -> Manifest:
    """The manifest in JSON ``{"v": 2, "type": "manifest", <fields>}``; anything else raises
    ``ControlMessageError`` (one line)."""
    body = _fields(data)
    if isinstance(body, str):
        raise ControlMessageError(f"manifest {body}")
    return Manifest(**body)


def _fields(data: bytes) -> dict | str:
    """The manifest fields in ``data``, or what is wrong with it."""
    if len(data) > MAX_MESSAGE_BYTES:
        return f"has {len(data)} bytes, at most {MAX_MESSAGE_BYTES} allowed"
    try:
        body = json.loads(str(data, "utf-8"))
    except RecursionError:  # nesting deeper than the parser's stack
        return "is not valid JSON: nested too deeply"
    except ValueError as e:  # bad UTF-8 or JSON, or an int past Python's digit limit
        return f"is not valid JSON: {str(e)[:200]}"
    if not isinstance(body, dict):
        return f"must be a JSON object, got {type(body).__name__}"
    v, kind = body.pop("v", None), body.pop("type", None)
    if (type(v), v, kind) != (int, PROTOCOL_VERSION, "manifest"):  # not 2.0, not true
        return f"needs v={PROTOCOL_VERSION} type=manifest, got {v!r:.40} {kind!r:.40}"
    if body.keys() != set(_FIELDS):
        return f"fields must be {_FIELDS}, got {sorted(body)!r:.200}"
    return body


def encode(m: Manifest) -> bytes:
    """``m``'s JSON, as ``decode`` reads it."""
    body = {"v": PROTOCOL_VERSION, "type": "manifest", **dataclasses.asdict(m)}
    return json.dumps(body, separators=(",", ":")).encode()


class ManifestCollector:
    """Collects one request's manifests from its ``cp_size`` prefill ranks (``dcp_size``: this
    decode's CP size, which they routed their pages by)."""

    def __init__(self, request_id: str, n_pages: int, cp_size: int, page_bytes: int, dcp_size=1):
        check_int("n_pages", n_pages, 0)
        check_int("cp_size", cp_size, 1)
        self.request_id, self.n_pages, self.cp_size = request_id, n_pages, cp_size
        self.page_bytes, self.dcp_size = page_bytes, dcp_size
        self.page_table: np.ndarray | None = None  # the first accepted rank's
        self.reported_by: dict[int, int] = {}  # rank -> positions reported

    @property
    def complete(self) -> bool:
        return len(self.reported_by) == self.cp_size

    def add(self, m: Manifest) -> bool:
        """Record ``m`` if it fits the request and the ranks before it, else raise ``ManifestError``
        (changing nothing); True once every rank is in."""
        table = np.asarray(m.page_table, dtype=np.int64)
        pos = np.asarray(m.positions, dtype=np.int64)
        wrong = self._wrong(m, table, pos)
        if wrong:
            raise ManifestError(f"request {self.request_id}: rank {m.rank} {wrong}")
        if self.page_table is None:
            self.page_table = table
        self.reported_by[m.rank] = pos.size
        return self.complete

    def _wrong(self, m: Manifest, table: np.ndarray, pos: np.ndarray) -> str | None:
        n, first, d = self.n_pages, self.page_table, self.dcp_size
        if m.request_id != self.request_id:
            return f"sent a manifest for request {m.request_id!r:.80}"
        if m.rank >= self.cp_size:
            return f"out of range [0, {self.cp_size})"
        if m.rank in self.reported_by:
            return "sent a second manifest"
        if m.dcp_size != d:
            return f"routed for a decode CP size of {m.dcp_size}, this decode runs {d}"
        if len(table) != n:
            return f"sent a page table of {len(table)} pages, expected {n}"
        if first is None and len(np.unique(table)) != n:
            return "sent a page table that lists a logical page twice"
        if first is not None and (diff := np.flatnonzero(table != first)).size:
            return f"sent a page table differing at position {diff[0]}"
        if pos.size and pos.max() >= n:
            return f"reported position {pos.max()}, out of range [0, {n})"
        uniq, counts = np.unique(pos, return_counts=True)
        if uniq.size != pos.size:
            return f"reported position {uniq[counts > 1][0]} twice"
        owners = page_owner(table, self.cp_size)
        p = next(iter(pos[owners[pos] != m.rank]), None)  # owned positions are disjoint
        if p is not None:
            return f"claimed position {p}, whose page {table[p]} rank {owners[p]} owns"
        missing = np.setdiff1d(np.nonzero(owners == m.rank)[0], pos)
        if missing.size:
            return f"did not report positions {missing[:8].tolist()} that it owns"
        if m.nbytes != pos.size * self.page_bytes:
            return f"reports {m.nbytes} bytes for {pos.size} pages of {self.page_bytes}"
        return None
