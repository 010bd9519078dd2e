"""The copy-engine all-gather on CUDA (ranks are processes; on a one-GPU machine they share it):
every rank ends with every rank's part byte for byte, over many calls at moving offsets (a call
that read a part before its owner wrote it, or an owner that overwrote it while a peer still
read, shows as wrong bytes), on a side stream too, and without a host sync."""

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
                ce.all_gather_into_many(outs, mine, async_op=True)
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
    ce.barrier()
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
        assert "registered buffers" in res[0] and "they must match" in res[0], res
