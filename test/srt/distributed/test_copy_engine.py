"""Choosing the view transport (CPU side): the setting's values, CPU views always on the CP group,
a required copy engine refused with its reason. The copy engines themselves: test_copy_engine_gpu."""

import logging
from types import SimpleNamespace

import pytest
import torch

from reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed import copy_engine
from sglang_cp_shared_kv.srt.distributed.copy_engine import (
    TRANSPORT_ENV,
    CopyEngineGroup,
    CopyEngineUnavailable,
    fall_back,
    prefetch_on,
    transport_setting,
)


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


def test_prefetch_follows_the_transport_chosen(caplog):
    # Only the group's kind matters here: NCCL (collective backend "nccl"), gloo, copy engines, one rank.
    nccl, gloo, engines = (
        SimpleNamespace(backend="nccl"),
        SimpleNamespace(backend="gloo"),
        CopyEngineGroup.__new__(CopyEngineGroup),
    )
    with caplog.at_level(logging.INFO, logger=copy_engine.__name__):
        assert prefetch_on(engines, True) and prefetch_on(gloo, True) and prefetch_on(None, True)
        assert not prefetch_on(nccl, True)
        assert not prefetch_on(engines, False) and not prefetch_on(nccl, False)
    assert [r.getMessage() for r in caplog.records] == [
        "CP-shared KV: layer-ahead prefetch of the views off: they are all-gathered by NCCL"
    ]


def test_a_fall_back_from_the_copy_engines_is_one_warning_with_its_reason(caplog):
    nccl = SimpleNamespace(backend="nccl")
    why = "rank 1: the CUDA driver library cannot be loaded: libcuda.so.1: cannot open shared object file"
    with caplog.at_level(logging.INFO, logger=copy_engine.__name__):
        assert fall_back(nccl, "auto", why) is nccl
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            f"CP-shared KV: copy engines unavailable ({why}): views all-gathered by the CP group's nccl "
            "collectives instead, which run on SMs, with no layer-ahead prefetch",
        )
    ]
    with pytest.raises(CopyEngineUnavailable, match=f"^{TRANSPORT_ENV}=copy_engine cannot run: no driver$"):
        fall_back(nccl, "copy_engine", "no driver")
