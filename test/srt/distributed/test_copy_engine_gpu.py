"""The copy-engine all-gather on CUDA (ranks are processes; on a one-GPU machine they share it):
every rank ends with every rank's part byte for byte, over many calls at moving offsets (a call
that read a part before its owner wrote it, or an owner that overwrote it while a peer still
read, shows as wrong bytes), on a side stream too, and without a host sync. Views read straight from
the peers' mapped pools, batch by batch behind the group's fence (launched as captured graphs), are
exact over many rounds with a host running late now and then (without the fence the same rounds read
wrong bytes on one H200), and pools that differ in shape are mapped on no rank. A graph capture whose body
raises ends the capture and raises the body's error."""

import pytest
import torch

from reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PAGES, WIDTHS = 96, (512, 264)


def _part(call: int, owner: int, pages: int, width: int, which: int) -> torch.Tensor:
    """What ``owner`` writes as its part in call ``call`` (any rank can recompute it)."""
    g = torch.Generator().manual_seed(1_000_003 * call + 7919 * owner + which)
    return torch.randint(0, 256, (pages, width), dtype=torch.uint8, generator=g)


def _rank(rank: int, size: int, calls: int) -> dict:
    from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    arena = [torch.full((PAGES, w), 255, dtype=torch.uint8, device=dev) for w in WIDTHS]
    ce = CopyEngineGroup(CPGroup(), arena)
    side = torch.cuda.Stream(dev)
    bad = []
    for call in range(1, calls + 1):
        per = 1 + call % 7  # pages per part, and where the view starts: both move call to call
        start = (call * 5) % (PAGES - per * size + 1)
        outs = [a[start : start + per * size] for a in arena]
        mine = [o[rank * per : (rank + 1) * per] for o in outs]
        stream = side if call % 3 == 0 else torch.cuda.current_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for i, (m, w) in enumerate(zip(mine, WIDTHS)):
                m.copy_(_part(call, rank, per, w, i).to(dev, non_blocking=False))
            if call == calls:
                torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
            try:
                ce.all_gather_into_many(outs, mine)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.current_stream(dev).wait_stream(stream)
        got = [o.cpu() for o in outs]
        for p in range(size):
            for i, w in enumerate(WIDTHS):
                if not torch.equal(got[i][p * per : (p + 1) * per], _part(call, p, per, w, i)):
                    bad.append((call, p, i))
    return {"bad": bad, "calls": ce.calls, "contexts_elsewhere": _contexts_on_other_gpus(dev)}


def _contexts_on_other_gpus(dev: torch.device) -> list[int] | None:
    """GPUs other than ``dev`` on which this process holds a CUDA context (NVML's process lists), or
    None where NVML is not installed or cannot see this process (a PID namespace: it does not list
    this process on ``dev`` either). Opening a peer's arena must map it into this device's context,
    not create one on the peer's GPU."""
    import os

    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        found = []
        for i in range(torch.cuda.device_count()):
            uuid = str(torch.cuda.get_device_properties(i).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            if os.getpid() in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}:
                found.append(i)
        return [i for i in found if i != dev.index] if dev.index in found else None
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize("size", [2, 3])
def test_copy_engine_all_gather_is_exact_over_many_calls(size):
    out = spawn_ranks(_rank, size, 60, timeout_s=300)
    for r, res in enumerate(out):
        assert res["bad"] == [], f"rank {r}: wrong parts (call, owner, buffer) {res['bad'][:5]}"
        assert res["calls"] == 60
        assert res["contexts_elsewhere"] in ([], None), f"rank {r} holds a context on GPUs {res['contexts_elsewhere']}"


def _rank_unacked(rank: int, size: int, calls: int) -> dict:
    """Calls alternating between two halves of the arena on one stream, none with the ack, then
    ``finish_reads`` before the last call's half is written again: a part overwritten while a peer
    still read it shows as wrong bytes."""
    from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    arena = [torch.full((2 * PAGES, w), 255, dtype=torch.uint8, device=dev) for w in WIDTHS]
    ce = CopyEngineGroup(CPGroup(), arena)
    per = PAGES // size
    bad, got_calls = [], []
    for call in range(1, calls + 2):
        half = call % 2
        outs = [a[half * PAGES : half * PAGES + per * size] for a in arena]
        mine = [o[rank * per : (rank + 1) * per] for o in outs]
        for i, (m, w) in enumerate(zip(mine, WIDTHS)):
            m.copy_(_part(call, rank, per, w, i).to(dev, non_blocking=False))
        if call > calls:  # after finish_reads: a write every peer has finished reading before
            break
        ce.all_gather_into_many(outs, mine, ack=False)
        got_calls.append([o.clone() for o in outs])
        if call == calls:
            ce.finish_reads()
    for call, got in enumerate(got_calls, 1):
        for p in range(size):
            for i, w in enumerate(WIDTHS):
                if not torch.equal(got[i][p * per : (p + 1) * per].cpu(), _part(call, p, per, w, i)):
                    bad.append((call, p, i))
    return {"bad": bad, "calls": ce.calls}


@pytest.mark.parametrize("size", [2, 3])
def test_copy_engine_all_gather_without_acks_on_alternating_buffers_is_exact(size):
    out = spawn_ranks(_rank_unacked, size, 40, timeout_s=300)
    for r, res in enumerate(out):
        assert res["bad"] == [], f"rank {r}: wrong parts (call, owner, buffer) {res['bad'][:5]}"
        assert res["calls"] == 40


def _misuse(rank: int, size: int) -> list[str]:
    from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup

    torch.cuda.set_device(rank % torch.cuda.device_count())
    arena = torch.zeros((16, 64), dtype=torch.uint8, device="cuda")
    ce = CopyEngineGroup(CPGroup(), [arena])
    other = torch.zeros((16, 64), dtype=torch.uint8, device="cuda")
    errors = []
    for out, local in [(other[:4], other[2 * rank : 2 * rank + 2]), (arena[:4], arena[4:6])]:
        try:
            ce.all_gather_into_many([out], [local])
        except ValueError as e:
            errors.append(str(e))
    ce.cpu_group.barrier()
    return errors


def test_copy_engine_all_gather_refuses_buffers_it_cannot_pull():
    for errors in spawn_ranks(_misuse, 2, timeout_s=120):
        assert errors == [
            "out lies outside every registered buffer",
            "a copy-engine all-gather is in place: local must be this rank's part of out",
        ]


def _mismatched(rank: int, size: int) -> list:
    from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup, CopyEngineUnavailable, view_group

    torch.cuda.set_device(rank % torch.cuda.device_count())
    group = CPGroup()
    arena = [torch.zeros((16 + rank, 64), dtype=torch.uint8, device="cuda")]  # not the same shape on every rank
    out = []
    try:
        CopyEngineGroup(group, arena)
    except CopyEngineUnavailable as e:
        out.append(str(e))
    out.append(view_group(group, arena, "auto") is group)  # every rank falls back alike, none hangs
    return out


def test_a_rank_that_cannot_register_makes_every_rank_fall_back():
    for res in spawn_ranks(_mismatched, 2, timeout_s=120):
        assert len(res) == 2 and res[1] is True, res
        # The line names both ranks' shapes, so an operator sees which rank differs and how.
        assert "registered arena buffers" in res[0] and "they must match" in res[0], res
        assert "((16, 64), torch.uint8)" in res[0] and "((17, 64), torch.uint8)" in res[0], res


POOL_PAGES, POOL_WIDTHS, ROUNDS = 24, (640, 132), 30


def _page_bytes(round_: int, owner: int, pages: torch.Tensor, width: int) -> torch.Tensor:
    """What ``owner`` writes into ``pages`` of its pool in round ``round_`` (any rank can recompute it)."""
    base = (round_ * 7 + owner * 31 + pages.long() * 13) % 251
    return ((base.unsqueeze(1) + torch.arange(width, device=pages.device)) % 256).to(torch.uint8)


def _pull_rank(rank: int, size: int, mismatch: bool) -> dict:
    """Rounds as batches use the pools: a fence, then every owner's pages written in the previous round read
    in one launch, then this round's pages written (the other half of the pool). A read that ran before its
    owner's write, or a write that ran while a peer still read, shows as wrong bytes."""
    import random
    import time

    from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import pull_launch, pull_pages_ref, word_view

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    arena = [torch.zeros((8, 64), dtype=torch.uint8, device=dev)]
    pages = POOL_PAGES + (rank if mismatch else 0)
    pools = [[torch.zeros((pages, w), dtype=torch.uint8, device=dev) for w in POOL_WIDTHS] for _ in range(2)]
    ce = CopyEngineGroup(CPGroup(), arena, sources=pools)
    if ce.source_table is None:
        return {"mapped": False}
    half = POOL_PAGES // 2
    s = 5
    outs = [torch.zeros((size * s, w), dtype=torch.uint8, device=dev) for w in POOL_WIDTHS]
    got, expected = [], []
    rng = random.Random(rank)
    for r in range(ROUNDS):
        ce.fence()
        if r:  # the pages every owner wrote last round: slot x from owner x // S
            g = torch.Generator().manual_seed(r)
            first = half * ((r - 1) % 2)
            slot_phys = torch.randint(first, first + half, (size * s,), generator=g)
            layer = r % 2
            pull_launch(ce.source_table, slot_phys.to(dev), s, [word_view(o) for o in outs], ce.source_strides, layer)()
            got.append([o.clone() for o in outs])
            sources = [[_page_bytes(r - 1, o, torch.arange(POOL_PAGES), w) for o in range(size)] for w in POOL_WIDTHS]
            expected.append([pull_pages_ref(src, slot_phys, s) for src in sources])
        mine = torch.arange(half * (r % 2), half * (r % 2) + half, device=dev)
        for layer_pools in pools:
            for buf, w in zip(layer_pools, POOL_WIDTHS):
                buf[mine] = _page_bytes(r, rank, mine, w)
        if rng.random() < 0.3:
            time.sleep(0.02)  # one rank's host runs late now and then
    torch.cuda.synchronize()
    wrong = [
        r + 1 for r, (a, b) in enumerate(zip(got, expected)) if not all(torch.equal(x.cpu(), y) for x, y in zip(a, b))
    ]
    own = [int(ce.source_table[0, k, rank]) == pools[0][k].data_ptr() for k in range(2)]
    graphs = [exe is not None for exe in ce._fence_graphs]  # each parity's fence launched as one captured graph
    ce.close()
    return {
        "mapped": True,
        "wrong_rounds": wrong,
        "own_addresses": own,
        "fence_graphs": graphs,
        "bytes": sum(o.numel() for o in outs),
    }


@pytest.mark.parametrize("size", [2, 3])
def test_views_read_from_the_peers_pools_follow_every_write_and_precede_the_next(size):
    for res in spawn_ranks(_pull_rank, size, False, timeout_s=300):
        assert res["mapped"] and res["own_addresses"] == [True, True] and res["fence_graphs"] == [True, True], res
        assert res["wrong_rounds"] == [], res


def test_pools_of_different_shapes_are_mapped_on_no_rank():
    """Every rank keeps the arena all-gather alike (none maps, none hangs)."""
    assert spawn_ranks(_pull_rank, 2, True, timeout_s=120) == [{"mapped": False}] * 2


def test_a_capture_whose_body_raises_ends_the_capture_and_raises_the_bodys_error():
    """``_Driver.capture``: an error inside the captured body reaches the caller as it was raised, and the
    stream is out of capture mode (the next capture on it, and plain work, run)."""
    from sglang_cp_shared_kv.srt.distributed.copy_engine import driver

    d = driver()
    stream = torch.cuda.Stream()
    x = torch.zeros(4, device="cuda")

    def broken(h: int) -> None:
        raise ValueError("body failed")

    with pytest.raises(ValueError, match="body failed"):
        d.capture(stream.cuda_stream, broken)
    assert d.capture(stream.cuda_stream, lambda h: None) is not None  # an empty graph: capture works again
    with torch.cuda.stream(stream):
        x += 1
    stream.synchronize()
    assert x.tolist() == [1.0] * 4
