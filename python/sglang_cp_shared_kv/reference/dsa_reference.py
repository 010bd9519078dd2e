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

from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_HEAD_DIM, decode_mla_rows


def read_index_k(index_pages: torch.Tensor, page_size: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetch fp8 K bytes and fp32 scales of token ``rows`` (``page * ps + offset``) from page-major indexer pages."""
    page, offset = rows // page_size, rows % page_size
    k_part = index_pages[:, : page_size * INDEX_HEAD_DIM].unflatten(1, (page_size, INDEX_HEAD_DIM))
    scale_part = index_pages[:, page_size * INDEX_HEAD_DIM :].view(torch.float32)
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


def indexer_scores(
    q_u8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor, k_u8: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """``q_u8 [T, H, 128]``, ``k_u8 [T, L, 128]`` (per query its keys) -> fp32 scores ``[T, L]``."""
    q = q_u8.view(torch.float8_e4m3fn).float()
    k = k_u8.view(torch.float8_e4m3fn).float()
    logits = torch.einsum("thd,tld->thl", q, k).relu()
    w = weights.float() * q_scale.float() * INDEX_HEAD_DIM**-0.5
    return torch.einsum("thl,th->tl", logits, w) * k_scale.float()


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
) -> torch.Tensor:
    """Top-k visible key positions per query token: int32 ``[T, topk]``, -1 padded.

    Causal: query at position ``p`` sees keys ``0 .. p``. Order is total: score
    descending, then position ascending, so the result does not depend on the
    kernel's tie handling.
    """
    t = q_u8.shape[0]
    max_len = max(kv_lens) if kv_lens else 0
    pos = torch.arange(max_len, device=q_u8.device).expand(t, max_len)
    # Invisible positions read the query's own row instead: every read stays inside its request's pages.
    visible = pos <= q_pos.long().unsqueeze(-1)
    rows = positions_to_rows(torch.minimum(pos, q_pos.long().unsqueeze(-1)), q_req, page_table, page_size)
    k_u8, k_scale = read_index_k(index_pages, page_size, rows)
    scores = indexer_scores(q_u8, q_scale, weights, k_u8, k_scale)
    scores = torch.where(visible, scores, torch.full_like(scores, -math.inf))
    # Stable sort by descending score keeps ascending position among ties.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk].to(torch.int32)
    n_visible = (q_pos.long() + 1).clamp(max=topk)
    keep = torch.arange(order.shape[1], device=order.device) < n_visible.unsqueeze(-1)
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q_u8.device)
    out[:, : order.shape[1]] = torch.where(keep, order, torch.full_like(order, -1))
    return out


def sparse_mla(
    q: torch.Tensor, kv_rows_u8: torch.Tensor, kv_format: str, rows: torch.Tensor, sm_scale: float, d_v: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over raw KV rows: ``q [T, H, 576]``, ``rows [T, K]`` (-1 invalid).

    Returns ``out [T, H, d_v]`` and natural-log ``lse [T, H]`` in fp32; a query
    with no valid key gets ``out = 0`` and ``lse = -inf``.
    """
    valid = rows >= 0
    safe = torch.where(valid, rows, torch.zeros_like(rows)).long()
    kv = decode_mla_rows(kv_rows_u8[safe.reshape(-1)], kv_format).reshape(*safe.shape, -1)  # [T, K, 576]
    logits = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    logits = torch.where(valid.unsqueeze(1), logits, torch.full_like(logits, -math.inf))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.einsum("thk,tkd->thd", probs, kv[..., :d_v])
    return out, lse
