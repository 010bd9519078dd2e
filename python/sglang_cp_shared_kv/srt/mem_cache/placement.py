"""Page ownership arithmetic for a KV pool sharded across CP ranks.

Every layer above the pool speaks in *logical* token locs. A logical page ``lp = loc // ps`` lives on
exactly one CP rank, and the map is a stateless bijection between logical locs and (owner, physical row)::

    owner(lp)     = lp % cp_size
    phys_page(lp) = lp // cp_size
    phys_row(loc) = phys_page(loc // ps) * ps + loc % ps
    loc           = ((phys_row // ps) * cp_size + owner) * ps + phys_row % ps

Physical page 0 of every rank is the trash page: the allocators never hand out logical pages
``[0, cp_size)``, so no owned row lands there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.srt.environ import envs
from sglang_cp_shared_kv.srt.utils import check_int, check_page_size


def debug_enabled() -> bool:
    """Syncing diagnostics are opt-in; they are off for every measurement."""
    return envs.SGLANG_DEBUG_CP_SHARED_KV.get()


TRASH_PAGE = 0  # physical page of every rank that foreign rows of a masked store land in


def page_owner(pages, cp_size: int):
    """The CP rank that holds logical page(s) ``pages`` (an int, array or tensor): the one ownership rule,
    SGLang 0.5.23's ``PageInterleavePlacement.owner_of`` of page ``loc // ps`` (``test_placement``)."""
    return pages % cp_size


def local_page(pages, cp_size: int):
    """The physical page of logical page(s) ``pages`` on their owner (``PageInterleavePlacement.local_index``)."""
    return pages // cp_size


class PageOwnership:
    """Stateless ownership map for ``cp_size`` ranks and ``page_size`` tokens per page. ``logical_pages``
    (optional) bounds the logical page space: in debug mode out-of-range locs raise (else nothing syncs)."""

    def __init__(self, cp_size: int, page_size: int, logical_pages: int | None = None):
        check_int("cp_size", cp_size, 1)
        check_page_size(page_size)
        if logical_pages is not None:
            check_int("logical_pages", logical_pages, 0)
        self.cp_size = cp_size
        self.page_size = page_size
        self.logical_pages = logical_pages
        self._shift = page_size.bit_length() - 1

    def __repr__(self) -> str:
        return f"PageOwnership(cp_size={self.cp_size}, page_size={self.page_size})"

    # -- validation (debug only: these read device data back to the host) --
    def _check_locs(self, name: str, locs: torch.Tensor, limit: int | None) -> None:
        if not isinstance(locs, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(locs).__name__}")
        if locs.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {locs.dtype}")
        if not debug_enabled() or locs.numel() == 0:
            return
        if bool((locs < 0).any()):
            raise ValueError(f"{name} holds a negative value ({int(locs.min())})")
        if limit is not None and bool((locs >= limit).any()):
            raise ValueError(f"{name} holds {int(locs.max())}, out of range [0, {limit})")

    def _loc_limit(self) -> int | None:
        return None if self.logical_pages is None else self.logical_pages * self.page_size

    def owner(self, logical_pages: torch.Tensor) -> torch.Tensor:
        self._check_locs("logical_pages", logical_pages, self.logical_pages)
        return page_owner(logical_pages, self.cp_size)

    def phys_page(self, logical_pages: torch.Tensor) -> torch.Tensor:
        self._check_locs("logical_pages", logical_pages, self.logical_pages)
        return local_page(logical_pages, self.cp_size)

    def logical_page(self, owner: torch.Tensor | int, phys_pages: torch.Tensor) -> torch.Tensor:
        """Inverse of (owner, phys_page)."""
        self._check_locs("phys_pages", phys_pages, None)
        if isinstance(owner, int) and not 0 <= owner < self.cp_size:
            raise ValueError(f"owner must be in [0, {self.cp_size}), got {owner}")
        return phys_pages * self.cp_size + owner

    def loc_owner(self, locs: torch.Tensor) -> torch.Tensor:
        self._check_locs("locs", locs, self._loc_limit())
        return page_owner(locs >> self._shift, self.cp_size)

    def phys_row(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical row of each loc on its owner."""
        self._check_locs("locs", locs, self._loc_limit())
        offset = locs & (self.page_size - 1)
        return local_page(locs >> self._shift, self.cp_size) * self.page_size + offset

    def logical_loc(self, owner: torch.Tensor | int, phys_rows: torch.Tensor) -> torch.Tensor:
        """Inverse of (loc_owner, phys_row)."""
        self._check_locs("phys_rows", phys_rows, None)
        if isinstance(owner, int) and not 0 <= owner < self.cp_size:
            raise ValueError(f"owner must be in [0, {self.cp_size}), got {owner}")
        offset = phys_rows & (self.page_size - 1)
        lp = (phys_rows >> self._shift) * self.cp_size + owner
        return lp * self.page_size + offset

    def store_rows(
        self, locs: torch.Tensor, rank: int, trash_page: int, phys_pages: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``rank`` stores each loc of a chunk every rank holds: ``(rows, mine)``. An owned loc goes to
        its physical row, any other to the same offset of ``trash_page`` (a masked store: no host sync)."""
        mine = self.loc_owner(locs) == rank
        trash = trash_page * self.page_size + (locs & (self.page_size - 1))
        rows = torch.where(mine, self.phys_row(locs), trash)
        if phys_pages is not None and debug_enabled():
            self.check_store_rows(locs, rows, mine, rank, trash_page, phys_pages)
        return rows, mine

    def check_store_rows(
        self, locs: torch.Tensor, rows: torch.Tensor, mine: torch.Tensor, rank: int, trash_page: int, phys_pages: int
    ) -> None:
        """Debug check of a masked store (syncs): owned rows stay within ``phys_pages``, off the trash page, and
        map back to their locs on ``rank``."""
        ps, limit = self.page_size, phys_pages * self.page_size
        owned_rows = torch.where(mine, rows, torch.zeros_like(rows))
        if bool((owned_rows >= limit).any()):
            bad = int(locs[mine & (rows >= limit)][0])
            raise ValueError(f"loc {bad} maps past this rank's {phys_pages} physical pages")
        reserved = self.cp_size * ps  # logical pages [0, cp_size) are never handed out
        if bool((mine & (locs >= reserved) & (owned_rows // ps == trash_page)).any()):
            raise AssertionError("an owned loc outside the reserved range maps onto the trash page")
        back = self.logical_loc(rank, owned_rows)
        if not bool(torch.equal(torch.where(mine, back, locs), locs)):
            raise AssertionError("a stored row does not map back to its logical loc on this rank")


@dataclass(frozen=True)
class CPSharedSpec:
    """One rank's share of a CP-shared pool, checked once when the pool is built."""

    cp_size: int  # the CP group's size (1: a replicated pool)
    cp_rank: int
    page_size: int  # tokens per page, a power of two
    phys_pages: int  # pages this rank's buffers hold, the trash page included
    row_bytes: int  # one token's latent row: 656 fp8, 1152 bf16, or SGLang's store row
    with_indexer: bool  # the pool also holds NSA indexer pages (page_size * 132 B)

    trash_page = TRASH_PAGE  # where a masked store puts the rows other ranks own

    def __post_init__(self) -> None:
        check_int("cp_size", self.cp_size, 1)
        if not isinstance(self.cp_rank, int) or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {self.cp_rank!r}")
        check_page_size(self.page_size)
        check_int("phys_pages", self.phys_pages, 1)
        check_int("row_bytes", self.row_bytes, 1)

    @property
    def logical_pages(self) -> int:
        return self.cp_size * self.phys_pages

    def ownership(self) -> PageOwnership:
        return PageOwnership(self.cp_size, self.page_size, self.logical_pages)
