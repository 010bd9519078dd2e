"""On one GPU: a page table that does not rotate owners is planned without a host sync, never points
past the view, and its overflow flag fails the batch once the flag has landed (1 CUDA GPU)."""

import pytest
import torch
from page_fixtures import build_slot_plan, plan_meta

from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import PLAN_META_ROWS, plan_batch
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    DeviceFlagCheck,
    SlotOverflowError,
    overflow_message,
    plan_meta_rows,
    slots_per_rank,
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
    check = DeviceFlagCheck()

    def record(plan):  # the plan's status copied into pinned memory, read once that copy has landed
        buf, array = check.host_views(n + 1, dev)
        buf.copy_(plan.status, non_blocking=True)
        s = plan.slots_per_rank
        check.watch(
            buf, lambda h: SlotOverflowError(overflow_message(h, s, ["a", "b"])) if h[0] else None, dev, array=array
        )

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = build_slot_plan(table, [6, 2], n, PS, 0, use_triton=True)
        record(plan)
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
        record(plan)
        check.poll(wait=True)


def test_plan_reads_pinned_lengths_in_place_and_writes_its_flags_to_pinned_memory():
    """The read path's plan: its host lengths in a pinned buffer the launch reads in place, its flags
    written straight back into that buffer, then its landed word, which the host polls (no event);
    equal to the plan of copied lengths into device flags, no host sync, and the buffer serves the next
    batch once read."""
    dev, n, pages = torch.device("cuda"), 2, [6, 2]
    table = torch.tensor([[1 + n * i for i in range(6)], [2, 3, 0, 0, 0, 0]], device=dev)
    rows = torch.arange(2, device=dev)
    s, m = slots_per_rank(pages, n), len(PLAN_META_ROWS) * len(pages)
    check = DeviceFlagCheck()
    buf = check.host_views(m + n + 2 + len(pages), dev)[0]
    assert buf.is_pinned()
    buf.fill_(0)
    seen = []
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the launch lands well after the first polls below
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = buf[:m]
        meta.numpy()[:] = plan_meta_rows(pages)
        pinned = plan_batch(table, rows, 1, meta, 6, sum(pages), n, s, 0, None, 0, 0, flags=buf[m:])
        check.watch(buf, lambda host: seen.append(host[m:]) or RuntimeError("overflow"), dev, landed=len(buf) - 1)
        check.poll()  # not landed yet: nothing read, nothing waited for
        assert check.pending == 1 and not seen
        device = plan_batch(table, rows, 1, plan_meta(pages, dev), 6, sum(pages), n, s, 0, None, 0, 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(pinned.slot_table, device.slot_table) and torch.equal(pinned.slot_phys, device.slot_phys)
    assert pinned.status.tolist() == device.status.tolist() and pinned.status.tolist()[0] == 1
    with pytest.raises(RuntimeError, match="overflow"):
        check.poll()
    assert seen == [device.status.tolist() + device.wrong.tolist() + [1]]
    assert check.host_views(m, dev)[0].data_ptr() == buf.data_ptr()  # the landed buffer is reused
    # The torch formulation takes the same pinned lengths and flags (it copies the lengths over).
    flags = torch.zeros(n + 2 + len(pages), dtype=torch.int64, pin_memory=True)
    ref = plan_batch(table, rows, 1, meta, 6, sum(pages), n, s, 0, None, 0, 0, use_triton=False, flags=flags)
    torch.cuda.synchronize()
    assert torch.equal(ref.slot_table, device.slot_table) and flags.tolist() == seen[0]


def test_a_failed_record_keeps_the_later_buffers_until_they_land():
    """After a record fails, the records queued behind it are dropped but their pinned buffers stay held
    (a launch may still read or write them) until their events land; then they serve new records."""
    dev = torch.device("cuda")
    check = DeviceFlagCheck()
    first, second = check.host_views(8, dev)[0], check.host_views(8, dev)[0]
    first.fill_(1)
    second.fill_(0)
    check.watch(first, lambda host: RuntimeError("first") if host[0] else None, dev)
    torch.cuda._sleep(200_000_000)  # the second record's event lands well after the first's
    check.watch(second, lambda host: RuntimeError("second"), dev)
    with pytest.raises(RuntimeError, match="first"):
        for _ in range(100_000):  # the first lands at once; poll never waits
            check.poll()
    assert check.pending == 1  # the second, still in flight, is held
    check.poll(wait=True)  # its values are dropped: no error, its buffer recycled
    assert check.pending == 0
    assert check.host_views(8, dev)[0].data_ptr() in (first.data_ptr(), second.data_ptr())


def test_a_launch_refuses_tensors_off_its_device_and_takes_pinned_host_memory():
    """Kernels get their tensors by address: a request-row tensor on the host is one clear ValueError before
    anything is queued, lengths in host memory that is not pinned are refused by Triton, and pinned host
    memory (the read state's lengths and flags) is read and written in place."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import translate_locs

    dev = torch.device("cuda")
    ps, n = 4, 2
    tokens = torch.arange(6 * 16, dtype=torch.int32, device=dev).view(6, 16)
    rows = torch.tensor([1, 3], dtype=torch.int64, device=dev)
    pages, prefix = [4, 3], [2, 1]
    m, s = sum(prefix), slots_per_rank(prefix, n)
    lengths = plan_meta_rows(pages, prefix)
    meta = torch.tensor(lengths, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="rows must be on the token table's device"):
        plan_batch(tokens, rows.cpu(), ps, meta, 4, m, n, s, 0, None, 0, 0)
    for pinned in (True, False):
        buf = torch.zeros(6 * 2 + n + 2 + 2, dtype=torch.int64, pin_memory=pinned)
        buf[: 6 * 2] = torch.tensor(lengths)
        if pinned:
            plan = plan_batch(tokens, rows, ps, buf[:12], 4, m, n, s, 0, None, 0, 0, flags=buf[12:])
            torch.cuda.synchronize()
            assert buf[-1].item() == 1 and plan.num_positions == m  # the landed word
        else:
            with pytest.raises(ValueError, match="cannot be accessed from Triton"):
                plan_batch(tokens, rows, ps, buf[:12], 4, m, n, s, 0, None, 0, 0, flags=buf[12:])
    page_pos = torch.arange(24, dtype=torch.int64, device=dev)
    assert translate_locs(page_pos, tokens[:2], ps).is_cuda
    with pytest.raises(ValueError, match="locs on cpu, the page map on cuda.*translate on one device"):
        translate_locs(page_pos, tokens[:2].cpu(), ps)
