"""The query-blocked DSA references give the bits of the whole-batch formulation, whatever the block size.

``_indexer_topk_whole`` and ``_sparse_mla_whole`` are the formulations before blocking (every query's
keys gathered and decoded at once, a full stable sort per row): the blocked functions must return
exactly their results, for blocks of one query, a few queries and the whole batch.
"""

import math

import pytest
import torch

from reference.dsa_reference import (
    indexer_scores,
    indexer_topk,
    positions_to_rows,
    query_block_size,
    read_index_k,
    sparse_mla,
)
from reference.kv_formats import decode_mla_rows, encode_mla_rows, quantize_index_k
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES


def _indexer_topk_whole(q_u8, q_scale, weights, q_req, q_pos, index_pages, page_table, kv_lens, page_size, topk):
    t = q_u8.shape[0]
    max_len = max(kv_lens) if kv_lens else 0
    pos = torch.arange(max_len).expand(t, max_len)
    visible = pos <= q_pos.long().unsqueeze(-1)
    rows = positions_to_rows(torch.minimum(pos, q_pos.long().unsqueeze(-1)), q_req, page_table, page_size)
    k_u8, k_scale = read_index_k(index_pages, page_size, rows)
    scores = indexer_scores(q_u8, q_scale, weights, k_u8, k_scale)
    scores = torch.where(visible, scores, torch.full_like(scores, -math.inf))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk].to(torch.int32)
    n_visible = (q_pos.long() + 1).clamp(max=topk)
    keep = torch.arange(order.shape[1]) < n_visible.unsqueeze(-1)
    out = torch.full((t, topk), -1, dtype=torch.int32)
    out[:, : order.shape[1]] = torch.where(keep, order, torch.full_like(order, -1))
    return out


def _sparse_mla_whole(q, kv_rows_u8, kv_format, rows, sm_scale, d_v=512):
    valid = rows >= 0
    safe = torch.where(valid, rows, torch.zeros_like(rows)).long()
    kv = decode_mla_rows(kv_rows_u8[safe.reshape(-1)], kv_format).reshape(*safe.shape, -1)
    logits = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    logits = torch.where(valid.unsqueeze(1), logits, torch.full_like(logits, -math.inf))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.einsum("thk,tkd->thd", probs, kv[..., :d_v]), lse


def _index_pages(k_u8, scale, page_size):
    n_pages = k_u8.shape[0] // page_size
    pages = torch.zeros(n_pages, page_size * INDEX_TOKEN_BYTES, dtype=torch.uint8)
    pages[:, : page_size * 128] = k_u8.reshape(n_pages, -1)
    pages[:, page_size * 128 :] = scale.reshape(n_pages, page_size).contiguous().view(torch.uint8)
    return pages


def _batch(lens, extend, ps, heads, seed, tied_keys=False):
    """Requests of ``lens`` tokens on shuffled pages, each computing its last ``extend[b]`` tokens."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // ps) for n in lens) + 2
    k = torch.randn(n_pages * ps, 128, generator=g)
    if tied_keys:  # few distinct keys: many equal scores, and whole rows of ties
        k = k[torch.randint(0, 3, (k.shape[0],), generator=g)]
    k_u8, k_scale = quantize_index_k(k)
    pages = _index_pages(k_u8, k_scale, ps)
    perm = torch.randperm(n_pages, generator=g)
    table = torch.zeros(len(lens), max(-(-n // ps) for n in lens), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        table[b, : -(-n // ps)] = perm[used : used + -(-n // ps)].int()
        used += -(-n // ps)
    q_req = torch.cat([torch.full((e,), b) for b, e in enumerate(extend)])
    q_pos = torch.cat([torch.arange(n - e, n) for n, e in zip(lens, extend)])
    t = q_req.numel()
    q_u8, q_scale = quantize_index_k(torch.randn(t * heads, 128, generator=g))
    weights = torch.randn(t, heads, generator=g)
    if tied_keys:
        weights = weights.abs()
    return q_u8.view(t, heads, 128), q_scale.view(t, heads), weights, q_req, q_pos, pages, table


@pytest.mark.parametrize("tied_keys", [False, True])
@pytest.mark.parametrize("block_bytes", [1, 20_000, 1 << 40])
def test_indexer_topk_blocks_equal_the_whole_batch(block_bytes, tied_keys):
    ps, topk, lens, extend = 16, 32, [700, 40, 1025, 5], [100, 40, 57, 5]
    q_u8, q_scale, w, q_req, q_pos, pages, table = _batch(lens, extend, ps, 4, 3, tied_keys)
    want = _indexer_topk_whole(q_u8, q_scale, w, q_req, q_pos, pages, table, lens, ps, topk)
    got = indexer_topk(q_u8, q_scale, w, q_req, q_pos, pages, table, lens, ps, topk, block_bytes=block_bytes)
    assert torch.equal(got, want)
    assert (got[q_pos < topk - 1] == -1).any()  # short prefixes: -1 padding is covered


def test_indexer_topk_topk_wider_than_the_keys_and_empty_batches():
    ps, lens, extend = 4, [6, 3], [6, 2]
    q_u8, q_scale, w, q_req, q_pos, pages, table = _batch(lens, extend, ps, 2, 5)
    want = _indexer_topk_whole(q_u8, q_scale, w, q_req, q_pos, pages, table, lens, ps, 9)
    assert torch.equal(indexer_topk(q_u8, q_scale, w, q_req, q_pos, pages, table, lens, ps, 9, block_bytes=1), want)
    empty = indexer_topk(q_u8[:0], q_scale[:0], w[:0], q_req[:0], q_pos[:0], pages, table, lens, ps, 9)
    assert empty.shape == (0, 9)


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
@pytest.mark.parametrize("block_bytes", [1, 300_000, 1 << 40])
def test_sparse_mla_blocks_equal_the_whole_batch(kv_format, block_bytes):
    g = torch.Generator().manual_seed(1)
    rows_u8 = encode_mla_rows(torch.randn(300, 512, generator=g), torch.randn(300, 64, generator=g), kv_format)
    q = torch.randn(37, 8, 576, generator=g).to(torch.bfloat16)
    rows = torch.randint(-1, 300, (37, 16), generator=g)
    rows[4] = -1  # a query with no valid key: out 0, lse -inf
    want_out, want_lse = _sparse_mla_whole(q, rows_u8, kv_format, rows, 0.07)
    out, lse = sparse_mla(q, rows_u8, kv_format, rows, 0.07, block_bytes=block_bytes)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert lse[4].isneginf().all()


def test_query_block_size_bounds_and_rejects_bad_budgets():
    assert query_block_size(10, 100) == 10
    assert query_block_size(1000, 100) == 1  # one query per block at least
    with pytest.raises(ValueError, match="block_bytes must be >= 1"):
        query_block_size(10, 0)
