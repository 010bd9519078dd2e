"""``Launch``: a Triton kernel with its arguments bound, queued through Triton's public API on torch's
current stream; every kernel of ``plan_kernels`` and ``materialize_kernels`` launches through it. Kernels
run on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set at import (the tests).
"""

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


class Launch:
    """``fn[grid](*args, **constexprs, **options)``, queued on the current stream at every call. Every tensor
    must be on the launch's device or pinned host memory. ``ran``: a launch of the same compiled kernel
    (``compile_key``) has been queued, so a graph capture compiles nothing."""

    __slots__ = ("fn", "grid", "args", "constexprs", "options", "device")

    def __init__(self, fn, grid: tuple[int, ...], args: tuple, constexprs: dict, **options):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
        for t in tensors:
            if t.device != device and not (t.device.type == "cpu" and t.is_pinned()):
                raise ValueError(
                    f"a kernel launched on {device} got a tensor on {t.device}: its arguments must be on the "
                    "launch's device (or pinned host memory)"
                )
        self.fn, self.grid, self.args, self.constexprs, self.options = fn, tuple(grid), args, constexprs, options
        self.device = device

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.constexprs, **self.options)
        if len(_RAN) >= 1024:
            _RAN.clear()
        _RAN.add(self.compile_key())

    @property
    def ran(self) -> bool:
        return self.compile_key() in _RAN

    def compile_key(self) -> tuple:
        """At least what Triton specializes a kernel on: a tensor's dtype and 16-byte alignment, an int's
        being 1, its divisibility by 16 and its width; equal keys run one compiled kernel."""
        spec = tuple(
            (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, torch.Tensor)
            else (a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31))
            if isinstance(a, int) and not isinstance(a, bool)
            else a
            for a in self.args
        )
        return (self.fn, self.device, spec, tuple(self.constexprs.items()), tuple(self.options.items()))

    def graph_key(self) -> tuple:
        """What a captured launch bakes in: the kernel, the grid, every argument's value (a tensor's address)."""
        values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.args)
        return (self.fn, self.grid, values, tuple(self.constexprs.items()), tuple(self.options.items()))


class LaunchSequence:
    """Launches queued one after another, taken as one by ``CopyEngineGroup.fence(then=)``."""

    def __init__(self, *launches: Launch):
        self.launches = launches

    def __call__(self) -> None:
        for one in self.launches:
            one()

    @property
    def ran(self) -> bool:
        return all(one.ran for one in self.launches)

    def graph_key(self) -> tuple:
        return tuple(one.graph_key() for one in self.launches)


_RAN: set[tuple] = set()  # the ``compile_key`` s of the launches queued so far (bounded)


def launch(fn, grid: tuple[int, ...], args: tuple, constexprs: dict, **options) -> Launch:
    """Queue ``fn[grid](*args, **constexprs, **options)`` now; returns the launch."""
    bound = Launch(fn, grid, args, constexprs, **options)
    bound()
    return bound


def nothing() -> None:
    """A launch with nothing to do."""


if triton is not None:
    # A kernel of this module's: whether ``triton.jit`` interprets (``interpreting``).
    @triton.jit
    def _probe(x):
        tl.store(x, 0)
