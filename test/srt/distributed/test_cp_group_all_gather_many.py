"""``CPGroup.all_gather_into_many``: several buffers all-gathered by one call, rank-major, on real gloo ranks;
in place (each rank's input is its slice of the output) or from separate inputs, waited at once or later."""

import pytest
import torch

from reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup, PendingCollective


def _buffers(rank: int, world_size: int):
    """Two buffers of different widths and dtypes (fp8: moved as bytes), filled per rank."""
    a = torch.arange(3 * 5, dtype=torch.float32).view(3, 5) + 100 * rank
    b = (torch.arange(2 * 7).view(2, 7) % 4 + rank).to(torch.float8_e4m3fn)
    return a, b


def _rank_many(rank, world_size, coalesce, in_place, async_op):
    group = CPGroup()
    a, b = _buffers(rank, world_size)
    outs = [torch.full((world_size * 3, 5), -1.0), torch.zeros((world_size * 2, 7), dtype=torch.float8_e4m3fn)]
    if in_place:
        outs[0][3 * rank : 3 * rank + 3] = a
        outs[1][2 * rank : 2 * rank + 2] = b
        locals_ = [outs[0][3 * rank : 3 * rank + 3], outs[1][2 * rank : 2 * rank + 2]]
    else:
        locals_ = [a, b]
    pending = group.all_gather_into_many(outs, locals_, async_op=async_op, coalesce=coalesce)
    assert isinstance(pending, PendingCollective)
    pending.wait()
    pending.wait()  # waiting twice is harmless
    want = [_buffers(r, world_size) for r in range(world_size)]
    ok_a = torch.equal(outs[0], torch.cat([w[0] for w in want]))
    ok_b = torch.equal(outs[1].view(torch.uint8), torch.cat([w[1] for w in want]).view(torch.uint8))
    return ok_a and ok_b


# (coalesce, in_place, async_op): the sequential gloo path, and the coalesced path NCCL takes.
VARIANTS = [(False, False, False), (False, True, True), (True, False, True), (True, True, False)]


def _rank_bad(group, world_size):
    errors = []
    for outs, locals_ in (
        ([torch.zeros(4)], []),
        ([], []),
        ([torch.zeros(3 * world_size)], [torch.zeros(2)]),
        ([torch.zeros((world_size, 4))[:, :2]], [torch.zeros((1, 2))]),
        ([torch.zeros((world_size, 4))], [torch.zeros((1, 4), dtype=torch.float16)]),  # another dtype
        ([torch.zeros(world_size)], [torch.tensor(1.0)]),  # a 0-dim part
    ):
        try:
            group.all_gather_into_many(outs, locals_)
        except ValueError as e:
            errors.append(str(e))
    before = group.bytes_received
    try:  # the single call too, counting nothing it did not receive
        group.all_gather_into(torch.zeros((world_size, 4)), torch.zeros((1, 4), dtype=torch.float16))
    except ValueError as e:
        errors.append(str(e))
    errors.append(group.bytes_received - before)
    return errors


def _rank_main(rank, world_size):
    results = [_rank_many(rank, world_size, *variant) for variant in VARIANTS]
    return results, _rank_bad(CPGroup(), world_size)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_into_many_is_rank_major(world_size):
    for results, errors in spawn_ranks(_rank_main, world_size, timeout_s=120):
        assert results == [True] * len(VARIANTS)
        assert len(errors) == 8
        assert "pair up" in errors[0] and "pair up" in errors[1]
        assert "out must be" in errors[2] and "contiguous" in errors[3]
        assert all("share a dtype and have a first dimension" in e for e in errors[4:7]), errors
        assert errors[7] == 0
