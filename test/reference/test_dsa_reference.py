"""The plain-torch DSA operators against loop-by-loop float64 recomputations."""

import math

import pytest
import torch

from reference.dsa_reference import (
    indexer_topk,
    positions_to_rows,
    read_index_k,
    sparse_mla,
)
from reference.kv_formats import decode_mla_rows, encode_mla_rows, quantize_index_k
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES


def _index_pages(k_u8, scale, page_size):
    n_pages = k_u8.shape[0] // page_size
    pages = torch.zeros(n_pages, page_size * INDEX_TOKEN_BYTES, dtype=torch.uint8)
    pages[:, : page_size * 128] = k_u8.reshape(n_pages, -1)
    pages[:, page_size * 128 :] = scale.reshape(n_pages, page_size).contiguous().view(torch.uint8)
    return pages


def test_read_index_k_and_positions_to_rows():
    ps = 4
    k_u8, scale = quantize_index_k(torch.randn(12, 128))
    pages = _index_pages(k_u8, scale, ps)
    rows = torch.tensor([[0, 5], [11, 7]])
    k, s = read_index_k(pages, ps, rows)
    assert torch.equal(k, k_u8[rows]) and torch.equal(s, scale[rows])
    table = torch.tensor([[2, 0], [1, 2]])
    pos = torch.tensor([[0, 5, -1], [3, 4, 7]])
    got = positions_to_rows(pos, torch.tensor([0, 1]), table, ps)
    assert got.tolist() == [[8, 1, -1], [7, 8, 11]]


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_sparse_mla_matches_loop(kv_format):
    torch.manual_seed(0)
    t, h, r = 3, 2, 20
    rows_u8 = encode_mla_rows(torch.randn(r, 512), torch.randn(r, 64), kv_format)
    q = torch.randn(t, h, 576).to(torch.bfloat16)
    idx = torch.tensor([[0, 3, 7, -1, 19], [-1, -1, -1, -1, -1], [4, 4, 2, 1, 0]])
    scale = 576**-0.5
    out, lse = sparse_mla(q, rows_u8, kv_format, idx, scale)
    kv = decode_mla_rows(rows_u8, kv_format).double()
    for ti in range(t):
        sel = [i for i in idx[ti].tolist() if i >= 0]
        for hi in range(h):
            if not sel:
                assert lse[ti, hi] == -math.inf and torch.all(out[ti, hi] == 0)
                continue
            logits = torch.stack([q[ti, hi].double() @ kv[i] for i in sel]) * scale
            ref_lse = torch.logsumexp(logits, 0)
            ref = sum(torch.exp(lg - ref_lse) * kv[i, :512] for lg, i in zip(logits, sel))
            assert torch.allclose(lse[ti, hi].double(), ref_lse, atol=1e-4)
            assert torch.allclose(out[ti, hi].double(), ref, atol=1e-3)


def test_sparse_mla_never_lets_an_unwritten_row_0_reach_the_output():
    """An invalid slot must not read row 0's bytes into the result: a view's row 0 may hold NaN bits."""
    torch.manual_seed(1)
    rows_u8 = encode_mla_rows(torch.randn(8, 512), torch.randn(8, 64), "bf16")
    poisoned = rows_u8.clone()
    poisoned[0] = 0xFF  # bf16 NaN bits everywhere in row 0
    q = torch.randn(2, 2, 576).to(torch.bfloat16)
    idx = torch.tensor([[3, -1, 5], [-1, -1, -1]])
    out, lse = sparse_mla(q, poisoned, "bf16", idx, 576**-0.5)
    clean_out, clean_lse = sparse_mla(q, rows_u8, "bf16", idx, 576**-0.5)
    assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)
    assert not out.isnan().any()


def test_indexer_topk_matches_loop_and_breaks_ties_by_position():
    torch.manual_seed(1)
    ps, h, topk = 4, 3, 5
    length = 11
    k = torch.randn(length, 128)
    k[6] = k[2]  # identical keys: equal scores, position 2 must come first
    k_u8, k_scale = quantize_index_k(k)
    pages = _index_pages(
        torch.cat([k_u8, torch.zeros(1, 128, dtype=torch.uint8)]), torch.cat([k_scale, torch.ones(1)]), ps
    )
    table = torch.tensor([[0, 1, 2]])
    q_u8, q_scale = quantize_index_k(torch.randn(length * h, 128))
    q_u8, q_scale = q_u8.reshape(length, h, 128), q_scale.reshape(length, h)
    weights = torch.randn(length, h)
    q_pos = torch.arange(length)
    got = indexer_topk(
        q_u8, q_scale, weights, torch.zeros(length, dtype=torch.long), q_pos, pages, table, [length], ps, topk
    )
    qf = q_u8.view(torch.float8_e4m3fn).double()
    kf = k_u8.view(torch.float8_e4m3fn).double()
    for t in range(length):
        scores = []
        for s in range(t + 1):
            w = weights[t].double() * q_scale[t].double() * 128**-0.5
            scores.append(((qf[t] @ kf[s]).relu() * w).sum().item() * k_scale[s].item())
        order = sorted(range(t + 1), key=lambda s: (-scores[s], s))[:topk]
        want = order + [-1] * (topk - len(order))
        assert got[t].tolist() == want, t
