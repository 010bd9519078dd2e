"""Argument checks and small helpers shared by the CP-shared KV cache's modules (this module imports without torch)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def check_int(name: str, value: Any, lo: int) -> None:
    """Raise ``ValueError("<name> must be an int >= <lo>, got <value!r>")`` unless ``value`` is an int >= ``lo``."""
    if not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def check_page_size(page_size: Any) -> None:
    """Raise ``ValueError`` unless ``page_size`` is a power of two (page ownership is shift/mask arithmetic)."""
    if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size!r}")


def env_int(name: str, default: int, lo: int) -> int:
    """The int in ``$name`` (``default`` when unset or blank); a value that is not an int >= ``lo`` raises
    ``ValueError("<name> must be an int >= <lo>, got '<raw>'")``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {raw!r}")
    return int(raw)


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream, for a launcher or driver call that takes one.

    Without building a ``torch.cuda.Stream`` (``torch.cuda.current_stream(device)`` cost ~10 µs of
    host time per call on an H200 host: ``docs/benchmarks/host_calls.json``).
    """
    index = device.index
    if index is None:
        import torch  # here, not at the top: this module imports without torch

        index = torch.cuda.current_device()
    return _raw_stream(index)


_RAW_STREAM = None  # torch's raw current-stream getter, looked up once (host time)


def _raw_stream(index: int) -> int:
    global _RAW_STREAM
    raw = _RAW_STREAM
    if raw is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:

            def raw(i: int) -> int:
                return torch.cuda.current_stream(i).cuda_stream

        _RAW_STREAM = raw
    return raw(index)


# Stream objects by (device index, raw handle): see ``current_stream``.
_STREAMS: dict[tuple[int, int], Any] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, built once per stream and looked up by its raw handle after
    that: an event's ``record`` and ``wait`` take a ``Stream``, which costs tens of µs of host time to
    build on a busy host (``docs/benchmarks/vs_upstream_1gpu_host_profile.txt``)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, _raw_stream(index))
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream
