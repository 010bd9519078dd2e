"""The CP shared-KV manifest through SGLang's own Mooncake connector, prefill CP ranks to a decode.

One worker subprocess (hooks cannot be undone) loads the plugin with SGLang's ``load_plugins()``
and runs SGLang 0.5.23's connector threads on 127.0.0.1, with the real Mooncake engine (TCP):

- two prefill CP ranks: ``MooncakeKVManager`` in prefill mode over a CP-shared DSA pool built by
  the plugin's configurator hooks, each running SGLang's bootstrap thread (it takes the decode's
  registration and destination pages over ZMQ) and SGLang's transfer worker (it writes the owned
  latent pages, the owned indexer pages and the aux slot, then sends the Success status);
- one non-CP decode: ``MooncakeKVManager`` in decode mode over a stock DSA pool, running SGLang's
  decode thread (it parses the status messages and marks requests ready), with SGLang's
  ``MooncakeKVReceiver`` per request (``init``, ``send_metadata``, ``poll``,
  ``failure_exception``, ``clear``) and ``MooncakeKVSender`` per request and rank (``init``,
  ``send``, ``poll``).

The managers are built with ``object.__new__`` and the attributes their methods read (a full
``__init__`` needs SGLang's distributed groups, a bootstrap HTTP server and a model runner); the
bootstrap lookup is the receiver's own connection-pool cache filled with the prefill sockets, and
the decode's prefill info comes from SGLang's ``_resolve_rank_mapping``. Wrong shares are
produced where a sender bug would produce them: SGLang's page filter of one rank is swapped for a
faulty one while that request is sent (the transfer worker then really writes those pages).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from plugin_models import build_pool_and_allocator, prefill_cp_argv, run_worker, stock_dsa_pools, write_model_dirs

from demo.sglang_parts import kv_args, mooncake_manager, new_request_locs, prefill_info

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

PS = 64
N = 2
FUZZ_EXAMPLES = int(os.environ.get("CP_SHARED_KV_FUZZ_EXAMPLES", "300"))  # hostile requests through SGLang
FLAG = "--enable-cp-shared-kv"
TARGETS = [
    "sglang.srt.disaggregation.common.conn.CommonKVSender._prepare_send_indices",
    "sglang.srt.disaggregation.common.conn.CommonKVSender.clear",
    "sglang.srt.disaggregation.common.conn.CommonKVManager._encode_kv_status_message",
    "sglang.srt.disaggregation.common.conn.CommonKVManager.parse_kv_status_message",
    "sglang.srt.disaggregation.common.conn.CommonKVReceiver.send_metadata",
    "sglang.srt.disaggregation.common.conn.CommonKVReceiver.clear",
]
# Requests: (name, pages, flag on?, faulty rank or None, fault, faulty rank sends first?).
# Rooms are 1000 + index. A non-owner write corrupts only if it lands after the owner's.
REQUESTS = [
    ("good", 6, True, None, None, False),
    ("non_owner", 5, True, 1, "non_owner", False),
    ("non_owner_first", 4, True, 0, "non_owner", True),
    ("missing", 5, True, 0, "missing", True),
    ("duplicate", 4, True, 1, "duplicate", True),
    ("out_of_range", 4, True, 0, "out_of_range", True),
    ("no_manifest", 3, True, 1, "no_manifest", True),
    ("off_good", 4, False, None, None, False),
    ("off_non_owner", 4, False, 1, "non_owner", False),
]
STARTUP = [  # (case, extra argv, expected phrase or None)
    ("decode_ok", [], None),
    (
        "decode_cp",
        ["--enable-prefill-cp", "--cp-strategy", "interleave", "--tp-size", "2", "--attn-cp-size", "2"],
        "--attn-cp-size 2",
    ),
    # A decode CP server shards a DSA model's pages: the tiny MLA model is refused, by its architecture.
    (
        "decode_dcp",
        ["--tp-size", "2", "--dcp-size", "2"],
        "on a decode CP server (--dcp-size 2): the flag shards a DSA",
    ),
    ("decode_nixl", ["--disaggregation-transfer-backend", "nixl"], "use --disaggregation-transfer-backend mooncake"),
    ("decode_kv_sharding", ["--enable-kv-cache-sharding"], "--enable-kv-cache-sharding"),
]


# ---------------------------------------------------------------- worker side
def _deadline_wait(cond, what: str, timeout_s: float = 30.0) -> None:
    from reference.spawn import wait_until

    wait_until(cond, what, timeout_s)


def _kv_args(pool, aux, engine_rank: int, ps: int = PS):
    return kv_args(pool, aux, engine_rank, ps)


_manager = mooncake_manager  # SGLang's Mooncake KV manager with the attributes its connector methods read
_prefill_info = prefill_info


def _configurator_build(model_config, tokens: int, ps: int = PS):
    """SGLang's configurator pool and allocator builders (hooked by the plugin), in the caller's parallel context."""
    return build_pool_and_allocator(model_config, tokens, 8, ps)


def _build_pools(model_dir: str):
    """Two prefill CP ranks' CP-shared DSA pools (plugin hooks), their allocator, a replicated and a decode pool."""

    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(prefill_cp_argv(model_dir, PS))
    server_args.resolve_once()
    server_args.__dict__["enable_cp_shared_kv"] = True  # the record as the launcher passes it (CPU cannot resolve it)
    publish(server_args, role="scheduler")
    dsa_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    per_rank_tokens = 24 * PS
    ranks, allocator = [], None
    for rank in range(N):
        with get_parallel().override(
            attn_cp_rank=rank, attn_cp_size=N, attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False
        ):
            pool, alloc = _configurator_build(dsa_config, per_rank_tokens)
        ranks.append(pool)
        allocator = allocator or alloc  # every rank's allocator makes the same decisions; one draws the pages
    replicated, decode = stock_dsa_pools([N * ranks[0].phys_pages * PS - PS, 48 * PS], PS)
    return server_args, ranks, allocator, replicated, decode


def _fill(ranks, replicated, allocator, lengths):
    """Allocate each request's pages with SGLang's allocator; write the same random KV to every pool."""
    import torch
    from sglang.srt.runtime_context import get_parallel

    class Layer:
        def __init__(self, i):
            self.layer_id = i

    all_locs, pages = [], []
    for seq in lengths:
        locs = new_request_locs(allocator, seq)
        all_locs.append(locs)
        pages.append((locs[::PS] // PS).numpy().astype("int32"))
    locs = torch.cat(all_locs)
    g = torch.Generator().manual_seed(5)
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        for layer in range(2):
            nope = torch.randn(len(locs), 1, 512, generator=g).to(torch.bfloat16)
            rope = torch.randn(len(locs), 1, 64, generator=g).to(torch.bfloat16)
            k = (torch.randn(len(locs), 128, generator=g) * 4).to(torch.float8_e4m3fn)
            scale = torch.rand(len(locs), 1, generator=g) + 0.5
            for p in [*ranks, replicated]:
                p.set_mla_kv_buffer(Layer(layer), locs, nope, rope)
                p.set_index_k_scale_buffer(layer, locs, k, scale)
    return pages


def _faulty_filter(original, bad_rank: int, fault: str):
    """SGLang's owned-page filter, wrong on one rank the way a sender bug would be."""
    import numpy as np

    def filt(*, kv_indices, index_slice, shard_rank, shard_size):
        local, positions = original(
            kv_indices=kv_indices, index_slice=index_slice, shard_rank=shard_rank, shard_size=shard_size
        )
        if shard_rank != bad_rank or len(kv_indices) == 0:
            return local, positions
        all_pos = np.arange(index_slice.start, index_slice.stop, dtype=np.int64)
        if fault == "non_owner":  # also sends a page it does not own (its own local page of that index)
            foreign = np.nonzero(np.asarray(kv_indices) % shard_size != shard_rank)[0][:1]
            return np.concatenate([local, np.asarray(kv_indices)[foreign] // shard_size]), np.concatenate(
                [positions, all_pos[foreign]]
            )
        if fault == "missing":  # leaves out its last owned page of the chunk
            return local[:-1], positions[:-1]
        if fault == "duplicate":  # sends its first owned page twice
            return np.concatenate([local, local[:1]]), np.concatenate([positions, positions[:1]])
        return local, positions

    return filt


def _worker(model_dir: str) -> None:
    import concurrent.futures
    import threading
    import time

    import numpy as np
    import torch

    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.disaggregation.common.conn as common_conn
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager, KVTransferError
    from sglang.srt.disaggregation.mooncake.conn import FastQueue, MooncakeKVReceiver, MooncakeKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.srt.sglang_wiring import transfer
    from sglang_cp_shared_kv.srt.sglang_wiring.plugin_state import state_of

    out: dict = {"patched": sorted(set(TARGETS) & HookRegistry._patched)}

    # -- startup checks of a decode server with the flag, through SGLang's resolution --
    base = ["--model-path", os.path.join(model_dir, "mla"), "--device", "cpu", "--skip-tokenizer-init"]
    base += ["--page-size", str(PS), "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"]
    startup = {}
    for case, extra, _ in STARTUP:
        argv = base + [FLAG] + extra
        if "--disaggregation-transfer-backend" in extra:
            argv = base[:-2] + [FLAG] + extra
        try:
            prepare_server_args(argv).resolve_once()
            startup[case] = {"accepted": True}
        except Exception as e:
            startup[case] = {"accepted": False, "error": f"{type(e).__name__}: {e}"}
    try:  # the flag off: stock decode
        prepare_server_args(base).resolve_once()
        startup["decode_off"] = {"accepted": True}
    except Exception as e:
        startup["decode_off"] = {"accepted": False, "error": f"{type(e).__name__}: {e}"}
    out["startup"] = startup

    # -- a decode server with the flag keeps SGLang's pool and allocator (the flag only checks manifests) --
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.runtime_context import get_parallel

    decode_args = prepare_server_args(base + [FLAG])
    decode_args.resolve_once()
    publish(decode_args, role="scheduler")
    dsa_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool, alloc = _configurator_build(dsa_config, 8 * PS)
    out["decode_pool"] = {
        "flag": bool(getattr(decode_args, "enable_cp_shared_kv", False)),
        "pool": type(pool).__name__,
        "allocator": type(alloc).__name__,
        "sharded_transfer": bool(get_parallel().enable_kv_cache_sharding),
    }

    # -- pools: a decode-mode record with the flag builds the stock pool (the flag only checks manifests) --
    server_args, ranks, allocator, replicated, decode = _build_pools(model_dir)
    pages = _fill(ranks, replicated, allocator, [n * PS - 7 for _, n, *_ in REQUESTS])

    # -- the connector: engines, managers and their SGLang threads --
    executor = concurrent.futures.ThreadPoolExecutor(2)
    d_engine = MooncakeTransferEngine("127.0.0.1")
    d_aux = torch.zeros(8, 64, dtype=torch.uint8)
    for buf in [*decode.kv_buffer, *decode.index_k_with_scale_buffer, d_aux]:
        d_engine.register(buf.data_ptr(), buf.nbytes)
    d_mgr = _manager(DisaggregationMode.DECODE, d_engine, _kv_args(decode, d_aux, 0), 0, 1)
    d_mgr.start_decode_thread()
    p_mgrs, p_aux = [], []
    for rank, pool in enumerate(ranks):
        engine = MooncakeTransferEngine("127.0.0.1")
        aux = torch.full((8, 64), 100 + rank, dtype=torch.uint8)
        for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux]:
            engine.register(buf.data_ptr(), buf.nbytes)
        m = _manager(DisaggregationMode.PREFILL, engine, _kv_args(pool, aux, rank), rank, N)
        m.transfer_queues = [FastQueue()]
        m.start_prefill_thread()
        threading.Thread(target=m.transfer_worker, args=(m.transfer_queues[0], executor), daemon=True).start()
        p_mgrs.append(m)
        p_aux.append(aux)
    addr = "127.0.0.1:1"  # the bootstrap address the decode knows the prefill by (no HTTP is made)
    info = _prefill_info(N, PS)
    d_mgr._resolve_rank_mapping(info)  # SGLang's rank mapping: pull from both CP ranks, expect 2 successes
    d_mgr.prefill_info_table[addr] = info
    for cp in info.target_cp_ranks:
        d_mgr.connection_pool[f"{addr}_0_{cp}_{info.target_tp_rank}"] = [
            {"rank_ip": "127.0.0.1", "rank_port": p_mgrs[cp].rank_port, "is_dummy": False}
        ]
    out["required_responses"] = info.required_prefill_response_num

    free_dst = list(range(47, 0, -1))  # decode pages handed out in a scrambled order
    original_filter = common_conn.filter_kv_indices_for_shard_rank
    checks = state_of(d_mgr).checks

    class Request:
        """One request through SGLang's receiver and the two ranks' senders."""

        def __init__(self, idx: int):
            self.idx, self.room = idx, 1000 + idx
            self.name, self.n_pages, self.flag, self.bad_rank, self.fault, self.bad_first = REQUESTS[idx]
            self.lp, self.held = pages[idx], None
            self.dst = np.asarray([free_dst.pop() for _ in range(self.n_pages)][::-1], dtype=np.int32)
            self.senders = [MooncakeKVSender(m, addr, self.room) for m in p_mgrs]
            for snd in self.senders:
                snd.init(self.n_pages, aux_index=idx % 8)
            self.receiver = MooncakeKVReceiver(d_mgr, addr, self.room)
            self.receiver.init(0)
            if not p_mgrs[0].decode_kv_args_table:  # the decode's KV registration, once, as SGLang sends it
                assert self.receiver._register_kv_args()
                _deadline_wait(lambda: all(m.decode_kv_args_table for m in p_mgrs), "registration")
            self.receiver.send_metadata(self.dst, idx % 8, [self.dst.copy()], 0)
            _deadline_wait(
                lambda: all(snd.poll() == KVPoll.WaitingForInput for snd in self.senders), f"{self.name}: destinations"
            )

        def send(self, rank: int, part: int) -> None:
            """Rank ``rank`` sends the first (0) or second (1) half of the pages, as two prefill chunks would."""
            cut = self.n_pages // 2
            faulty = rank == self.bad_rank
            if faulty and self.fault in ("non_owner", "missing", "duplicate"):
                common_conn.filter_kv_indices_for_shard_rank = _faulty_filter(original_filter, rank, self.fault)
            try:
                if part == 0:
                    self.senders[rank].send(self.lp[:cut])
                    return
                shares = state_of(p_mgrs[rank]).shares
                if faulty and self.fault == "out_of_range":  # a manifest naming a position past the request
                    shares[self.room].positions.append(self.n_pages + 3)
                if faulty and self.fault == "no_manifest":  # a share never opened: no manifest, as a stock prefill
                    shares.pop(self.room)
                self.senders[rank].send(self.lp[cut:], [self.lp.copy()])
            finally:
                common_conn.filter_kv_indices_for_shard_rank = original_filter
            _deadline_wait(lambda: self.senders[rank].poll() == KVPoll.Success, f"{self.name}: rank {rank} transfer")

        def run(self) -> None:
            bad, order = self.bad_rank, [0, 1]
            if bad is not None:
                order = [bad, 1 - bad] if self.bad_first else [1 - bad, bad]
            for k, rank in enumerate(order):
                self.send(rank, 0)
                self.send(rank, 1)
                if k == 0 and self.bad_first and self.flag:
                    # The faulty rank's status reached the decode; the request must still wait for the other rank.
                    _deadline_wait(
                        lambda r=rank: self.room in checks and r in checks[self.room].reported, f"{self.name}: report"
                    )
                    time.sleep(0.05)
                    self.held = int(self.receiver.poll())

        def verdict(self) -> dict:
            receiver = self.receiver
            _deadline_wait(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), f"{self.name}: verdict")
            run = {
                "poll": int(receiver.poll()),
                "held_poll": self.held,
                "senders": [int(x.poll()) for x in self.senders],
            }
            if run["poll"] == KVPoll.Failed:
                try:
                    receiver.failure_exception()  # what SGLang's decode queue calls on a failed poll
                except KVTransferError as e:
                    run["error"] = e.failure_reason
            exact = True
            for layer in range(2):
                for p, page in enumerate(self.lp):
                    d, r = int(self.dst[p]), int(page)
                    exact &= torch.equal(
                        decode.kv_buffer[layer][d * PS : (d + 1) * PS],
                        replicated.kv_buffer[layer][r * PS : (r + 1) * PS],
                    )
                    exact &= torch.equal(
                        decode.index_k_with_scale_buffer[layer][d], replicated.index_k_with_scale_buffer[layer][r]
                    )
            run["exact"], run["aux"] = bool(exact), int(d_aux[self.idx % 8, 0])
            receiver.clear()
            run["forgotten"] = self.room not in checks
            for snd in self.senders:
                snd.clear()
            run["shares_left"] = [self.room in state_of(m).shares for m in p_mgrs]
            return run

    def publish_flag(flag: bool) -> None:
        server_args.__dict__["enable_cp_shared_kv"] = flag
        publish(server_args, role="scheduler")

    runs = {}
    publish_flag(True)
    # The plugin's series, as a decode server with --enable-metrics builds them (single-process registry here).
    from prometheus_client import REGISTRY

    from sglang_cp_shared_kv.srt.sglang_wiring import metrics

    labels = {"model_name": "tiny", "engine_type": "decode", "tp_rank": "0", "cp_rank": "0"}
    metrics.use(metrics.CPSharedKVMetrics(labels))
    # "good" stays in flight (one rank's first chunk sent) while every faulty request runs and fails.
    good = Request(0)
    good.send(1, 0)
    for idx, req in enumerate(REQUESTS):
        if req[2] and idx != 0:
            bad = Request(idx)
            bad.run()
            runs[bad.name] = bad.verdict()
    runs["good"] = {"in_flight_poll": int(good.receiver.poll())}
    good.send(1, 1)
    good.send(0, 0)
    good.send(0, 1)
    runs["good"].update(good.verdict())
    out["manifest_rejections"] = REGISTRY.get_sample_value("sglang:cp_shared_kv_manifest_rejections_total", labels)
    publish_flag(False)
    for idx, req in enumerate(REQUESTS):
        if not req[2]:
            r = Request(idx)
            r.run()
            runs[r.name] = r.verdict()
    out["runs"] = runs

    # -- the wire format: with the flag off a prefill sends SGLang's three frames; with it on the
    # manifest follows, and SGLang's own (unhooked) parser reads the status unchanged --
    stock_parse = CommonKVManager.parse_kv_status_message.__wrapped__
    frames = {}
    for flag in (False, True):
        server_args.__dict__["enable_cp_shared_kv"] = flag
        publish(server_args, role="scheduler")
        state_of(p_mgrs[1]).shares[77] = transfer.SentShare([4, 7, 9], [0, 2])
        parts = p_mgrs[1]._encode_kv_status_message(bootstrap_room=77, status=KVPoll.Success, failure_reason=None)
        frames[str(flag)] = {"n": len(parts), "stock_parse": list(stock_parse(d_mgr, parts))}
        state_of(p_mgrs[1]).shares.pop(77, None)
    out["frames"] = frames

    # -- status messages a faulty or foreign prefill could send, straight into the hooked parser --
    from sglang_cp_shared_kv.srt.disaggregation.mooncake import manifest as cm
    from sglang_cp_shared_kv.srt.disaggregation.mooncake.manifest import ManifestCollector
    from sglang_cp_shared_kv.srt.sglang_wiring.decode_manifest import RoomCheck

    publish_flag(True)
    page_bytes = sum(d_mgr.kv_args.kv_item_lens)

    def status(room, prank, tail):
        return [str(room).encode(), str(KVPoll.Success).encode(), str(prank).encode(), b"", *tail]

    def manifest(room, rank, positions):
        m = cm.Manifest(str(room), rank, (6, 9), tuple(positions), len(positions) * page_bytes)
        return cm.encode(m)

    tag = cm.MANIFEST_FRAME
    forged = {
        "rank_mismatch": [tag, b"2", None],  # rank 0's manifest on rank 1's status
        "cp_mismatch": [tag, b"4", None],
        "malformed": [tag, b"2", b"{not json"],
        "truncated": [tag, b"2"],
    }
    parsed = {}
    for k, (case, tail) in enumerate(forged.items()):
        room = 900 + k
        d_mgr.request_status[room] = KVPoll.WaitingForInput
        checks[room] = RoomCheck(ManifestCollector(str(room), 2, N, page_bytes), senders=N)
        tail = [manifest(room, 0, [0]) if f is None else f for f in tail]
        first = d_mgr.parse_kv_status_message(status(room, 1, tail))  # the faulty rank: held
        last = d_mgr.parse_kv_status_message(status(room, 0, [tag, b"2", manifest(room, 0, [0])]))
        parsed[case] = {"first": first, "last": list(last) if last else last}
        checks.pop(room)
        d_mgr.request_status.pop(room)
    out["forged"] = parsed

    # -- a prefill whose cache is not sharded (not running the flag): SGLang pulls from fewer of its CP
    # ranks than it has, which the decode finds when it arms the request's check --
    import logging

    from sglang_cp_shared_kv.srt.sglang_wiring import decode_manifest

    addr_stock = "127.0.0.1:2"
    info_stock = _prefill_info(N, PS, sharded=False)
    d_mgr._resolve_rank_mapping(info_stock)
    d_mgr.prefill_info_table[addr_stock] = info_stock
    for cp in info_stock.target_cp_ranks:
        d_mgr.connection_pool[f"{addr_stock}_0_{cp}_{info_stock.target_tp_rank}"] = [
            {"rank_ip": "127.0.0.1", "rank_port": p_mgrs[cp].rank_port, "is_dummy": False}
        ]
    logged: list = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())
    decode_manifest.logger.addHandler(handler)
    room = 950
    receiver = MooncakeKVReceiver(d_mgr, addr_stock, room)
    receiver.init(0)
    dst = np.asarray([free_dst[-1], free_dst[-2]], dtype=np.int32)
    receiver.send_metadata(dst, 0, [dst.copy()], 0)
    rejected = REGISTRY.get_sample_value("sglang:cp_shared_kv_manifest_rejections_total", labels)
    got = d_mgr.parse_kv_status_message(status(room, 0, [tag, b"2", manifest(room, 0, [0])]))
    out["stock_prefill"] = {
        "required": info_stock.required_prefill_response_num,
        "parsed": list(got) if got else got,
        "counted": REGISTRY.get_sample_value("sglang:cp_shared_kv_manifest_rejections_total", labels) - rejected,
        "logged": logged,
    }
    decode_manifest.logger.removeHandler(handler)
    receiver.clear()

    # -- a prefill rank whose only destination is a dummy (a decode rank that takes nothing from it): SGLang's
    # transfer worker marks the request Success and sends no status message, so no manifest is attached --
    room = 960
    dummy_sender = MooncakeKVSender(p_mgrs[1], addr, room)
    dummy_sender.init(2, aux_index=0)
    dummy = d_mgr.build_receiver_metadata_message(
        bootstrap_room=room,
        required_dst_info_num=1,
        kv_indices=np.zeros(0, dtype=np.int32),
        aux_index=None,
        state_indices=None,
        decode_prefix_len=None,
        is_dummy=True,
    )
    d_mgr._send_multipart_locked(f"tcp://127.0.0.1:{p_mgrs[1].rank_port}", dummy)
    _deadline_wait(lambda: dummy_sender.poll() == KVPoll.WaitingForInput, "dummy destination")
    dummy_sender.send(np.asarray(pages[0][:2], dtype=np.int32))
    _deadline_wait(lambda: dummy_sender.poll() == KVPoll.Success, "dummy transfer")
    dummy_sender.clear()
    out["dummy_destination"] = {"share_left": room in state_of(p_mgrs[1]).shares}
    # Debug mode checks the pages SGLang's sender selects, chunk by chunk: an honest chunk passes.
    room = 961
    os.environ["SGLANG_DEBUG_CP_SHARED_KV"] = "1"
    checked, real_check = [], transfer.check_send_indices
    transfer.check_send_indices = lambda *args: checked.append(real_check(*args))
    aborted = MooncakeKVSender(p_mgrs[1], addr, room)
    aborted.init(4, aux_index=0)
    d_mgr._send_multipart_locked(f"tcp://127.0.0.1:{p_mgrs[1].rank_port}", [str(room).encode(), *dummy[1:]])
    _deadline_wait(lambda: aborted.poll() == KVPoll.WaitingForInput, "aborted request's destination")
    aborted.send(np.asarray(pages[0][:2], dtype=np.int32))  # the first of two chunks
    aborted.clear()
    transfer.check_send_indices = real_check
    os.environ.pop("SGLANG_DEBUG_CP_SHARED_KV")
    out["debug_checked_chunks"] = len(checked)

    # -- hostile manifests at scale: test_manifest_fuzz's requests (N ranks, any of them hostile)
    # through the hooked parser and SGLang's apply_prefill_status, the decode pool watched --
    import hashlib
    from collections import Counter

    from hypothesis import HealthCheck, given, settings

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(tests, "disaggregation", "mooncake"))
    from test_manifest_fuzz import request_messages

    def pool_digest() -> str:
        h = hashlib.blake2b(digest_size=16)
        for buf in [*decode.kv_buffer, *decode.index_k_with_scale_buffer]:
            h.update(buf.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    before = pool_digest()
    tally: Counter = Counter()

    # Derandomized: the same requests every run, so the share of hostile ones below does not vary.
    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(case=request_messages())
    def hostile_request(case):
        room, cp_size, table, pb, hostile, messages = case
        d_mgr.request_status[room] = KVPoll.WaitingForInput  # what the receiver's send_metadata leaves
        d_mgr.prefill_response_tracker[room] = set()
        d_mgr.required_prefill_response_num_table[room] = cp_size
        checks[room] = RoomCheck(ManifestCollector(str(room), len(table), cp_size, pb), senders=cp_size)
        try:
            for _, msg in messages:
                got = d_mgr.parse_kv_status_message(msg)
                if got is not None:
                    r, status_, prank, reason = got
                    d_mgr.apply_prefill_status(
                        bootstrap_room=r, status=status_, prefill_rank=prank, failure_reason=reason
                    )
            final = d_mgr.request_status[room]
            reason = d_mgr.failure_records.get(room, "")
            if hostile:
                ok = final == KVPoll.Failed and reason.startswith(f"{FLAG}: manifest check failed: request {room}")
                ok = ok and "\n" not in reason
            else:
                ok = final == KVPoll.Success and not reason
            tally["hostile_failed" if hostile and ok else "honest_served" if ok else "wrong"] += 1
            if not ok:
                tally[f"wrong: {sorted(hostile.values())} {final} {reason[:120]}"] += 1
        finally:  # what the receiver's clear does, and the plugin's forget_room
            for table_ in (d_mgr.request_status, d_mgr.prefill_response_tracker, d_mgr.failure_records):
                table_.pop(room, None)
            d_mgr.required_prefill_response_num_table.pop(room, None)
            checks.pop(room, None)

    hostile_request()
    out["hostile"] = {"tally": dict(tally), "pool_unchanged": pool_digest() == before, "checks_left": len(checks)}
    out["manifest_frame"] = cm.MANIFEST_FRAME.decode()
    print("RESULT:" + json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # SGLang's connector threads block on their sockets forever


# ---------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    write_model_dirs(root, ["mla", "dsa"])
    env = {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv", "TRITON_INTERPRET": "1", "MC_LOG_LEVEL": "WARNING"}
    env.pop("SGLANG_DEBUG_CP_SHARED_KV", None)  # the faults must reach the decode, not the prefill's debug check
    return run_worker([__file__, str(root)], env, 240)


SUCCESS, FAILED = 4, 0


def test_every_hook_is_installed(results):
    assert results["patched"] == sorted(TARGETS)
    assert results["required_responses"] == N  # SGLang itself waits for both CP ranks


def test_good_manifests_mark_the_request_ready_with_the_replicated_bytes(results):
    run = results["runs"]["good"]
    assert run["in_flight_poll"] == 2  # WaitingForInput while the faulty requests came and failed
    assert run["poll"] == SUCCESS and run["senders"] == [SUCCESS, SUCCESS]
    assert run["exact"]  # latent and indexer pages equal the replicated pool at their positions
    assert run["aux"] in (100, 101)  # the aux slot written by the prefill's transfer worker
    assert run["forgotten"] and run["shares_left"] == [False, False]


@pytest.mark.parametrize(
    "name,phrase",
    [
        ("non_owner", "rank 1 claimed position"),  # after the owner's report
        ("non_owner_first", "rank 0 claimed position"),
        ("missing", "rank 0 did not report positions"),
        ("duplicate", "rank 1 reported position"),
        ("out_of_range", "out of range [0, 4)"),
        ("no_manifest", "prefill rank 1 sent no CP shared-KV manifest"),
    ],
)
def test_a_wrong_manifest_fails_only_that_request(results, name, phrase):
    run = results["runs"][name]
    assert run["poll"] == FAILED
    assert run["senders"] == [SUCCESS, SUCCESS]  # every prefill rank finished writing before the verdict
    reason = run["error"]
    assert reason.startswith(f"{FLAG}: manifest check failed: request {1000 + [r[0] for r in REQUESTS].index(name)}: ")
    assert phrase in reason and "\n" not in reason, reason
    assert run["forgotten"] and run["shares_left"] == [False, False]
    if [r for r in REQUESTS if r[0] == name][0][-1]:
        # The faulty rank reported first; the decode held the request until the other rank was done too.
        assert run["held_poll"] not in (None, FAILED, SUCCESS), run["held_poll"]


def test_each_refused_request_counts_once_in_the_metrics(results):
    failed = [name for name, run in results["runs"].items() if run["poll"] == FAILED]
    assert len(failed) == 6 and results["manifest_rejections"] == len(failed), results["manifest_rejections"]


def test_wrong_shares_really_corrupt_what_the_check_rejects(results):
    # A rank sending a page it does not own overwrites its position with the wrong bytes, and a rank
    # leaving one out leaves that position unwritten: the manifest check is what stops these.
    assert not results["runs"]["non_owner"]["exact"]
    assert not results["runs"]["missing"]["exact"]


def test_other_requests_are_unaffected(results):
    # "good" was in flight across all the failed requests, and ends ready with the right bytes.
    good = results["runs"]["good"]
    assert good["in_flight_poll"] == 2 and good["poll"] == SUCCESS and good["exact"]


def test_flag_off_is_stock(results):
    off = results["runs"]["off_good"]
    assert off["poll"] == SUCCESS and off["exact"] and off["held_poll"] is None
    # Without the flag nothing is checked: SGLang marks a request with a wrong share ready.
    bug = results["runs"]["off_non_owner"]
    assert bug["poll"] == SUCCESS and "error" not in bug and not bug["exact"]
    frames = results["frames"]
    assert frames["False"]["n"] == 3  # SGLang's [room, status, rank]
    assert frames["True"]["n"] == 3 + 1 + 3  # + empty reason + tag, cp size, manifest
    for flag in ("False", "True"):  # SGLang's own parser reads both the same
        assert frames[flag]["stock_parse"] == [77, SUCCESS, 1, None]


@pytest.mark.parametrize(
    "case,phrase",
    [
        ("rank_mismatch", "prefill rank 1 sent the manifest of rank 0"),
        ("cp_mismatch", "prefill rank 1 shards over 4 CP ranks"),
        ("malformed", "prefill rank 1's manifest is malformed"),
        ("truncated", "prefill rank 1's manifest has 1 frames, expected 2"),
    ],
)
def test_a_forged_status_is_held_then_fails(results, case, phrase):
    got = results["forged"][case]
    assert got["first"] is None  # held: the other rank has not reported yet
    room, status, rank, reason = got["last"]
    assert status == FAILED and rank == 0
    assert reason.startswith(f"{FLAG}: manifest check failed: request {room}: ") and phrase in reason, reason


def test_a_prefill_without_the_flag_fails_the_request_once_logged_and_counted(results):
    got = results["stock_prefill"]
    assert got["required"] < N  # SGLang pulls from fewer CP ranks than the prefill has
    room, status, _rank, reason = got["parsed"]
    assert status == FAILED and f"SGLang waits for {got['required']} prefill senders" in reason, reason
    assert got["counted"] == 1 and len(got["logged"]) == 1, got
    assert got["logged"][0].startswith(f"{FLAG}: manifest check failed: request {room}: "), got["logged"]


def test_a_rank_that_sends_only_to_a_dummy_destination_keeps_no_record(results):
    assert results["dummy_destination"]["share_left"] is False, results["dummy_destination"]


def test_debug_mode_checks_each_chunk_the_sender_selects(results):
    assert results["debug_checked_chunks"] == 1  # and it passed: the worker went on


def test_hostile_manifests_fail_their_request_in_sglang_and_write_nothing(results):
    """Requests with any prefill rank hostile (``test_manifest_fuzz``'s generator) end ``Failed`` in SGLang's
    decode manager with the one-line reason; all-honest ones end ``Success``; the decode pool is unchanged."""
    h = results["hostile"]
    assert set(h["tally"]) <= {"hostile_failed", "honest_served"}, h["tally"]
    # Both kinds are well represented (about a quarter of the generated requests have a hostile rank).
    assert min(h["tally"].get("hostile_failed", 0), h["tally"].get("honest_served", 0)) >= FUZZ_EXAMPLES // 8, h[
        "tally"
    ]
    assert h["pool_unchanged"] and h["checks_left"] == 0


@pytest.mark.parametrize("case,extra,expected", STARTUP, ids=[c[0] for c in STARTUP])
def test_decode_startup_checks(results, case, extra, expected):
    got = results["startup"][case]
    if expected is None:
        assert got["accepted"], got.get("error")
        return
    assert not got["accepted"], f"{case} was accepted"
    lines = got["error"][len("CPSharedKVStartupError: ") :].split("\n")
    assert got["error"].startswith("CPSharedKVStartupError: ") and len(lines) == 1, lines
    assert lines[0].startswith(f"{FLAG}: ") and expected in lines[0], lines


def test_decode_server_with_the_flag_keeps_sglang_pool(results):
    assert results["decode_pool"] == {
        "flag": True,
        "pool": "DSATokenToKVPool",
        "allocator": "PagedTokenToKVPoolAllocator",
        "sharded_transfer": False,
    }


def test_decode_without_the_flag_resolves_as_stock(results):
    assert results["startup"]["decode_off"]["accepted"], results["startup"]["decode_off"]


if __name__ == "__main__":
    _worker(sys.argv[1])
