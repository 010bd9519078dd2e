"""Choosing the view transport (CPU side): the setting's values, CPU views always on the CP group,
a required copy engine refused with its reason. The copy engines themselves: test_copy_engine_gpu."""

import pytest
import torch

from sglang_cp_shared_kv.reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.copy_engine import TRANSPORT_ENV, transport_setting


def test_transport_setting(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert transport_setting() == "auto"
    for value in ("auto", "copy_engine", "nccl"):
        monkeypatch.setenv(TRANSPORT_ENV, f" {value} ")
        assert transport_setting() == value
    monkeypatch.setenv(TRANSPORT_ENV, "nvls")
    with pytest.raises(ValueError, match=f"^{TRANSPORT_ENV} must be one of auto, copy_engine, nccl, got 'nvls'$"):
        transport_setting()


def _choose(rank: int, size: int) -> list:
    from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineUnavailable, view_group
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup

    group = CPGroup()
    arena = [torch.zeros((4, 8), dtype=torch.uint8)]
    out = [view_group(group, arena, "auto") is group, view_group(group, arena, "nccl") is group]
    try:
        view_group(group, arena, "copy_engine")
    except CopyEngineUnavailable as e:
        out.append(str(e))
    return out


def test_cpu_views_use_the_cp_group_and_a_required_copy_engine_is_refused():
    for res in spawn_ranks(_choose, 2):
        assert res == [True, True, f"{TRANSPORT_ENV}=copy_engine needs CUDA view buffers"]
