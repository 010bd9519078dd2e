"""``read_state.TensorMemo``: a translation runs once per input tensor, again after an in-place change."""

import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import TensorMemo


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
