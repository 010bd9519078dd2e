"""Sharded pools on N spawned ranks store, together, exactly what one replicated pool stores.

Every rank computes its interleaved share of each chunk's tokens, the CP group all-gathers them back into
token order (as prefill CP does after each layer), and every rank writes the whole chunk through its masked
store. The parent then compares each rank's buffers against the replicated pool, byte for byte.
"""

import pytest
import torch
from pool_workload import chunk_stream, make_requests, token_kv

from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

LAYERS = 2
PHYS_PAGES = 12  # per rank; enough for the workload at N = 2
CONFIGS = [(16, "fp8"), (64, "fp8"), (16, "bf16"), (64, "bf16")]
CHUNK = 40


def _gathered_chunk(group, req_parts, layer, kv_format):
    """This rank computes tokens i % N == rank; the all-gather puts the chunk back in token order."""
    n, rank = group.size, group.rank
    ids = torch.cat([torch.full((len(pos),), i) for i, pos in req_parts])
    pos = torch.cat([p for _, p in req_parts])
    t = ids.shape[0]
    per_rank = -(-t // n)
    mine = torch.arange(rank, per_rank * n, n).clamp(max=t - 1)  # pad by repeating the last token
    rows_parts = [token_kv(int(i), p.view(1), layer, kv_format) for i, p in zip(ids[mine], pos[mine])]
    local = [torch.cat([r[j] for r in rows_parts]) for j in range(3)]
    full = []
    for x in local:
        x2 = x if x.dim() == 2 else x.unsqueeze(1)
        out = torch.empty((n * per_rank, *x2.shape[1:]), dtype=x2.dtype)
        group.all_gather_into(out, x2.contiguous())
        # rank-major [n, per_rank] -> token order (token i came from rank i % n, slot i // n)
        ordered = out.view(n, per_rank, *x2.shape[1:]).transpose(0, 1).reshape(n * per_rank, *x2.shape[1:])[:t]
        full.append(ordered if x.dim() == 2 else ordered.squeeze(1))
    return full


def _rank_writes(rank, world_size):
    group = CPGroup()
    results = {}
    for ps, kv_format in CONFIGS:
        own = PageOwnership(world_size, ps)
        alloc = BalancedPageAllocator(own, PHYS_PAGES)
        pool = ShardedMLAPool(own, rank, PHYS_PAGES, LAYERS, kv_format)
        for locs, parts in chunk_stream(make_requests(ps), alloc, CHUNK):
            for layer in range(LAYERS):
                rows, k_u8, scale = _gathered_chunk(group, parts, layer, kv_format)
                pool.set_latent(layer, locs, rows)
                pool.set_index(layer, locs, k_u8, scale)
        results[(ps, kv_format)] = (pool.latent, pool.index, alloc.used_pages(rank), pool.page_bytes)
    return results


def _replicated(world_size, ps, kv_format):
    own = PageOwnership(1, ps)
    alloc = BalancedPageAllocator(PageOwnership(world_size, ps), PHYS_PAGES)  # same logical pages as the CP run
    pool = ShardedMLAPool(own, 0, PHYS_PAGES * world_size, LAYERS, kv_format)
    requests = make_requests(ps)
    for locs, parts in chunk_stream(requests, alloc, CHUNK):
        for layer in range(LAYERS):
            data = [token_kv(i, pos, layer, kv_format) for i, pos in parts]
            rows, k_u8, scale = (torch.cat([d[j] for d in data]) for j in range(3))
            pool.set_latent(layer, locs, rows)
            pool.set_index(layer, locs, k_u8, scale)
    used = {p for r in requests for p in r.pages}
    return pool, used, len(requests)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_union_of_ranks_equals_replicated_pool(world_size):
    per_rank = spawn_ranks(_rank_writes, world_size, timeout_s=300)
    for ps, kv_format in CONFIGS:
        repl, used, n_req = _replicated(world_size, ps, kv_format)
        own = PageOwnership(world_size, ps)
        for rank in range(world_size):
            latent, index, used_pages, page_bytes = per_rank[rank][(ps, kv_format)]
            for layer in range(LAYERS):
                # Expected buffer: the replicated page for every page this rank owns and the stream used, zeros elsewhere.
                # Page 0 is the trash page (foreign rows land there); the allocator never hands it out.
                want_lat = torch.zeros_like(latent[layer][ps : PHYS_PAGES * ps])
                want_idx = torch.zeros_like(index[layer][1:PHYS_PAGES])
                for phys in range(1, PHYS_PAGES):
                    lp = int(own.logical_page(rank, torch.tensor(phys)))
                    if lp in used:
                        want_lat[(phys - 1) * ps : phys * ps] = repl.latent[layer][lp * ps : (lp + 1) * ps]
                        want_idx[phys - 1] = repl.index[layer][lp]
                assert torch.equal(latent[layer][ps : PHYS_PAGES * ps], want_lat), (ps, kv_format, rank, layer)
                assert torch.equal(index[layer][1:PHYS_PAGES], want_idx), (ps, kv_format, rank, layer)
            # Each rank holds 1/N of the replicated bytes, within one page per request.
            repl_bytes = len(used) * page_bytes
            assert abs(used_pages * page_bytes - repl_bytes / world_size) <= n_req * page_bytes
        assert sum(per_rank[r][(ps, kv_format)][2] for r in range(world_size)) == len(used)
