"""What the CP-shared KV cache keeps about an SGLang KV manager, beside it: one ``ManagerState`` per manager.

The states live in a ``weakref.WeakKeyDictionary`` keyed by the manager, so SGLang's objects carry no
added attribute and a state goes with its manager. Each hook module reads and writes only its own
fields.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ManagerState:
    """The tables kept for one KV manager, each by bootstrap room unless said otherwise."""

    shares: dict = field(default_factory=dict)  # prefill: what this rank sent, for its manifest (transfer.SentShare)
    sent: dict = field(default_factory=dict)  # prefill, debug: the request's pages seen, the positions sent
    checks: dict = field(default_factory=dict)  # decode: manifests expected and received (decode_manifest)
    bounds: Any = None  # prefill: the connector's per-room tables bounded (connector_bounds.RoomBounds)
    ready_sockets: dict = field(default_factory=dict)  # by endpoint: status sockets that connected


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_of(mgr) -> ManagerState:
    """``mgr``'s state, made at first use."""
    state = _STATES.get(mgr)
    if state is None:
        state = _STATES[mgr] = ManagerState()
    return state


def state_if_any(mgr) -> ManagerState | None:
    """``mgr``'s state, or None where no hook has made one."""
    return _STATES.get(mgr)
