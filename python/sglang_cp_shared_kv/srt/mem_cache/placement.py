"""Page ownership of a KV pool sharded over ``N`` CP ranks: logical page ``loc // ps``
lives on rank ``lp % N`` as physical page ``lp // N`` (SGLang's page-interleave
placement). Physical page 0 of every rank is the trash page: the allocators never hand
out logical pages ``[0, N)``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.srt.environ import envs
from sglang_cp_shared_kv.srt.utils import check_int

TRASH_PAGE = 0  # where a rank's masked store puts the rows other ranks own


def debug_enabled() -> bool:
    """Syncing diagnostics are opt-in; they are off for every measurement."""
    return envs.SGLANG_DEBUG_CP_SHARED_KV.get()


def page_owner(pages, cp_size: int):
    """The rank holding logical page(s) ``pages`` (an int, array or tensor)."""
    return pages % cp_size


def local_page(pages, cp_size: int):
    """The physical page of logical page(s) ``pages`` on their owner."""
    return pages // cp_size


class PageOwnership:
    """The map for ``cp_size`` ranks and ``page_size``-token pages; debug mode checks
    values (reading them back), locs against ``logical_pages`` if given."""

    def __init__(self, cp_size: int, page_size: int, logical_pages: int | None = None):
        check_int("cp_size", cp_size, 1)
        ps = page_size
        if not isinstance(ps, int) or ps < 1 or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size!r}")
        if logical_pages is not None:
            check_int("logical_pages", logical_pages, 0)
        self.cp_size, self.page_size = cp_size, page_size
        self.logical_pages = logical_pages
        self._shift, self._mask = page_size.bit_length() - 1, page_size - 1
        self._loc_limit = None if logical_pages is None else logical_pages * page_size

    def _check(self, name: str, values, limit: int | None = None, owner=None) -> None:
        if isinstance(owner, int) and not 0 <= owner < self.cp_size:
            raise ValueError(f"owner must be in [0, {self.cp_size}), got {owner}")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(values)}")
        if values.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {values.dtype}")
        if not debug_enabled() or values.numel() == 0:
            return
        if bool((values < 0).any()):
            raise ValueError(f"{name} holds a negative value ({int(values.min())})")
        if limit is not None and bool((values >= limit).any()):
            top = int(values.max())
            raise ValueError(f"{name} holds {top}, out of range [0, {limit})")

    def owner(self, logical_pages: torch.Tensor) -> torch.Tensor:
        self._check("logical_pages", logical_pages, self.logical_pages)
        return page_owner(logical_pages, self.cp_size)

    def phys_page(self, logical_pages: torch.Tensor) -> torch.Tensor:
        self._check("logical_pages", logical_pages, self.logical_pages)
        return local_page(logical_pages, self.cp_size)

    def loc_owner(self, locs: torch.Tensor) -> torch.Tensor:
        self._check("locs", locs, self._loc_limit)
        return page_owner(locs >> self._shift, self.cp_size)

    def phys_row(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical row of each loc on its owner."""
        self._check("locs", locs, self._loc_limit)
        page = local_page(locs >> self._shift, self.cp_size)
        return page * self.page_size + (locs & self._mask)

    def logical_loc(self, owner, phys_rows: torch.Tensor) -> torch.Tensor:
        """Inverse of (``loc_owner``, ``phys_row``)."""
        self._check("phys_rows", phys_rows, owner=owner)
        page = (phys_rows >> self._shift) * self.cp_size + owner
        return page * self.page_size + (phys_rows & self._mask)

    def store_rows(self, locs, rank: int, trash_page: int, phys_pages=None):
        """``(rows, mine)`` of a masked store on ``rank`` (no host sync): an owned loc
        at its physical row, any other at its offset in ``trash_page``."""
        mine = self.loc_owner(locs) == rank
        trash = trash_page * self.page_size + (locs & self._mask)
        rows = torch.where(mine, self.phys_row(locs), trash)
        if phys_pages is not None and debug_enabled():
            self.check_store_rows(locs, rows, mine, rank, trash_page, phys_pages)
        return rows, mine

    def check_store_rows(self, locs, rows, mine, rank, trash_page, pages) -> None:
        """Debug (syncs): owned rows lie within ``pages``, off the trash page (but
        for the reserved locs), and map back to their locs on ``rank``."""
        ps, end = self.page_size, pages * self.page_size
        owned = torch.where(mine, rows, torch.zeros_like(rows))
        if bool((owned >= end).any()):
            bad = int(locs[mine & (rows >= end)][0])
            raise ValueError(f"loc {bad} maps past this rank's {pages} physical pages")
        trashed = mine & (locs >= self.cp_size * ps) & (owned // ps == trash_page)
        if bool(trashed.any()):
            raise AssertionError("an owned loc (not reserved) maps onto the trash page")
        back = torch.where(mine, self.logical_loc(rank, owned), locs)
        if not bool(torch.equal(back, locs)):
            raise AssertionError("a stored row does not map back to its loc")


@dataclass(frozen=True)
class CPSharedSpec:
    """One rank's share of a CP-shared pool, checked once when the pool is built."""

    cp_size: int
    cp_rank: int
    page_size: int
    phys_pages: int  # this rank's pages, the trash page included
    row_bytes: int  # one token's latent row
    with_indexer: bool  # the pool also holds DSA indexer pages

    trash_page = TRASH_PAGE

    def __post_init__(self) -> None:
        PageOwnership(self.cp_size, self.page_size)  # checks both
        rank, n = self.cp_rank, self.cp_size
        if not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"cp_rank must be in [0, {n}), got {rank!r}")
        check_int("phys_pages", self.phys_pages, 1)
        check_int("row_bytes", self.row_bytes, 1)

    @property
    def logical_pages(self) -> int:
        return self.cp_size * self.phys_pages

    def ownership(self) -> PageOwnership:
        return PageOwnership(self.cp_size, self.page_size, self.logical_pages)
