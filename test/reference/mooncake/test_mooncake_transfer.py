"""N owned-page senders -> one decode receiver over the real Mooncake engine (TCP, 127.0.0.1).

For N = 2 and 4, fp8 and bf16, page size 16 and 64: every sender process builds its CP
rank's share of the pool through the masked write path, sends its owned pages, and the
decode process compares the rebuilt pool with a replicated pool byte for byte. Each case
has a fragmented request (more than 1024 entries per rank, so writes are split into
several calls) and a contiguous one (one entry per layer and buffer per rank).
"""

import itertools

import pytest
from mooncake_procs import (
    Case,
    Worker,
    call_all,
    decode_add,
    decode_close,
    decode_release,
    decode_start,
    decode_verify,
    decode_wait,
    sender_close,
    sender_finish,
    sender_start,
    sender_submit,
    stop_all,
)

pytestmark = pytest.mark.mooncake

LAYERS = 2
ENTRIES_PER_PAGE = 2 * LAYERS  # latent + indexer, every layer


def _case(n, kv_format, ps):
    big = 300 * n + 1  # every rank owns >= 300 pages: well over 1024 entries even if a few pages coalesce
    small = 3 * n + 1
    phys = -(-(big + small) // n) + 2
    return Case(n, ps, kv_format, LAYERS, phys, (("big", big, True), ("small", small, False)), seed=n * 10 + ps)


CASES = [_case(n, f, ps) for n, f, ps in itertools.product((2, 4), ("fp8", "bf16"), (16, 64))]


@pytest.fixture(scope="module")
def workers():
    procs = [Worker("decode")] + [Worker(f"sender{r}") for r in range(4)]
    yield procs[0], procs[1:]
    stop_all(procs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c.n}-{c.kv_format}-ps{c.page_size}")
def test_senders_rebuild_the_replicated_pool(workers, case):
    decode, all_senders = workers
    senders = all_senders[: case.n]
    rids = [rid for rid, _, _ in case.requests]
    address = decode.call(decode_start, case)
    call_all(senders, sender_start, [(case, r, address) for r in range(case.n)])
    decode.call(decode_add, rids)
    call_all(senders, sender_submit, [(rids,)] * case.n)
    results = call_all(senders, sender_finish, [(rids,)] * case.n)

    assert decode.call(decode_wait, rids) == {rid: ("SUCCESS", "") for rid in rids}
    assert decode.call(decode_verify, rids) == {rid: True for rid in rids}

    page_bytes = results[0]["_page_bytes"]
    for rid, n_pages, fragmented in case.requests:
        per_rank = [res[rid] for res in results]
        assert [r["state"] for r in per_rank] == ["SUCCESS"] * case.n
        # each rank sends 1/N of the request's bytes, within one page
        total = n_pages * page_bytes
        assert sum(r["nbytes"] for r in per_rank) == total
        assert all(abs(r["nbytes"] - total / case.n) < page_bytes for r in per_rank)
        for r in per_rank:
            if fragmented:  # (almost) nothing coalesces: writes are split into <= 1024-entry calls
                assert 1024 < r["entries"] <= r["pages"] * ENTRIES_PER_PAGE
                assert r["calls"] == -(-r["entries"] // 1024) >= 2
            else:  # contiguous on both sides: one entry per layer and buffer
                assert (r["entries"], r["calls"]) == (ENTRIES_PER_PAGE, 1)
    # prefill pages freed on every rank, decode pages freed on release
    assert [res["_used_pages"] for res in results] == [0] * case.n
    assert decode.call(decode_release, rids) == case.decode_pages
    call_all(senders, sender_close, [()] * case.n)
    decode.call(decode_close)
