"""The ``--enable-cp-shared-kv`` flag: its name, and whether a server-args record (or this process) has it on."""

from __future__ import annotations

from typing import Any

FLAG = "--enable-cp-shared-kv"
ATTR = "enable_cp_shared_kv"


def enabled(server_args: Any) -> bool:
    """Whether a server-args record (or a resolving view of one) has the flag on."""
    return bool(getattr(server_args, ATTR, False))


def runtime_enabled() -> bool:
    """Whether the server args published in this process have the flag on (False before any are published,
    e.g. for a pool built by a test)."""
    from sglang.srt.runtime_context import get_context

    try:
        server_args = get_context().server_args
    except ValueError:  # "Global server args is not set yet!"
        return False
    return enabled(server_args)


def manager_enabled(mgr: Any, mode: str) -> bool:
    """Whether ``mgr`` is a KV manager of disaggregation ``mode`` (``"prefill"``, ``"decode"``) in a process
    with the flag on."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(mgr, "disaggregation_mode", None) == DisaggregationMode(mode) and runtime_enabled()
