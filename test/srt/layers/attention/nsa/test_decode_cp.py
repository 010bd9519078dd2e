"""Decode CP over a sharded DSA cache (``decode_cp``) on gloo ranks, against the replicated oracles.

Each rank holds the indexer keys and latent rows of the positions on its pages (a request's pages
rotate owners from a base of its own, as the allocator draws them). Per query row the ranks' global
top-k equals the replicated indexer's (``reference.dsa_reference``: same positions, same order, ties
included: keys repeated across pages score the same), and sparse MLA over each rank's own selected
rows, merged by LSE, equals sparse MLA over the replicated rows within fp32 rounding. A short request
leaves some ranks with nothing selected (``lse = -inf``).
"""

from __future__ import annotations

import pytest
import torch

PS, TOPK, HEADS, INDEX_HEADS = 4, 16, 4, 2
LENS = [61, 38, 6]  # tokens per request; the last is shorter than TOPK
SM_SCALE = 576**-0.5


def _batch(seed: int, cp_size: int) -> dict:
    """The same batch on every rank: per request its tokens' index keys and latent rows, its owners."""
    from reference.kv_formats import encode_mla_rows, quantize_index_k

    g = torch.Generator().manual_seed(seed)
    longest = max(LENS)
    k = torch.randn(len(LENS), longest, 128, generator=g)
    k[:, 20:24] = k[:, 4:8]  # a page of keys repeated: equal scores, the tie rule decides
    index_k, index_scale = quantize_index_k(k.reshape(-1, 128))
    latent = encode_mla_rows(
        torch.randn(len(LENS) * longest, 512, generator=g), torch.randn(len(LENS) * longest, 64, generator=g), "bf16"
    )
    bases = torch.randint(0, cp_size, (len(LENS),), generator=g)
    owner = (bases.unsqueeze(1) + torch.arange(longest) // PS) % cp_size  # [B, P]
    # Query rows: each request's decode step, and one earlier position of the first (causal masking).
    q_req = torch.tensor([0, 1, 2, 0])
    q_pos = torch.tensor([LENS[0] - 1, LENS[1] - 1, LENS[2] - 1, 25])
    q_index = torch.randn(len(q_req), INDEX_HEADS, 128, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
    return {
        "index_k": index_k.view(len(LENS), longest, 128),
        "index_scale": index_scale.view(len(LENS), longest),
        "latent": latent.view(len(LENS), longest, -1),
        "owner": owner,
        "q_req": q_req,
        "q_pos": q_pos,
        "q_index": q_index,
        "q_scale": torch.rand(len(q_req), INDEX_HEADS, generator=g) + 0.5,
        "weights": torch.randn(len(q_req), INDEX_HEADS, generator=g),
        "q": torch.randn(len(q_req), HEADS, 576, generator=g),
    }


def _scores(b: dict) -> torch.Tensor:
    """fp32 ``[R, P]``: every query row's indexer score of every position of its request, -inf past it."""
    from reference.dsa_reference import indexer_scores

    k, scale = b["index_k"][b["q_req"]], b["index_scale"][b["q_req"]]
    scores = indexer_scores(b["q_index"], b["q_scale"], b["weights"], k, scale)
    return torch.where(torch.arange(k.shape[1]) <= b["q_pos"].unsqueeze(1), scores, -torch.inf)


def _replicated(b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The replicated indexer's top-k (``indexer_topk``'s rule) and sparse MLA over every row."""
    from reference.dsa_reference import _top_positions, sparse_mla

    scores = _scores(b)
    width = min(TOPK, scores.shape[1])
    top = torch.full((scores.shape[0], TOPK), -1, dtype=torch.int64)
    top[:, :width] = _top_positions(scores, width).long()
    visible = (b["q_pos"] + 1).clamp(max=TOPK).unsqueeze(1)
    top = torch.where(torch.arange(TOPK) < visible, top, -1)
    longest = scores.shape[1]
    rows = torch.where(top < 0, -1, b["q_req"].unsqueeze(1) * longest + top)
    out, lse = sparse_mla(b["q"], b["latent"].reshape(-1, b["latent"].shape[-1]), "bf16", rows, SM_SCALE)
    return top, out, lse


def _rank(rank: int, cp_size: int, seed: int) -> dict:
    from reference.dsa_reference import sparse_mla
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import global_topk, merge_by_lse, owned_rows

    group = CPGroup()
    b = _batch(seed, cp_size)
    want_top, want_out, want_lse = _replicated(b)
    # This rank's share: the rows of the positions it owns, in a compact buffer of its own.
    mine = b["owner"] == rank  # [B, P]
    local_latent = b["latent"][mine]
    row_of = torch.full(mine.shape, -1, dtype=torch.int64)
    row_of[mine] = torch.arange(int(mine.sum()))
    # Its candidates per query row: its positions only, compact (padded with empty ones).
    scores = _scores(b)
    owned = mine[b["q_req"]]
    width = int(owned.sum(dim=1).max())
    positions = torch.full((len(b["q_req"]), width), -1, dtype=torch.int64)
    local_scores = torch.full((len(b["q_req"]), width), -torch.inf)
    for r in range(len(b["q_req"])):
        cols = owned[r].nonzero().flatten()
        positions[r, : len(cols)], local_scores[r, : len(cols)] = cols, scores[r, cols]
    top = global_topk(local_scores, positions, TOPK, group)

    rows = owned_rows(top, row_of[b["q_req"]])
    out, lse = sparse_mla(b["q"], local_latent, "bf16", rows, SM_SCALE)
    outs = torch.empty((cp_size * out.shape[0], *out.shape[1:]))
    lses = torch.empty((cp_size * lse.shape[0], *lse.shape[1:]))
    group.all_gather_into_many([outs, lses], [out, lse])
    merged, merged_lse = merge_by_lse(outs.view(cp_size, *out.shape), lses.view(cp_size, *lse.shape))
    return {
        "top_equal": bool(torch.equal(top, want_top)),
        "ties_selected": int((top == 20).sum() + (top == 4).sum()),
        "out_err": float((merged - want_out).abs().max()),
        "lse_err": float((merged_lse - want_lse).abs().max()),
        "empty_rows": int((lse == -torch.inf).all(dim=1).sum()),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_global_topk_and_lse_merge_equal_the_replicated_decode(cp_size):
    from reference.spawn import spawn_ranks

    results = spawn_ranks(_rank, cp_size, 5, timeout_s=300)
    for rank, res in enumerate(results):
        assert res["top_equal"], (rank, res)
        assert res["out_err"] < 1e-5 and res["lse_err"] < 1e-5, (rank, res)
    # The repeated keys reach the top-k somewhere, and some rank attends to nothing for some row.
    assert any(res["ties_selected"] for res in results), results
    assert cp_size == 2 or any(res["empty_rows"] for res in results), results


def test_ranked_topk_orders_by_score_then_position_and_pads():
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import merge_by_lse, ranked_topk

    scores = torch.tensor([[1.0, 3.0, 3.0, -torch.inf, -torch.inf, 2.0]])
    positions = torch.tensor([[9, 7, 2, 5, -1, 4]])  # 5 is not visible, -1 an empty candidate
    values, chosen = ranked_topk(scores, positions, 7)
    assert chosen.tolist() == [[2, 7, 4, 9, -1, -1, -1]], chosen
    assert values[0, :4].tolist() == [3.0, 3.0, 2.0, 1.0]
    assert ranked_topk(torch.tensor([[-0.0, 0.0, -1.0]]), torch.tensor([[8, 3, 1]]), 2)[1].tolist() == [[3, 8]]
    # No rank attended to the row: out 0, lse -inf (not NaN), whatever the outputs held.
    out, lse = merge_by_lse(torch.full((2, 1, 1, 3), torch.nan), torch.full((2, 1, 1), -torch.inf))
    assert out.tolist() == [[[0.0, 0.0, 0.0]]] and lse.tolist() == [[-torch.inf]]
    # FlashMLA's mark of a rank that attended to nothing (lse +inf) drops out of the merge as -inf does.
    out, lse = merge_by_lse(torch.tensor([[[[1.0, 2.0]]], [[[0.0, 0.0]]]]), torch.tensor([[[0.5]], [[torch.inf]]]))
    assert out.tolist() == [[[1.0, 2.0]]] and lse.tolist() == [[0.5]]


@pytest.mark.parametrize("seed", range(6))
def test_ranked_topk_equals_the_rule_by_sorting(seed):
    from reference.dsa_reference import ranked_topk_ref
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import ranked_topk

    g = torch.Generator().manual_seed(seed)
    rows, width, k = 5, 300, 64
    # Few distinct scores (ties everywhere), both zeros, negatives, invisible and empty candidates.
    levels = torch.tensor([-torch.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 7.25, 3e38])
    scores = levels[torch.randint(0, len(levels), (rows, width), generator=g)]
    positions = torch.randint(0, 2**31 - 1, (rows, width), generator=g)
    positions[torch.rand(rows, width, generator=g) < 0.1] = -1
    positions[0, :3] = torch.tensor([0, 2**31 - 2, 2**31 - 3])
    for kk in (k, width + 20):  # fewer candidates than k: padded
        values, chosen = ranked_topk(scores, positions, kk)
        want_values, want_chosen = ranked_topk_ref(scores, positions, kk)
        assert torch.equal(chosen, want_chosen) and torch.equal(values, want_values)
