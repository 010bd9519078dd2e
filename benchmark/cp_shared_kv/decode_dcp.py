"""Decode context parallel over a sharded DSA cache: tokens per GPU, and the global top-k checked exact.

**Capacity** (``capacity``): SGLang's own pool and allocator classes on CPU, DeepSeek-V3.2's rows (fp8
656-byte latent rows, 64-token indexer pages of 128 fp8 keys + fp32 scales, 132 bytes a token), one
layer of ``rows`` rows per rank, built three ways:

- **replicated**: ``DSATokenToKVPool`` + ``PagedTokenToKVPoolAllocator``, a decode without DCP;
- **SGLang's DCP** (index replicated): the same classes under ``attn_dcp_size = N``: the latent striped
  by token (``slot % N``), the indexer pages whole on every rank, the allocator widened to ``N`` x the
  rows in pages of ``64 N`` tokens, as SGLang's configurator builds them;
- **sharded** (latent and index by page ownership): ``CPSharedDSATokenToKVPool`` (rank 0 of ``N``) +
  SGLang's ``PageInterleavePoolAllocator``, no view arena (a decode reads no view).

Per layout: the bytes of the rank's KV buffers (their tensors' ``nbytes``) and the tokens its allocator
hands out (``available_size``). Tokens per byte of a rank's KV budget is what a GPU holds; its ratio
to the replicated pool's is the capacity ratio (every layer repeats the same buffers, so it holds for
the whole model). ``tokens_per_gpu`` scales it to ``--budget-gib`` over DeepSeek-V3.2's 61 layers.

**Global top-k** (``topk_rank``): ``N`` gloo ranks, each with a ``CPSharedDSATokenToKVPool`` and a
replicated pool, both written by SGLang's indexer writer at the locs SGLang's owner-rotating allocator
hands out. Per request one decode query at its last position, 64 index heads: each rank scores the keys
it holds and ``decode_cp.global_topk`` merges the ranks' candidates; the replicated pool's keys ranked
by the replicated indexer's rule (``reference.dsa_reference._top_positions``, score descending then
position ascending) give the answer it must equal, position for position. Half the pages repeat one
of 16 keys, so equal scores straddle the top-k's edge across ranks.

What it cannot show: time. ``decode_dcp_step`` models a decode step on one GPU.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmark.cp_shared_kv.rank_model import PS, pool_kwargs

INDEX_HEAD_DIM, INDEX_HEADS = 128, 64
DSV32_LAYERS = 61


def _buffer_bytes(pool) -> int:
    return sum(t.nbytes for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer])


def capacity(cp_size: int, rows: int) -> list[dict]:
    """The three layouts of one rank of ``cp_size`` holding ``rows`` rows a layer: bytes and tokens."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    kw, out = pool_kwargs(1, torch.device("cpu")), []

    def row(layout: str, pool, allocator) -> None:
        out.append(
            {
                "layout": layout,
                "cp_size": cp_size,
                "rows_per_rank": rows,
                "index_rows_per_rank": pool.index_k_with_scale_buffer[0].shape[0] * PS,
                "bytes_per_rank": _buffer_bytes(pool),
                "tokens": int(allocator.available_size()),
            }
        )

    parallel = get_parallel()
    with parallel.override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool = DSATokenToKVPool(rows, **kw)
        row("replicated", pool, PagedTokenToKVPoolAllocator(rows, PS, torch.int64, "cpu", pool, False))
        pool = CPSharedDSATokenToKVPool(rows, cp_rank=0, cp_size=cp_size, cp_group=lambda: None, **kw)
        row("sharded", pool, PageInterleavePoolAllocator(rows, PS, cp_size, torch.int64, "cpu", pool, False))
    with parallel.override(attn_dcp_size=cp_size, attn_dcp_rank=0, dcp_enabled=True):
        pool = DSATokenToKVPool(rows, **kw)
        alloc = PagedTokenToKVPoolAllocator(rows * cp_size, PS * cp_size, torch.int64, "cpu", pool, False)
        row("sglang_dcp", pool, alloc)
    replicated = out[0]["tokens"] / out[0]["bytes_per_rank"]
    for r in out:
        r["capacity_ratio"] = round(r["tokens"] / r["bytes_per_rank"] / replicated, 4)
    return out


def _keys(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 keys ``[n, 128]`` and fp32 scales ``[n, 1]``: odd pages drawn from 16 keys (equal scores)."""
    k = torch.randn(n, INDEX_HEAD_DIM, generator=g) * 4
    scale = torch.rand(n, 1, generator=g) + 0.5
    few = torch.randint(0, 16, (n,), generator=g)
    repeat = (torch.arange(n) // PS) % 2 == 1
    k[repeat], scale[repeat] = k[few[repeat]], scale[few[repeat]]
    return k.to(torch.float8_e4m3fn), scale


def topk_rank(rank: int, world: int, lengths: list[int], topk: int, seed: int) -> dict:
    """One decode DCP rank: its global top-k of each request's last position against the replicated one."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from demo.sglang_parts import new_request_locs
    from reference.dsa_reference import _top_positions, indexer_scores, read_index_k
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import global_topk, position_rows
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    g = torch.Generator().manual_seed(seed)  # the same draws on every rank
    group = CPGroup()
    pages = [-(-n // PS) for n in lengths]
    rows = (sum(pages) // world + len(lengths) + 1) * PS
    kw = pool_kwargs(1, torch.device("cpu"))
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool = CPSharedDSATokenToKVPool(rows, cp_rank=rank, cp_size=world, cp_group=group, **kw)
        replicated = DSATokenToKVPool(world * pool.phys_pages * PS - PS, **kw)
        allocator = PageInterleavePoolAllocator(rows, PS, world, torch.int64, "cpu", pool, False)
        # SGLang's allocator draws every request's pages: the same on every rank (SPMD).
        locs = [new_request_locs(allocator, n) for n in lengths]
        table = torch.zeros((len(lengths), max(pages)), dtype=torch.int64)
        for b, loc in enumerate(locs):
            table[b, : pages[b]] = loc[::PS] // PS
        every = torch.cat(locs)
        k, scale = _keys(len(every), g)
        for p in (pool, replicated):
            p.set_index_k_scale_buffer(0, every, k, scale)
    longest = max(pages) * PS
    batch = len(lengths)
    q = (torch.randn(batch, INDEX_HEADS, INDEX_HEAD_DIM, generator=g) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
    q_scale = torch.rand(batch, INDEX_HEADS, generator=g) + 0.5
    weights = torch.randn(batch, INDEX_HEADS, generator=g)
    visible = torch.arange(longest) < torch.tensor(lengths).unsqueeze(1)
    pos = torch.arange(longest)

    # The replicated indexer over every position's key.
    logical = table[:, pos // PS] * PS + pos % PS
    k_all, s_all = read_index_k(replicated.index_k_with_scale_buffer[0], PS, logical)
    scores = torch.where(visible, indexer_scores(q, q_scale, weights, k_all, s_all), -torch.inf)
    want = _top_positions(scores, topk).long()
    want = torch.where(torch.arange(topk) < torch.tensor(lengths).clamp(max=topk).unsqueeze(1), want, -1)
    ranked = torch.sort(scores, dim=-1, descending=True).values
    edge_ties = [bool(n > topk and ranked[b, topk - 1] == ranked[b, topk]) for b, n in enumerate(lengths)]

    # This rank: the keys it holds, its candidates, the merge.
    row_of = position_rows(table, PS, world, rank, longest)
    k_own, s_own = read_index_k(pool.index_k_with_scale_buffer[0], PS, row_of.clamp(min=0))
    mine = (row_of >= 0) & visible
    local = torch.where(mine, indexer_scores(q, q_scale, weights, k_own, s_own), -torch.inf)
    top = global_topk(local, torch.where(mine, pos, -1), topk, group)
    return {
        "rank": rank,
        "topk_equal": bool(torch.equal(top, want)),
        "rows_equal": [bool(torch.equal(top[b], want[b])) for b in range(batch)],
        "edge_ties": edge_ties,
        "owned_positions": int(mine.sum()),
        "visible_positions": int(visible.sum()),
    }


def main(argv: list[str] | None = None) -> int:
    from benchmark.cp_shared_kv.bench_common import write_result
    from reference.spawn import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rows", type=int, default=1 << 16, help="rows per rank of the capacity pools")
    ap.add_argument("--budget-gib", type=float, default=60.0, help="a rank's KV budget for tokens_per_gpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 9001, 2100, 700])
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rows = []
    for n in args.cp_sizes:
        for r in capacity(n, args.rows):
            per_byte = r["tokens"] / r["bytes_per_rank"]
            r["tokens_per_gpu"] = math.floor(per_byte * args.budget_gib * 2**30 / DSV32_LAYERS)
            rows.append(r)
    topk = {}
    for n in args.cp_sizes:
        ranks = spawn_ranks(topk_rank, n, args.lengths, args.topk, args.seed, timeout_s=600)
        topk[str(n)] = ranks
        print(n, [(r["rank"], r["topk_equal"], r["owned_positions"]) for r in ranks], flush=True)

    def ratio(layout: str, n: int) -> float | None:
        return next((r["capacity_ratio"] for r in rows if r["layout"] == layout and r["cp_size"] == n), None)

    summary = {
        "capacity_ratio_dcp8": ratio("sharded", 8),
        "capacity_ratio_sglang_dcp8": ratio("sglang_dcp", 8),
        "topk_exact": all(r["topk_equal"] for ranks in topk.values() for r in ranks),
        "topk_cp_sizes": args.cp_sizes,
        "topk_k": args.topk,
        "topk_lengths": args.lengths,
        "topk_edge_ties": sum(t for t in topk[str(args.cp_sizes[0])][0]["edge_ties"]),
        "step_overhead_b32_128k": None,
        "step_overhead_why_none": "timed by benchmark.cp_shared_kv.decode_dcp_step, on a GPU",
        "budget_gib": args.budget_gib,
    }
    write_result("decode_dcp", rows, summary, {"topk": topk})
    print(summary)
    return 0 if summary["topk_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
