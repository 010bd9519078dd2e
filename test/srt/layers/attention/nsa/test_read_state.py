"""``read_state``: ``TensorMemo`` runs a translation once per input tensor, again after an in-place change;
``BatchReadState.begin`` refuses lengths that cannot describe a batch."""

import pytest
import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import BatchInputs, BatchReadState, PageBuffers, TensorMemo
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


def test_memo_returns_the_first_result_for_the_same_unmodified_tensor():
    calls = []

    def double(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t * 2

    memo = TensorMemo(double, size=2)
    a, b = torch.arange(4), torch.arange(4)
    first = memo(a)
    assert memo(a) is first and len(calls) == 1
    assert torch.equal(memo(b), first) and len(calls) == 2  # equal values, another tensor: computed
    a.add_(1)  # modified in place: its version moved
    assert torch.equal(memo(a), torch.arange(1, 5) * 2) and len(calls) == 3
    memo(torch.zeros(1))  # holds the last 2 inputs: this one and a; b is evicted
    assert len(calls) == 4
    memo(a)
    assert len(calls) == 4  # a is still held
    memo(b)
    assert len(calls) == 5
    memo.clear()
    memo(b)
    assert len(calls) == 6


_OUT_OF_RANGE = r"prefix_lens must lie in \[0, seq_len\] and seq_lens within .* 64 columns"


@pytest.mark.parametrize(
    "prefix_lens,seq_lens,message",
    [
        ([32, 0], [16, 16], _OUT_OF_RANGE),  # a prefix past its request's end
        ([-16, 0], [16, 16], _OUT_OF_RANGE),  # a negative prefix
        ([0, 0], [16, 5 * 16], _OUT_OF_RANGE),  # a request longer than the token table's rows
        ([24, 8], [32, 16], r"prefix_lens must be page-aligned \(page size 16\), got \[24, 8\]"),  # sum aligned
        ([0, 8], [16, 16], r"prefix_lens must be page-aligned \(page size 16\), got \[0, 8\]"),
    ],
)
def test_begin_refuses_lengths_that_cannot_describe_a_batch_and_keeps_its_state(prefix_lens, seq_lens, message):
    ps, row = 16, 8
    ownership = PageOwnership(2, ps, logical_pages=16)
    latent = PageBuffers(ownership, 0, row, [torch.zeros((8, ps * row), dtype=torch.uint8)])
    state = BatchReadState(ownership, 0, 16, latent, None, None)
    table, rows = torch.arange(2 * 4 * ps, dtype=torch.int32).view(2, 4 * ps), torch.arange(2)
    hint = ((-1, 0), (0, 1))
    with pytest.raises(ValueError, match=message):
        state.begin(BatchInputs(table, rows, tuple(prefix_lens), tuple(seq_lens), shared_prefix=hint))
    assert state.mode is None and state.counters is None
    state.begin(BatchInputs(table, rows, (0, 0), (16, 4 * ps)))  # a batch that fits still runs
    assert state.mode == "current"
