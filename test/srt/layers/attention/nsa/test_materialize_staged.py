"""The materialized view with the current chunk staged locally (``ViewMaterializer(stage_current=True)``,
through the standalone ``ReadPath``), on N spawned gloo ranks.

Random pool contents are written through the masked store on every rank and into a replicated pool.
A batch with page-aligned, unaligned and empty prefixes (and two requests sharing pages) plans only
each request's prefix pages (a page the prefix shares with the chunk included); the chunk's other
pages come from the rows handed to ``layer_view``, never from the group. Every token a request reads
must hold the replicated pool's bytes, through the kernels' page table and through the top-k remap,
and the bytes moved are those of the prefix pages alone.
"""

import pytest
import torch

from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.reference.dsa_stack import page_table_from_pages
from sglang_cp_shared_kv.reference.read_path import ReadPath, pack_index_records
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES, index_page_views, mla_row_bytes
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


def _lens(ps: int) -> tuple[list[int], list[int]]:
    seq = [3 * ps + 5, ps, 6 * ps, ps // 2, 2 * ps + 1]
    prefix = [ps + 3, 0, 2 * ps, 0, ps]  # unaligned, none, aligned (shared pages), none, aligned
    return seq, prefix


def _rank_staged(rank: int, world_size: int, ps: int, kv_format: str, prefetch: bool, device: str = "cpu") -> dict:
    group = CPGroup()
    g = torch.Generator().manual_seed(11)
    seq, prefix = _lens(ps)
    own = PageOwnership(world_size, ps)
    alloc = BalancedPageAllocator(own, 2 + sum(-(-n // ps) for n in seq))
    pages = []
    for i, n in enumerate(seq):
        shared = pages[0][:2] if i == 2 else []  # request 2 reads request 0's first two pages
        first = alloc.next_owner(shared[-1]) if shared else i % world_size
        pages.append(shared + alloc.alloc(-(-n // ps) - len(shared), first).tolist())
    table = page_table_from_pages(pages).to(device)
    phys = alloc.phys_pages_per_rank
    sharded = ShardedMLAPool(own, rank, phys, 2, kv_format, device=device)
    replicated = ShardedMLAPool(PageOwnership(1, ps), 0, phys * world_size, 2, kv_format, device=device)
    locs = torch.arange(phys * world_size * ps, device=device)
    data = []
    for layer in range(2):
        rows = torch.randint(0, 256, (len(locs), mla_row_bytes(kv_format)), dtype=torch.uint8, generator=g)
        k_u8 = torch.randint(0, 256, (len(locs), 128), dtype=torch.uint8, generator=g)
        rows, k_u8, scale = rows.to(device), k_u8.to(device), torch.rand(len(locs), generator=g).to(device)
        for pool in (sharded, replicated):
            pool.set_latent(layer, locs, rows)
            pool.set_index(layer, locs, k_u8, scale)
        data.append((rows, k_u8, scale))
    # The chunk every rank holds: request-major tokens [prefix_b, seq_b).
    tok_locs = [torch.tensor([p[t // ps] * ps + t % ps for t in range(n)], device=device) for p, n in zip(pages, seq)]
    new = torch.cat([t[q:] for t, q in zip(tok_locs, prefix)])
    use_triton = None if device == "cuda" else False  # the Triton kernels on GPUs
    mat = ReadPath(sharded, group, current_reuse=False, stage_current=True, prefetch=prefetch, use_triton=use_triton)
    counters = mat.begin_batch(table, seq, prefix)
    bad, row_ok = [], True
    for layer in range(2):
        rows, k_u8, scale = data[layer]
        view = mat.layer_view(layer, rows[new], pack_index_records(k_u8[new], scale[new]))
        k_view, s_view = index_page_views(view.index_pages, ps)
        for b, t in enumerate(tok_locs):
            j = torch.arange(len(t), device=device)
            slot = view.page_table[b, j // ps].long()
            vrow = slot * ps + j % ps
            if not torch.equal(view.kv_rows[vrow], rows[t]):
                bad.append(("latent", layer, b))
            off = j % ps
            if not (torch.equal(k_view[slot, off], k_u8[t]) and torch.equal(s_view[slot, off], scale[t])):
                bad.append(("index", layer, b))
        # Top-k positions (-1 padded) of queries of requests 0 (unaligned prefix) and 2 (shared pages).
        pos = torch.tensor([[0, ps + 2, ps + 3, 3 * ps + 4], [ps - 1, 2 * ps, 6 * ps - 1, -1]], dtype=torch.int32)
        pos, q_req = pos.to(device), torch.tensor([0, 2], device=device)
        got = view.rows(pos, q_req)
        for r, vrs, q in zip(pos, got, q_req):
            for x, vr in zip(r, vrs):
                if x >= 0:
                    row_ok &= torch.equal(view.kv_rows[int(vr)], rows[int(tok_locs[int(q)][int(x)])])
        row_ok &= bool((got[pos < 0] == -1).all())
    return {
        "bad": bad,
        "row_ok": row_ok,
        "view_pages": counters.view_pages,
        "received": counters.bytes_received,
        "current_gathered": counters.current_chunk_bytes_gathered,
        "staged": counters.pages_staged,
    }


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("world_size", "ps", "kv_format", "prefetch"),
    [(2, 16, "bf16", False), (3, 16, "fp8", True), (4, 64, "fp8", False)],
)
def test_staged_view_reads_the_replicated_bytes_and_gathers_only_prefixes(world_size, ps, kv_format, prefetch):
    seq, prefix = _lens(ps)
    prefix_pages = [-(-q // ps) for q in prefix]
    s = sum(-(-q // world_size) for q in prefix_pages)
    staged = sum(-(-n // ps) for n in seq) - sum(prefix_pages)
    page_bytes = ps * (mla_row_bytes(kv_format) + INDEX_TOKEN_BYTES)
    for res in spawn_ranks(_rank_staged, world_size, ps, kv_format, prefetch, timeout_s=300):
        assert res["bad"] == [] and res["row_ok"], res
        assert (res["view_pages"], res["staged"], res["current_gathered"]) == (world_size * s, staged, 0), res
        assert res["received"] == 2 * (world_size - 1) * s * page_bytes, res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("prefetch", [False, True])
def test_staged_view_on_gpus(prefetch):
    """The same on 2 GPUs over NCCL, with the Triton kernels (and the side-stream prefetch)."""
    world_size, ps, kv_format = 2, 64, "fp8"
    seq, prefix = _lens(ps)
    prefix_pages = [-(-q // ps) for q in prefix]
    s = sum(-(-q // world_size) for q in prefix_pages)
    for res in spawn_ranks(_rank_staged, world_size, ps, kv_format, prefetch, "cuda", backend="nccl", timeout_s=300):
        assert res["bad"] == [] and res["row_ok"] and res["view_pages"] == world_size * s, res
        assert res["current_gathered"] == 0, res
