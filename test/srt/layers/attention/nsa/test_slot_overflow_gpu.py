"""On one GPU: a page table that does not rotate owners is planned without a host sync, never points
past the view, and its overflow flag fails the batch once the flag's copy has landed (1 CUDA GPU)."""

import pytest
import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    OverflowCheck,
    SlotOverflowError,
    build_slot_plan,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PS = 64


@pytest.mark.parametrize("cp_size", [2, 4])
def test_non_rotating_pages_plan_inside_the_view_and_fail_without_a_sync(cp_size):
    dev = torch.device("cuda")
    n = cp_size
    # Request "a": 6 pages all owned by rank 1; request "b": 2 balanced pages.
    table = torch.tensor([[1 + n * i for i in range(6)], [2, 3, 0, 0, 0, 0]], device=dev)
    check = OverflowCheck()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = build_slot_plan(table, [6, 2], n, PS, 0, use_triton=True)
        check.record(plan, ["a", "b"])
        check.poll()  # never waits: the flag is read once its copy has landed
    except SlotOverflowError:
        pass  # the copy may already have landed: still no sync was needed to see it
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    # The kernels' page table stays inside the view; the torch formulation plans the same on the CPU.
    assert int(plan.slot_table.max()) < plan.view_pages and int(plan.slot_table.min()) >= 0
    ref = build_slot_plan(table.cpu(), [6, 2], n, PS, 0, use_triton=False)
    assert torch.equal(plan.slot_table.cpu(), ref.slot_table) and torch.equal(plan.status.cpu(), ref.status)
    assert plan.status.tolist()[0] == 1
    with pytest.raises(SlotOverflowError, match=r"\[a, b\]|'a'"):
        check.record(plan, ["a", "b"])
        check.poll(wait=True)
