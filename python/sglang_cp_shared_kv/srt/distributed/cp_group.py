"""A thin CP-group wrapper over ``torch.distributed`` (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class CPGroup:
    """The prefill context-parallel group: rank, size and the collectives we need."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)

    def __repr__(self) -> str:
        return f"CPGroup(rank={self.rank}, size={self.size}, backend={self.backend})"

    def all_gather_into(self, out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``out`` (``[size * n, ...]``) <- every rank's ``local`` (``[n, ...]``), rank-major.

        Moves raw bytes: fp8 and other dtypes gloo cannot reduce are gathered as uint8.
        """
        if out.shape[0] != local.shape[0] * self.size or out.shape[1:] != local.shape[1:]:
            raise ValueError(f"out must be [{self.size} * {local.shape[0]}, ...], got {tuple(out.shape)}")
        out_b, local_b = _as_bytes(out), _as_bytes(local)
        if self.backend == "nccl":
            dist.all_gather_into_tensor(out_b, local_b, group=self.group)
        else:
            dist.all_gather(list(out_b.chunk(self.size)), local_b, group=self.group)
        return out

    def all_gather_object(self, obj: object) -> list[object]:
        objs: list[object] = [None] * self.size
        dist.all_gather_object(objs, obj, group=self.group)
        return objs

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("all-gather buffers must be contiguous")
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t
