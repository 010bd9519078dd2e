"""The decode CP step model computes what it times: its logits kernel equals the indexer's plain-torch
math, and rank 0's merged top-k equals the replicated top-k, until a peer's candidates go missing (CPU:
Triton's interpreter, FlashMLA's plain-torch reference, no pacing)."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the logits kernel is Triton")


def test_logits_kernel_equals_the_indexer_math():
    from benchmark.cp_shared_kv.decode_dcp_step import DecodeData, index_logits, index_logits_ref

    d = DecodeData(batch=2, context=200, cp_size=2, device="cpu")
    got = index_logits(d.q, d.w, d.k, d.k_scale, torch.empty(2, 200))
    torch.testing.assert_close(got, index_logits_ref(d.q, d.w, d.k, d.k_scale), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_merged_topk_is_the_replicated_one_until_a_peer_is_missing(cp_size):
    from benchmark.cp_shared_kv import rank_model_pacing as pacing
    from benchmark.cp_shared_kv.decode_dcp_step import DecodeData, ReplicatedStep, ShardedStep

    data = DecodeData(batch=2, context=4096, cp_size=cp_size, device="cpu")
    link = pacing.PacedLink(370.0, 0.0, 1e9, pacing.Spinner(torch.device("cpu")))
    rep, shard = ReplicatedStep(data), ShardedStep(data, link)
    rep()
    out = shard()
    assert out.shape == (2, 128, 512) and torch.isfinite(out).all()

    def sets(top):
        return [{t for t in row.tolist() if t >= 0} for row in top]

    assert sets(shard.top) == sets(rep.top)
    assert all(len(s) == 2048 for s in sets(shard.top))
    shard.peer_vals[0] = -torch.inf  # rank 1's candidates never arrive
    shard()
    assert sets(shard.top) != sets(rep.top)


def test_a_cell_reports_both_steps():
    from benchmark.cp_shared_kv import rank_model_pacing as pacing
    from benchmark.cp_shared_kv.decode_dcp_step import measure

    link = pacing.PacedLink(370.0, 0.0, 1e9, pacing.Spinner(torch.device("cpu")))
    row = measure(2, 4096, 4, link, "cpu", lambda fn: (fn(), 10.0)[1])  # every step "takes" 10 us here
    assert row["topk_equal"] and row["overhead_pct"] == 0.0 and row["replicated_us"] == 10.0
    assert row["merge_equal"] and row["merge_us"] == row["merge_sorting_us"] == 10.0
    kv = row["kv_bytes_per_rank"]
    assert kv["sharded"] * 4 == kv["replicated"]


def test_attention_over_owned_rows_first_equals_over_all_k():
    from benchmark.cp_shared_kv import rank_model_pacing as pacing
    from benchmark.cp_shared_kv.decode_dcp_step import DecodeData, ShardedStep, measure_owned_first

    link = pacing.PacedLink(370.0, 0.0, 1e9, pacing.Spinner(torch.device("cpu")))
    shard = ShardedStep(DecodeData(batch=2, context=4096, cp_size=4, device="cpu"), link)
    row = measure_owned_first(shard, lambda fn: (fn(), 10.0)[1])
    assert row["attn_us"] == row["attn_owned_first_us"] == 10.0 and row["owned_first_max_diff"] < 1e-2, row


def test_owned_rows_first_keep_their_order_and_count():
    from benchmark.cp_shared_kv.decode_dcp_step import owned_first

    rows = torch.tensor([[[5, -1, 7, -1, 2]], [[-1, -1, -1, -1, -1]], [[1, 2, 3, 4, 0]]], dtype=torch.int32)
    first, count = owned_first(rows)
    assert first[:, 0].tolist() == [[5, 7, 2, -1, -1], [-1] * 5, [1, 2, 3, 4, 0]] and count.tolist() == [3, 0, 5]
