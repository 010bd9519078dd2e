"""Argument checks shared by the CP-shared KV cache's modules (no torch)."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, lo: int) -> None:
    """Raise ``ValueError("<name> must be an int >= <lo>, got <value!r>")`` unless ``value`` is an int >= ``lo``."""
    if not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
