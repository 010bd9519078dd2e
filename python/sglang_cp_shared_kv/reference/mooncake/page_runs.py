"""Which pages a CP rank sends for a request, and the fewest transfer entries that carry them.

A request's page table lists its logical pages by position (``0 .. n_pages-1``).
Rank ``r`` owns the positions whose logical page ``lp`` has ``lp % cp_size == r``; on
``r`` that page is physical page ``lp // cp_size``, and on the decode side it goes to
destination page ``dst[position]``.

Both pools keep a page of one layer's buffer as one contiguous block (latent rows
are token-row-major, so a page is ``ps * row_bytes`` bytes; the indexer buffer is
page-major, ``ps * 132`` bytes a page). A run of pages that is contiguous on both
sides is therefore one transfer entry per buffer, however long it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


@dataclass(frozen=True)
class PageRuns:
    """Runs of pages contiguous on both sides: ``length[i]`` pages from ``src_page[i]`` to ``dst_page[i]``."""

    src_page: np.ndarray
    dst_page: np.ndarray
    length: np.ndarray

    @property
    def num_runs(self) -> int:
        return int(self.length.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True)
class BufferPair:
    """One per-layer buffer on both sides: base addresses and the bytes one page takes there."""

    src_base: int
    dst_base: int
    page_bytes: int


def owned_positions(page_table: torch.Tensor, ownership: PageOwnership, rank: int) -> torch.Tensor:
    """Positions (int64, ascending) of the request's pages that ``rank`` owns."""
    if page_table.dim() != 1:
        raise ValueError(f"page_table must be 1-D, got shape {tuple(page_table.shape)}")
    return torch.nonzero(ownership.owner(page_table.to(torch.int64)) == rank).flatten()


def coalesce_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> PageRuns:
    """The fewest runs covering every ``src_pages[i] -> dst_pages[i]`` pair.

    Source pages are distinct, so sorting by source and merging neighbours whose
    source and destination both step by one is optimal: a run is exactly a maximal
    stretch of consecutive source pages with a constant ``dst - src``.
    """
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src_pages and dst_pages must be 1-D of one length, got {src.shape} and {dst.shape}")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return PageRuns(empty, empty, empty)
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate(([0], np.nonzero(breaks)[0] + 1))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return PageRuns(src[starts], dst[starts], lengths)


def transfer_entries(runs: PageRuns, buffers: Sequence[BufferPair]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_addr, dst_addr, length)`` for every run in every buffer, buffer-major."""
    if runs.num_runs == 0 or not buffers:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    src = [b.src_base + runs.src_page * b.page_bytes for b in buffers]
    dst = [b.dst_base + runs.dst_page * b.page_bytes for b in buffers]
    length = [runs.length * b.page_bytes for b in buffers]
    return np.concatenate(src), np.concatenate(dst), np.concatenate(length)
