"""Page ownership arithmetic for a KV pool sharded across CP ranks.

Every layer above the pool (allocator, prefix cache, ``req_to_token``, page
tables) speaks in *logical* token locs. A logical page ``lp = loc // ps`` lives
on exactly one CP rank and nowhere else::

    owner(lp)     = lp % N
    phys_page(lp) = lp // N
    phys_row(loc) = phys_page(loc // ps) * ps + loc % ps

and the map is a bijection between logical locs and (owner, physical row)::

    loc = ((phys_row // ps) * N + owner) * ps + phys_row % ps

It is stateless: any rank computes any page's owner and physical row with
arithmetic alone, so there is nothing to store or keep coherent.
"""

from __future__ import annotations

import os

import torch

_DEBUG_ENV = "SGLANG_DEBUG_CP_SHARED_KV"


def debug_enabled() -> bool:
    """Syncing diagnostics are opt-in; they are off for every measurement."""
    return os.environ.get(_DEBUG_ENV, "0") not in ("", "0", "false", "False")


def _check_int_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


class PageOwnership:
    """Stateless ownership map for ``cp_size`` ranks and ``page_size`` tokens per page.

    ``logical_pages`` (optional) bounds the logical page space; with it set and
    debug mode on, out-of-range locs raise. Without debug mode nothing syncs.
    """

    def __init__(self, cp_size: int, page_size: int, logical_pages: int | None = None):
        if not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
        if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size!r}")
        if logical_pages is not None and (not isinstance(logical_pages, int) or logical_pages < 0):
            raise ValueError(f"logical_pages must be an int >= 0, got {logical_pages!r}")
        self.cp_size = cp_size
        self.page_size = page_size
        self.logical_pages = logical_pages
        self._shift = page_size.bit_length() - 1

    def __repr__(self) -> str:
        return f"PageOwnership(cp_size={self.cp_size}, page_size={self.page_size})"

    # -- validation (debug only: these read device data back to the host) --
    def _check_locs(self, name: str, locs: torch.Tensor, limit: int | None) -> None:
        _check_int_tensor(name, locs)
        if not debug_enabled() or locs.numel() == 0:
            return
        if bool((locs < 0).any()):
            raise ValueError(f"{name} holds a negative value ({int(locs.min())})")
        if limit is not None and bool((locs >= limit).any()):
            raise ValueError(f"{name} holds {int(locs.max())}, out of range [0, {limit})")

    def _loc_limit(self) -> int | None:
        return None if self.logical_pages is None else self.logical_pages * self.page_size

    # -- pages --
    def owner(self, logical_pages: torch.Tensor) -> torch.Tensor:
        self._check_locs("logical_pages", logical_pages, self.logical_pages)
        return logical_pages % self.cp_size

    def phys_page(self, logical_pages: torch.Tensor) -> torch.Tensor:
        self._check_locs("logical_pages", logical_pages, self.logical_pages)
        return logical_pages // self.cp_size

    def logical_page(self, owner: torch.Tensor | int, phys_pages: torch.Tensor) -> torch.Tensor:
        """Inverse of (owner, phys_page)."""
        self._check_locs("phys_pages", phys_pages, None)
        if isinstance(owner, int) and not 0 <= owner < self.cp_size:
            raise ValueError(f"owner must be in [0, {self.cp_size}), got {owner}")
        return phys_pages * self.cp_size + owner

    # -- tokens --
    def loc_owner(self, locs: torch.Tensor) -> torch.Tensor:
        self._check_locs("locs", locs, self._loc_limit())
        return (locs >> self._shift) % self.cp_size

    def phys_row(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical row of each loc on its owner."""
        self._check_locs("locs", locs, self._loc_limit())
        offset = locs & (self.page_size - 1)
        return ((locs >> self._shift) // self.cp_size) * self.page_size + offset

    def logical_loc(self, owner: torch.Tensor | int, phys_rows: torch.Tensor) -> torch.Tensor:
        """Inverse of (loc_owner, phys_row)."""
        self._check_locs("phys_rows", phys_rows, None)
        if isinstance(owner, int) and not 0 <= owner < self.cp_size:
            raise ValueError(f"owner must be in [0, {self.cp_size}), got {owner}")
        offset = phys_rows & (self.page_size - 1)
        lp = (phys_rows >> self._shift) * self.cp_size + owner
        return lp * self.page_size + offset

    def store_rows(self, locs: torch.Tensor, rank: int, trash_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``rank`` stores each loc of a chunk every rank holds: ``(rows, mine)``.

        An owned loc goes to its physical row; any other to the same offset of ``trash_page``, so
        the store keeps the chunk's static shape (a masked store, no ``nonzero``, no host sync).
        """
        mine = self.loc_owner(locs) == rank
        trash = trash_page * self.page_size + (locs & (self.page_size - 1))
        return torch.where(mine, self.phys_row(locs), trash), mine

    # -- capacity --
    def logical_capacity_pages(self, phys_pages_per_rank: int) -> int:
        """Logical page space is N times one rank's physical pages."""
        return phys_pages_per_rank * self.cp_size

    def owned_page_count(self, n_pages: int, first_owner: int, rank: int) -> int:
        """How many of ``n_pages`` consecutive-owner pages starting at ``first_owner`` land on ``rank``."""
        k = (rank - first_owner) % self.cp_size
        return 0 if k >= n_pages else (n_pages - 1 - k) // self.cp_size + 1
