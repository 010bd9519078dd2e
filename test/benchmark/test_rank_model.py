"""The rank model at CPU sizes: the pacing arithmetic, the sharded pools written with the real page
placement, both ways of pulling a view (the product's pull kernel and the copy pulls) giving exactly
the owners' pages, the pacing check against the 2-H200 figures, and a cell's JSON and its table."""

import json
import os

import pytest
import torch
from benchmark.cp_shared_kv import rank_model as rm
from benchmark.cp_shared_kv import rank_model_pacing as pacing

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="the product's kernels run interpreted on CPU"
    ),
]

CPU = torch.device("cpu")


def test_link_time_is_bytes_over_link():
    # CP 8 at 128K: 7 peers x 256 slots x 50432 B = 90.4 MB, 244 us at 370 GB/s (the figures).
    nbytes = 7 * 256 * rm.PAGE_BYTES
    assert nbytes == 90_374_144
    assert pacing.link_time_us(nbytes, 370.0) == pytest.approx(244.25, abs=0.01)
    assert pacing.link_time_us(nbytes, 50.0, latency_us=10.0) == pytest.approx(10.0 + 1807.48, abs=0.01)
    with pytest.raises(ValueError):
        pacing.link_time_us(1, 0.0)


def test_pads_make_each_piece_cost_its_link_time():
    # A piece copied locally at 2000 GB/s, then padded: local time + pad = link time.
    for nbytes in (1 << 20, 5_000_000):
        local = nbytes / (2000.0 * 1e3)
        assert local + pacing.pad_us(nbytes, 370.0, 2000.0) == pytest.approx(pacing.link_time_us(nbytes, 370.0))
    assert pacing.pad_us(1 << 20, 5000.0, 2000.0) == 0.0  # a link faster than the copy: no wait


def test_pieces_cover_the_pull_exactly():
    total = 90_374_144
    size = pacing.piece_size(total)
    assert size >= pacing.MIN_PIECE_BYTES and -(-total // size) <= pacing.MAX_PIECES
    spans = pacing.pieces(total, size)
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert pacing.piece_size(10) == pacing.MIN_PIECE_BYTES and pacing.pieces(0, 8) == []


@pytest.fixture(scope="module")
def pools():
    rm._publish(CPU, rm.Shapes.tiny(), 8192)
    # CP 4, 10 prefix pages (not a multiple of 4: two owners get a padding slot), 2 chunk pages, 2 layers.
    return rm.RankPools(4, 0, 10, 2, 2, CPU, seed=3)


def test_sharded_pools_hold_the_owners_pages(pools):
    for lp in pools.lp.tolist():
        owner, phys = lp % 4, lp // 4
        for layer in range(2):
            lat, idx = pools._sources(owner, layer)
            s_lat, s_idx = pools.stock_pages(layer)
            assert torch.equal(lat[phys], s_lat[lp]) and torch.equal(idx[phys], s_idx[lp])
    assert pools.s == 3 and pools.view_pages == 12
    assert pools.remote_bytes == 3 * 3 * rm.PAGE_BYTES and pools.own_bytes == 3 * rm.PAGE_BYTES
    # Padding slots read the trash page.
    assert sorted(pools.slot.tolist()) != list(range(12)) and int((pools.slot_phys == 0).sum()) == 2


def test_both_pulls_give_the_owners_pages(pools):
    pools.sm_pull(1, 0)  # the product's pull kernel over the four pools
    assert pools.view_matches(1, 0)
    assert not pools.view_matches(0, 0)  # another layer's pages differ: the check can fail
    link = pacing.PacedLink(370.0, 0.0, 1e3, pacing.Spinner(CPU))
    pools.own_gather(0, 1)
    moved = link.copy_pull(pools.peer_pairs(0, 1))
    assert moved == pools.remote_bytes
    assert pools.view_matches(0, 1)


def _row(n, prefix, tokens, ce_us, sm_us, nbytes):
    res = {
        "link_gbps": 370.0,
        "pull_modeled_us": 1.0,
        "ce_view_measured_us": ce_us,
        "sm_view_measured_us": sm_us,
        "stock_us": 1000.0,
        "inline": {"ours_us": 1010.0, "overhead_pct": 1.0},
        "prefetch": {"ours_us": 1001.0, "overhead_pct": 0.1},
    }
    return {"n": n, "prefix": prefix, "tokens": tokens, "pull_bytes": nbytes, "links": {"370": res}}


def test_pacing_check_against_two_h200s():
    ref = rm.TWO_H200
    good = [
        _row(2, p, 512, r["copy_engine_device_us"] * 1.1, r["nccl_device_us"] * 0.9, r["bytes_per_rank_sent"])
        for p, r in ref.items()
    ]
    check = rm.pacing_check(good)
    assert check["copy_engine_pass"] and check["sm_vs_nccl_pass"] and len(check["entries"]) == 3
    slow = [dict(r) for r in good]
    slow[1] = _row(2, 131072, 512, ref[131072]["copy_engine_device_us"] * 1.3, 1.0, ref[131072]["bytes_per_rank_sent"])
    assert not rm.pacing_check(slow)["copy_engine_pass"]
    other_bytes = [
        _row(2, p, 512, r["copy_engine_device_us"], r["nccl_device_us"], r["bytes_per_rank_sent"] + 1)
        for p, r in ref.items()
    ]
    assert not rm.pacing_check(other_bytes)["copy_engine_pass"]


def test_a_cell_json_and_its_table(tmp_path):
    out = tmp_path / "cell.json"
    args = ["--tiny", "--device", "cpu", "--n", "2", "--prefix", "512", "--tokens", "16", "--link-gbps", "370"]
    args += ["--layers", "1", "--rounds", "1", "--pool-layers", "2", "--out", str(out)]
    assert rm.main(args) == 0
    doc = json.loads(out.read_text())
    for key in ("command", "git_commit", "environment", "pacing", "stand_ins", "rows", "summary", "pacing_check"):
        assert key in doc, key
    for key in ("overhead_cp8_128k_1k_prefetch", "overhead_cp8_128k_1k_inline", "overhead_max_prefetch_2k_up"):
        assert key in doc["summary"]
    assert doc["summary"]["link_gbps"] == 370.0 and doc["summary"]["logits_stand_in_tflops"] is not None
    (row,) = doc["rows"]
    assert row["view_exact"] and row["pull_bytes"] == 4 * rm.PAGE_BYTES  # 8 pages, S 4, one peer
    res = row["links"]["370"]
    for key in ("stock_us", "pull_modeled_us", "ce_view_measured_us", "sm_view_measured_us"):
        assert res[key] >= 0, key
    for mode in ("inline", "prefetch"):
        assert {"ours_us", "overhead_pct", "exposed_us", "pull_us"} <= set(res[mode])
    cell = doc["startup_rule_inputs"]["cells"][0]
    assert cell["pull_modeled_us"] == res["pull_modeled_us"] and cell["layer_us"] == res["stock_us"]
    assert "/" not in doc["command"].split("--out")[1].split()[0]  # no folder in the recorded command
    md = rm.markdown(doc)
    assert "a model" in md and "370 GB/s" in md and "| 2 | 0K | 16 |" in md


def test_the_harness_cost_stand_ins_are_the_scores_they_say():
    """``StandIns(cost="model")``: the logits are ``k_scale * sum_h q_h . k`` on each request's span, the
    top-k picks the best of a span's first ``4 * topk`` positions, both deterministic."""
    from benchmark.cp_shared_kv.vs_upstream_stand_ins import StandIns

    g = torch.Generator().manual_seed(1)
    si = StandIns(CPU, logits_budget_bytes=1 << 12, cost="model")
    si.spans = [(0, 3, 0, 90), (3, 5, 90, 9)]
    q = (torch.randn(5, 4, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(99, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    ks_ = torch.rand(99, generator=g) + 0.5
    w = torch.randn(5, 4, generator=g)
    got = si.fp8_mqa_logits(q, (k, ks_), w, None, None)
    assert torch.equal(got[:, :99].isfinite()[:3, :90], torch.ones(3, 90, dtype=torch.bool))
    for q0, q1, k0, n in si.spans:
        want = (q[q0:q1].float().sum(1) @ k[k0 : k0 + n].float().t()) * ks_[k0 : k0 + n]
        assert torch.allclose(got[q0:q1, k0 : k0 + n], want, rtol=2e-2, atol=2e-2)
    assert torch.equal(got[:3, :90], si.fp8_mqa_logits(q, (k, ks_), w, None, None)[:3, :90])

    lengths = torch.tensor([88, 89, 90, 8, 9], dtype=torch.int32)
    table = torch.arange(100, 300, dtype=torch.int32).view(2, 100)
    scores = torch.randn(5, 99, generator=g)
    out = si.fast_topk_transform_fused(scores.clone(), lengths, table, torch.tensor([0, 3, 5]), 16, row_starts=None)
    for m, (b, start) in enumerate([(0, 0), (0, 0), (0, 0), (1, 90), (1, 90)]):
        n = int(lengths[m])
        head = min(n, 64)
        want = torch.sort(-scores[m, start : start + head]).indices[:16] if n > 16 else torch.arange(n)
        assert sorted(out[m][out[m] >= 0].tolist()) == sorted(table[b, want].tolist()), m
    assert "cost=model" in si.describe()[0]["stand_in"]
    with pytest.raises(ValueError):
        StandIns(CPU, cost="fast")
