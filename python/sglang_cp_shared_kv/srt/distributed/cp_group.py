"""A thin CP-group wrapper over ``torch.distributed`` (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# Newer torch renamed ``all_gather_into_tensor`` (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class PendingCollective:
    """Collectives issued without waiting; ``wait()`` orders later work after them."""

    def __init__(self, works: Sequence[object] = ()):
        self._works = list(works)

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()


class CPGroup:
    """The prefill context-parallel group: rank, size and the collectives we need."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.bytes_received = 0  # by the all-gathers (for benchmarks)

    def __repr__(self) -> str:
        return f"CPGroup(rank={self.rank}, size={self.size}, backend={self.backend})"

    def all_gather_into(self, out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``out`` (``[size * n, ...]``) <- every rank's ``local`` (``[n, ...]``) as
        bytes, rank-major; ``local`` may be this rank's slice of ``out``."""
        self.all_gather_into_many([out], [local], coalesce=False)
        return out

    def all_gather_into_many(
        self,
        outs: Sequence[torch.Tensor],
        locals_: Sequence[torch.Tensor],
        *,
        async_op: bool = False,
        coalesce: bool | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> PendingCollective:
        """``all_gather_into`` of every pair, coalesced on NCCL (or ``coalesce=True``).
        ``async_op``: ``wait()`` before reading ``outs``; ``stream``: queued there. No
        ack is needed before writing ``locals_`` again (unlike ``CopyEngineGroup``)."""
        if stream is not None:
            with torch.cuda.stream(stream):
                self.all_gather_into_many(outs, locals_, async_op=True, coalesce=coalesce).wait()
            return PendingCollective()
        check_pairs(outs, locals_)
        pairs = []  # as bytes
        for out, local in zip(outs, locals_):
            n = local.shape[0]
            if out.shape[0] != n * self.size or out.shape[1:] != local.shape[1:]:
                msg = f"out must be [{self.size} * {n}, ...], got {tuple(out.shape)}"
                raise ValueError(msg)
            if not out.is_contiguous() or not local.is_contiguous():
                raise ValueError("all-gather buffers must be contiguous")
            pairs.append((out.view(torch.uint8), local.view(torch.uint8)))
        self.bytes_received += sum(o.numel() - x.numel() for o, x in pairs)
        nccl = self.backend == "nccl"
        if len(pairs) == 1 and nccl:
            work = _all_gather_single(*pairs[0], group=self.group, async_op=async_op)
            return PendingCollective([work] if async_op else [])
        if coalesce is None:
            coalesce = nccl
        if not coalesce or len(pairs) == 1:
            for out, local in pairs:
                if nccl:
                    _all_gather_single(out, local, group=self.group)
                else:
                    dist.all_gather(list(out.chunk(self.size)), local, group=self.group)
            return PendingCollective()
        with dist._coalescing_manager(group=self.group, async_ops=True) as coalesced:
            for out, local in pairs:
                _all_gather_single(out, local, group=self.group)
        pending = PendingCollective([coalesced])
        if not async_op:
            pending.wait()
        return pending

    def all_gather_object(self, obj: object) -> list[object]:
        objs: list[object] = [None] * self.size
        dist.all_gather_object(objs, obj, group=self.group)
        return objs

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def check_pairs(outs: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor]) -> None:
    """Refuse ``all_gather_into_many`` arguments other than pairs of like dtypes."""
    if len(outs) != len(locals_) or not outs:
        raise ValueError(f"outs and locals_ must be non-empty and pair up, got {len(outs)} and {len(locals_)}")
    for out, local in zip(outs, locals_):
        if out.dim() == 0 or local.dim() == 0 or out.dtype != local.dtype:
            raise ValueError(
                f"out and local must share a dtype and have a first dimension, got {out.dtype} {tuple(out.shape)} "
                f"and {local.dtype} {tuple(local.shape)}"
            )
