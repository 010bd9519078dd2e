"""A thin wrapper over ``mooncake.engine.TransferEngine`` for page writes.

What it adds over the raw engine:

- peer-to-peer handshake on one host address (no metadata server), TCP forced by
  default (``MC_FORCE_TCP=1``: on this build the protocol argument alone does not pick
  the transport);
- memory registration by tensor, undone on ``close``;
- ``write`` splits a list of (src, dst, length) entries into calls of at most
  ``max_entries_per_call`` (the TCP transport fails larger batches once a peer's
  queue is full) and raises ``TransferError`` on the first failed call.

The engine's own timeout, ``MC_TRANSFER_TIMEOUT`` (seconds, minimum 5), bounds every
call: a dead peer fails a call in well under a second, a frozen one after the timeout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

MAX_ENTRIES_PER_CALL = 1024
_ENGINE_MIN_TIMEOUT_S = 5.0
_ENGINE_DEFAULT_TIMEOUT_S = 30.0


class TransferError(RuntimeError):
    """A batch write to a peer failed (peer dead, frozen past the timeout, or out-of-range address)."""

    def __init__(self, message: str, calls: int = 0):
        super().__init__(message)
        self.calls = calls  # calls made, the failed one included


def transfer_timeout_s() -> float:
    """The engine's transfer timeout as it will apply it: ``MC_TRANSFER_TIMEOUT``, at least 5 s."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT", "")
    try:
        value = float(raw) if raw else _ENGINE_DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"MC_TRANSFER_TIMEOUT must be a number of seconds, got {raw!r}") from None
    return max(value, _ENGINE_MIN_TIMEOUT_S)


class MooncakeEngine:
    """One transfer engine per process; share it between every sender and receiver there."""

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        max_entries_per_call: int = MAX_ENTRIES_PER_CALL,
    ):
        if not isinstance(max_entries_per_call, int) or not 1 <= max_entries_per_call <= MAX_ENTRIES_PER_CALL:
            raise ValueError(
                f"max_entries_per_call must be in [1, {MAX_ENTRIES_PER_CALL}], got {max_entries_per_call!r}"
            )
        if protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        from mooncake.engine import TransferEngine  # imported late: it links libibverbs

        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}"
            )
        self.hostname = hostname
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self.max_entries_per_call = max_entries_per_call
        self._registered: dict[int, int] = {}  # address -> length

    def __repr__(self) -> str:
        return f"MooncakeEngine(session_id={self.session_id!r}, registered={len(self._registered)})"

    # -- memory --
    def register(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor's bytes as a transfer source / destination."""
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous to be registered")
        addr, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if addr in self._registered:
            return
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise RuntimeError(f"register_memory({addr:#x}, {length}) returned {rc}")
        self._registered[addr] = length

    def unregister(self, tensor: torch.Tensor) -> None:
        addr = tensor.data_ptr()
        if self._registered.pop(addr, None) is not None:
            self._engine.unregister_memory(addr)

    def is_registered(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` lies inside one registered region."""
        return any(base <= addr and addr + length <= base + size for base, size in self._registered.items())

    # -- transfer --
    def write(
        self,
        peer_session_id: str,
        src: Sequence[int] | np.ndarray,
        dst: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        should_continue=None,
    ) -> int:
        """Write ``lengths[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``; return the call count.

        ``should_continue()`` (optional) is checked before every call: a request failed
        elsewhere stops writing after at most one call instead of finishing the batch.
        """
        src, dst, lengths = (np.asarray(a, dtype=np.int64) for a in (src, dst, lengths))
        if not src.shape == dst.shape == lengths.shape or src.ndim != 1:
            raise ValueError(
                f"src, dst, lengths must be 1-D of one length, got {src.shape}, {dst.shape}, {lengths.shape}"
            )
        step = self.max_entries_per_call
        calls = 0
        for start in range(0, src.shape[0], step):
            if should_continue is not None and not should_continue():
                raise TransferError(
                    f"write to {peer_session_id} stopped after {calls} calls: request no longer live", calls
                )
            end = start + step
            rc = self._engine.batch_transfer_sync_write(
                peer_session_id, src[start:end].tolist(), dst[start:end].tolist(), lengths[start:end].tolist()
            )
            calls += 1
            if rc != 0:
                raise TransferError(
                    f"batch_transfer_sync_write to {peer_session_id} returned {rc} on call {calls} "
                    f"(entries {start}..{min(end, src.shape[0]) - 1})",
                    calls,
                )
        return calls

    def close(self) -> None:
        for addr in list(self._registered):
            self._engine.unregister_memory(addr)
        self._registered.clear()
