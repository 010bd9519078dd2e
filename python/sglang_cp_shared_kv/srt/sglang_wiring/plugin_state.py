"""The CP-shared KV cache's tables beside each SGLang KV manager, weakly keyed by it: SGLang's
objects carry no added attribute, and a state goes with its manager."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field


@dataclass
class ManagerState:
    """One KV manager's tables, by bootstrap room unless said otherwise."""

    shares: dict = field(default_factory=dict)  # prefill: transfer.SentShare
    checks: dict = field(default_factory=dict)  # decode: decode_manifest.RoomCheck
    bounds: object = None  # prefill: connector_bounds.RoomBounds
    ready_sockets: dict = field(default_factory=dict)  # by endpoint: sockets connected


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_of(mgr) -> ManagerState:
    """``mgr``'s state, made at first use."""
    return _STATES.get(mgr) or _STATES.setdefault(mgr, ManagerState())
