"""Argument checks shared by the plugin and the reference stack (no torch)."""

from __future__ import annotations

import os
from typing import Any


def check_int(name: str, value: Any, lo: int) -> None:
    """Raise ``ValueError("<name> must be an int >= <lo>, got <value!r>")`` unless ``value`` is an int >= ``lo``."""
    if not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def env_int(name: str, default: int, lo: int) -> int:
    """The int in ``$name`` (``default`` when unset or blank); a value that is not an int >= ``lo`` raises
    ``ValueError("<name> must be an int >= <lo>, got '<raw>'")``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {raw!r}")
    return int(raw)
