"""Spawned worker processes for the Mooncake tests, and the prefill/decode steps they run.

A ``Worker`` is one spawned process (never forked: engine sockets would be inherited)
that keeps one ``MooncakeEngine`` and runs module-level step functions on request,
so several test cases reuse the seconds an interpreter with torch + Mooncake costs.

Prefill state is built as CP ranks build it: every sender writes the same seeded
token stream through ``ShardedMLAPool.set_latent / set_index`` and keeps only its
owned rows. The decode worker writes the same stream into a replicated pool
(``PageOwnership(1, ps)``) to compare against.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import time
import traceback
from dataclasses import dataclass

import torch

WORKER_ENV = {
    "MC_FORCE_TCP": "1",
    "MC_LOG_LEVEL": "WARNING",
    "MC_TRANSFER_TIMEOUT": "5",
    "OMP_NUM_THREADS": "1",
}


# ---------------------------------------------------------------------------- workers
def _serve(conn, env):
    os.environ.update(env)
    torch.set_num_threads(1)
    state: dict = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the test process is gone
            return
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send((True, fn(state, *args)))
        except BaseException:
            conn.send((False, traceback.format_exc()))
    for obj in list(state.get("closers", [])):
        try:
            obj.close()
        except Exception:
            pass


class Worker:
    """A spawned process running ``fn(state, *args)`` calls one at a time."""

    def __init__(self, name: str, env: dict | None = None):
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, {**WORKER_ENV, **(env or {})}), name=name, daemon=True)
        self.proc.start()
        child.close()
        self._pending = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, fn, *args) -> None:
        assert not self._pending, f"{self.name}: a call is already in flight"
        self._conn.send((fn, args))
        self._pending = True

    def recv(self, timeout_s: float = 120.0):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.name} did not answer within {timeout_s} s")
        self._pending = False
        ok, out = self._conn.recv()
        if not ok:
            raise RuntimeError(f"{self.name} raised:\n{out}")
        return out

    def call(self, fn, *args, timeout_s: float = 120.0):
        self.send(fn, *args)
        return self.recv(timeout_s)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def request_stop(self) -> None:
        if self.proc.is_alive() and not self._pending:
            try:
                self._conn.send(None)
            except OSError:
                pass

    def stop(self) -> None:
        self.request_stop()
        self.proc.join(10)
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
            self.proc.join(10)
        self._conn.close()


def stop_all(workers) -> None:
    """Stop workers concurrently (each tears down its engine)."""
    for w in workers:
        w.request_stop()
    for w in workers:
        w.stop()


def call_all(workers, fn, args_per_worker, timeout_s: float = 120.0):
    """Run ``fn`` on every worker at once; return the results in order."""
    for w, args in zip(workers, args_per_worker):
        w.send(fn, *args)
    return [w.recv(timeout_s) for w in workers]


class FramedClient:
    """A blocking socket speaking the control protocol by hand, for playing a peer in tests."""

    def __init__(self, sock):
        self.sock = sock
        self.sock.settimeout(15)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(struct.pack("!I", len(data)) + data)

    def send(self, msg) -> None:
        from sglang_cp_shared_kv.reference.mooncake import control_messages as cm

        self.send_raw(cm.encode(msg))

    def recv(self):
        """The next message that is not a heartbeat."""
        from sglang_cp_shared_kv.reference.mooncake import control_messages as cm

        while True:
            (n,) = struct.unpack("!I", self._read(4))
            msg = cm.decode(self._read(n))
            if not isinstance(msg, cm.Heartbeat):
                return msg

    def expect(self, kind):
        msg = self.recv()
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg}"
        return msg

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "peer closed the connection"
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One prefill CP group (``n`` ranks) and the requests it sends to one decode server."""

    n: int
    page_size: int
    kv_format: str
    layers: int
    phys_pages: int  # per sender rank
    requests: tuple[tuple[str, int, bool], ...]  # (request id, pages, fragmented)
    seed: int = 0

    @property
    def decode_pages(self) -> int:
        return sum(p for _, p, _ in self.requests) + 8


def page_tables(case: Case) -> dict[str, torch.Tensor]:
    """Each request's logical pages, identical in every process.

    A fragmented request's pages are shuffled among the positions of each owner:
    still owner-balanced, but no two owned pages are contiguous in both pools.
    """
    from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
    from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

    alloc = BalancedPageAllocator(PageOwnership(case.n, case.page_size), case.phys_pages)
    g = torch.Generator().manual_seed(case.seed + 7)
    tables = {}
    for i, (rid, n_pages, fragmented) in enumerate(case.requests):
        table = alloc.alloc(n_pages, first_owner=i % case.n)
        assert table is not None, "case needs more phys_pages"
        if fragmented:
            for r in range(case.n):
                pos = torch.nonzero(table % case.n == r).flatten()
                table[pos] = table[pos[torch.randperm(pos.numel(), generator=g)]]
        tables[rid] = table
    return tables


def write_stream(pool, case: Case, tables: dict[str, torch.Tensor]) -> None:
    """Write every request's seeded KV (last page partly filled) through the pool's masked store."""
    ps = case.page_size
    for i, (rid, n_pages, _) in enumerate(case.requests):
        table = tables[rid]
        tokens = n_pages * ps - min(3, ps - 1)
        locs = (table[:, None] * ps + torch.arange(ps)).flatten()[:tokens]
        for layer in range(case.layers):
            g = torch.Generator().manual_seed((case.seed * 1000 + i) * 100 + layer)
            rows = torch.empty(tokens, pool.row_bytes, dtype=torch.uint8).random_(generator=g)
            k = torch.empty(tokens, 128, dtype=torch.uint8).random_(generator=g)
            scale = torch.rand(tokens, generator=g)
            pool.set_latent(layer, locs, rows)
            pool.set_index(layer, locs, k, scale)


def _engine(state):
    from sglang_cp_shared_kv.reference.mooncake.engine import MooncakeEngine

    if "engine" not in state:
        state["engine"] = MooncakeEngine()
    return state["engine"]


# ---------------------------------------------------------------------------- decode steps
def decode_start(state, case: Case, timeout_s: float | None = None, with_reference: bool = True) -> str:
    from sglang_cp_shared_kv.reference.mooncake.decode_pool import make_decode_pool
    from sglang_cp_shared_kv.reference.mooncake.decode_receiver import DecodeReceiver
    from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
    from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

    pool = make_decode_pool(case.page_size, case.decode_pages, case.layers, case.kv_format)
    receiver = DecodeReceiver(pool, _engine(state), cp_size=case.n, timeout_s=timeout_s).start()
    state.update(case=case, pool=pool, receiver=receiver, closers=[receiver])
    if with_reference:
        tables = page_tables(case)
        ref = ShardedMLAPool(PageOwnership(1, case.page_size), 0, case.n * case.phys_pages, case.layers, case.kv_format)
        write_stream(ref, case, tables)
        state.update(tables=tables, reference=ref)
    return receiver.address


def decode_add(state, request_ids, wait_senders_s: float = 60.0) -> dict[str, list[int]]:
    receiver, case = state["receiver"], state["case"]
    assert receiver.wait_for_senders(wait_senders_s), f"senders connected: {receiver.connected_ranks}"
    pages = dict((rid, n) for rid, n, _ in case.requests)
    out = {}
    for rid in request_ids:
        dst = receiver.add_request(rid, pages[rid])
        assert dst is not None
        out[rid] = dst.tolist()
    return out


def decode_wait(state, request_ids, timeout_s: float = 60.0) -> dict[str, tuple[str, str]]:
    receiver = state["receiver"]
    return {rid: (receiver.wait(rid, timeout_s).name, receiver.failure_reason(rid)) for rid in request_ids}


def decode_verify(state, request_ids) -> dict[str, bool]:
    """Byte-for-byte: decode page ``dst[p]`` == replicated pool page ``page_table[p]``, every layer, both buffers."""
    receiver, pool, ref, tables = state["receiver"], state["pool"], state["reference"], state["tables"]
    out = {}
    for rid in request_ids:
        dst, table = receiver.dst_pages(rid), tables[rid]
        ok = True
        for layer in range(pool.num_layers):
            ok &= torch.equal(pool.latent_pages(layer)[dst], ref.latent_pages(layer)[table])
            ok &= torch.equal(pool.index[layer][dst], ref.index[layer][table])
        out[rid] = bool(ok)
    return out


def decode_release(state, request_ids) -> int:
    """Release the requests; return the free page count after the pool settles."""
    receiver = state["receiver"]
    for rid in request_ids:
        receiver.release(rid)
    return receiver.allocator.free_pages


def decode_status(state, request_ids) -> dict:
    receiver = state["receiver"]
    return {
        "states": {rid: receiver.poll(rid).name for rid in request_ids},
        "reasons": {rid: receiver.failure_reason(rid) for rid in request_ids},
        "held": {rid: receiver.pages_held(rid) for rid in request_ids},
        "free_pages": receiver.allocator.free_pages,
        "rejected": list(receiver.rejected),
        "loop_errors": list(receiver.loop_errors),
    }


def decode_wait_free(state, want_free: int, timeout_s: float) -> int:
    receiver = state["receiver"]
    deadline = time.monotonic() + timeout_s
    while receiver.allocator.free_pages != want_free and time.monotonic() < deadline:
        time.sleep(0.02)
    return receiver.allocator.free_pages


def decode_extra_pages(state, n_pages: int) -> tuple[list[int], int, int]:
    """Take pages outside any transfer and give them back: (pages, free while held, free after)."""
    receiver = state["receiver"]
    pages = receiver.alloc_pages(n_pages)
    held = receiver.free_page_count
    receiver.free_pages(pages)
    return pages.tolist(), held, receiver.free_page_count


def decode_close(state) -> None:
    state["receiver"].close()
    for key in ("receiver", "pool", "reference", "tables", "case"):
        state.pop(key, None)
    state["closers"] = []


# ---------------------------------------------------------------------------- sender steps
def sender_start(state, case: Case, rank: int, address: str, timeout_s: float | None = None) -> None:
    from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
    from sglang_cp_shared_kv.reference.mooncake.owned_page_sender import OwnedPageSender
    from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
    from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

    own = PageOwnership(case.n, case.page_size)
    pool = ShardedMLAPool(own, rank, case.phys_pages, case.layers, case.kv_format)
    tables = page_tables(case)
    write_stream(pool, case, tables)
    # this rank's copy of the (replicated) prefill allocator, holding every request's pages
    alloc = BalancedPageAllocator(own, case.phys_pages)
    for i, (_, n_pages, _) in enumerate(case.requests):
        alloc.alloc(n_pages, first_owner=i % case.n)
    sender = OwnedPageSender(pool, _engine(state), address, timeout_s=timeout_s).start()
    state.update(case=case, pool=pool, sender=sender, tables=tables, alloc=alloc, closers=[sender])


def sender_status(state, request_ids) -> dict:
    sender = state["sender"]
    return {
        "states": {rid: sender.poll(rid).name for rid in request_ids},
        "reasons": {rid: sender.result(rid).reason for rid in request_ids},
        "rejected": list(sender.rejected),
        "lost": sender.decode_lost,
        "loop_errors": list(sender.loop_errors),
    }


def sender_submit_nowait(state, request_ids) -> None:
    for rid in request_ids:
        state["sender"].submit(rid, state["tables"][rid])


def sender_wait_dst(state, request_ids, timeout_s: float = 30.0) -> bool:
    sender = state["sender"]
    deadline = time.monotonic() + timeout_s
    while any(sender.destination_pages(r) is None for r in request_ids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sender_submit(state, request_ids, until: str = "finished", timeout_s: float = 60.0) -> dict:
    """Submit; return when every request is finished (or, with ``until='transferring'``, has left WAITING)."""
    from sglang_cp_shared_kv.reference.mooncake.transfer_state import TransferState

    sender = state["sender"]
    t0 = time.monotonic()
    for rid in request_ids:
        sender.submit(rid, state["tables"][rid])
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        states = [sender.poll(rid) for rid in request_ids]
        if all(s.finished for s in states) or (
            until == "transferring" and all(s != TransferState.WAITING for s in states)
        ):
            break
        time.sleep(0.002)
    return {"submitted_at": t0, "states": {rid: sender.poll(rid).name for rid in request_ids}}


def sender_finish(state, request_ids, timeout_s: float = 60.0) -> dict:
    """Wait for the requests, free their prefill pages (as the scheduler would), return the results."""
    sender, alloc, tables = state["sender"], state["alloc"], state["tables"]
    out = {}
    for rid in request_ids:
        sender.wait(rid, timeout_s)
        done_at = time.monotonic()
        res = sender.pop(rid)
        alloc.free(tables[rid])
        out[rid] = {**vars(res), "state": res.state.name, "done_at": done_at}
    out["_used_pages"] = alloc.used_pages(state["pool"].rank)  # pages of requests not finished here
    out["_page_bytes"] = state["pool"].page_bytes
    out["_lost"] = sender.decode_lost
    return out


def sender_finish_after_submit(state, request_ids) -> dict:
    sender_submit(state, request_ids, "transferring")
    return sender_finish(state, request_ids)


def sender_close(state) -> None:
    state["sender"].close()
    for key in ("sender", "pool", "tables", "alloc", "case"):
        state.pop(key, None)
    state["closers"] = []
