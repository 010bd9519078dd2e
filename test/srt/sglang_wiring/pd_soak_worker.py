"""The PD soak's two processes: the prefill CP ranks (which also play the router) and the decode.

``python pd_soak_worker.py prefill CONFIG_JSON`` runs N prefill CP ranks in one process: per rank,
SGLang 0.5.23's ``MooncakeKVManager`` in prefill mode over the plugin's CP-shared DSA pool and the
allocator SGLang's configurator builds with the plugin (one per rank, drawing the same pages), a
real Mooncake engine (TCP on 127.0.0.1), SGLang's bootstrap thread and transfer worker, and
SGLang's ``MooncakeKVSender`` per request and rank. It spawns the decode as a child process,
routes requests to both sides, injects the faults (random aborts, one SIGKILL + restart and one
SIGSTOP/SIGCONT of the decode; the link cut where it has one) and prints ``RESULT:{json}``. The
faults fire at request indices (``kill_at``, ``stop_at``, ``partition_at``: fractions of the
requests, reached once the router started that many and the fault's condition holds), never on the
clock; ``faults`` records each one's window (``begin_s``, ``end_s``: seconds since the run's start on
the monotonic clock of every row's times) and ``faults["blacklisted"]`` every window in which a
prefill rank held a decode session in SGLang's ``failed_sessions`` (``BlacklistLog``). Like a PD
router's health gate, the router holds new requests while the live decode's session is blacklisted
(``faults["admission_held_s"]``), so a fault reaches the requests in flight, not every request the
probe window would otherwise fail at once.

``python pd_soak_worker.py decode CONFIG_JSON`` is the decode: SGLang's ``MooncakeKVManager`` in
decode mode with the plugin's manifest check, a stock DSA pool and ``PagedTokenToKVPoolAllocator``
built by SGLang's configurator, SGLang's ``MooncakeKVReceiver`` per request, and SGLang's decode
release policy for failed requests (abort notification to every prefill rank, pages held until
every rank's ABORT_ACK or SGLang's release timeout). It talks to the prefill process over its
stdin/stdout (JSON lines; its stdout carries only lines starting with ``@@``).

The managers are built as in ``test_plugin_decode_manifest`` (``object.__new__`` and the
attributes their methods read), with SGLang's default deferred decode KV release switched on on
both sides. Every ZMQ socket binds or connects to 127.0.0.1; the Mooncake engines are started
with host 127.0.0.1 (metadata mode P2PHANDSHAKE, TCP). Every wait has a deadline.
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The connector and configurator stand-ins of the single-request manifest test, shared.
from test_plugin_decode_manifest import _configurator_build, _kv_args, _prefill_info  # noqa: E402

from reference.sglang_writers import use_torch_writers  # noqa: E402

FLAG = "--enable-cp-shared-kv"
ADDR = "127.0.0.1:1"  # the bootstrap address the decode knows the prefill by (no HTTP is made)
N_AUX = 64


def _env_setup() -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand, for a hang
    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"


class EngineLedger:
    """Counts a real ``MooncakeTransferEngine``'s (de)registrations and batch sizes (pass-through)."""

    def __init__(self, engine: Any, regions: list[tuple[int, int]]):
        self.engine, self.regions = engine, list(regions)
        self.calls = {"register": 0, "deregister": 0, "batch_register": 0, "batch_deregister": 0}
        self.batches, self.entries, self.max_entries, self.failed_batches = 0, 0, 0, 0
        for name in self.calls:
            setattr(engine, name, self._counted(name, getattr(engine, name)))
        inner = engine.batch_transfer_sync

        def batch_transfer_sync(session_id, src, dst, lengths):
            ret = inner(session_id, src, dst, lengths)
            self.batches += 1
            self.entries += len(src)
            self.max_entries = max(self.max_entries, len(src))
            self.failed_batches += int(ret != 0)
            return ret

        engine.batch_transfer_sync = batch_transfer_sync

    def _counted(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return call

    def still_registered(self) -> int:
        """How many of the regions registered at start the engine still holds.

        Registering a held region again fails (Mooncake rejects overlapping regions) and changes
        nothing; a region that succeeds was gone (it is then held again and counted missing).
        """
        held = 0
        for ptr, length in self.regions:
            held += int(self.engine.engine.register_memory(ptr, length) != 0)
        return held

    def report(self) -> dict:
        return {
            "regions_at_start": len(self.regions),
            "regions_held_at_end": self.still_registered(),
            "registration_calls_during_run": dict(self.calls),
            "batches": self.batches,
            "entries": self.entries,
            "max_entries_per_batch": self.max_entries,
            "failed_batches": self.failed_batches,
        }


def _register(engine: Any, bufs: list) -> list[tuple[int, int]]:
    regions = [(b.data_ptr(), b.nbytes) for b in bufs]
    for ptr, length in regions:
        engine.register(ptr, length)
    return regions


def page_digests(pool: Any, pages: Any, ps: int) -> list[str]:
    """A 16-byte BLAKE2b digest per page: every layer's latent rows and DSA indexer page."""
    import hashlib

    import torch

    kv = [b.view(torch.uint8) for b in pool.kv_buffer]
    idx = [b.view(torch.uint8) for b in pool.index_k_with_scale_buffer]
    out = []
    for p in pages:
        p = int(p)
        h = hashlib.blake2b(digest_size=16)
        for layer in range(len(kv)):
            h.update(kv[layer][p * ps : (p + 1) * ps].numpy().tobytes())
            h.update(idx[layer][p].numpy().tobytes())
        out.append(h.hexdigest())
    return out


def _manager(mode: Any, engine: Any, kv_args: Any, rank: int, shard_size: int, host: str) -> Any:
    from test_plugin_decode_manifest import _manager as build

    m = build(mode, engine, kv_args, rank, shard_size, host)
    m.enable_deferred_decode_kv_release = True  # SGLang's default for Mooncake
    return m


# ======================================================================= decode process
def _emit(msg: dict) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


def decode_main(cfg: dict) -> None:
    _env_setup()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import numpy as np
    import torch
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    ps, n, model_dir = cfg["ps"], cfg["n"], cfg["model_dir"]
    base = ["--model-path", os.path.join(model_dir, "mla"), "--device", "cpu", "--skip-tokenizer-init"]
    base += ["--page-size", str(ps), "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    decode_args = prepare_server_args(base + [FLAG])
    decode_args.resolve_once()
    publish(decode_args, role="scheduler")
    dsa_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool, alloc = _configurator_build(dsa_config, cfg["decode_pages"] * ps, ps)
    aux = torch.zeros(N_AUX, 64, dtype=torch.uint8)
    engine = MooncakeTransferEngine(cfg["decode_ip"])
    ledger = EngineLedger(engine, _register(engine, [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux]))
    mgr = _manager(DisaggregationMode.DECODE, engine, _kv_args(pool, aux, 0, ps), 0, 1, cfg["decode_ip"])
    mgr.waiting_timeout = cfg["waiting_timeout_s"]
    mgr.start_decode_thread()
    info = _prefill_info(n, ps)
    mgr._resolve_rank_mapping(info)  # SGLang's rank mapping: pull from every CP rank
    reseeded = [0]

    def bootstrap_answers() -> None:
        """What SGLang's bootstrap server would answer, where the receiver looks it up first.

        A receiver whose transfer failed drops the cached entries (``invalidate_cached_bootstrap_infos``)
        and the next one asks the bootstrap server over HTTP; there is none here, so they are put back.
        """
        if ADDR in mgr.prefill_info_table and all(
            f"{ADDR}_0_{cp}_{info.target_tp_rank}" in mgr.connection_pool for cp in info.target_cp_ranks
        ):
            return
        reseeded[0] += int(ADDR in mgr.prefill_info_table)
        with mgr.connection_lock:
            mgr.prefill_info_table[ADDR] = info
            for cp in info.target_cp_ranks:
                mgr.connection_pool[f"{ADDR}_0_{cp}_{info.target_tp_rank}"] = [
                    {"rank_ip": cfg["prefill_ip"], "rank_port": cfg["prefill_ports"][cp], "is_dummy": False}
                ]

    bootstrap_answers()
    free_at_start = int(alloc.available_size())
    aux_free = list(range(N_AUX))
    release_timeout = float(cfg["release_timeout_s"])

    inbox: queue.Queue = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            inbox.put(json.loads(line))
        inbox.put({"op": "eof"})

    threading.Thread(target=read_stdin, daemon=True).start()
    _emit(
        {
            "op": "ready",
            "session": engine.get_session_id(),
            "free_pages": free_at_start // ps,
            "required_responses": info.required_prefill_response_num,
        }
    )

    @dataclass
    class Active:
        room: int
        receiver: Any
        locs: Any
        dst: Any
        aux_idx: int
        t0: float

    active: dict[int, Active] = {}
    held: list[tuple[Active, float, int, str, float]] = []  # (req, deadline, required acks, reason, t_fail)
    registered = False
    from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_of

    def room_tables_clean(room: int) -> bool:
        return not (
            room in mgr.request_status
            or room in mgr.required_prefill_response_num_table
            or room in mgr.prefill_response_tracker
            or room in mgr.addr_to_rooms_tracker.get(ADDR, ())
            or room in mgr.failure_records
            or room in mgr._deferred_abort_ack_tracker
            or room in state_of(mgr).checks
        )

    def release(req: Active) -> None:
        alloc.free(req.locs)
        aux_free.append(req.aux_idx)

    finishing, deadline_finish = False, None
    while True:
        while True:
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                break
            op = msg["op"]
            if op == "new":
                room, n_pages = msg["room"], msg["n_pages"]
                locs = alloc.alloc(n_pages * ps)
                if locs is None or not aux_free:
                    _emit({"op": "done", "room": room, "status": "rejected", "reason": "decode out of pages"})
                    continue
                dst = (locs[::ps] // ps).numpy().astype(np.int32)
                bootstrap_answers()
                receiver = MooncakeKVReceiver(mgr, ADDR, room)
                receiver.init(0)
                if not registered:  # the decode's KV registration, once, as SGLang sends it
                    assert receiver._register_kv_args()
                    registered = True
                aux_idx = aux_free.pop()
                receiver.send_metadata(dst, aux_idx, [dst.copy()], 0)
                active[room] = Active(room, receiver, locs, dst, aux_idx, time.monotonic())
            elif op == "abort":
                req = active.get(msg["room"])
                if req is not None:
                    req.receiver.abort()  # SGLang's AbortReq path: Failed, ABORT to every prefill rank
            elif op in ("finish", "eof"):
                finishing, deadline_finish = True, time.monotonic() + cfg["finish_timeout_s"]
        for room in list(active):
            req = active[room]
            poll = req.receiver.poll()
            if poll == KVPoll.Success:
                digests = page_digests(pool, req.dst, ps)
                req.receiver.clear()
                release(req)
                del active[room]
                _emit(
                    {
                        "op": "done",
                        "room": room,
                        "status": "success",
                        "digests": digests,
                        "clean": room_tables_clean(room),
                        "aux": int(aux[req.aux_idx, 0]),
                    }
                )
            elif poll == KVPoll.Failed:
                reason = ""
                try:
                    req.receiver.failure_exception()  # what SGLang's decode queue calls on a failed poll
                except KVTransferError as e:
                    reason = e.failure_reason
                if not req.receiver.abort_notified:  # SGLang: a failure decode did not start still drains
                    req.receiver.ensure_abort_notified(force_arm=True)
                required = len(req.receiver.bootstrap_infos) if req.receiver.abort_notified else 0
                held.append((req, time.monotonic() + release_timeout, required, reason, time.monotonic()))
                del active[room]
        still = []
        for req, deadline, required, reason, t_fail in held:
            drained = mgr.is_abort_release_safe(req.room, required)
            if drained or time.monotonic() >= deadline:
                mgr.clear_deferred_abort_state(req.room)
                release(req)
                _emit(
                    {
                        "op": "done",
                        "room": req.room,
                        "status": "failed",
                        "reason": reason,
                        "drained": bool(drained),
                        "held_s": round(time.monotonic() - t_fail, 3),
                        "clean": room_tables_clean(req.room),
                    }
                )
            else:
                still.append((req, deadline, required, reason, t_fail))
        held = still
        if finishing and ((not active and not held) or time.monotonic() > deadline_finish):
            break
        time.sleep(0.002)

    report = {
        "op": "ledger",
        "left_active": sorted(active),
        "left_held": sorted(r.room for r, *_ in held),
        "free_pages_start": free_at_start // ps,
        "free_pages_end": int(alloc.available_size()) // ps,
        "aux_free_end": len(aux_free),
        "bootstrap_answers_put_back": reseeded[0],
        "tables": {
            "request_status": len(mgr.request_status),
            "required_prefill_response_num_table": len(mgr.required_prefill_response_num_table),
            "prefill_response_tracker": len(mgr.prefill_response_tracker),
            "addr_to_rooms_tracker": sum(len(v) for v in mgr.addr_to_rooms_tracker.values()),
            "failure_records": len(mgr.failure_records),
            "deferred_abort_ack_tracker": len(mgr._deferred_abort_ack_tracker),
            "manifest_checks": len(state_of(mgr).checks),
        },
        "engine": ledger.report(),
    }
    _emit(report)
    os._exit(0)  # SGLang's connector threads block on their sockets forever


# ======================================================================= prefill process
class BlacklistLog(set):
    """A prefill manager's ``failed_sessions`` (SGLang's blacklist of decode sessions) that logs when a
    session goes in (a failed transfer) and out (SGLang's probe took it back, or its idle timeout)."""

    def __init__(self, rank: int, t_start: float, events: list):
        super().__init__()
        self.rank, self.t_start, self.events = rank, t_start, events

    def add(self, session: str) -> None:
        if session not in self:
            self.events.append((time.monotonic() - self.t_start, self.rank, "add", session))
        super().add(session)

    def discard(self, session: str) -> None:
        if session in self:
            self.events.append((time.monotonic() - self.t_start, self.rank, "discard", session))
        super().discard(session)


def blacklist_windows(events: list[tuple[float, int, str, str]]) -> list[dict]:
    """Per session, when any prefill rank had it blacklisted: from the first rank's add to the last
    rank's discard (``end_s`` None: still blacklisted at the end of the run)."""
    ranks: dict[str, set[int]] = {}
    opened: dict[str, float] = {}
    out = []
    for t, rank, op, session in sorted(events):
        held = ranks.setdefault(session, set())
        if op == "add":
            if not held:
                opened[session] = t
            held.add(rank)
        elif rank in held:
            held.discard(rank)
            if not held:
                out.append({"session": session, "begin_s": round(opened.pop(session), 3), "end_s": round(t, 3)})
    out += [{"session": s, "begin_s": round(t, 3), "end_s": None} for s, t in opened.items()]
    return sorted(out, key=lambda w: w["begin_s"])


@dataclass
class Request:
    room: int
    tokens: int
    n_pages: int
    cuts: list[int]
    abort: tuple[str, str] | None  # (side: "decode" | "both", phase: "boot" | "mid" | "late")
    huge: bool
    incarnation: int = -1
    state: str = "new"
    chunk: int = 0
    locs: Any = None
    before_metadata: list[int] = field(default_factory=list)
    metadata_seen: set[int] = field(default_factory=set)
    pages: Any = None
    expected: list[str] = field(default_factory=list)
    senders: list = field(default_factory=list)
    aux_idx: int = -1
    prefill_status: str = ""
    prefill_reason: str = ""
    prefill_reasons: list[str] = field(default_factory=list)  # each failed rank's reason, whole
    prefill_clean: bool = True
    decode: dict | None = None
    aborted: bool = False
    alloc_pages: int = 0  # pages the allocators' free count dropped by for this request
    freed_pages: int = 0  # pages their free count rose by when it was freed
    t0: float = 0.0
    t_prefill_end: float = 0.0
    t_end: float = 0.0


class DecodeProc:
    """The decode child process and the reader thread of its ``@@`` lines."""

    def __init__(self, cfg: dict, incarnation: int, log_path: str, env: dict):
        self.incarnation = incarnation
        self.log = open(log_path, "ab")
        netns = ["ip", "netns", "exec", cfg["decode_netns"]] if cfg.get("decode_netns") else []
        self.proc = subprocess.Popen(  # ``ip netns exec`` execs the command: the pid is the decode's
            [*netns, sys.executable, os.path.abspath(__file__), "decode", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self.inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.inbox.put(json.loads(line[2:]))
        self.inbox.put({"op": "exit"})

    def send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def wait_for(self, op: str, timeout_s: float) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                msg = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg["op"] == op:
                return msg
            if msg["op"] == "exit":
                break
            self.inbox.put(msg)  # not ours yet: keep it (only used before any request runs)
        raise TimeoutError(f"decode {self.incarnation}: no {op!r} within {timeout_s}s (log: see decode log)")


def _plan(rng: random.Random, cfg: dict, n: int, ps: int) -> list[Request]:
    """The requests: random lengths (log-uniform), a few huge ones, random chunking and aborts."""
    total, reqs = cfg["requests"], []
    huge_at = set(rng.sample(range(1, total), max(1, round(total * cfg["huge_fraction"]))))
    pre_at = set(rng.sample(sorted(set(range(1, total)) - huge_at), max(2, round(total * 0.03))))
    for i in range(total):
        room = cfg["room_base"] + i
        huge = i in huge_at
        if i == 0:
            tokens = 1
        elif huge:  # more than 1024 pages (positions) in one transfer
            n_pages = 1026 + rng.randint(0, 30)
            tokens = n_pages * ps - rng.randint(0, ps - 1)
        else:
            tokens = max(1, int(math.exp(rng.uniform(0.0, math.log(cfg["max_small_pages"] * ps)))))
        n_pages = -(-tokens // ps)
        k = 1 if (huge or n_pages < 2) else rng.choice([1, 2, 3])
        cuts = sorted(rng.sample(range(1, n_pages), min(k - 1, n_pages - 1)))
        abort = None
        if not huge and rng.random() < cfg["abort_fraction"]:
            abort = (rng.choice(["decode", "both"]), rng.choice(["boot", "mid", "late"]))
        if i in pre_at:  # the client abort reached the prefill before the decode's destinations
            abort = ("both", "pre")
        reqs.append(Request(room, tokens, n_pages, cuts, abort, huge))
    return reqs


def prefill_main(cfg: dict) -> None:  # noqa: C901 - one event loop, read top to bottom
    _env_setup()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import concurrent.futures

    import numpy as np
    import torch
    from plugin_models import stock_dsa_pools
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.mooncake.conn import FastQueue, MooncakeKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.srt.sglang_wiring import connector_bounds
    from sglang_cp_shared_kv.srt.sglang_wiring.hooks import bounds_of
    from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_of

    t_start = time.monotonic()
    n, ps, model_dir = cfg["n"], cfg["ps"], cfg["model_dir"]
    use_torch_writers()  # SGLang's per-token indexer-key writer, interpreted, would be the soak's cost
    rng = random.Random(cfg["seed"])
    argv = ["--model-path", os.path.join(model_dir, "mla"), "--device", "cpu", "--skip-tokenizer-init"]
    argv += ["--enable-prefill-cp", "--cp-strategy", "interleave", "--tp-size", str(n), "--attn-cp-size", str(n)]
    argv += [
        "--page-size",
        str(ps),
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-transfer-backend",
        "mooncake",
    ]
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    server_args.__dict__["enable_cp_shared_kv"] = True  # the record as the launcher passes it (CPU cannot resolve it)
    publish(server_args, role="scheduler")
    dsa_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    pools, allocs = [], []
    for rank in range(n):
        with get_parallel().override(
            attn_cp_rank=rank, attn_cp_size=n, attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False
        ):
            pool, alloc = _configurator_build(dsa_config, cfg["prefill_pages"] // n * ps, ps)
        pools.append(pool)
        allocs.append(alloc)
    (replicated,) = stock_dsa_pools([n * pools[0].phys_pages * ps - ps], ps)
    free_start = [int(a.available_size()) for a in allocs]
    last_holder: dict[int, int] = {}  # logical page -> the last request it was allocated to

    def missing_pages(a: Any) -> list[list[int]]:
        free: set[int] = set()
        listed = 0
        for lst in [*a.class_free_pages, *a.class_release_pages]:
            free.update(lst.tolist())
            listed += len(lst)
        if listed != len(free):
            print(f"[soak] duplicate free pages: {listed - len(free)}", file=sys.stderr)
        every = {p * a.shard_size + r for r in range(a.shard_size) for p in range(1, a.num_pages // a.shard_size + 1)}
        return [[p, last_holder.get(p, -1)] for p in sorted(every - free)]

    class Layer:
        def __init__(self, i: int):
            self.layer_id = i

    def prefill_forward(req: Request) -> None:
        """What the forward leaves in the pools: the same random KV on every rank's pool and the replicated one."""
        t = torch.tensor
        locs = None
        free_before = int(allocs[0].available_size())
        for a in allocs:  # each rank's scheduler runs its own allocator; they must agree
            got = a.alloc_extend(
                t([0]), t([0]), t([req.tokens]), t([req.tokens]), t([0]), req.tokens, rotation_bases=[None]
            )
            if got is None:
                raise MemoryError("prefill allocator refused a request the router admitted")
            got = got.long()
            assert locs is None or torch.equal(locs, got), "prefill CP ranks' allocators disagree"
            locs = got
        req.locs = locs
        req.pages = (locs[::ps] // ps).numpy().astype(np.int32)
        req.alloc_pages = (free_before - int(allocs[0].available_size())) // ps
        for page in sorted(set((locs // ps).tolist())):
            last_holder[page] = req.room
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + req.room)
        with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
            for layer in range(2):
                nope = torch.randn(len(locs), 1, 512, generator=g).to(torch.bfloat16)
                rope = torch.randn(len(locs), 1, 64, generator=g).to(torch.bfloat16)
                k = (torch.randn(len(locs), 128, generator=g) * 4).to(torch.float8_e4m3fn)
                scale = torch.rand(len(locs), 1, generator=g) + 0.5
                for p in [*pools, replicated]:
                    p.set_mla_kv_buffer(Layer(layer), locs, nope, rope)
                    p.set_index_k_scale_buffer(layer, locs, k, scale)
        req.expected = page_digests(replicated, req.pages, ps)

    # -- engines, managers and SGLang's threads, one set per prefill CP rank --
    executor = concurrent.futures.ThreadPoolExecutor(2)
    blacklist_events: list[tuple[float, int, str, str]] = []
    mgrs, ledgers, auxes = [], [], []
    for rank, pool in enumerate(pools):
        engine = MooncakeTransferEngine(cfg["prefill_ip"])
        aux = torch.full((N_AUX, 64), 100 + rank, dtype=torch.uint8)
        ledgers.append(EngineLedger(engine, _register(engine, [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux])))
        m = _manager(DisaggregationMode.PREFILL, engine, _kv_args(pool, aux, rank, ps), rank, n, cfg["prefill_ip"])
        m.bootstrap_timeout = cfg["bootstrap_timeout_s"]
        m.transfer_queues = [FastQueue()]
        m.start_prefill_thread()
        # SGLang's failed-session probe, as MooncakeKVManager.__init__ starts it: a decode session
        # blacklisted after a failed transfer is probed and taken back once it answers.
        m.failed_session_probe_interval = envs.SGLANG_FAILED_SESSION_PROBE_INTERVAL_S.get()
        m.failed_session_probe_max_interval = envs.SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S.get()
        m.failed_session_idle_timeout = envs.SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S.get()
        m._failed_session_probe_shutdown = threading.Event()
        threading.Thread(target=m._failed_session_probe_loop, daemon=True).start()
        threading.Thread(target=m.transfer_worker, args=(m.transfer_queues[0], executor), daemon=True).start()
        m.failed_sessions = BlacklistLog(rank, t_start, blacklist_events)
        mgrs.append(m)
        auxes.append(aux)
    aux_free = list(range(N_AUX))

    # -- the decode child --
    env = {**os.environ}
    decode_cfg = {
        "ps": ps,
        "n": n,
        "model_dir": model_dir,
        "decode_pages": cfg["decode_pages"],
        "prefill_ports": [m.rank_port for m in mgrs],
        "prefill_ip": cfg["prefill_ip"],
        "decode_ip": cfg["decode_ip"],
        "release_timeout_s": cfg["release_timeout_s"],
        "waiting_timeout_s": cfg["waiting_timeout_s"],
        "finish_timeout_s": cfg["finish_timeout_s"],
        "decode_netns": cfg.get("decode_netns"),
    }
    log_path = cfg["decode_log"]
    incarnations: list[dict] = []

    def start_decode() -> DecodeProc:
        t0 = time.monotonic()
        d = DecodeProc(decode_cfg, len(incarnations), log_path, env)
        ready = d.wait_for("ready", cfg["decode_start_timeout_s"])
        incarnations.append(
            {"pid": d.proc.pid, "session": ready["session"], "start_s": round(time.monotonic() - t0, 2), **ready}
        )
        return d

    decode = start_decode()
    reqs = _plan(rng, cfg, n, ps)
    by_room = {r.room: r for r in reqs}
    pending = list(reqs)
    inflight: list[Request] = []
    finished: list[Request] = []
    kill_at = int(len(reqs) * cfg["kill_at"])
    stop_at = int(len(reqs) * cfg["stop_at"])
    faults: dict[str, Any] = {"killed": None, "stopped": None, "partition": None}
    link = cfg.get("partition_link")  # the prefill's end of the link to the decode (namespaced runs)
    partition_at = int(len(reqs) * cfg["partition_at"]) if link else None
    partition_until = None

    def set_link(state: str) -> None:
        subprocess.run(["ip", "link", "set", "dev", link, state], check=True, timeout=10, capture_output=True)

    started = 0
    stopped_until = None
    held_since: float | None = None  # when the router began to hold new requests (a blacklisted decode)
    admission_held: list[float] = []  # how long, each time
    t_deadline = t_start + cfg["run_timeout_s"]
    stuck: list[dict] = []

    def min_poll(req: Request) -> int:
        return min(int(s.poll()) for s in req.senders)

    def room_clean(room: int) -> bool:
        for m in mgrs:
            if (
                room in m.request_status
                or room in m.transfer_infos
                or room in m.failure_records
                or room in m.req_to_decode_prefix_len
                or room in state_of(m).shares
            ):
                return False
        return True

    def abort_prefill(req: Request) -> None:
        for s in req.senders:
            s.abort()  # what SGLang's prefill scheduler calls on an AbortReq
        req.aborted = True

    def do_abort(req: Request) -> None:
        side, _ = req.abort
        if side == "both":
            abort_prefill(req)
        if req.incarnation == decode.incarnation:
            decode.send({"op": "abort", "room": req.room})
        req.aborted = True

    def conclude_prefill(req: Request) -> None:
        ok = min_poll(req) == KVPoll.Success
        note_metadata(req)
        # Ranks the decode's destination pages were not seen to reach before this conclusion.
        req.before_metadata = [r for r in range(n) if r not in req.metadata_seen]
        reasons = []
        for s in req.senders:
            if s.poll() == KVPoll.Failed:
                try:
                    s.failure_exception()  # SGLang's prefill: clear + the recorded reason
                except KVTransferError as e:
                    reasons.append(e.failure_reason)
            else:
                s.clear()
        free_before = int(allocs[0].available_size())
        for a in allocs:
            a.free(req.locs)
        req.freed_pages = (int(allocs[0].available_size()) - free_before) // ps
        aux_free.append(req.aux_idx)
        req.prefill_status = "success" if ok else "failed"
        req.prefill_reasons = sorted(set(reasons))
        req.prefill_reason = "; ".join(req.prefill_reasons)[:300]
        req.prefill_clean = room_clean(req.room)
        req.t_prefill_end = time.monotonic()
        req.state = "await_decode"

    def fits(req: Request) -> bool:
        return req.n_pages + 1 <= int(allocs[0].available_size()) // ps and bool(aux_free)

    def start(req: Request) -> bool:
        if not fits(req):
            return False
        req.t0 = time.monotonic()
        req.incarnation = decode.incarnation
        prefill_forward(req)
        req.aux_idx = aux_free.pop()
        req.senders = [MooncakeKVSender(m, ADDR, req.room) for m in mgrs]
        for s in req.senders:
            s.init(req.n_pages, aux_index=req.aux_idx)
        req.state = "boot"
        if req.abort == ("both", "pre"):  # the prefill drops the request before the decode sends its pages
            abort_prefill(req)
            conclude_prefill(req)
            decode.send({"op": "new", "room": req.room, "n_pages": req.n_pages})
            decode.send({"op": "abort", "room": req.room})
            req.aborted = True
            return True
        decode.send({"op": "new", "room": req.room, "n_pages": req.n_pages})
        return True

    def send_chunk(req: Request) -> None:
        bounds = [0, *req.cuts, req.n_pages]
        lo, hi = bounds[req.chunk], bounds[req.chunk + 1]
        last = req.chunk + 1 == len(bounds) - 1
        order = list(range(n))
        rng.shuffle(order)
        for rank in order:
            if last:
                req.senders[rank].send(req.pages[lo:hi], [req.pages.copy()])
            else:
                req.senders[rank].send(req.pages[lo:hi])
        req.chunk += 1

    def note_metadata(req: Request) -> None:
        for r, (m, snd) in enumerate(zip(mgrs, req.senders)):
            if req.room in m.transfer_infos or snd.poll() >= KVPoll.WaitingForInput:
                req.metadata_seen.add(r)

    def step(req: Request) -> None:
        phase = req.abort[1] if (req.abort and not req.aborted) else None
        if req.state == "boot":
            note_metadata(req)
            if phase == "boot":
                do_abort(req)
            p = min_poll(req)
            if p == KVPoll.Failed:
                conclude_prefill(req)
            elif p >= KVPoll.WaitingForInput:
                req.state = "send"
        elif req.state == "send":
            if min_poll(req) == KVPoll.Failed:
                conclude_prefill(req)
                return
            send_chunk(req)
            if phase == "mid":
                do_abort(req)
            if req.chunk == len(req.cuts) + 1:
                req.state = "wait"
        elif req.state == "wait":
            if phase == "late":
                do_abort(req)
            p = min_poll(req)
            if p in (KVPoll.Success, KVPoll.Failed):
                conclude_prefill(req)

    def take_decode_messages() -> None:
        while True:
            try:
                msg = decode.inbox.get_nowait()
            except queue.Empty:
                return
            if msg["op"] == "done":
                req = by_room[msg["room"]]
                if req.incarnation == decode.incarnation:
                    req.decode = msg
                    if msg["status"] == "rejected" and req.state != "await_decode":
                        abort_prefill(req)  # the router: no decode pages, so the prefill drops it too

    def finalize(req: Request) -> None:
        req.t_end = time.monotonic()
        inflight.remove(req)
        finished.append(req)

    def room_tables(m: Any) -> int:
        """The most rooms any of a prefill manager's per-room tables holds."""
        return max(
            len(m.request_status),
            len(m.transfer_infos),
            len(m.req_to_decode_prefix_len),
            len(m.failure_records),
            len(state_of(m).shares),
        )

    def sample_tables() -> None:
        """Per rank, how far its tables exceed the requests in flight at the prefill (kept if it lasts)."""
        at_prefill = sum(1 for r in inflight if r.state != "await_decode")
        for rank, m in enumerate(mgrs):
            excess = room_tables(m) - at_prefill
            if excess > 0:  # a room between two of SGLang's table updates: look again
                time.sleep(0.02)
                excess = room_tables(m) - at_prefill
            bounds_seen[rank]["max_excess_over_in_flight"] = max(bounds_seen[rank]["max_excess_over_in_flight"], excess)
            poisoned = len(m._deferred_ack_poisoned_rooms)
            bounds_seen[rank]["max_poisoned"] = max(bounds_seen[rank]["max_poisoned"], poisoned)
        bounds_seen_samples[0] += 1

    bounds_seen = [{"max_excess_over_in_flight": -(10**9), "max_poisoned": 0} for _ in mgrs]
    bounds_seen_samples = [0]
    last_progress, last_sample = 0.0, 0.0
    while pending or inflight:
        now = time.monotonic()
        if now - last_sample > 0.1:
            last_sample = now
            sample_tables()
        if now - last_progress > 1.0:
            last_progress = now
            states = sorted(f"{r.room}:{r.state}" for r in inflight)
            print(
                f"[soak n={n}] {now - t_start:.0f}s started={started} finished={len(finished)} {states}",
                file=sys.stderr,
            )
        if now > t_deadline:
            stuck = [{"room": r.room, "state": r.state, "polls": [int(s.poll()) for s in r.senders]} for r in inflight]
            break
        # -- faults --
        huge_in_flight = any(r.huge and r.state != "await_decode" for r in inflight)
        # The kill waits for a request with chunks still to send whose destinations reached every rank:
        # the router does not abort that one at the prefill, so its next chunk goes to the dead decode
        # (a failed Mooncake batch, which poisons the room's abort acknowledgement).
        victims, poison_victim = [], None
        if faults["killed"] is None and started >= kill_at and not huge_in_flight and partition_until is None:
            take_decode_messages()
            victims = [r for r in inflight if r.incarnation == decode.incarnation and r.decode is None]
            sending = [
                r
                for r in victims
                if r.state == "send" and r.chunk <= len(r.cuts) and min_poll(r) >= KVPoll.WaitingForInput
            ]
            if sending:
                poison_victim = sending[0]
            elif started < int(len(reqs) * 0.9):
                victims = []  # not yet: wait for such a request
        if victims:  # kill only with requests the decode has not concluded
            t0 = time.monotonic()
            killed_session = incarnations[decode.incarnation]["session"]
            decode.proc.kill()
            decode.proc.wait(timeout=30)
            for r in victims:  # the router sees the decode gone and aborts those requests at the prefill
                r.decode = {"op": "done", "room": r.room, "status": "lost", "reason": "decode process killed"}
                if r.state != "await_decode" and r is not poison_victim:
                    abort_prefill(r)
            decode = start_decode()
            faults["killed"] = {
                "at_request": started,
                "left_sending": poison_victim.room if poison_victim is not None else None,
                "in_flight": len(victims),
                "in_flight_states": sorted({r.state for r in victims}),
                "restart_s": round(time.monotonic() - t0, 2),
                "session": killed_session,
                # the window: SIGKILL to the new decode's "ready" (no request starts in between)
                "begin_s": round(t0 - t_start, 3),
                "end_s": round(time.monotonic() - t_start, 3),
            }
        # -- the partition: the link to the decode down for partition_s with transfers in flight, then up --
        # (after the kill, once its requests have concluded: the two faults do not overlap)
        if (
            partition_at is not None
            and faults["partition"] is None
            and faults["killed"] is not None
            and started >= partition_at
            and all(r.incarnation == decode.incarnation and r.decode is None for r in inflight)
            and any(r.state in ("send", "wait") for r in inflight)
        ):
            set_link("down")
            partition_until = time.monotonic() + cfg["partition_s"]
            faults["partition"] = {
                "at_request": started,
                "in_flight": len(inflight),
                "in_flight_rooms": sorted(r.room for r in inflight),
                "in_flight_states": sorted({r.state for r in inflight}),
                "down_at_s": round(time.monotonic() - t_start, 3),
                "seconds": cfg["partition_s"],
                "session": incarnations[decode.incarnation]["session"],
            }
            faults["partition"]["begin_s"] = faults["partition"]["down_at_s"]
        if partition_until is not None and time.monotonic() >= partition_until:
            set_link("up")
            faults["partition"]["up_at_s"] = faults["partition"]["end_s"] = round(time.monotonic() - t_start, 3)
            partition_until = None
        partitioned = partition_until is not None
        if faults["stopped"] is None and started >= stop_at and inflight and not huge_in_flight and not partitioned:
            os.kill(decode.proc.pid, signal.SIGSTOP)
            stopped_until = time.monotonic() + cfg["stop_s"]
            faults["stopped"] = {
                "at_request": started,
                "in_flight": len(inflight),
                "in_flight_states": sorted({r.state for r in inflight}),
                "seconds": cfg["stop_s"],
                "session": incarnations[decode.incarnation]["session"],
                "begin_s": round(time.monotonic() - t_start, 3),  # SIGSTOP to SIGCONT
            }
        if stopped_until is not None and time.monotonic() >= stopped_until:
            os.kill(decode.proc.pid, signal.SIGCONT)
            faults["stopped"]["end_s"] = round(time.monotonic() - t_start, 3)
            stopped_until = None
        # -- admit new requests (the router) --
        # A router's health gate: no new request to a decode session the prefill ranks hold blacklisted
        # (SGLang fails each at once, "is not alive", until its probe takes the session back), for at
        # most ``hold_blacklisted_s`` each time; the requests in flight meet the blacklist as they are.
        live = incarnations[decode.incarnation]["session"]
        if any(live in m.failed_sessions for m in mgrs):
            if held_since is None:
                held_since = time.monotonic()
            holding = time.monotonic() - held_since < cfg.get("hold_blacklisted_s", 30.0)
        else:
            if held_since is not None:
                admission_held.append(round(time.monotonic() - held_since, 3))
            held_since, holding = None, False
        while pending and len(inflight) < cfg["concurrency"] and not holding:
            if not start(pending[0]):
                break
            inflight.append(pending.pop(0))
            started += 1
        take_decode_messages()
        for req in list(inflight):
            if req.state == "await_decode":
                if req.decode is not None:
                    finalize(req)
            else:
                step(req)
        if not inflight and pending and not fits(pending[0]):
            raise MemoryError(f"request of {pending[0].n_pages} pages never fits the prefill pool")
        time.sleep(0.002)

    wall_s = time.monotonic() - t_start
    if stopped_until is not None:  # the run's deadline passed with the decode stopped
        os.kill(decode.proc.pid, signal.SIGCONT)
        faults["stopped"]["end_s"] = round(time.monotonic() - t_start, 3)
    if partition_until is not None:
        set_link("up")
        faults["partition"]["up_at_s"] = faults["partition"]["end_s"] = round(time.monotonic() - t_start, 3)
    # -- drain and ledgers --
    decode.send({"op": "finish"})
    ledger = decode.wait_for("ledger", cfg["finish_timeout_s"] + 30)
    try:
        decode.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        decode.proc.kill()
    time.sleep(0.5)  # late ABORT_ACKs and statuses settle on the prefill threads
    # The poison of a failed batch's room is held until the room's window ends (connector_bounds):
    # wait for it (``bounds_wait``: "real"), or sweep as the next request's clear would then ("clock").
    poisoned_before_sweep = [len(m._deferred_ack_poisoned_rooms) for m in mgrs]
    closed_open = [sorted(bounds_of(m).closed.items(), key=lambda kv: kv[1]) for m in mgrs]
    poisoned_in_window = [
        set(m._deferred_ack_poisoned_rooms) <= {room for room, _ in closed} for m, closed in zip(mgrs, closed_open)
    ]
    last_window_end = max((until for closed in closed_open for _, until in closed), default=time.monotonic())
    if cfg["bounds_wait"] == "real":
        time.sleep(max(0.0, last_window_end - time.monotonic()) + 0.1)
        for m in mgrs:
            connector_bounds.sweep(bounds_of(m), m)
    else:
        for m in mgrs:
            connector_bounds.sweep(bounds_of(m), m, now=max(time.monotonic(), last_window_end) + 0.1)
    prefill_tables = []
    for m in mgrs:
        prefill_tables.append(
            {
                "request_status": len(m.request_status),
                "transfer_infos": len(m.transfer_infos),
                "failure_records": len(m.failure_records),
                "req_to_decode_prefix_len": len(m.req_to_decode_prefix_len),
                "staging_outstanding": sum(1 for v in m._staging_outstanding.values() if v),
                "deferred_ack_targets": len(m._deferred_ack_targets),
                "manifest_shares": len(state_of(m).shares),
                "queued_chunks": m.transfer_queues[0].qsize() if hasattr(m.transfer_queues[0], "qsize") else 0,
                "rooms_left": sorted(set(m.request_status) | set(m.transfer_infos)),
                "decode_registrations": sorted(m.decode_kv_args_table),
                "failed_sessions": sorted(m.failed_sessions),
                "poisoned_ack_rooms": len(m._deferred_ack_poisoned_rooms),
                "poisoned_before_sweep": poisoned_before_sweep[len(prefill_tables)],
                "poisoned_all_in_open_windows": poisoned_in_window[len(prefill_tables)],
                "bounds": bounds_of(m).counts(),
                **bounds_seen[len(prefill_tables)],
            }
        )
    rows = []
    for r in finished:
        d = r.decode or {}
        status = d.get("status", "missing")
        rows.append(
            {
                "room": r.room,
                "tokens": r.tokens,
                "pages": r.n_pages,
                "prefill_pages_taken": r.alloc_pages,
                "prefill_pages_returned": r.freed_pages,
                "chunks": len(r.cuts) + 1,
                "huge": r.huge,
                "abort": list(r.abort) if r.abort else None,
                "incarnation": r.incarnation,
                "prefill": r.prefill_status,
                "prefill_reason": r.prefill_reason,
                "prefill_reasons": r.prefill_reasons,
                "session": incarnations[r.incarnation]["session"] if r.incarnation >= 0 else None,
                "prefill_clean": r.prefill_clean,
                "concluded_before_metadata_on_ranks": r.before_metadata,
                "decode": status,
                "decode_reason": (d.get("reason") or "")[:500],
                "decode_clean": d.get("clean", status == "lost"),
                "drained": d.get("drained"),
                "exact": (d.get("digests") == r.expected) if status == "success" else None,
                "seconds": round(r.t_end - r.t0, 3),
                "start_s": round(r.t0 - t_start, 3),
                "end_s": round(r.t_end - t_start, 3),
                "prefill_end_s": round(r.t_prefill_end - t_start, 3),
            }
        )
    result = {
        "n": n,
        "page_size": ps,
        "seed": cfg["seed"],
        "requests_planned": len(reqs),
        "requests_finished": len(finished),
        "stuck": stuck,
        "wall_s": round(wall_s, 2),
        "table_samples": bounds_seen_samples[0],
        "bounds_window_s": bounds_of(mgrs[0]).window,
        "bounds_wait": cfg["bounds_wait"],
        "faults": faults,
        "incarnations": incarnations,
        "prefill_free_pages": {
            "start": [f // ps for f in free_start],
            "end": [int(a.available_size()) // ps for a in allocs],
        },
        "prefill_aux_free_end": len(aux_free),
        "prefill_pages_not_free": [missing_pages(a) for a in allocs],
        "prefill_tables": prefill_tables,
        "prefill_engines": [lg.report() for lg in ledgers],
        "decode_ledger": ledger,
        "rows": rows,
    }
    faults["blacklisted"] = blacklist_windows(blacklist_events)
    faults["admission_held_s"] = admission_held
    print("RESULT:" + json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    role, config = sys.argv[1], json.loads(sys.argv[2])
    {"prefill": prefill_main, "decode": decode_main}[role](config)
