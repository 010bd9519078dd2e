"""Where the read path's Triton kernels run: on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1``
was set at import (the tests). Every kernel launches through Triton's public ``kernel[grid](...)``."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on every platform we run
    triton = tl = None


def interpreting() -> bool:
    """Whether ``triton.jit`` builds interpreted kernels (``TRITON_INTERPRET=1`` at import), which CPU tensors run."""
    return triton is not None and not isinstance(_probe, triton.runtime.JITFunction)


def triton_enabled(device: torch.device, use_triton: bool | None = None) -> bool:
    """Whether a wrapper runs its Triton kernel for tensors on ``device`` (``use_triton`` forces it)."""
    runnable = triton is not None and (device.type == "cuda" or interpreting())
    if use_triton is None:
        return runnable
    if use_triton and not runnable:
        raise ValueError(
            f"use_triton=True needs triton and a CUDA device, or TRITON_INTERPRET=1 at import, for {device} tensors"
        )
    return use_triton


def check_index(name: str, t: torch.Tensor, dim: int) -> None:
    """``t`` is an int32 or int64 index tensor of ``dim`` dimensions, else a ``ValueError`` naming it."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def nothing() -> None:
    """A launch with nothing to do."""


if triton is not None:
    # A kernel of this module's: whether ``triton.jit`` interprets (``interpreting``).
    @triton.jit
    def _probe(x):
        tl.store(x, 0)
