"""Owner-balanced page allocator for the logical page space of a sharded pool.

A request's consecutive logical pages go to consecutive owners
(``owner(page_i) = (first_owner + i) % cp_size``), so the count of a request's pages on
any two ranks differs by at most one. That bound is what gives every per-batch
materialize buffer a static, host-known size (``S = sum(ceil(pages_i / cp_size))``).

Physical page 0 of every rank is the pool's trash page (``placement.TRASH_PAGE``), so
logical pages ``[0, cp_size)`` are never handed out, as in SGLang's widened allocator:
each rank lends ``phys_pages_per_rank - 1`` pages.

The allocator runs on the host, identically on every CP rank (same calls, same
order, same result), as SGLang's allocators do.
"""

from __future__ import annotations

from collections import deque

import torch

from sglang_cp_shared_kv.srt.mem_cache.placement import TRASH_PAGE, PageOwnership
from sglang_cp_shared_kv.srt.utils import check_int


class BalancedPageAllocator:
    """Per-owner free lists of physical pages; hands out logical page ids.

    ``phys_pages_per_rank`` is the pool's page count per rank, the trash page included.
    """

    def __init__(self, ownership: PageOwnership, phys_pages_per_rank: int):
        check_int("phys_pages_per_rank", phys_pages_per_rank, 1)
        self.ownership = ownership
        self.phys_pages_per_rank = phys_pages_per_rank
        cp_size = ownership.cp_size
        lendable = [p for p in range(phys_pages_per_rank) if p != TRASH_PAGE]
        self._free: list[deque[int]] = [deque(lendable) for _ in range(cp_size)]
        self._in_use = [bytearray(phys_pages_per_rank) for _ in range(cp_size)]

    @property
    def logical_capacity_pages(self) -> int:
        """The logical page space, ``[0, cp_size)`` (the trash pages) included."""
        return self.ownership.logical_capacity_pages(self.phys_pages_per_rank)

    @property
    def lendable_pages_per_rank(self) -> int:
        return self.phys_pages_per_rank - 1

    def free_pages(self, rank: int) -> int:
        return len(self._free[rank])

    def used_pages(self, rank: int) -> int:
        return self.lendable_pages_per_rank - len(self._free[rank])

    def next_owner(self, last_logical_page: int | None) -> int:
        """The owner that continues a request whose last page is ``last_logical_page``."""
        if last_logical_page is None:
            return 0
        return (last_logical_page + 1) % self.ownership.cp_size

    def _demand(self, n_pages: int, first_owner: int) -> list[int]:
        cp_size = self.ownership.cp_size
        return [self.ownership.owned_page_count(n_pages, first_owner, r) for r in range(cp_size)]

    def can_alloc(self, n_pages: int, first_owner: int = 0) -> bool:
        return all(d <= len(f) for d, f in zip(self._demand(n_pages, first_owner), self._free))

    def alloc(self, n_pages: int, first_owner: int = 0) -> torch.Tensor | None:
        """``n_pages`` logical pages cycling through owners from ``first_owner``.

        Returns an int64 tensor of logical page ids, or ``None`` (and allocates
        nothing) when any owner lacks pages.
        """
        cp_size = self.ownership.cp_size
        check_int("n_pages", n_pages, 0)
        if not isinstance(first_owner, int) or not 0 <= first_owner < cp_size:
            raise ValueError(f"first_owner must be in [0, {cp_size}), got {first_owner!r}")
        if not self.can_alloc(n_pages, first_owner):
            return None
        pages = []
        for i in range(n_pages):
            owner = (first_owner + i) % cp_size
            phys = self._free[owner].popleft()
            self._in_use[owner][phys] = 1
            pages.append(phys * cp_size + owner)
        return torch.tensor(pages, dtype=torch.int64)

    def free(self, logical_pages: torch.Tensor | list[int]) -> None:
        """Return pages to their owners. Rejects foreign or double-freed pages before freeing any."""
        cp_size = self.ownership.cp_size
        pages = [int(p) for p in (logical_pages.tolist() if isinstance(logical_pages, torch.Tensor) else logical_pages)]
        seen = set()
        for p in pages:
            if not 0 <= p < self.logical_capacity_pages:
                raise ValueError(f"logical_pages holds {p}, out of range [0, {self.logical_capacity_pages})")
            if p in seen or not self._in_use[p % cp_size][p // cp_size]:
                raise ValueError(f"logical_pages holds page {p}, which is not allocated")
            seen.add(p)
        for p in pages:
            self._in_use[p % cp_size][p // cp_size] = 0
            self._free[p % cp_size].append(p // cp_size)
