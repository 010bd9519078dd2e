"""The side-by-side harness on 2 gloo ranks, small: SGLang's stock DSA pool and ours through SGLang's
own classes, same batches (current, mixed, history, a shared-prefix second turn), bit-identical reads,
top-k and sparse attention; the bytes and memory it reports are the ones the read path moved and held.
(SGLang's page-interleave pool builds a NCCL communicator: its column needs GPUs.)"""

import os

import pytest

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.multirank,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="SGLang's pool writers need Triton"),
]


def test_tiny_workload_is_bit_exact_and_accounts_bytes():
    from benchmark.cp_shared_kv.bench_vs_upstream import SCALES, _rank, batch_kind, schedule, summarize

    from sglang_cp_shared_kv.reference.spawn import spawn_ranks

    args = dict(device="cpu", scale="tiny", kv_format="fp8", page_size=64, paths=["stock", "ours"])
    per_rank = spawn_ranks(_rank, 2, args, timeout_s=600)
    batches = schedule(SCALES["tiny"], 64)
    kinds = [r["kind"] for r in per_rank[0]["rows"]]
    assert kinds == [batch_kind(b) for b in batches] and {"current", "mixed", "history"} <= set(kinds)
    shared = [b for b in batches if {4, 5} <= {s for s, _, _ in b}]  # two requests continuing request 0
    assert len(shared) == 1 and shared[0][0][1] == shared[0][1][1] > 0
    for res in per_rank:
        assert res["correct_all"], [r.get("ours_mismatch") for r in res["rows"]]
        rows = res["rows"]
        # current-reuse gathers nothing; every batch with a prefix receives pages from the other rank
        assert [r["ours_bytes_received"] == 0 for r in rows] == [k == "current" for k in kinds]
        # Every batch's views and staged pages fit the arena attached at start-up.
        assert all(0 < r["ours_peak_view_bytes"] <= res["env"]["ours_arena_bytes"] for r in rows)
        # Exactly the prefix pages (latent + indexer, one owner's block per layer from the other
        # rank), the current chunk staged locally: what SGLang's page-interleave pool receives
        # for these batches, less its cross-request dedup of shared prefix pages.
        page_bytes, layers = 64 * (656 + 132), SCALES["tiny"].layers
        for r, b in zip(rows, batches):
            # The shared-prefix turn: slot 5 reads request 0's prefix pages through slot 4's slots (the hint).
            shared = {5: 4} if {4, 5} <= {s for s, _, _ in b} else {}
            block = sum(-(-(p // 64) // 2) for s, p, _ in b if s not in shared)
            assert r["ours_bytes_received"] == block * page_bytes * layers, (r, b)
            assert r["ours_current_chunk_bytes_gathered"] == 0, r
    summary = summarize(per_rank[0]["rows"], per_rank[0]["env"], True)
    assert summary["correct_all"] and "bytes_ratio" not in summary  # no upstream column on CPU
    assert summary["current_chunk_bytes_gathered"] == 0
