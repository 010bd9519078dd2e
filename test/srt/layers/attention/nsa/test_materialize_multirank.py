"""The sharded read path on N spawned gloo ranks gives exactly what the replicated pool gives.

Each rank runs the tiny DSA stack twice over the same chunked-prefill stream (requests with shared
prefixes; current-only, mixed and history batches): once over a replicated pool, once over its share
of a pool sharded across the CP group, read through the materialized view and current-reuse. Top-k
positions, attention outputs and LSE must be ``torch.equal`` layer by layer, and the counters must be
what the host lengths predict. Some runs build their views in pipeline chunks (the gather of one chunk
overlapping the all-gather of the previous one on GPU; in order on gloo). A second check builds views
of random pool contents and compares every page position with the replicated pool directly.
"""

import os

import pytest
import torch

from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.reference.dsa_stack import (
    RequestSpec,
    StackConfig,
    first_mismatch,
    page_table_from_pages,
    run_chunked_prefill,
    schedule_chunked_prefill,
)
from sglang_cp_shared_kv.reference.read_path import ReadPath, pack_index_records
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import PIPELINE_CHUNK_TOKENS_ENV
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    pages_for_lens,
    pipeline_chunks,
    predicted_view_pages,
    slots_per_rank,
)
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES, mla_row_bytes
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


CONFIG = StackConfig(num_layers=2, hidden=64, heads=16, index_heads=4, topk=32)


def stream(ps: int) -> tuple[list[RequestSpec], int]:
    """Batch 0 current-only (two fresh requests), batch 1 mixed (a shared-prefix request beside a
    fresh one), batch 2 history (the rest of a chunked request)."""
    requests = [
        RequestSpec(5 * ps // 2),
        RequestSpec(3 * ps // 2),
        RequestSpec(13 * ps // 4, prefix_from=0, prefix_len=2 * ps),
        RequestSpec(4 * ps),
    ]
    return requests, 4 * ps


def _rank_prefill(rank, world_size, ps, kv_format, current_reuse, prefetch, chunk_tokens):
    os.environ[PIPELINE_CHUNK_TOKENS_ENV] = str(chunk_tokens)  # read when the run builds its materializer
    requests, chunk = stream(ps)
    group = CPGroup()
    replicated = run_chunked_prefill(
        requests, chunk_size=chunk, page_size=ps, kv_format=kv_format, config=CONFIG, cp_size=world_size
    )
    sharded = run_chunked_prefill(
        requests,
        chunk_size=chunk,
        page_size=ps,
        kv_format=kv_format,
        config=CONFIG,
        group=group,
        current_reuse=current_reuse,
        prefetch=prefetch,
    )
    # The comparison means something only if history batches select keys stored on other ranks.
    history_reads = 0
    for res in sharded.batches:
        q_prefix = torch.cat([torch.full((e,), p) for p, e in zip(res.batch.prefix_lens, res.batch.extend_lens)])
        for out in res.layers:
            history_reads += int(((out.topk >= 0) & (out.topk < q_prefix.unsqueeze(1))).sum())
    return {
        "mismatch": first_mismatch(replicated, sharded),
        "counters": [res.counters for res in sharded.batches],
        "kinds": [res.batch.kind for res in sharded.batches],
        "history_reads": history_reads,
        "sparse": any(bool((out.topk >= 0).all(1).any()) for res in sharded.batches for out in res.layers),
        "finite_lse": all(bool(torch.isfinite(out.lse).all()) for res in replicated.batches for out in res.layers),
        "page_tables_equal": replicated.request_pages == sharded.request_pages,
    }


CASES = [
    # (N, page size, format, current_reuse, prefetch, pipeline chunk tokens; 0: one piece): every N,
    # page size and format appears at least once, and every N with pipeline chunks.
    (2, 64, "fp8", True, False, 0),
    (2, 16, "bf16", False, True, 24),  # current-only batch materialized too; blocks padded to 2 chunks
    (4, 64, "bf16", True, True, 0),
    (4, 16, "fp8", True, False, 16),
    (8, 16, "fp8", True, True, 16),
]


@pytest.mark.multirank
@pytest.mark.parametrize(("world_size", "ps", "kv_format", "current_reuse", "prefetch", "chunk_tokens"), CASES)
def test_sharded_prefill_equals_replicated(world_size, ps, kv_format, current_reuse, prefetch, chunk_tokens):
    per_rank = spawn_ranks(
        _rank_prefill, world_size, ps, kv_format, current_reuse, prefetch, chunk_tokens, timeout_s=300
    )
    requests, chunk = stream(ps)
    batches = schedule_chunked_prefill(requests, chunk)
    assert [b.kind for b in batches] == ["current", "mixed", "history"]
    pages = [pages_for_lens(b.seq_lens, ps) for b in batches]
    chunks = [pipeline_chunks(slots_per_rank(p, world_size), ps, chunk_tokens or None) for p in pages]
    assert (max(chunks) > 1) == bool(chunk_tokens)  # the chunked cases do pipeline
    page_bytes = ps * (mla_row_bytes(kv_format) + INDEX_TOKEN_BYTES)
    layers = CONFIG.num_layers
    for rank, got in enumerate(per_rank):
        assert got["mismatch"] is None, f"rank {rank}: {got['mismatch']}"
        assert got["page_tables_equal"] and got["finite_lse"] and got["sparse"]
        assert got["history_reads"] > 0
        assert got["kinds"] == ["current", "mixed", "history"]
        for batch, counters, p, k in zip(batches, got["counters"], pages, chunks):
            assert counters.kind == batch.kind and counters.layers == layers
            if batch.kind == "current" and current_reuse:
                assert counters.current_reuse_hits == layers
                assert counters.bytes_materialized == counters.pages_gathered == counters.bytes_received == 0
                continue
            # Exactly what the host lengths predict: N * S pages per layer, S = sum(ceil(pages_b / N))
            # rounded up to a multiple of the chunk count.
            s = predicted_view_pages(p, world_size, k) // world_size
            if k == 1:
                assert s == sum(_ceil(_ceil(n, ps), world_size) for n in batch.seq_lens)
            assert counters.current_reuse_hits == 0
            assert counters.view_pages == world_size * s
            assert counters.pages_gathered == layers * s
            assert counters.bytes_materialized == layers * world_size * s * page_bytes
            assert counters.bytes_received == layers * (world_size - 1) * s * page_bytes
    assert all(got["counters"] == per_rank[0]["counters"] for got in per_rank)


def _rank_views(rank, world_size, ps, kv_format, chunk_tokens):
    """Random pool contents, written through the masked store on every rank and into a replicated pool;
    every page position of a batch's view must hold the replicated pool's page."""
    group = CPGroup()
    g = torch.Generator().manual_seed(7)
    lens = [3 * ps + 5, ps, 6 * ps, ps // 2, 2 * ps + 1]
    own = PageOwnership(world_size, ps)
    alloc = BalancedPageAllocator(own, 2 + sum(-(-n // ps) for n in lens))
    pages = []
    for i, n in enumerate(lens):
        shared = pages[0][:2] if i == 2 else []  # request 2 shares request 0's first two pages
        first = alloc.next_owner(shared[-1]) if shared else i % world_size
        pages.append(shared + alloc.alloc(-(-n // ps) - len(shared), first).tolist())
    table = page_table_from_pages(pages)
    phys = alloc.phys_pages_per_rank
    sharded = ShardedMLAPool(own, rank, phys, 1, kv_format)
    replicated = ShardedMLAPool(PageOwnership(1, ps), 0, phys * world_size, 1, kv_format)
    locs = torch.arange(phys * world_size * ps)
    rows = torch.randint(0, 256, (len(locs), mla_row_bytes(kv_format)), dtype=torch.uint8, generator=g)
    k_u8 = torch.randint(0, 256, (len(locs), 128), dtype=torch.uint8, generator=g)
    scale = torch.rand(len(locs), generator=g)
    for pool in (sharded, replicated):
        pool.set_latent(0, locs, rows)
        pool.set_index(0, locs, k_u8, scale)
    mat = ReadPath(sharded, group, pipeline_chunk_tokens=chunk_tokens)
    counters = mat.begin_batch(table, lens, [1] * len(lens))
    view = mat.layer_view(0)
    bad = []
    for b, p in enumerate(pages):
        for j, lp in enumerate(p):
            slot = int(view.page_table[b, j])
            latent_ok = torch.equal(
                view.kv_rows[slot * ps : (slot + 1) * ps], replicated.latent[0][lp * ps : (lp + 1) * ps]
            )
            index_ok = torch.equal(view.index_pages[slot], replicated.index[0][lp])
            if not (latent_ok and index_ok):
                bad.append((b, j, lp, slot))
    # Token-level remap: position p of request b is row p of its pages in the view.
    pos = torch.tensor([[0, ps - 1, -1], [ps + 1, 0, 2], [5 * ps, -1, 3]], dtype=torch.int32)
    q_req = torch.tensor([0, 4, 2])
    view_rows = view.rows(pos, q_req)
    row_ok = all(
        torch.equal(view.kv_rows[int(vr)], rows[int(table[int(q), int(x) // ps]) * ps + int(x) % ps])
        for r, vrs, q in zip(pos, view_rows, q_req)
        for x, vr in zip(r, vrs)
        if x >= 0
    ) and bool((view_rows[pos < 0] == -1).all())
    return bad, row_ok, counters.view_pages, counters.bytes_materialized, mat.plan.chunks


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("world_size", "ps", "kv_format", "chunk_tokens", "chunks"),
    [(2, 16, "bf16", 0, 1), (2, 16, "fp8", 64, 2), (4, 64, "fp8", 0, 1), (4, 64, "bf16", 96, 4)],
)
def test_view_pages_equal_replicated_pages(world_size, ps, kv_format, chunk_tokens, chunks):
    lens = [3 * ps + 5, ps, 6 * ps, ps // 2, 2 * ps + 1]
    pages = pages_for_lens(lens, ps)
    view = predicted_view_pages(pages, world_size, chunks)
    if chunks == 1:
        assert view == world_size * sum(_ceil(p, world_size) for p in pages)
    for bad, row_ok, view_pages, nbytes, got_chunks in spawn_ranks(
        _rank_views, world_size, ps, kv_format, chunk_tokens, timeout_s=300
    ):
        assert bad == []
        assert row_ok
        assert got_chunks == chunks
        assert view_pages == view
        assert nbytes == view * ps * (mla_row_bytes(kv_format) + INDEX_TOKEN_BYTES)


def test_pack_index_records_is_the_page_size_one_layout():
    k = torch.randint(0, 256, (3, 128), dtype=torch.uint8)
    scale = torch.tensor([0.5, 2.0, 8.0])
    rec = pack_index_records(k, scale)
    assert rec.shape == (3, INDEX_TOKEN_BYTES)
    assert torch.equal(rec[:, :128], k) and torch.equal(rec[:, 128:].contiguous().view(torch.float32).view(-1), scale)
