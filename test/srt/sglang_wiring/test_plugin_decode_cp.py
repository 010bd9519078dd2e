"""Decode CP over SGLang's DSA pool sharded by page ownership (``CPSharedDSATokenToKVPool``), on gloo ranks.

Each rank's pool stores only the latent rows and indexer pages of the pages it owns (SGLang's writers,
the masked store); a replicated ``DSATokenToKVPool`` gets the same writes. Per layer, each rank scores
the indexer keys it holds (``decode_cp.position_rows`` finds them by the pool's ownership), the ranks
merge their candidates into the global top-k, attend over their own selected rows and merge by LSE:
the top-k equals the replicated pool's (same positions, same order) and the output equals sparse MLA
over the replicated rows within fp32 rounding. Read as SGLang's paged indexer reads (each page through
``decode_cp.indexer_pages``, another rank's the trash page), ``decode_cp.owned_topk`` selects what
SGLang's torch top-k selects over the replicated scores, in its format (tied positions at the ``k``-th
score aside: each picks its own); SGLang's loc transform of the top-k, through
``decode_cp.owned_loc_rows``, gives this rank's rows; and SGLang's own DCP merge kernel (2 ranks: it
takes a power of two) over ``decode_cp.for_dcp_merge``'s output gives the same result, where
natural-log LSE read as base 2 does not.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.multirank]
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="SGLang's pool writers are Triton kernels: CPU needs TRITON_INTERPRET=1",
)

PS, TOPK, HEADS, INDEX_HEADS, LAYERS = 64, 96, 4, 2, 2
LENS = [300, 130, 40]  # tokens per request (the last shorter than TOPK)
SM_SCALE = 576**-0.5


def _rank(rank: int, world: int, seed: int) -> dict:
    from sglang.kernels.ops.attention.dcp_kernels import correct_attn_out
    from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel
    from test_plugin_sharded_pool import _chunk, _dsa_kwargs, _Layer

    from reference.dsa_reference import _top_positions, indexer_scores, read_index_k, sparse_mla
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import (
        for_dcp_merge,
        global_topk,
        indexer_pages,
        merge_by_lse,
        owned_loc_rows,
        owned_rows,
        owned_topk,
        position_rows,
    )
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    g = torch.Generator().manual_seed(seed)
    group = CPGroup()
    # Each request's pages rotate owners from a base of its own, as the allocator draws them.
    n_pages = [-(-n // PS) for n in LENS]
    first = world  # logical pages [0, N) are the trash pages
    pages = []
    for n in n_pages:
        pages.append(list(range(first, first + n)))
        first += n + int(torch.randint(0, world, (1,), generator=g))
    width = max(n_pages)
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages])
    longest = width * PS
    q_req = torch.arange(len(LENS))
    q_pos = torch.tensor(LENS) - 1
    kwargs = _dsa_kwargs(LAYERS, fp8=False)
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool = CPSharedDSATokenToKVPool(
            (first // world + 1) * PS, cp_rank=rank, cp_size=world, cp_group=group, **kwargs
        )
        replicated = DSATokenToKVPool(world * pool.phys_pages * PS - PS, **kwargs)
        replicated.dcp_replicated = True
    locs = torch.cat([(torch.tensor(p).repeat_interleave(PS) * PS + torch.arange(PS).repeat(len(p)))[:n]
                      for p, n in zip(pages, LENS)])  # fmt: skip
    out: dict = {
        "top_equal": [],
        "out_err": [],
        "sglang_topk_equal": [],
        "sglang_merge_err": [],
        "base_e_err": [],
        "loc_rows_equal": [],
    }
    for layer in range(LAYERS):
        nope, rope, k, scale = _chunk(len(locs), seed + layer)
        for p in (pool, replicated):  # every rank receives the whole chunk; the pool keeps its own rows
            p.set_index_k_scale_buffer(layer, locs, k, scale)
            p.set_mla_kv_buffer(_Layer(layer), locs, nope, rope)
        q_index = torch.randn(len(q_req), INDEX_HEADS, 128, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
        q_scale = torch.rand(len(q_req), INDEX_HEADS, generator=g) + 0.5
        weights = torch.randn(len(q_req), INDEX_HEADS, generator=g)
        q = torch.randn(len(q_req), HEADS, 576, generator=g)
        visible = torch.arange(longest) <= q_pos.unsqueeze(1)

        # The replicated pool: every position's key, the indexer's top-k, sparse MLA over its rows.
        logical = table[q_req][:, torch.arange(longest) // PS] * PS + torch.arange(longest) % PS
        k_all, s_all = read_index_k(replicated.index_k_with_scale_buffer[layer], PS, logical)
        scores = torch.where(visible, indexer_scores(q_index, q_scale, weights, k_all, s_all), -torch.inf)
        want = torch.full((len(q_req), TOPK), -1, dtype=torch.int64)
        want[:, :] = _top_positions(scores, TOPK).long()
        want = torch.where(torch.arange(TOPK) < (q_pos + 1).clamp(max=TOPK).unsqueeze(1), want, -1)
        kv = replicated.get_key_buffer(layer)
        rows = torch.where(want < 0, -1, logical.gather(1, want.clamp(min=0)))
        want_out, _ = sparse_mla(q, kv.view(torch.uint8).reshape(kv.shape[0], -1), "bf16", rows, SM_SCALE)

        # This rank: the keys and rows it holds, the global top-k, its attention, the LSE merge.
        row_of = position_rows(table[q_req], PS, world, rank, longest)
        k_own, s_own = read_index_k(pool.index_k_with_scale_buffer[layer], PS, row_of.clamp(min=0))
        mine = (row_of >= 0) & visible
        local = torch.where(mine, indexer_scores(q_index, q_scale, weights, k_own, s_own), -torch.inf)
        positions = torch.where(mine, torch.arange(longest), -1)
        top = global_topk(local, positions, TOPK, group)
        # SGLang's decode turns the top-k positions into token locs of the request's page table.
        top_locs = transform_index_page_table_decode(page_table=logical.int(), topk_indices=top.int(), page_size=1)
        out["loc_rows_equal"].append(
            bool(torch.equal(owned_loc_rows(top_locs, pool.ownership, rank), owned_rows(top, row_of)))
        )
        kv_own = pool.kv_buffer[layer]
        o, lse = sparse_mla(q, kv_own.view(torch.uint8).reshape(kv_own.shape[0], -1), "bf16",
                            owned_rows(top, row_of), SM_SCALE)  # fmt: skip
        outs = torch.empty((world * o.shape[0], *o.shape[1:]))
        lses = torch.empty((world * lse.shape[0], *lse.shape[1:]))
        group.all_gather_into_many([outs, lses], [o, lse])
        merged, _ = merge_by_lse(outs.view(world, *o.shape), lses.view(world, *lse.shape))
        out["top_equal"].append(bool(torch.equal(top, want)))

        # As SGLang's paged indexer reads it: every position through this rank's page table (another
        # rank's page reads the trash page), then its decode top-k format, against SGLang's torch top-k
        # over the replicated scores.
        own_pages = indexer_pages(table[q_req], world, rank)
        paged = own_pages[:, torch.arange(longest) // PS] * PS + torch.arange(longest) % PS
        k_read, s_read = read_index_k(pool.index_k_with_scale_buffer[layer], PS, paged)
        read_scores = indexer_scores(q_index, q_scale, weights, k_read, s_read)
        lengths = (q_pos + 1).int()
        got = owned_topk(read_scores, lengths, table[q_req], PS, TOPK, group)
        sglang = DSATopKBackend.TORCH.topk_func(scores.clone(), lengths, TOPK)
        out["sglang_topk_equal"].append(_same_selection(got, sglang, scores, TOPK))
        out["out_err"].append(float((merged - want_out).abs().max()))

        # SGLang's own DCP merge kernel (its per-rank correction; the sum over ranks stands in for its
        # reduce-scatter), fed as a `dsa` backend's output: base-2 LSE. Natural-log LSE read as base 2
        # (what SGLang does with flash_mla_with_kvcache's today) is measured beside it.
        pairs = (("sglang_merge_err", for_dcp_merge(o, lse)), ("base_e_err", (o, lse)))
        for name, (o_r, lse_r) in pairs if world & (world - 1) == 0 else ():  # its kernel: 2^k ranks
            every_lse = torch.empty((world * lse_r.shape[0], *lse_r.shape[1:]))
            group.all_gather_into(every_lse, lse_r.contiguous())
            heads_first = torch.empty((o_r.shape[1], o_r.shape[0], o_r.shape[2]))  # [H, R, D], as it writes
            corrected, _ = correct_attn_out(o_r.contiguous(), every_lse.view(world, *lse_r.shape), rank, None,
                                            heads_first, is_lse_base_on_e=False)  # fmt: skip
            torch.distributed.all_reduce(corrected)
            out[name].append(float((corrected.transpose(0, 1) - want_out).abs().max()))
    return out


def _same_selection(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, k: int) -> bool:
    """Both int32 ``[R, k]`` top-k in SGLang's format select every position scored above the ``k``-th
    score and as many at it: which tied positions is each top-k's own (``torch.topk`` leaves it open,
    ``owned_topk`` takes the first positions); the attention reads the selection as a set."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    for g, w, row in zip(got, want, scores):
        kth = row.sort(descending=True).values[min(k, row.numel()) - 1]
        sets = [set(t[t >= 0].tolist()) for t in (g, w)]
        above = [{p for p in chosen if row[p] > kth} for chosen in sets]
        if len(sets[0]) != len(sets[1]) or above[0] != above[1] or any(row[p] < kth for p in sets[0] | sets[1]):
            return False
    return True


@needs_interpreter
@pytest.mark.parametrize("world", [2, 3])
def test_decode_over_sharded_pools_equals_the_replicated_pool(world):
    from reference.spawn import spawn_ranks

    results = spawn_ranks(_rank, world, 7, timeout_s=300)
    for rank, res in enumerate(results):
        assert all(res["top_equal"]) and all(res["sglang_topk_equal"]) and all(res["loc_rows_equal"]), (rank, res)
        assert max(res["out_err"]) < 1e-5, (rank, res)
        if world & (world - 1) == 0:  # SGLang's merge kernel takes 2^k ranks
            assert len(res["sglang_merge_err"]) == LAYERS and max(res["sglang_merge_err"]) < 1e-5, (rank, res)
            assert min(res["base_e_err"]) > 1e-3, (rank, res)  # the base matters: a wrong one is seen
