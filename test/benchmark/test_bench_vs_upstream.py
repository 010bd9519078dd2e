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


ARGS = dict(device="cpu", scale="tiny", kv_format="fp8", page_size=64, paths=["stock", "ours"])


@pytest.fixture(scope="module")
def tiny_run():
    from benchmark.cp_shared_kv.bench_vs_upstream import _rank

    from sglang_cp_shared_kv.reference.spawn import spawn_ranks

    return spawn_ranks(_rank, 2, ARGS, timeout_s=600)


def test_tiny_workload_is_bit_exact_and_accounts_bytes(tiny_run):
    from benchmark.cp_shared_kv.bench_vs_upstream import SCALES, batch_kind, schedule, summarize

    per_rank = tiny_run
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


def test_a_piece_of_the_workload_measures_what_the_whole_run_measures_for_it(tiny_run, tmp_path, monkeypatch):
    """``--batches``: the batches before the range only written, the range read and checked as in the
    whole run (same kinds, bytes, bit-exactness); ``--merge`` of the whole run's first part and the
    piece gives every batch once and the whole run's summary."""
    import json

    from benchmark.cp_shared_kv import bench_common
    from benchmark.cp_shared_kv.bench_vs_upstream import SCALES, _rank, _write, main, schedule, summarize

    from sglang_cp_shared_kv.reference.spawn import spawn_ranks

    n = len(schedule(SCALES["tiny"], 64))
    first = n - 1  # the second turn's last two batches, the shared-prefix one among them
    piece = spawn_ranks(_rank, 2, dict(ARGS, batches=(first, n)), timeout_s=600)
    whole = tiny_run[0]["rows"]
    assert [r["batch"] for r in piece[0]["rows"]] == [first, n]
    assert all(res["correct_all"] for res in piece)
    keys = ("kind", "seq_tokens", "shared_prefix", "ours_bytes_received", "ours_current_chunk_bytes_gathered")
    for got, want in zip(piece[0]["rows"], whole[first - 1 :]):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}

    monkeypatch.setattr(bench_common, "RESULTS_DIR", tmp_path)
    env = dict(tiny_run[0]["env"], batches="all")
    head = [dict(r, scale="tiny") for r in whole[: first - 1]]
    tail = [dict(r, scale="tiny") for r in piece[0]["rows"]]
    _write("head", head, {"tiny": summarize(head, env, True)}, {"tiny": env}, True)
    _write("tail", tail, {"tiny": summarize(tail, env, True)}, {"tiny": env}, True)
    main(["--merge", "head", "tail", "--out", "joined"])
    joined = json.loads((tmp_path / "joined.json").read_text())
    assert [r["batch"] for r in joined["rows"]] == list(range(1, n + 1))
    assert joined["summary"]["correct_all"] is True
    assert joined["by_scale"]["tiny"] == summarize(joined["rows"], env, True)
    with pytest.raises(SystemExit, match="twice"):
        main(["--merge", "head", "head", "--out", "again"])


@pytest.mark.parametrize("text", ["5", "0:3", "4:2", "a:b", ":"])
def test_a_batch_range_is_first_colon_last_from_one(text):
    import argparse

    from benchmark.cp_shared_kv.bench_vs_upstream import _batch_range

    assert _batch_range("2:7") == (2, 7) and _batch_range("3:3") == (3, 3)
    with pytest.raises(argparse.ArgumentTypeError, match="FIRST:LAST"):
        _batch_range(text)
