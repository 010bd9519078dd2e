"""A deterministic chunked-prefill write stream for pool tests (several requests, shared prefix pages)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import encode_mla_rows, quantize_index_k
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


@dataclass
class Request:
    length: int
    prefix_from: int | None = None  # index of the request whose first pages this one reuses
    prefix_pages: int = 0
    pages: list[int] = field(default_factory=list)
    written: int = 0  # tokens of this request already in the pool


def make_requests(page_size: int) -> list[Request]:
    ps = page_size
    return [
        Request(5 * ps + 3),
        Request(3 * ps + 7, prefix_from=0, prefix_pages=2),  # shares two full pages of request 0
        Request(2 * ps - 1),
        Request(4 * ps + 5, prefix_from=0, prefix_pages=4),
    ]


def token_kv(req_id: int, positions: torch.Tensor, layer: int, kv_format: str):
    """Seeded per-token KV: equal for equal (request, position, layer), so shared prefixes agree."""
    out_rows, out_k, out_s = [], [], []
    for p in positions.tolist():
        g = torch.Generator().manual_seed(((req_id * 100_003 + p) * 131 + layer) % (2**62))
        latent = torch.randn(1, 512, generator=g) * (1 + p % 7)
        rope = torch.randn(1, 64, generator=g)
        k = torch.randn(1, 128, generator=g)
        out_rows.append(encode_mla_rows(latent, rope, kv_format))
        k_u8, s = quantize_index_k(k)
        out_k.append(k_u8)
        out_s.append(s)
    return torch.cat(out_rows), torch.cat(out_k), torch.cat(out_s)


def chunk_stream(requests: list[Request], allocator: BalancedPageAllocator, chunk: int):
    """Yield (locs, [(req_id, positions)]) per batch; allocates pages as requests grow."""
    ps = allocator.ownership.page_size
    for r in requests:
        if r.prefix_from is not None:
            r.pages = list(requests[r.prefix_from].pages[: r.prefix_pages])
            r.written = r.prefix_pages * ps
    pending = list(range(len(requests)))
    while pending:
        locs, parts = [], []
        for i in list(pending):
            r = requests[i]
            if r.prefix_from is not None and requests[r.prefix_from].written < r.prefix_pages * ps:
                continue  # its prefix is not cached yet
            end = min(r.length, r.written + chunk)
            need = -(-end // ps) - len(r.pages)
            if need > 0:
                got = allocator.alloc(need, allocator.next_owner(r.pages[-1] if r.pages else None))
                assert got is not None, "test pool too small"
                r.pages += got.tolist()
            pos = torch.arange(r.written, end)
            page_ids = torch.tensor(r.pages)[pos // ps]
            locs.append(page_ids * ps + pos % ps)
            parts.append((i, pos))
            r.written = end
            if end == r.length:
                pending.remove(i)
        yield torch.cat(locs), parts


def filled_pool(kv_format="fp8", with_indexer=True, page_size=16):
    """A replicated pool (10 pages, 2 layers) of random latent rows and indexer K + scale."""
    PS = page_size
    pool = ShardedMLAPool(PageOwnership(1, PS), 0, 10, 2, kv_format, with_indexer=with_indexer)
    g = torch.Generator().manual_seed(3)
    locs = torch.arange(10 * PS)
    for layer in range(2):
        pool.set_latent(layer, locs, torch.randint(0, 256, (len(locs), pool.row_bytes), dtype=torch.uint8, generator=g))
        if with_indexer:
            k = torch.randint(0, 256, (len(locs), 128), dtype=torch.uint8, generator=g)
            pool.set_index(layer, locs, k, torch.rand(len(locs), generator=g))
    return pool
