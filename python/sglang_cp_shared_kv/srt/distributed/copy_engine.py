"""Copy-engine all-gather for CP ranks on one node: no SMs, no host sync.

Every rank pulls its peers' parts of a view from their CUDA-IPC-mapped buffers
(``cuMemcpyDtoDAsync``), ordered by 64-bit counters it waits on in its own memory.
Per call ``k`` (the same on every rank), on the caller's stream::

    ready[me] := k on every peer          (after this rank's part is written)
    wait ready[p] >= k; pull p's part      (every peer p)
    ack[me]   := k on every peer           (done reading the peers' parts)
    wait ack[p] >= k                       (no peer reads this rank's part any more)

``ack=False`` (calls alternating two buffer sets): the next write into a set follows
the next call's wait for ``ready[p] >= k + 1``, sent after the peers' pulls of ``k``;
end with an acked call or ``finish_reads``. With ``sources`` (the peers' pools mapped),
one ``fence`` per batch orders the pools across ranks.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import socket
from collections.abc import Callable, Sequence

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup, PendingCollective, check_pairs
from sglang_cp_shared_kv.srt.distributed.peer_watchdog import PeerWatchdog
from sglang_cp_shared_kv.srt.environ import envs

logger = logging.getLogger(__name__)


class CopyEngineUnavailable(RuntimeError):
    """The copy engines cannot run here (no CUDA driver, ranks on several nodes)."""


class _Driver:
    """The driver calls the copy engines need (cuda-python); errors name the call."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:
            msg = f"cuda-python's driver bindings cannot be imported: {e}"
            raise CopyEngineUnavailable(msg) from e
        self.cu = cu
        self._mapped: dict[bytes, list[int]] = {}  # handle -> [address, opens]

    def _call(self, name: str, *args) -> tuple:
        result = getattr(self.cu, name)(*args)
        if result[0]:
            raise RuntimeError(f"{name} failed: {result[0].name} ({int(result[0])})")
        return result[1:]

    def write64(self, stream: int, address: int, value: int) -> None:
        self._call("cuStreamWriteValue64", stream, address, value, 0)

    def wait64(self, stream: int, address: int, value: int, flags: int) -> None:
        self._call("cuStreamWaitValue64", stream, address, value, flags)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("cuMemcpyDtoDAsync", dst, src, nbytes, stream)

    def capture(self, stream: int, body: Callable[[int], None]):
        """What ``body(stream)`` queues on idle ``stream`` (not the legacy default), as
        a graph for ``launch``; an error of ``body`` is raised after capture ends."""
        cu = self.cu
        # Relaxed: other threads' calls are not checked.
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        self._call("cuStreamBeginCapture", stream, mode)
        try:
            body(stream)
        except BaseException:
            _, graph = cu.cuStreamEndCapture(stream)
            if int(graph):  # a null handle where nothing was captured
                cu.cuGraphDestroy(graph)
            raise
        (graph,) = self._call("cuStreamEndCapture", stream)
        try:
            (exe,) = self._call("cuGraphInstantiate", graph, 0)
        finally:
            cu.cuGraphDestroy(graph)
        return exe

    def launch(self, exe, stream: int) -> None:
        self._call("cuGraphLaunch", exe, stream)

    def export(self, t: torch.Tensor) -> tuple[bytes, int]:
        """(IPC handle of the allocation holding ``t``, ``t``'s offset in it)."""
        ptr = t.data_ptr()
        base, _ = self._call("cuMemGetAddressRange", ptr)
        (handle,) = self._call("cuIpcGetMemHandle", base)
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES), ptr - int(base)

    def open(self, handle: bytes) -> int:
        """Map a peer's allocation once per handle; the last ``release`` unmaps it."""
        entry = self._mapped.get(handle)
        if entry is None:
            h = self.cu.CUipcMemHandle()
            ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_BYTES)
            flags = self.cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            (ptr,) = self._call("cuIpcOpenMemHandle", h, flags)
            entry = self._mapped[handle] = [int(ptr), 0]
        entry[1] += 1
        return entry[0]

    def release(self, handle: bytes) -> None:
        entry = self._mapped[handle]
        entry[1] -= 1
        if entry[1] == 0:
            del self._mapped[handle]
            self.cu.cuIpcCloseMemHandle(entry[0])


IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
PULL_CACHE_SIZE = 16  # buffer sets whose pulls a group keeps (a batch uses 1 or 2)
TRANSPORT_ENV = envs.SGLANG_CP_SHARED_KV_TRANSPORT.name
TRANSPORTS = ("auto", "copy_engine", "nccl")
# A failed group's signal rows (ready, ack, fence0, fence1): every wait passes.
RELEASED = (1 << 62, 1 << 62, 1, 1)
WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


@functools.cache  # one per process; a failure is raised again at the next call
def driver() -> _Driver:
    return _Driver()


class CopyEngineGroup:
    """In-place all-gathers inside registered CUDA ``buffers``, by copy engines.
    Collective (same shapes on every rank); ``on_peer_lost``: the fail-stop."""

    backend = "copy_engine"

    def __init__(
        self,
        group: CPGroup,
        buffers: Sequence[torch.Tensor],
        sources: Sequence[Sequence[torch.Tensor]] | None = None,
        on_peer_lost: Callable[[str], None] | None = None,
    ):
        if not buffers or any(not b.is_cuda or not b.is_contiguous() for b in buffers):
            raise ValueError("copy engines need one or more contiguous CUDA buffers")
        self.cpu_group = group
        self.rank, self.size = group.rank, group.size
        self.device = buffers[0].device
        self._driver = driver()
        # ready[p], ack[p], fence0[p], fence1[p]: written by peer p, read by this rank.
        self.signals = torch.zeros(4, self.size, dtype=torch.int64, device=self.device)
        # This rank's counter (a call's ready and ack), copied to the peers.
        self.outbox = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._signals_at = self.signals.data_ptr()
        self._outbox_at = self.outbox.data_ptr()
        self.buffers = [b.view(torch.uint8).view(-1) for b in buffers]
        self._opened: list[bytes] = []  # the peers' handles mapped, released at close
        self._fence_graphs: list = [None, None]  # per parity, at its first fence
        secs = envs.SGLANG_CP_SHARED_KV_PEER_TIMEOUT.get()
        self.watchdog = PeerWatchdog(secs, self._laggards, self._release, on_peer_lost)
        torch.cuda.current_stream(self.device).synchronize()  # sync-ok: at setup
        shapes = [(tuple(b.shape), b.dtype) for b in buffers]
        mapped, failed = self._map_peers("arena", shapes, [self.signals, *self.buffers])
        if failed:  # on every rank alike (``view_group`` falls back)
            self.close()
            raise CopyEngineUnavailable("; ".join(failed))
        self._peer_signals = {p: addresses[0] for p, addresses in mapped.items()}
        self._peer_buffers = {p: addresses[1:] for p, addresses in mapped.items()}
        self.calls = 0
        self.fences = 0  # fences queued so far (the same count on every rank)
        self._one = torch.ones(1, dtype=torch.int64, device=self.device)  # fence word
        self._capture_stream: torch.cuda.Stream | None = None
        self.bytes_received = 0  # pulled from the peers (for benchmarks)
        self._pull_cache: dict[tuple, list[tuple[int, list]]] = {}
        self.source_table: torch.Tensor | None = None
        self.source_strides: list[int] = []
        self._own_sources: list[tuple[int, int]] = []  # (table slot, own pointer)
        self._side: torch.cuda.Stream | None = None  # the watchdog's stream
        if sources:
            self._map_sources(sources)

    def _map_peers(self, what: str, shapes, tensors: list, why: str = "") -> tuple:
        """Export ``tensors`` (None: a hole) and map the peers' alike by CUDA IPC, a
        collective: ``{peer: [address or None]}``, and every rank's failure."""
        mine, mapped = None, {}
        with torch.cuda.device(self.device):  # driver calls act on the current context
            try:  # a custom allocator's memory (expandable segments) may not export
                if not why:
                    mine = [t if t is None else self._driver.export(t) for t in tensors]
            except RuntimeError as e:
                why = f"exporting this rank's {what} by CUDA IPC failed: {e}"
            everyone = self.cpu_group.all_gather_object((shapes, mine, why))
            for p, (their_shapes, exports, their_why) in enumerate(everyone):
                if p == self.rank or why or their_why:  # a failed rank tells its own
                    continue
                if their_shapes != shapes:
                    mismatch = f"{what} buffers {their_shapes}, this rank {shapes}"
                    why = f"rank {p} registered {mismatch}: they must match"
                    continue
                try:
                    mapped[p] = [self._open(entry) for entry in exports]
                except RuntimeError as e:
                    why = f"opening rank {p}'s {what} by CUDA IPC failed: {e}"
        whys = self.cpu_group.all_gather_object(why)
        return mapped, [f"rank {p}: {w}" for p, w in enumerate(whys) if w]

    def _open(self, export: tuple[bytes, int] | None) -> int | None:
        if export is None:
            return None
        address = self._driver.open(export[0]) + export[1]
        self._opened.append(export[0])
        return address

    def _map_sources(self, sources: Sequence[Sequence[torch.Tensor]]) -> None:
        """Map the peers' pages (``sources[layer][k]``: uint8 ``[P, W]`` or empty).
        Collective: if any rank cannot, none maps them."""
        kinds = len(sources[0])
        flat = [t for layer in sources for t in layer]
        used = [t for t in flat if t.numel()]
        why = ""
        if kinds > 2 or any(len(layer) != kinds for layer in sources):
            why = "one or two page buffers per layer are needed"
        elif any(t.dtype != torch.uint8 or t.stride(1) != 1 for t in used):
            why = "page buffers must be uint8 rows"
        elif any(x % 4 for t in used for x in (t.shape[1], t.stride(0), t.data_ptr())):
            why = "page rows must be int32 words, 4-byte aligned"
        shapes = [(tuple(t.shape), t.stride(0) if t.numel() else 0) for t in flat]
        tensors = [t if t.numel() else None for t in flat]
        mapped, failed = self._map_peers("pool", (kinds, shapes), tensors, why)
        if failed:
            logger.info("CP-shared KV: views all-gathered by the copy engines (pools not mapped: %s)", failed[0])
            return
        table = [[[0] * self.size for _ in range(2)] for _ in sources]  # [layers, 2, N]
        for i, t in enumerate(tensors):
            row = table[i // kinds][i % kinds]
            row[self.rank] = 0 if t is None else t.data_ptr()
            for p, addresses in mapped.items():
                row[p] = addresses[i] or 0
        self.source_table = torch.tensor(table, dtype=torch.int64).to(self.device)  # sync-ok: at registration
        at = self.source_table.data_ptr()
        rows = [row for layer in table for row in layer]  # [layers * 2] of N
        self._own_sources = [
            (at + (i * self.size + p) * 8, row[self.rank]) for i, row in enumerate(rows) for p in self._peer_signals
        ]
        # Words from one page to the next, per buffer kind (alike in every layer).
        self.source_strides = [
            next((layer[k].stride(0) // 4 for layer in sources if layer[k].numel()), 0) for k in range(kinds)
        ]

    def fence(self, stream: torch.cuda.Stream | None = None) -> None:
        """Queue on ``stream`` a point no rank's stream passes before all reach it.
        Fence ``f`` sets word ``f % 2`` on every peer, waits for the peers' and resets
        it (set again only past fence ``f + 1``, which waits for this reset). One graph
        per parity: queued call by call, a fence blocked on a dead peer kept the
        watchdog's line from going out."""
        self.watchdog.check()
        stream = self._stream(stream)
        q = self.fences % 2
        self.fences += 1
        if self._fence_graphs[q] is None:
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.device)
            capture = self._capture_stream.cuda_stream
            graph = self._driver.capture(capture, lambda h: self._fence_calls(h, q))
            self._fence_graphs[q] = graph
        self._driver.launch(self._fence_graphs[q], stream.cuda_stream)
        self._watch(stream, ("fence", self.fences))

    def _fence_calls(self, stream: int, q: int) -> None:
        d, one, row = self._driver, self._one.data_ptr(), 2 + q
        d.write64(stream, one, 1)  # the barrier: earlier work visible
        for peer in self._peer_signals.values():
            d.copy(peer + (row * self.size + self.rank) * 8, one, 8, stream)
        mine = [self._slot(row, p) for p in self._peer_signals]
        for slot in mine:
            d.wait64(stream, slot, 1, WAIT_EQ)
        for slot in mine:
            d.write64(stream, slot, 0)

    def _slot(self, row: int, p: int) -> int:  # of ``signals[row][p]``
        return self._signals_at + (row * self.size + p) * 8

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device) if stream is None else stream

    def _watch(self, stream: torch.cuda.Stream, what: tuple[str, int]) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        self.watchdog.watch(event.query, what)

    def _laggards(self, what: tuple[str, int]) -> list[int]:
        """The peers whose signal for ``what`` has not arrived (on a side stream)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._side_stream()):
            signals = self.signals.cpu().tolist()  # sync-ok: the watchdog's thread
        kind, n = what
        if kind == "fence":
            return [p for p in self._peer_signals if signals[2 + (n - 1) % 2][p] != 1]
        return [p for p in self._peer_signals if min(signals[0][p], signals[1][p]) < n]

    def _release(self) -> None:
        """Satisfy this failed rank's waits for its peers by stream memory writes
        (a kernel could wait for SMs held by work queued behind the blocked wait)."""
        d, side = self._driver, self._side_stream()
        writes = list(self._own_sources)  # pulls read this rank's pool, not a dead one
        for p in self._peer_signals:
            writes += [(self._slot(row, p), v) for row, v in enumerate(RELEASED)]
        with torch.cuda.device(self.device):
            for at, value in writes:
                d.write64(side.cuda_stream, at, value)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def close(self) -> None:
        """Unmap the peers' allocations (after the last call has run)."""
        self.watchdog.close()
        graphs, self._fence_graphs = self._fence_graphs, [None, None]
        for exe in graphs:
            if exe is not None:
                self._driver.cu.cuGraphExecDestroy(exe)
        opened, self._opened = self._opened, []
        with torch.cuda.device(self.device):
            for handle in opened:
                self._driver.release(handle)
        self._peer_signals, self._peer_buffers, self._pull_cache = {}, {}, {}

    def all_gather_object(self, obj: object) -> list[object]:
        return self.cpu_group.all_gather_object(obj)

    def _signal(self, stream: int, which: int) -> None:
        """Queue ``signals[which][me] := outbox`` on every peer (a copy each)."""
        d, src = self._driver, self._outbox_at
        slot = (which * self.size + self.rank) * 8  # int64 signals
        for peer in self._peer_signals.values():
            d.copy(peer + slot, src, 8, stream)

    def _locate(self, out: torch.Tensor, local: torch.Tensor) -> tuple[int, ...]:
        """(registered buffer, ``out``'s address and offset in it, bytes per part)."""
        n = local.shape[0]
        if out.shape != (n * self.size, *local.shape[1:]) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{self.size} * {n}, ...], got {tuple(out.shape)}")
        part, ptr = local.numel() * local.element_size(), out.data_ptr()
        if local.data_ptr() != ptr + self.rank * part:
            raise ValueError("a copy-engine all-gather is in place: local must be this rank's part of out")
        for i, buf in enumerate(self.buffers):
            base = buf.data_ptr()
            if base <= ptr and ptr + part * self.size <= base + buf.numel():
                return i, ptr, ptr - base, part
        raise ValueError("out lies outside every registered buffer")

    def _pulls(self, outs, locals_) -> list[tuple[int, list]]:
        """Per peer: ``(ready address, [(dst, src, bytes)])``, cached per buffer set."""
        key: tuple = (len(outs),)
        for t in (*outs, *locals_):
            key += (t.data_ptr(), t.numel(), t.is_contiguous(), t.dtype)
        found = self._pull_cache.get(key)
        if found is not None:
            return found
        check_pairs(outs, locals_)
        spans = [self._locate(out, local) for out, local in zip(outs, locals_)]
        for out in outs:
            if out.device != self.device:
                msg = f"out is on {out.device}, the registered buffers on {self.device}"
                raise ValueError(msg)
        found = []
        for p in sorted(self._peer_signals):
            src = self._peer_buffers[p]
            copies = [(dst + p * n, src[i] + at + p * n, n) for i, dst, at, n in spans]
            found.append((self._slot(0, p), copies))
        if len(self._pull_cache) >= PULL_CACHE_SIZE:
            self._pull_cache.clear()
        self._pull_cache[key] = found
        return found

    def all_gather_into_many(
        self,
        outs: Sequence[torch.Tensor],
        locals_: Sequence[torch.Tensor],
        *,
        stream: torch.cuda.Stream | None = None,
        ack: bool = True,
    ) -> PendingCollective:
        """``outs[i][p * n : (p + 1) * n]`` <- rank ``p``'s part, queued on ``stream``
        (no wait needed). ``ack=False``: see the module docstring."""
        self.watchdog.check()
        pulls = self._pulls(outs, locals_)
        d, torch_stream = self._driver, self._stream(stream)
        h = torch_stream.cuda_stream
        # Ready once my part is written; the same word is the ack after the pulls.
        self.calls += 1
        k = self.calls
        d.write64(h, self._outbox_at, k)
        self._signal(h, 0)
        for ready, copies in pulls:
            d.wait64(h, ready, k, WAIT_GEQ)
            for dst, src, nbytes in copies:
                d.copy(dst, src, nbytes, h)
                self.bytes_received += nbytes
        if ack:
            self._finish_reads(torch_stream, k)
        return PendingCollective()

    def finish_reads(self, stream: torch.cuda.Stream | None = None) -> None:
        """Ack the last call (after ``ack=False`` ones) before ``stream`` writes."""
        self.watchdog.check()
        self._finish_reads(self._stream(stream), self.calls)

    def _finish_reads(self, stream: torch.cuda.Stream, k: int) -> None:
        h = stream.cuda_stream
        self._signal(h, 1)  # ack := k (the outbox) on every peer
        for p in self._peer_signals:
            self._driver.wait64(h, self._slot(1, p), k, WAIT_GEQ)
        self._watch(stream, ("all-gather", k))


def transport_setting(setting: str | None = None) -> str:
    """``setting``, else ``$SGLANG_CP_SHARED_KV_TRANSPORT`` (see ``environ.Envs``)."""
    raw = setting or envs.SGLANG_CP_SHARED_KV_TRANSPORT.get().strip() or "auto"
    if raw not in TRANSPORTS:
        msg = f"{TRANSPORT_ENV} must be one of {', '.join(TRANSPORTS)}, got {raw!r}"
        raise ValueError(msg)
    return raw


def view_group(
    group: CPGroup,
    buffers: Sequence[torch.Tensor],
    setting: str | None = None,
    sources: Sequence[Sequence[torch.Tensor]] | None = None,
    on_peer_lost: Callable[[str], None] | None = None,
) -> CPGroup | CopyEngineGroup:
    """The group that all-gathers views in ``buffers``, alike on every rank: copy
    engines (CUDA buffers, the driver on every rank, one host) or ``group``."""
    setting = transport_setting(setting)
    if setting == "nccl" or not buffers or not buffers[0].is_cuda:
        if setting == "copy_engine":
            msg = f"{TRANSPORT_ENV}=copy_engine needs CUDA view buffers"
            raise CopyEngineUnavailable(msg)
        return group
    try:
        driver()
        why = ""
    except CopyEngineUnavailable as e:
        why = str(e)
    votes = group.all_gather_object((socket.gethostname(), why))
    reasons = [f"rank {r}: {w}" for r, (_, w) in enumerate(votes) if w]
    if len({h for h, _ in votes}) != 1:
        reasons.append(f"CP ranks on {len({h for h, _ in votes})} hosts")
    if reasons:
        return fall_back(group, setting, "; ".join(reasons))
    try:
        ce = CopyEngineGroup(group, buffers, sources, on_peer_lost)
    except CopyEngineUnavailable as e:  # raised on every rank alike
        return fall_back(group, setting, str(e))
    logger.info("CP-shared KV: views all-gathered by the copy engines (%d ranks on one node)", group.size)
    return ce


def fall_back(group: CPGroup, setting: str, why: str) -> CPGroup:
    """``group`` as the copy engines cannot run (``why``); an error if required."""
    if setting == "copy_engine":
        raise CopyEngineUnavailable(f"{TRANSPORT_ENV}=copy_engine cannot run: {why}")
    instead = f"the CP group's {group.backend} collectives instead"
    if group.backend == "nccl":
        instead += ", which run on SMs, with no layer-ahead prefetch"
    logger.warning(f"CP-shared KV: copy engines unavailable ({why}): views all-gathered by {instead}")
    return group


def prefetch_on(group: CPGroup | CopyEngineGroup | None, requested: bool) -> bool:
    """Whether to prefetch views a layer ahead: if ``requested``, and not over NCCL,
    whose kernels wait for the SMs the layer holds."""
    if requested and getattr(group, "backend", None) == "nccl":
        logger.info("CP-shared KV: layer-ahead prefetch of the views off: they are all-gathered by NCCL")
        return False
    return requested
