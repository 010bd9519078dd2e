"""The chunked-prefill scheduler and the tiny DSA stack's driver in one process."""

import pytest
import torch

from sglang_cp_shared_kv.reference.dsa_stack import (
    RequestSpec,
    StackConfig,
    first_mismatch,
    request_tokens,
    run_chunked_prefill,
    schedule_chunked_prefill,
)

SMALL = StackConfig(num_layers=2, hidden=32, heads=4, index_heads=2, topk=16)


def test_schedule_splits_requests_and_waits_for_shared_prefixes():
    reqs = [RequestSpec(40), RequestSpec(24), RequestSpec(52, prefix_from=0, prefix_len=32), RequestSpec(64)]
    batches = schedule_chunked_prefill(reqs, 64)
    assert [(b.requests, b.prefix_lens, b.extend_lens) for b in batches] == [
        ((0, 1), (0, 0), (40, 24)),
        ((2, 3), (32, 0), (20, 44)),
        ((3,), (44,), (20,)),
    ]
    assert [b.kind for b in batches] == ["current", "mixed", "history"]
    assert [b.seq_lens for b in batches] == [(40, 24), (52, 44), (64,)]
    # A request sharing the prefix of one still running waits for it, and so does everything behind it.
    waits = schedule_chunked_prefill([RequestSpec(100), RequestSpec(40, 0, 32), RequestSpec(8)], 64)
    assert [b.requests for b in waits] == [(0,), (0,), (1, 2)]
    assert all(sum(b.extend_lens) <= 64 for b in waits)


@pytest.mark.parametrize(
    ("reqs", "message"),
    [
        ([RequestSpec(0)], "length"),
        ([RequestSpec(8, prefix_len=16)], "prefix_from"),
        ([RequestSpec(40), RequestSpec(40, prefix_from=1, prefix_len=16)], "earlier request"),
        ([RequestSpec(40), RequestSpec(40, prefix_from=0, prefix_len=8)], "multiple of page_size"),
        ([RequestSpec(40), RequestSpec(40, prefix_from=0, prefix_len=48)], "prefix_len"),
    ],
)
def test_bad_requests_are_rejected(reqs, message):
    with pytest.raises(ValueError, match=message):
        run_chunked_prefill(reqs, chunk_size=32, page_size=16, config=SMALL)


def test_shared_prefix_tokens_are_the_source_tokens():
    toks = request_tokens([RequestSpec(40), RequestSpec(50, 0, 32)], vocab=100, seed=0)
    assert torch.equal(toks[1][:32], toks[0][:32]) and not torch.equal(toks[1][32:40], toks[0][32:40])


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_replicated_results_do_not_depend_on_the_page_layout(kv_format):
    """Logical page ids from a 1-owner or a 4-owner allocator: same bytes read in the same order."""
    reqs = [RequestSpec(40), RequestSpec(24), RequestSpec(52, prefix_from=0, prefix_len=32), RequestSpec(64)]
    kw = {"chunk_size": 64, "page_size": 16, "kv_format": kv_format, "config": SMALL}
    a = run_chunked_prefill(reqs, **kw)
    b = run_chunked_prefill(reqs, cp_size=4, **kw)
    assert a.request_pages != b.request_pages
    assert first_mismatch(a, b) is None
    assert b.request_pages[2][:2] == b.request_pages[0][:2]  # the shared prefix reuses the source's pages
    out = a.batches[1].layers[1]
    assert out.topk.shape == (64, SMALL.topk) and out.out.shape == (64, SMALL.heads, 512)
    assert bool(torch.isfinite(out.lse).all()) and bool((out.topk >= 0).all(1).any())


def test_first_mismatch_names_the_first_difference():
    reqs = [RequestSpec(40), RequestSpec(24, 0, 16)]
    kw = {"chunk_size": 40, "page_size": 16, "config": SMALL}
    a = run_chunked_prefill(reqs, **kw)
    b = run_chunked_prefill(reqs, **kw)
    assert first_mismatch(a, b) is None
    b.batches[1].layers[1].lse[0, 0] += 1
    assert first_mismatch(a, b).startswith("batch 1 (history) layer 1: lse differs")
