"""The decode side's check that N sender manifests rebuild a request exactly.

Each prefill CP rank reports, after its write, the request's page table (identical on every rank) and the
positions it sent. A request is complete only when every rank ``0 .. N-1`` reported once, all with the same
table of ``n_pages`` distinct pages, and rank ``r`` reported exactly the positions whose page it owns, with
a byte count matching them: the positions are then exactly ``0 .. n_pages-1``. Rank ``r`` is that of the
connection the manifest arrived on (checked by the receiver), so the owner check is against who wrote. Every
rank routed its pages by the decode's CP size ``D`` (1: not routed), so decode rank ``d`` of ``D`` got each
position whose destination logical page ``l`` has ``l % D == d`` from the one prefill rank owning it.
"""

from __future__ import annotations

import numpy as np

from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest_codec import Manifest
from sglang_cp_shared_kv.srt.mem_cache.placement import page_owner
from sglang_cp_shared_kv.srt.utils import check_int


class ManifestError(ValueError):
    """A manifest contradicts the request: the request must fail."""


class ManifestCollector:
    """Collects the manifests of one request from ``cp_size`` senders."""

    def __init__(self, request_id: str, n_pages: int, cp_size: int, page_bytes: int, dcp_size: int = 1):
        check_int("n_pages", n_pages, 0)
        check_int("cp_size", cp_size, 1)
        check_int("dcp_size", dcp_size, 1)
        self.request_id = request_id
        self.n_pages = n_pages
        self.cp_size = cp_size
        self.dcp_size = dcp_size  # the decode's CP size: every sender must have routed by it
        self.page_bytes = page_bytes
        self.page_table: np.ndarray | None = None
        self.reported_by: dict[int, int] = {}  # rank -> pages reported
        self._covered = np.zeros(n_pages, dtype=bool)

    @property
    def complete(self) -> bool:
        return len(self.reported_by) == self.cp_size

    def add(self, m: Manifest) -> bool:
        """Check ``m`` against the request and record it (nothing if it is wrong: ``ManifestError``); return
        True once all ranks are in."""
        rank, rid = m.rank, self.request_id
        if m.request_id != rid:
            raise ManifestError(f"request {rid}: the manifest is for request {m.request_id!r:.80}")
        if not 0 <= rank < self.cp_size:
            raise ManifestError(f"request {rid}: manifest rank {rank} out of range [0, {self.cp_size})")
        if rank in self.reported_by:
            raise ManifestError(f"request {rid}: rank {rank} sent a second manifest")
        if m.dcp_size != self.dcp_size:
            raise ManifestError(
                f"request {rid}: rank {rank} routed its pages for a decode CP size of {m.dcp_size}, "
                f"this decode runs {self.dcp_size}"
            )
        table = np.asarray(m.page_table, dtype=np.int64)
        if table.shape[0] != self.n_pages:
            raise ManifestError(
                f"request {rid}: rank {rank}'s page table has {table.shape[0]} pages, expected {self.n_pages}"
            )
        if self.page_table is None:
            if np.unique(table).shape[0] != table.shape[0]:
                raise ManifestError(f"request {rid}: rank {rank}'s page table lists a logical page twice")
        elif not np.array_equal(table, self.page_table):
            p = int(np.nonzero(table != self.page_table)[0][0])
            raise ManifestError(
                f"request {rid}: rank {rank}'s page table differs from the other ranks' at position {p}"
            )

        pos = np.asarray(m.positions, dtype=np.int64)
        if pos.size and int(pos.max()) >= self.n_pages:
            raise ManifestError(
                f"request {rid}: rank {rank} reported position {int(pos.max())}, out of range [0, {self.n_pages})"
            )
        uniq, counts = np.unique(pos, return_counts=True)
        if uniq.size != pos.size:
            raise ManifestError(f"request {rid}: rank {rank} reported position {int(uniq[counts > 1][0])} twice")
        if self._covered[pos].any():
            raise ManifestError(
                f"request {rid}: position {int(pos[self._covered[pos]][0])} was already reported by another rank"
            )
        owners = page_owner(table, self.cp_size)
        foreign = pos[owners[pos] != rank]
        if foreign.size:
            p = int(foreign[0])
            raise ManifestError(
                f"request {rid}: rank {rank} claimed position {p}, whose logical page {int(table[p])} is owned by rank {int(owners[p])}"
            )
        owned = np.nonzero(owners == rank)[0]
        if owned.size != pos.size:
            missing = np.setdiff1d(owned, pos)[:8].tolist()
            raise ManifestError(f"request {rid}: rank {rank} did not report positions {missing} that it owns")
        if m.nbytes != pos.size * self.page_bytes:
            raise ManifestError(
                f"request {rid}: rank {rank} reports {m.nbytes} bytes for {pos.size} pages, expected {pos.size * self.page_bytes}"
            )

        if self.page_table is None:
            self.page_table = table
        self._covered[pos] = True
        self.reported_by[rank] = int(pos.size)
        if (
            self.complete and not self._covered.all()
        ):  # cannot happen after the checks above; never mark ready if it does
            raise ManifestError(
                f"request {rid}: positions {np.nonzero(~self._covered)[0][:8].tolist()} were never reported"
            )
        return self.complete
