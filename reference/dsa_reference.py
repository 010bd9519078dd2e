"""Plain-torch DSA operators: the lightning indexer's top-k and sparse MLA.

They stand in for the production kernels (DeepGEMM paged logits, FlashMLA
sparse attention) on CPU, and serve as the references the fast paths are
checked against. Both read raw pool bytes through a page table, so the same
function runs over a replicated pool (page table = logical pages), over a
materialized view (page table = slot table) or over the current chunk
(compact rows): equal bytes in equal order give bit-identical results.

Math and byte formats: DSA indexer ``I[t, s] = (sum_h relu(q[t,h] . k[s]) *
w[t,h] * q_scale[t,h] * 128^-0.5) * k_scale[s]`` with fp8 e4m3 q and k; sparse
MLA in absorbed form, 576-dim q/k, ``d_v = 512``, natural-log LSE.
"""

from __future__ import annotations

import math

import torch

from reference.kv_formats import decode_mla_rows, index_page_views
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_HEAD_DIM, LATENT_DIM


def read_index_k(index_pages: torch.Tensor, page_size: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetch fp8 K bytes and fp32 scales of token ``rows`` (``page * ps + offset``) from page-major indexer pages."""
    page, offset = rows // page_size, rows % page_size
    k_part, scale_part = index_page_views(index_pages, page_size)
    return k_part[page, offset], scale_part[page, offset]


def positions_to_rows(
    positions: torch.Tensor, q_req: torch.Tensor, page_table: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Token positions within each query's request -> rows through ``page_table``; -1 stays -1."""
    valid = positions >= 0
    pos = torch.where(valid, positions, torch.zeros_like(positions)).long()
    pages = page_table[q_req.long().unsqueeze(-1).expand_as(pos), pos // page_size].long()
    rows = pages * page_size + pos % page_size
    return torch.where(valid, rows, torch.full_like(rows, -1))


# Working memory of one block of queries in ``indexer_topk`` and ``sparse_mla``. Both compute each query on
# its own (per-query batched matmuls, per-row top-k and logsumexp), so any split over queries gives the
# same bits; the split keeps their temporaries bounded by this many bytes instead of growing with
# chunk x context.
QUERY_BLOCK_BYTES = 8 << 20


def query_block_size(bytes_per_query: int, block_bytes: int = QUERY_BLOCK_BYTES) -> int:
    """How many queries one block holds when each needs ``bytes_per_query`` of temporaries (at least 1)."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes!r}")
    return max(1, block_bytes // max(1, bytes_per_query))


def indexer_scores(
    q_u8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor, k_u8: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """``q_u8 [T, H, 128]``, ``k_u8 [T, L, 128]`` (per query its keys) -> fp32 scores ``[T, L]``."""
    q = q_u8.view(torch.float8_e4m3fn).float()
    k = k_u8.view(torch.float8_e4m3fn).float()
    return _scores_f32(q, _query_weights(weights, q_scale), k, k_scale.float())


def _query_weights(weights: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    return weights.float() * q_scale.float() * INDEX_HEAD_DIM**-0.5


def _scores_f32(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """The indexer's score math on decoded operands: ``q [T, H, 128]``, ``w [T, H]``, ``k [T, L, 128]``, ``k_scale [T, L]``."""
    logits = torch.einsum("thd,tld->thl", q, k).relu()
    return torch.einsum("thl,th->tl", logits, w) * k_scale


def indexer_topk(
    q_u8: torch.Tensor,
    q_scale: torch.Tensor,
    weights: torch.Tensor,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    index_pages: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: list[int],
    page_size: int,
    topk: int,
    block_bytes: int = QUERY_BLOCK_BYTES,
) -> torch.Tensor:
    """Top-k visible key positions per query token: int32 ``[T, topk]``, -1 padded.

    Causal: query at position ``p`` sees keys ``0 .. p``. Order is total: score
    descending, then position ascending, so the result does not depend on the
    kernel's tie handling.

    Every key a query can see is read and decoded once (fp8 to fp32 is exact). Queries then run in
    blocks of one request's queries with at most ``block_bytes`` of temporaries, each scoring all
    ``max(kv_lens)`` positions against its request's keys (positions it cannot see score ``-inf``):
    per query the same matmul as scoring the whole batch at once, so the bits do not depend on the
    split, and no per-query copy of the keys is made.
    """
    t = q_u8.shape[0]
    device = q_u8.device
    max_len = max(kv_lens) if kv_lens else 0
    out = torch.full((t, topk), -1, dtype=torch.int32, device=device)
    if t == 0 or max_len == 0:
        return out
    q_req, q_pos = q_req.long(), q_pos.long()
    # Keys 0 .. (last query position) of each request, request after request: every row a query reads.
    last = torch.full((page_table.shape[0],), -1, dtype=torch.long, device=device)
    last = last.scatter_reduce(0, q_req, q_pos, "amax")
    n_keys = last + 1
    starts = torch.cumsum(n_keys, 0) - n_keys
    total = int(n_keys.sum())
    key_req = torch.repeat_interleave(torch.arange(len(n_keys), device=device), n_keys, output_size=total)
    key_pos = torch.arange(total, device=device) - starts[key_req]
    rows = positions_to_rows(key_pos.unsqueeze(-1), key_req, page_table, page_size).squeeze(-1)
    k_u8, k_scale = read_index_k(index_pages, page_size, rows)
    k = k_u8.view(torch.float8_e4m3fn).float()
    q = q_u8.view(torch.float8_e4m3fn).float()
    w = _query_weights(weights, q_scale)

    pos = torch.arange(max_len, device=device)
    width = min(topk, max_len)
    n_visible = (q_pos + 1).clamp(max=topk)
    keep_cols = torch.arange(width, device=device)
    # the H per-head logits, scores, sort keys and indices, per position
    per_query = max_len * (q_u8.shape[1] * 4 + 40)
    step = query_block_size(per_query, block_bytes)
    # Runs of consecutive queries of one request (request-major batches: one run per request).
    cuts = (torch.nonzero(q_req[1:] != q_req[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, t]
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        b = int(q_req[r0])
        first, n = int(starts[b]), int(n_keys[b])
        # The request's keys at positions 0 .. max_len - 1; past its last query they are never visible.
        req_k = torch.zeros(max_len, INDEX_HEAD_DIM, dtype=torch.float32, device=device)
        req_k[:n] = k[first : first + n]
        req_scale = torch.zeros(max_len, dtype=torch.float32, device=device)
        req_scale[:n] = k_scale[first : first + n]
        for s in range(r0, r1, step):
            e = min(r1, s + step)
            qp = q_pos[s:e].unsqueeze(-1)
            scores = _scores_f32(
                q[s:e], w[s:e], req_k.expand(e - s, max_len, INDEX_HEAD_DIM), req_scale.expand(e - s, max_len)
            )
            scores = torch.where(pos <= qp, scores, torch.full_like(scores, -math.inf))
            keep = keep_cols < n_visible[s:e].unsqueeze(-1)
            out[s:e, :width] = _top_positions(scores, width).masked_fill(~keep, -1)
    return out


def _top_positions(scores: torch.Tensor, width: int) -> torch.Tensor:
    """int32 ``[b, width]``: the first ``width`` positions of each row in descending score, ascending position.

    Equal to ``torch.sort(scores, descending=True, stable=True).indices[:, :width]`` without sorting whole
    rows: ``torch.topk`` finds each row's ``width``-th largest score, and only positions scoring at least
    that much (all of the answer, plus any ties) are sorted.
    """
    b = scores.shape[0]
    threshold = torch.topk(scores, width, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    cand = scores >= threshold
    r, c = cand.nonzero(as_tuple=True)  # row-major: ascending position within a row
    order = torch.sort(scores[r, c], descending=True, stable=True).indices  # ties keep ascending position
    order = order[torch.sort(r[order], stable=True).indices]  # rows together, each in the order above
    r, c = r[order], c[order]
    counts = cand.sum(dim=-1)
    rank = torch.arange(r.numel(), device=scores.device) - (torch.cumsum(counts, 0) - counts)[r]
    sel = rank < width
    top = torch.empty((b, width), dtype=torch.int32, device=scores.device)
    top[r[sel], rank[sel]] = c[sel].to(torch.int32)
    return top


def ranked_topk_ref(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_cp.ranked_topk`` by two stable sorts: fp32 and int64 ``[R, k]``, the ``k`` first of each row
    by score descending, position ascending (-1: an empty candidate, after every position of its score;
    a row of fewer than ``k`` is padded with empties, ``-inf`` and -1)."""
    key = torch.where(positions < 0, torch.iinfo(torch.int64).max, positions)
    by_position = torch.sort(key, dim=-1, stable=True).indices
    s, p = scores.gather(-1, by_position), positions.gather(-1, by_position)
    first = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    values = torch.nn.functional.pad(s.gather(-1, first), (0, k - first.shape[1]), value=-torch.inf)
    chosen = torch.nn.functional.pad(p.gather(-1, first), (0, k - first.shape[1]), value=-1)
    return values, torch.where(values == -torch.inf, -1, chosen)


def sparse_mla(
    q: torch.Tensor,
    kv_rows_u8: torch.Tensor,
    kv_format: str,
    rows: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    block_bytes: int = QUERY_BLOCK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over raw KV rows: ``q [T, H, 576]``, ``rows [T, K]`` (-1 invalid).

    Returns ``out [T, H, d_v]`` and natural-log ``lse [T, H]`` in fp32; a query
    with no valid key gets ``out = 0`` and ``lse = -inf``. Queries run in blocks of at most
    ``block_bytes`` of temporaries; each query's math is its own, so the split does not change bits.
    """
    t, k = rows.shape
    # decoded fp32 rows (and their row-format staging), per-head logits and probabilities
    per_query = k * (3 * LATENT_DIM * 4 + kv_rows_u8.shape[1] + 3 * q.shape[1] * 4 + 16)
    step = query_block_size(per_query, block_bytes)
    if t <= step:
        return _sparse_mla_block(q, kv_rows_u8, kv_format, rows, sm_scale, d_v)
    parts = [
        _sparse_mla_block(q[s : s + step], kv_rows_u8, kv_format, rows[s : s + step], sm_scale, d_v)
        for s in range(0, t, step)
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def flash_mla_sparse_fwd_ref(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, use_legacy=True):
    """SGLang's ``flash_mla_sparse_fwd`` (``flash_mla_interface``) by ``sparse_mla`` over a bf16 ``kv
    [rows, 1, 576]``: ``(out, None, lse)``, ``out`` in ``q``'s dtype, the LSE in base 2 as SGLang's wrapper
    returns the legacy kernel's; ``indices [T, 1, K]``, ``topk_length [T]`` the valid ones of each row."""
    if attn_sink is not None:
        raise NotImplementedError("sparse MLA with attention sinks has no reference")
    rows = indices[:, 0, :]
    if topk_length is not None:
        cols = torch.arange(rows.shape[1], device=rows.device)
        rows = torch.where(cols < topk_length.unsqueeze(-1), rows, torch.full_like(rows, -1))
    kv_rows = kv.reshape(kv.shape[0], -1).contiguous().view(torch.uint8)
    out, lse = sparse_mla(q, kv_rows, "bf16", rows, sm_scale, d_v)
    return out.to(q.dtype), None, lse * 1.4426950408889634  # log2(e)


def _sparse_mla_block(
    q: torch.Tensor, kv_rows_u8: torch.Tensor, kv_format: str, rows: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    valid = rows >= 0
    safe = torch.where(valid, rows, torch.zeros_like(rows)).long()
    kv = decode_mla_rows(kv_rows_u8[safe.reshape(-1)], kv_format).reshape(*safe.shape, -1)  # [T, K, 576]
    # An invalid slot reads row 0, which a view may never have written (NaN bits): zero it, or its
    # zero probability times NaN would reach the output. The kernels never read such a slot at all.
    kv = torch.where(valid.unsqueeze(-1), kv, torch.zeros_like(kv))
    logits = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    logits = torch.where(valid.unsqueeze(1), logits, torch.full_like(logits, -math.inf))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.einsum("thk,tkd->thd", probs, kv[..., :d_v])
    return out, lse
