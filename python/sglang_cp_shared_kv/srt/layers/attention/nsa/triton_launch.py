"""Where the read path's Triton kernels run: on CUDA tensors, and on CPU tensors when
``TRITON_INTERPRET=1`` was set at import (the tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether ``triton.jit`` builds interpreted kernels, which CPU tensors run."""
    return not isinstance(_probe, triton.runtime.JITFunction)


def triton_enabled(device: torch.device, use_triton: bool | None = None) -> bool:
    """Whether a wrapper runs its kernel on ``device`` (``use_triton`` forces it)."""
    runnable = device.type == "cuda" or interpreting()
    if use_triton and not runnable:
        raise ValueError(f"use_triton needs CUDA or TRITON_INTERPRET=1, got {device}")
    return runnable if use_triton is None else use_triton


def check_index(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def nothing() -> None:
    """A launch with nothing to do."""


@triton.jit
def _probe(x):  # a kernel of this module's, for ``interpreting``
    tl.store(x, 0)
