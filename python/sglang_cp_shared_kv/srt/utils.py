"""Argument checks and small helpers shared by the CP-shared KV cache's modules (this module imports without torch)."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, lo: int) -> None:
    """Raise ``ValueError("<name> must be an int >= <lo>, got <value!r>")`` unless ``value`` is an int >= ``lo``."""
    if not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def check_page_size(page_size: Any) -> None:
    """Raise ``ValueError`` unless ``page_size`` is a power of two (page ownership is shift/mask arithmetic)."""
    if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size!r}")
