"""The multi-rank harness: real spawned gloo ranks; failures, deaths and hangs become test failures."""

import os
import time

import pytest
import torch

from reference.spawn import RankFailure, spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup


def _all_gather(rank, world_size):
    group = CPGroup()
    assert (group.rank, group.size, group.backend) == (rank, world_size, "gloo")
    local = torch.full((3, 2), rank, dtype=torch.float8_e4m3fn)  # gloo has no fp8: moved as bytes
    out = torch.empty(3 * world_size, 2, dtype=torch.float8_e4m3fn)
    group.all_gather_into(out, local)
    return out.float()[:, 0].tolist(), group.all_gather_object(rank * 10)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_gather_is_rank_major(world_size):
    results = spawn_ranks(_all_gather, world_size, timeout_s=120)
    want = [float(r) for r in range(world_size) for _ in range(3)]
    for gathered, objs in results:
        assert gathered == want and objs == [10 * r for r in range(world_size)]


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise AssertionError("rank one disagrees")
    return rank


def _die_on_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    time.sleep(30)


def _hang(rank, world_size):
    time.sleep(60)


@pytest.mark.multirank
def test_rank_errors_deaths_and_timeouts_are_reported():
    with pytest.raises(RankFailure, match="rank 1 raised:(.|\n)*rank one disagrees"):
        spawn_ranks(_raise_on_one, 2, timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died with exit code 3"):
        spawn_ranks(_die_on_one, 2, timeout_s=60)
    assert time.monotonic() - t0 < 30
    with pytest.raises(RankFailure, match=r"did not finish within 8 s"):
        spawn_ranks(_hang, 2, timeout_s=8)


def test_bad_buffers_are_rejected():
    with pytest.raises(RuntimeError, match="not initialized"):
        CPGroup()
