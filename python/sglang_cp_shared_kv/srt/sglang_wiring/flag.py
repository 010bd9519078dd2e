"""The ``--enable-cp-shared-kv`` flag; whether a record or this process has it on."""

from __future__ import annotations

from typing import Any

FLAG = "--enable-cp-shared-kv"
ATTR = "enable_cp_shared_kv"


def enabled(server_args: Any) -> bool:
    """Whether a server-args record (or a resolving view of one) has the flag on."""
    return bool(getattr(server_args, ATTR, False))


def runtime_enabled() -> bool:
    """Whether this process's published server args have the flag on (none yet: no)."""
    from sglang.srt.runtime_context import get_context

    try:
        return enabled(get_context().server_args)
    except ValueError:  # "Global server args is not set yet!"
        return False


def manager_enabled(mgr: Any, mode: str) -> bool:
    """Whether ``mgr`` is a KV manager of ``mode`` ("prefill", "decode"), flag on."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    of_mode = getattr(mgr, "disaggregation_mode", None) == DisaggregationMode(mode)
    return of_mode and runtime_enabled()
