"""The side-by-side harness on 2 gloo ranks, small: SGLang's own DSA backend (``init_forward_metadata``,
the indexer's pool calls, ``forward_extend`` with the ``flashmla_kv`` impl SGLang picks for an fp8 cache)
over SGLang's stock pool, SGLang's layer-split pool and ours, same batches (current, mixed, history, a
shared-prefix second turn); the timed forwards' outputs bit-identical across the pools; the bytes are
the ones the transports moved. (SGLang's page-interleave pool builds a NCCL communicator: its column
needs a GPU per rank.) Every path's pools write through ``reference.sglang_writers``' twins of SGLang's
per-token writers. Also the stand-ins' semantics against plain-torch references."""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.multirank,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="SGLang's pool writers need Triton"),
]


ARGS = dict(device="cpu", scale="tiny", kv_format="fp8", page_size=64, paths=["stock", "ours", "layersplit"])


def _rank(rank: int, world: int, args: dict) -> dict:
    """The harness's rank, every path's pools writing through the same plain-torch twins of SGLang's
    per-token KV writers (interpreted, they would be most of the run)."""
    from benchmark.cp_shared_kv import bench_vs_upstream

    from reference.sglang_writers import use_torch_writers

    use_torch_writers()
    return bench_vs_upstream._rank(rank, world, args)


@pytest.fixture(scope="module")
def tiny_run():
    from reference.spawn import spawn_ranks

    return spawn_ranks(_rank, 2, dict(ARGS, warmup=False), timeout_s=900)


def test_tiny_workload_through_sglangs_backend_is_bit_exact_and_counts_moved_bytes(tiny_run):
    from benchmark.cp_shared_kv.bench_vs_upstream import SCALES, batch_kind, schedule, summarize

    per_rank = tiny_run
    batches = schedule(SCALES["tiny"], 64)
    kinds = [r["kind"] for r in per_rank[0]["rows"]]
    assert kinds == [batch_kind(b) for b in batches] and {"current", "mixed", "history"} <= set(kinds)
    shared = [b for b in batches if {4, 5} <= {s for s, _, _ in b}]  # two requests continuing request 0
    assert len(shared) == 1 and shared[0][0][1] == shared[0][1][1] > 0
    env = per_rank[0]["env"]
    assert env["prefill_impl"] == "flashmla_kv"  # what SGLang picks on SM90 for an fp8 cache
    page_bytes, layers = 64 * (656 + 132), SCALES["tiny"].layers
    for rank, res in enumerate(per_rank):
        rows = res["rows"]
        # The timed forwards' attention outputs and index reads, digest for digest, against the stock pool's.
        assert res["correct_all"] and all(r["ours_correct"] and r["layersplit_correct"] for r in rows), rows
        for r, b in zip(rows, batches):
            # Our transport's own count: exactly the prefix pages (latent + indexer, one owner's block per
            # layer from the other rank); the current chunk staged locally. The shared-prefix turn: slot 5
            # reads request 0's prefix pages through slot 4's (the hint).
            dup = {5} if {4, 5} <= {s for s, _, _ in b} else set()
            block = sum(-(-(p // 64) // 2) for s, p, _ in b if s not in dup)
            assert r["ours_bytes_received"] == block * page_bytes * layers, (r, b)
            assert r["ours_current_chunk_bytes_gathered"] == 0, r
            # SGLang's layer split moves whole layers: the owner of the one layer (rank 0) receives nothing,
            # the other rank whole buffers whatever the batch (after the first, only the indexer's: its
            # remote copy of the latent layer is kept current by the writes).
            assert (r["layersplit_bytes_received"] > 0) == (rank == 1), r
        assert len({r["layersplit_bytes_received"] for r in rows[1:]}) == 1
        assert all(r[f"{p}_forward_host_syncs"] == 0 for r in rows for p in ARGS["paths"])
    summary = summarize(per_rank[0]["rows"], env, True)
    for key in (
        "ours_vs_stock_layer_time",
        "ours_vs_stock_read_time",
        "ours_vs_stock_layer_time_without_stand_ins",
        "ours_vs_layersplit_layer_time",
        "ours_plan_host_us",
        "ours_read_host_us_per_layer",
        "stock_read_host_us_per_layer",
        "host_syncs_ours_per_forward",
        "host_syncs_stock_per_forward",
    ):
        assert summary[key] is not None, key
    assert summary["correct_all"] and summary["current_chunk_bytes_gathered"] == 0
    # Ours minus stock per layer, in us, beside the ratio: the median batch's difference of the rows' layer times.
    diffs = sorted(r["ours_layer_time_us"] - r["stock_layer_time_us"] for r in per_rank[0]["rows"])
    assert summary["ours_minus_stock_layer_us_median_batch"] == round(diffs[len(diffs) // 2], 1)
    assert "bytes_ratio" not in summary  # no page-interleave column on CPU
    # Equal admission: our arena sized for SGLang's eight contexts, beside the default two.
    assert summary["ours_arena_bytes"] < summary["ours_arena_bytes_equal_admission"] < summary["upstream_scratch_bytes"]
    ops = {s["op"] for s in summary["stand_ins"]}
    assert {"deep_gemm.fp8_mqa_logits", "sgl_kernel.fast_topk_transform_fused"} <= ops
    assert all(s["us_per_forward_median"] > 0 for s in summary["stand_ins"])


def test_a_piece_of_the_workload_measures_what_the_whole_run_measures_for_it(tiny_run, tmp_path, monkeypatch):
    """``--batches``: the batches before the range only written, the range read and checked as in the
    whole run (same kinds, bytes, bit-exactness); ``--merge`` of the whole run's first part and the
    piece gives every batch once and the whole run's summary."""
    import json

    from benchmark.cp_shared_kv import bench_common
    from benchmark.cp_shared_kv.bench_vs_upstream import SCALES, _write, main, schedule, summarize

    from reference.spawn import spawn_ranks

    n = len(schedule(SCALES["tiny"], 64))
    piece = spawn_ranks(_rank, 2, dict(ARGS, paths=["stock", "ours"], batches=(n, n), warmup=False), timeout_s=900)
    whole = tiny_run[0]["rows"]
    assert [r["batch"] for r in piece[0]["rows"]] == [n]
    assert all(res["correct_all"] for res in piece)
    keys = ("kind", "seq_tokens", "shared_prefix", "ours_bytes_received", "ours_current_chunk_bytes_gathered")
    for got, want in zip(piece[0]["rows"], whole[n - 1 :]):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}

    monkeypatch.setattr(bench_common, "RESULTS_DIR", tmp_path)
    env = dict(tiny_run[0]["env"], batches="all")
    head = [dict(r, scale="tiny") for r in whole[: n - 1]]
    tail = [dict(r, scale="tiny") for r in whole[n - 1 :]]
    _write("head", head, {"tiny": summarize(head, env, True)}, {"tiny": env}, True)
    _write("tail", tail, {"tiny": summarize(tail, env, True)}, {"tiny": env}, True)
    main(["--merge", "head", "tail", "--out", "joined"])
    joined = json.loads((tmp_path / "joined.json").read_text())
    assert [r["batch"] for r in joined["rows"]] == list(range(1, n + 1))
    assert joined["summary"]["correct_all"] is True
    assert joined["by_scale"]["tiny"] == summarize(joined["rows"], env, True)
    with pytest.raises(SystemExit, match="twice"):
        main(["--merge", "head", "head", "--out", "again"])
    with pytest.raises(SystemExit, match="--host-passes must be at least 1"):
        main(["--host-passes", "0", "--merge", "head", "tail", "--out", "joined"])


@pytest.mark.parametrize("text", ["5", "0:3", "4:2", "a:b", ":"])
def test_a_batch_range_is_first_colon_last_from_one(text):
    import argparse

    from benchmark.cp_shared_kv.bench_vs_upstream import _batch_range

    assert _batch_range("2:7") == (2, 7) and _batch_range("3:3") == (3, 3)
    with pytest.raises(argparse.ArgumentTypeError, match="FIRST:LAST"):
        _batch_range(text)


def test_the_prefix90_workload_caches_every_prompt_and_continues_it():
    """Eight 100K prompts, 90K of each a cached prefix (only written), 10K new tokens per request in
    chunks, each batch admitted within our arena's prefix budget."""
    from benchmark.cp_shared_kv.bench_vs_upstream import SCALES, schedule, turn2_sources, written_only

    scale = SCALES["prefix90"]
    batches = schedule(scale, 64)
    cached = written_only(scale, batches)
    assert sum(n - p for b in batches[:cached] for _, p, n in b) == 8 * 92160
    turn2 = [x for b in batches[cached:] for x in b]
    assert {s for s, _, _ in turn2} == set(turn2_sources(scale)) and all(p >= 92160 for _, p, _ in turn2)
    assert sum(n - p for _, p, n in turn2) == 8 * 10240 and all(sum(n - p for _, p, n in b) <= 8192 for b in batches)


def test_the_stand_ins_compute_what_the_ops_they_replace_compute():
    """``fp8_mqa_logits`` on each request's span against the indexer's plain-torch score math (bf16
    per-head dots), and the fused top-k's positions and page-table mapping against a sort."""
    from benchmark.cp_shared_kv.vs_upstream_stand_ins import StandIns

    from reference.dsa_reference import _scores_f32

    g = torch.Generator().manual_seed(0)
    si = StandIns(torch.device("cpu"), logits_budget_bytes=1 << 16)
    si.spans = [(0, 3, 0, 40), (3, 5, 40, 9)]  # request 0: 3 queries over 40 keys; request 1: 2 over 9
    q = (torch.randn(5, 4, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(49, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    ks_ = torch.rand(49, generator=g) + 0.5
    w = torch.randn(5, 4, generator=g) / 4
    got = si.fp8_mqa_logits(q, (k, ks_), w, None, None)
    for q0, q1, k0, n in si.spans:
        keys = k[k0 : k0 + n].float().expand(q1 - q0, -1, -1)
        want = _scores_f32(q[q0:q1].float(), w[q0:q1], keys, ks_[k0 : k0 + n].expand(q1 - q0, -1))
        assert torch.allclose(got[q0:q1, k0 : k0 + n], want, rtol=3e-2, atol=1e-2)

    lengths = torch.tensor([38, 39, 40, 8, 9], dtype=torch.int32)
    table = torch.arange(100, 200, dtype=torch.int32).view(2, 50)
    scores = torch.randn(5, 49, generator=g)
    out = si.fast_topk_transform_fused(scores.clone(), lengths, table, torch.tensor([0, 3, 5]), 16, row_starts=None)
    for m, (b, start) in enumerate([(0, 0), (0, 0), (0, 0), (1, 40), (1, 40)]):
        n = int(lengths[m])
        want = torch.sort(-scores[m, start : start + n]).indices[:16] if n > 16 else torch.arange(n)
        assert sorted(out[m][out[m] >= 0].tolist()) == sorted(table[b, want].tolist()), m
        assert (out[m] >= 0).sum() == min(n, 16)


class _Calls:
    """A pool's call surface as the harness's probe wraps it, recording the order of calls."""

    def __init__(self, log: list):
        self.log = log

    def begin_shard_extend(self, *a):
        self.log.append("begin_shard_extend")

    def translate_loc_to_scratch(self, loc):
        self.log.append("translate_loc_to_scratch")
        return loc

    def get_key_buffer(self, layer):
        self.log.append("get_key_buffer")


@pytest.mark.parametrize("drain_plan", [False, True])
def test_host_pass_drains_before_reads_and_only_with_drain_plan_before_the_plans_calls(monkeypatch, drain_plan):
    import benchmark.cp_shared_kv.bench_vs_upstream as bench

    log: list = []
    monkeypatch.setattr(bench, "_drain", lambda device, poll: log.append("drain"))
    pool = _Calls(log)
    probe = bench._PoolProbe(pool, torch.device("cpu"))
    probe.active = probe.sync_each = True
    probe.drain_plan = drain_plan
    pool.begin_shard_extend()
    pool.translate_loc_to_scratch(torch.zeros(1))
    pool.get_key_buffer(0)
    plan = ["drain", "begin_shard_extend", "drain", "translate_loc_to_scratch"]
    expected = plan if drain_plan else plan[1::2]
    assert log == [*expected, "drain", "get_key_buffer"]
    assert set(probe.plan_calls) == {"begin_shard_extend", "translate_loc_to_scratch"}


def test_a_busy_host_pass_queues_work_after_each_drain_and_counts_calls_that_outlast_it(monkeypatch):
    import benchmark.cp_shared_kv.bench_vs_upstream as bench

    log: list = []

    class Done:
        """The event after the queued sleep: finished once the call after it has run twice."""

        def query(self):
            return log.count("get_key_buffer") > 1

    def occupy(device, cycles):
        log.append(f"occupy {cycles}")
        return Done()

    monkeypatch.setattr(bench, "_drain", lambda device, poll: log.append("drain"))
    monkeypatch.setattr(bench, "_occupy", occupy)
    pool = _Calls(log)
    probe = bench._PoolProbe(pool, torch.device("cpu"))
    probe.active = probe.sync_each = True
    probe.busy_cycles = bench.BUSY_CYCLES
    pool.begin_shard_extend()
    pool.translate_loc_to_scratch(torch.zeros(1))
    pool.get_key_buffer(0)
    pool.get_key_buffer(1)
    busy = f"occupy {bench.BUSY_CYCLES}"
    # The plan's calls run inside the metadata call, which the forward occupies: nothing queued before them.
    reads = ["drain", busy, "get_key_buffer"] * 2
    assert log == ["begin_shard_extend", "translate_loc_to_scratch", *reads]
    assert probe.busy_ended == 1  # the second read ended after its sleep: counted, so the run shows it
    probe.reset()
    assert probe.busy_ended == 0


def test_every_host_timer_target_names_a_callable_that_exists():
    """A renamed or inlined function must not drop silently out of ``--profile-host``'s table."""
    import importlib
    import inspect

    from benchmark.cp_shared_kv.bench_vs_upstream import HOST_TIMER_TARGETS

    missing = []
    for target in HOST_TIMER_TARGETS:
        module, _, path = target.partition(":")
        owner = importlib.import_module(module)
        for part in path.split("."):
            owner = inspect.getattr_static(owner, part, None)
        if owner is None:
            missing.append(target)
    assert not missing, missing
