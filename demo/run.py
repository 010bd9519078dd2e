"""The demo: SGLang's prefill CP path with ``--enable-cp-shared-kv``, prefill to decode, on CPU.

1. ``--cp-size`` prefill CP ranks (spawned processes, gloo) each resolve a prefill server's
   arguments with the flag, and SGLang's KV cache configurator builds their pool and allocator
   through the plugin's hooks (as ``launch_server --enable-cp-shared-kv`` does): the CP-shared
   DSA pool, SGLang's owner-rotating ``PageInterleavePoolAllocator``, the view arena.
2. Each rank runs chunked prefill of a few requests through SGLang's ``prepare_kv_shard_forward``
   and the pool calls of the DSA backend (a tiny DSA model's math, ``tiny_model``), and the same
   batches through SGLang's stock replicated ``DSATokenToKVPool``: every indexer read, top-k and
   hidden state must be equal, bit for bit.
3. Each rank sends its owned pages of every request to a decode (this process) through SGLang's
   Mooncake connector (``MooncakeKVSender`` / ``MooncakeKVReceiver``, the real transfer engine on
   127.0.0.1) with the plugin's manifest; the decode checks the manifests, then its rebuilt KV and
   one decode step against the replicated pool, byte for byte.
4. With ``--decode-cp-size D`` (D > 1) the decode is D spawned ranks, each over a pool sharded by the
   same page ownership: each prefill rank writes each page it owns to its decode owner, every decode
   rank checks that it holds exactly its pages, and a decode step runs on the D ranks (gloo: global
   top-k, attention over each rank's rows, LSE merge) against the replicated step, layer by layer.

SGLang's own ``--enable-kv-cache-sharding`` pool gathers through a CUDA communicator, so on CPU its
column shows what SGLang sizes for it (its scratch by its own constants), not a run.

    scripts/demo.sh [--cp-size 2] [--requests 3] [--request-len 320] [--chunk 128] ...   (--help)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from demo import limits

PROG = os.environ.get("CP_SHARED_KV_DEMO_PROG", "python -m demo")
ADDR = "127.0.0.1:1"  # the bootstrap address the decode knows the prefill by (no HTTP request is made)
AUX_SLOTS = 16
LAYERS = 2  # the tiny model's layers (its config)
WAIT_S = 300.0
# The LSE merge of the decode CP ranks' partial outputs against one softmax over every row: fp32 rounding.
STEP_TOLERANCE = 1e-4


class DemoError(RuntimeError):
    """A rank failed or went quiet; the message says which and why."""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _open_files() -> int:
    """This process's open file descriptors now (Linux's ``/proc/self/fd``; elsewhere 0)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def _rss_now() -> int:
    """This process's resident bytes now (Linux's ``VmRSS``; elsewhere its peak so far)."""
    now = limits.proc_bytes("/proc/self/status", "VmRSS")
    return _peak_rss() if now is None else now


def schedule(lengths: list[int], chunk: int, page_size: int) -> list[list[tuple[int, int, int]]]:
    """Chunked prefill as SGLang's scheduler issues it over a sharded pool: batches of ``(request, prefix_len,
    seq_len)`` with at most ``chunk`` new tokens; a request that ends mid-batch leaves the rest of the budget to
    the next, whose chunk is floored to whole pages unless it ends the request (sharded extends start on a page)."""
    batches, cur, budget = [], [], chunk
    for req, length in enumerate(lengths):
        done = 0
        while done < length:
            take = min(budget, length - done)
            if done + take < length:
                take -= take % page_size
            if take == 0:
                batches.append(cur)
                cur, budget = [], chunk
                continue
            cur.append((req, done, done + take))
            done, budget = done + take, budget - take
            if budget == 0 or done < length:
                batches.append(cur)
                cur, budget = [], chunk
    if cur:
        batches.append(cur)
    return batches


# ------------------------------------------------------------------------------------------ prefill rank
def _prefill_rank(rank: int, cp_size: int, cfg: dict, to_driver, inbox) -> None:
    """One prefill CP rank: SGLang's pools through the plugin, chunked prefill, then its share sent to the decode."""
    import concurrent.futures
    import threading

    import numpy as np
    import torch
    import torch.distributed as dist
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import FastQueue, MooncakeKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.layers.attention.kv_shard_hooks import prepare_kv_shard_forward
    from sglang.srt.mem_cache import page_interleave
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    from demo import sglang_parts as sp
    from demo.tiny_model import TinyDSA
    from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES
    from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import upstream_scratch_bytes

    _quiet()
    load_plugins()  # SGLANG_PLUGINS=cp_shared_kv: the hooks launch_server installs
    imported = _rss_now()  # torch, the SGLang modules used here and those the plugin's hooks target
    ps, lengths, chunk = cfg["page_size"], cfg["lengths"], cfg["chunk"]
    argv = sp.prefill_cp_argv(cfg["model_dir"], ps, cp_size) + ["--chunked-prefill-size", str(chunk)]
    argv += ["--context-length", str(cfg["context_len"])]
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    server_args.__dict__["enable_cp_shared_kv"] = True  # the record as the launcher passes it (CPU cannot resolve it)
    publish(server_args, role="scheduler")
    model_config = model_config_of(prepare_server_args(["--model-path", os.path.join(cfg["model_dir"], "dsa")]))
    model_config.context_len = cfg["context_len"]
    pages_per_rank = -(-sum(-(-n // ps) for n in lengths) // cp_size) + 2
    # The CP group the pool's reads look up at the first batch: this process group (on a server: SGLang's
    # attention-CP group coordinator, whose device group it names).
    get_parallel().override_permanently(attn_cp_group=SimpleNamespace(device_group=None))
    pool, allocator = sp.build_pool_and_allocator(model_config, pages_per_rank * ps, len(lengths), ps, (rank, cp_size))
    (stock,) = sp.stock_dsa_pools([cp_size * pool.phys_pages * ps - ps], ps)  # the replicated pool of today
    arena = sum(t.numel() * t.element_size() for t in pool.read.arena.values())  # allocated once, by the hook
    token_bytes = pool.kv_buffer[0][0].nbytes + INDEX_TOKEN_BYTES  # one layer's row + indexer record
    theirs = upstream_scratch_bytes(allocator.shard_spec, token_bytes, cfg["context_len"])
    classes = {
        "pool": type(pool).__name__,
        "pool_sglang_bases": [c.__name__ for c in type(pool).__mro__ if c.__module__.startswith("sglang.srt")][:2],
        "allocator": type(allocator).__name__,
        "stock": type(stock).__name__,
        "upstream_constant": f"page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS={page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS}",
    }
    model = TinyDSA(LAYERS, topk=cfg["topk"])
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 1024, (n,), generator=g) for n in lengths]
    max_len = -(-max(lengths) // ps) * ps
    req_to_token = torch.zeros((len(lengths), max_len), dtype=torch.int32)
    rows, mismatches = [], []
    batches = schedule(lengths, chunk, ps)
    alloc = sp.extend_allocation(allocator, len(lengths), max_len)  # SGLang's scheduler-side allocation
    reqs = [SimpleNamespace(last_node=None, kv_rotation_base=None) for _ in lengths]  # what it reads of a Req
    with sp.no_dcp():
        for bi, batch in enumerate(batches):
            # One allocation per batch, the same logical pages on every rank; a request's later chunks
            # continue the rotation base its first chunk drew, so its pages cycle through the owners.
            locs = alloc(
                [reqs[r] for r, _, _ in batch],
                [p for _, p, _ in batch],
                [n for _, _, n in batch],
                [int(req_to_token[r, p - 1]) if p else 0 for r, p, _ in batch],
            )
            at = 0
            for req, prefix, seq in batch:
                req_to_token[req, prefix:seq] = locs[at : at + seq - prefix].to(torch.int32)
                at += seq - prefix
            new = torch.cat([tokens[r][p:n] for r, p, n in batch])
            fb = SimpleNamespace(
                forward_mode=ForwardMode.EXTEND,
                req_pool_indices=torch.tensor([r for r, _, _ in batch]),
                extend_prefix_lens_cpu=[p for _, p, _ in batch],
                seq_lens_cpu=[n for _, _, n in batch],
                rids=[f"req{r}" for r, _, _ in batch],
            )
            prepare_kv_shard_forward(pool, req_to_token, fb)  # SGLang's batch start (the plugin's hook names rids)
            mode = pool.read.mode
            ours = model.forward(pool, new, batch, req_to_token, sharded=True)
            received = int(pool.read.counters.bytes_received) if pool.read.counters is not None else 0
            pool.end_shard_extend()
            ref = model.forward(stock, new, batch, req_to_token, sharded=False)
            equal = all(torch.equal(a, b) for mine, theirs_ in zip(ours, ref) for a, b in zip(mine, theirs_))
            if not equal:
                mismatches.append(bi + 1)
            rows.append(
                {
                    "batch": bi + 1,
                    "requests": [[r, p, n] for r, p, n in batch],
                    "read": mode,
                    "bytes_received": received,
                    "equal": equal,
                }
            )
            to_driver.put(("progress", rank, bi + 1))  # the driver's quiet-rank timer counts from here
            if rank == 0:
                kind = "prefix view" if mode == "materialized" else "current chunk only"
                print(
                    f"prefill: batch {bi + 1}/{len(batches)}: {sum(n - p for _, p, n in batch)} new tokens, "
                    f"{kind}, {_fmt_bytes(received)} received by rank 0, "
                    f"{'equal' if equal else 'DIFFERENT'} to the replicated pool",
                    flush=True,
                )
    # The last batches' flags (a server acts on them two batches later): a slot overflow raises here.
    pool.read.check_overflow(wait=True)

    # -- SGLang's Mooncake connector: this rank's manager, engine, bootstrap thread and transfer worker --
    engine = _engine()
    aux = torch.full((AUX_SLOTS, 64), rank, dtype=torch.uint8)
    for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux]:
        engine.register(buf.data_ptr(), buf.nbytes)
    sent = [0]
    inner = engine.batch_transfer_sync

    def counted(session_id, src, dst, lens):  # the bytes this rank's transfer worker writes, as it writes them
        sent[0] += int(sum(lens))
        return inner(session_id, src, dst, lens)

    engine.batch_transfer_sync = counted
    mgr = sp.mooncake_manager(DisaggregationMode.PREFILL, engine, sp.kv_args(pool, aux, rank, ps), rank, cp_size)
    mgr.transfer_queues = [FastQueue()]
    mgr.start_prefill_thread()
    executor = concurrent.futures.ThreadPoolExecutor(1)
    threading.Thread(target=mgr.transfer_worker, args=(mgr.transfer_queues[0], executor), daemon=True).start()
    pages = [(req_to_token[r, : lengths[r] : ps].long() // ps).numpy().astype(np.int32) for r in range(len(lengths))]
    senders = []
    for r, lp in enumerate(pages):
        s = MooncakeKVSender(mgr, ADDR, 1000 + r)
        s.init(len(lp), aux_index=r % AUX_SLOTS)
        senders.append(s)
    reply = {
        "rank": rank,
        "port": mgr.rank_port,
        "pages": [p.tolist() for p in pages],
        "rows": rows,
        "mismatches": mismatches,
        "kv_held": sum(b.nbytes for b in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]),
        "stock_held": sum(b.nbytes for b in [*stock.kv_buffer, *stock.index_k_with_scale_buffer]),
        "arena": arena,
        "upstream_scratch": theirs,
        "classes": classes,
        "rss_after_imports": imported,
    }
    if rank == 0:  # what the decode must rebuild: the replicated pool's pages, and a decode step over them
        reply["expected"] = [
            [
                (
                    stock.kv_buffer[layer].view(-1, ps, stock.kv_buffer[layer].shape[-1])[lp].clone(),
                    stock.index_k_with_scale_buffer[layer][lp].clone(),
                )
                for layer in range(LAYERS)
            ]
            for lp in (torch.from_numpy(p).long() for p in pages)
        ]
        reply["decode"], reply["trace"] = [], []
        for r, p in enumerate(pages):  # per layer: its input, top-k and output (what each decode CP layer gets)
            trace: list = []
            reply["decode"].append(model.decode_step(stock, torch.from_numpy(p).long(), lengths[r], 1 + r, trace))
            reply["trace"].append(trace)
    to_driver.put(("prefilled", rank, reply))
    op = inbox.get(timeout=WAIT_S)  # the decode registered and sent every request's destination pages
    assert op == "send", op
    for s, lp in zip(senders, pages):
        _wait(lambda s=s: s.poll() == KVPoll.WaitingForInput, "the decode's destination pages")
        s.send(lp, [lp.copy()])  # the request's pages (SGLang's filter keeps this rank's), then the manifest
    for s in senders:
        _wait(lambda s=s: s.poll() in (KVPoll.Success, KVPoll.Failed), "the transfer worker")
    ok = all(s.poll() == KVPoll.Success for s in senders)
    to_driver.put(("sent", rank, {"bytes_sent": sent[0], "ok": ok, "open_files": _open_files()}))
    inbox.get(timeout=WAIT_S)  # stay up until the decode has read everything
    to_driver.put(("rss", rank, _peak_rss()))
    dist.barrier()


def _quiet() -> None:
    """SGLang's and the Mooncake engine's start-up logs off this process's output: the demo prints its own."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _engine():
    """SGLang's ``MooncakeTransferEngine`` on 127.0.0.1 (TCP); the engine's glog start-up lines kept off stderr."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        return MooncakeTransferEngine("127.0.0.1")
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _wait(cond, what: str, timeout_s: float = 60.0) -> None:
    from reference.spawn import wait_until

    wait_until(cond, what, timeout_s)


def _rank_main(rank: int, cp_size: int, port: int, cfg: dict, to_driver, inbox, role: str) -> None:
    """A spawned rank: gloo on 127.0.0.1 with the others of its ``role``, then ``_prefill_rank`` or
    ``_decode_rank``. Ctrl-C ends it quietly (the driver reports)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _quiet()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp_size)
        (_prefill_rank if role == "prefill" else _decode_rank)(rank, cp_size, cfg, to_driver, inbox)
        to_driver.put(("done", rank, None))
    except KeyboardInterrupt:
        os._exit(130)
    except BaseException:  # noqa: BLE001 - every failure goes to the driver, which names the rank
        to_driver.put(("error", rank, traceback.format_exc()))
    to_driver.close()
    to_driver.join_thread()  # the queue's feeder thread delivers what was put
    sys.stdout.flush()
    os._exit(0)  # SGLang's connector threads block on their sockets: leave without joining them


# ------------------------------------------------------------------------------------------ decode (driver)
class _Ranks:
    """The spawned ranks of one ``role`` (prefill, or the decode's when it is sharded) and their queues."""

    def __init__(self, cp_size: int, cfg: dict, role: str = "prefill"):
        from reference.spawn import free_port

        ctx = mp.get_context("spawn")
        self.role = role
        self.to_driver = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(cp_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_rank_main, args=(r, cp_size, port, cfg, self.to_driver, self.inboxes[r], role), daemon=True
            )
            for r in range(cp_size)
        ]
        for p in self.procs:
            p.start()

    def collect(self, kind: str) -> dict[int, object]:
        """One ``kind`` message from every rank; a rank's error or death, or ``WAIT_S`` without any message
        (a rank reports each prefill batch), raises ``DemoError``."""
        want = set(range(len(self.procs)))
        got: dict[int, object] = {}
        end = time.monotonic() + WAIT_S
        while set(got) != want:
            try:
                k, rank, body = self.to_driver.get(timeout=0.5)
                end = time.monotonic() + WAIT_S
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None and r not in got]
                if dead:
                    raise DemoError(
                        f"{self.role} rank {dead[0]} exited (code {self.procs[dead[0]].exitcode})"
                    ) from None
                if time.monotonic() > end:
                    raise DemoError(f"{self.role} ranks {sorted(want - set(got))} went quiet") from None
                continue
            if k == "error":
                raise DemoError(f"{self.role} rank {rank} failed:\n{body}")
            if k == kind:
                got[rank] = body
        return got

    def tell(self, op) -> None:
        for q in self.inboxes:
            q.put(op)

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)


def _decode(args, ranks: _Ranks, model_dir: str) -> dict:
    """The decode: with ``--decode-cp-size 1`` this process, SGLang's stock pool and Mooncake receivers with the
    plugin's manifest check; with D > 1, D spawned decode ranks (``_decode_rank``), each over its own pool
    sharded by page ownership."""
    if args.decode_cp_size > 1:
        return _decode_sharded(args, ranks, model_dir)
    import numpy as np
    import torch

    # One thread, as every prefill rank: CPU matmuls split their reductions by thread count, and the decode
    # step is compared with rank 0's byte for byte.
    torch.set_num_threads(1)
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from demo import sglang_parts as sp

    _quiet()
    load_plugins()
    imported = _rss_now()
    ps, lengths = args.page_size, limits.request_lengths(args.request_len, args.requests)
    _publish_decode_args(model_dir, ps)
    model_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    pages = [-(-n // ps) for n in lengths]
    with sp.no_dcp():
        pool, allocator = sp.build_pool_and_allocator(model_config, (sum(pages) + 2) * ps, args.requests, ps)
    dst = [(allocator.alloc(n * ps)[::ps] // ps).numpy().astype(np.int32) for n in pages]
    before = [b.clone() for b in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]
    aux = torch.zeros(AUX_SLOTS, 64, dtype=torch.uint8)
    mgr = _decode_manager(pool, aux, 0, 1, ps, DisaggregationMode)
    prefilled = ranks.collect("prefilled")
    receivers = _receive(mgr, [prefilled[r]["port"] for r in sorted(prefilled)], dst, ps)
    ranks.tell("send")
    sent = ranks.collect("sent")
    open_files = _open_files()  # every rank's connections up
    polls, reasons = _verdicts(receivers)
    kv_equal = _rebuilt(pool, before, 0, 1, dst, prefilled[0]["expected"], ps)
    ranks.tell("exit")
    rss = ranks.collect("rss")
    model_steps = []
    from demo.tiny_model import TinyDSA

    model = TinyDSA(LAYERS, topk=args.topk)
    for r, d in enumerate(dst):
        step = model.decode_step(pool, torch.from_numpy(d).long(), lengths[r], 1 + r)
        model_steps.append(torch.equal(step, prefilled[0]["decode"][r]))
    return {
        "prefilled": prefilled,
        "sent": sent,
        "transfer_ok": all(polls) and all(s["ok"] for s in sent.values()),
        "reasons": reasons,
        "kv_equal": [kv_equal],
        "step": {"ok": all(model_steps), "equal": model_steps},
        "rss": rss,
        "decode_rss_after_imports": imported,
        "decode_open_files": open_files,
        "decode_pool": type(pool).__name__,
        "decode_held": [sum(b.nbytes for b in [*pool.kv_buffer, *pool.index_k_with_scale_buffer])],
    }


def _decode_sharded(args, ranks: _Ranks, model_dir: str) -> dict:
    """``--decode-cp-size`` D > 1: D decode ranks, processes of their own as a server's are, each registering
    with every prefill rank and receiving the pages it owns; then a decode step on them (gloo)."""
    imported = _rss_now()  # this process only orchestrates: no SGLang import
    lengths = limits.request_lengths(args.request_len, args.requests)
    cfg = {"model_dir": model_dir, "page_size": args.page_size, "lengths": lengths, "topk": args.topk}
    decoders = _Ranks(args.decode_cp_size, cfg, role="decode")
    try:
        prefilled = ranks.collect("prefilled")
        ports = [prefilled[r]["port"] for r in sorted(prefilled)]
        decoders.tell(("connect", ports, prefilled[0]["expected"], prefilled[0]["trace"]))
        decoders.collect("registered")
        ranks.tell("send")
        sent = ranks.collect("sent")
        decoded = decoders.collect("decoded")
        ranks.tell("exit")
        rss = ranks.collect("rss")
        decoders.tell("exit")
    finally:
        decoders.stop()
    per = [decoded[d] for d in sorted(decoded)]
    steps = [d["step"] for d in per]
    top_equal = all(all(s["top_equal"]) for s in steps)
    err = max(e for s in steps for e in s["out_err"])
    agree = all(s["outs"] == steps[0]["outs"] for s in steps)
    return {
        "prefilled": prefilled,
        "sent": sent,
        "transfer_ok": all(all(d["polls"]) for d in per) and all(s["ok"] for s in sent.values()),
        "reasons": [r for d in per for r in d["reasons"]],
        "kv_equal": [d["kv_equal"] for d in per],
        "step": {
            "ok": top_equal and agree and err <= STEP_TOLERANCE,
            "top_equal": top_equal,
            "max_err": err,
            "ranks_agree": agree,
        },  # fmt: skip
        "rss": rss,
        "decode_rss_after_imports": imported,
        "decode_open_files": max([_open_files()] + [d["open_files"] for d in per]),
        "decode_pool": per[0]["pool"],
        "decode_held": [d["held"] for d in per],
        "decode_rank_peak_rss": [d["peak_rss"] for d in per],
    }


def _decode_rank(rank: int, size: int, cfg: dict, to_driver, inbox) -> None:
    """One rank of a decode sharded by page ownership: its pool (``CPSharedDSATokenToKVPool``, rank ``rank`` of
    ``size``, built directly; a decode server with the flag and ``--dcp-size`` builds it itself), SGLang's Mooncake
    manager and receivers with the manifest check, the pages it owns checked, then its part of a decode step."""
    import numpy as np
    import torch
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.plugins import load_plugins

    from demo import sglang_parts as sp

    load_plugins()
    ps, lengths = cfg["page_size"], cfg["lengths"]
    _publish_decode_args(cfg["model_dir"], ps)
    tokens = (sum(-(-n // ps) for n in lengths) // size + len(lengths) + 1) * ps
    pools = sp.sharded_dsa_pools(tokens, ps, size)
    pool = pools[rank]
    # SGLang's owner-rotating allocator draws each request's pages: the same on every decode rank.
    allocator = PageInterleavePoolAllocator(tokens, ps, size, torch.int64, "cpu", pools[0], False)
    dst = [(sp.new_request_locs(allocator, n)[::ps] // ps).numpy().astype(np.int32) for n in lengths]
    before = [b.clone() for b in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]
    aux = torch.zeros(AUX_SLOTS, 64, dtype=torch.uint8)
    mgr = _decode_manager(pool, aux, rank, size, ps, DisaggregationMode)
    op, ports, expected, trace = inbox.get(timeout=WAIT_S)  # the prefill ranks' sockets, the replicated pages
    assert op == "connect", op
    receivers = _receive(mgr, ports, dst, ps)
    to_driver.put(("registered", rank, None))
    polls, reasons = _verdicts(receivers)
    kv_equal = _rebuilt(pool, before, rank, size, dst, expected, ps)
    step = _decode_cp_step(rank, size, cfg["topk"], ps, pool, dst, lengths, trace)
    result = {"polls": polls, "reasons": reasons, "kv_equal": kv_equal, "step": step, "pool": type(pool).__name__}
    result.update(held=sum(b.nbytes for b in before), peak_rss=_peak_rss(), open_files=_open_files())
    to_driver.put(("decoded", rank, result))
    inbox.get(timeout=WAIT_S)  # stay up until every rank has decoded


def _publish_decode_args(model_dir: str, ps: int) -> None:
    """A decode server's arguments with the flag, as the scheduler's (the manifest check reads them)."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    from demo import sglang_parts as sp

    decode_args = prepare_server_args(sp.decode_argv(model_dir, ps) + ["--enable-cp-shared-kv"])
    decode_args.resolve_once()
    publish(decode_args, role="scheduler")


def _decode_manager(pool, aux, rank: int, size: int, ps: int, mode):
    """SGLang's Mooncake decode manager over ``pool`` (rank ``rank`` of a decode group of ``size``: SGLang's
    DCP fields, its attention TP spanning the group), its engine registered, its decode thread running."""
    from demo import sglang_parts as sp

    engine = _engine()
    for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux]:
        engine.register(buf.data_ptr(), buf.nbytes)
    mgr = sp.mooncake_manager(mode.DECODE, engine, sp.kv_args(pool, aux, rank, ps), 0, 1)
    mgr.dcp_size, mgr.dcp_rank, mgr.attn_tp_size, mgr.attn_tp_rank = size, rank, size, rank
    mgr.start_decode_thread()
    return mgr


def _receive(mgr, ports: list[int], dst: list, ps: int) -> list:
    """SGLang's receivers of every request on ``mgr``: the prefill ranks on ``ports`` found as SGLang's rank
    mapping says (every CP rank), the decode's KV registered once, each request's destination pages sent."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

    from demo import sglang_parts as sp

    info = sp.prefill_info(len(ports), ps)
    mgr._resolve_rank_mapping(info)  # SGLang's rank mapping: pull from every prefill CP rank
    mgr.prefill_info_table[ADDR] = info
    for cp in info.target_cp_ranks:
        mgr.connection_pool[f"{ADDR}_0_{cp}_{info.target_tp_rank}"] = [
            {"rank_ip": "127.0.0.1", "rank_port": ports[cp], "is_dummy": False}
        ]
    receivers = []
    for r, d_pages in enumerate(dst):
        rcv = MooncakeKVReceiver(mgr, ADDR, 1000 + r)
        rcv.init(0)
        if r == 0:
            assert rcv._register_kv_args()  # the decode's KV registration, once, as SGLang sends it
        rcv.send_metadata(d_pages, r % AUX_SLOTS, [d_pages.copy()], 0)
        receivers.append(rcv)
    return receivers


def _verdicts(receivers: list) -> tuple[list[bool], list[str]]:
    """Each receiver's Success, once every prefill rank's transfer concluded, and the failures' reasons."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    polls, reasons = [], []
    for rcv in receivers:
        _wait(lambda rcv=rcv: rcv.poll() in (KVPoll.Success, KVPoll.Failed), "the prefill ranks' transfers", WAIT_S)
        polls.append(rcv.poll() == KVPoll.Success)
        if rcv.poll() == KVPoll.Failed:
            try:
                rcv.failure_exception()
            except KVTransferError as e:
                reasons.append(e.failure_reason)
    return polls, reasons


def _rebuilt(pool, before: list, rank: int, size: int, dst: list, expected: list, ps: int) -> bool:
    """Whether decode rank ``rank``'s buffers hold, at each page it owns, the replicated pool's page of that
    position (``expected``), and elsewhere what they held before the transfers."""
    import torch

    want = [b.clone() for b in before]
    layers = len(pool.kv_buffer)
    for r, d_pages in enumerate(dst):
        for j, page in enumerate(d_pages.tolist()):
            if page % size != rank:
                continue
            phys = page // size
            for layer in range(layers):
                latent, index = expected[r][layer]
                want[layer].view(-1, ps, want[layer].shape[-1])[phys] = latent[j]
                want[layers + layer][phys] = index[j]
    return all(torch.equal(a, b) for a, b in zip([*pool.kv_buffer, *pool.index_k_with_scale_buffer], want))


def _decode_cp_step(rank: int, size: int, topk: int, ps: int, pool, dst: list, lengths: list, trace: list) -> dict:
    """This decode rank's part of a decode step (``TinyDSA.decode_layer_cp``, gloo with the other decode ranks)
    for every request, each layer from the replicated step's input to that layer, against its top-k and output."""
    import torch

    from demo.tiny_model import TinyDSA
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import position_rows

    model, group = TinyDSA(LAYERS, topk=topk), CPGroup()
    out: dict = {"top_equal": [], "out_err": [], "outs": []}
    for r, d_pages in enumerate(dst):
        row_of = position_rows(torch.from_numpy(d_pages).long().view(1, -1), ps, size, rank, lengths[r])
        for layer, (h_in, top_ref, h_ref) in enumerate(trace[r]):
            kv = pool.kv_buffer[layer]
            h, top = model.decode_layer_cp(
                layer, h_in, pool.index_k_with_scale_buffer[layer], ps,
                kv.view(torch.uint8).reshape(kv.shape[0], -1), row_of, group,
            )  # fmt: skip
            out["top_equal"].append(bool(torch.equal(top, top_ref)))
            out["out_err"].append(float((h - h_ref).abs().max()))
            out["outs"].append(h.flatten().tolist())
    return out


# ------------------------------------------------------------------------------------------ report
def _report(args, res: dict, seconds: float) -> tuple[list[str], dict, bool]:
    pre = res["prefilled"]
    n, size = args.cp_size, args.decode_cp_size
    r0 = pre[0]
    if size == 1:
        decode = "one decode (Mooncake on 127.0.0.1)"
        rebuilt = "the decode pool's pages equal the replicated pool's, byte for byte, nothing else written"
        step = "a decode step over them equals one over the replicated pool, bit for bit"
    else:
        decode = f"a decode of {size} CP ranks, pages sharded by ownership (Mooncake on 127.0.0.1)"
        rebuilt = (
            f"each of the {size} decode ranks holds, at its physical page, every page it owns equal to the "
            "replicated pool's, byte for byte, nothing else written"
        )
        st = res["step"]
        step = (
            f"each layer on {size} gloo ranks (global top-k, attention over each rank's rows, LSE merge): top-k "
            f"{'equal to' if st['top_equal'] else 'DIFFERENT from'} the replicated step's, output within "
            f"{st['max_err']:.1e} of it (at most {STEP_TOLERANCE:g}), every rank the same"
        )
    checks = [
        (
            "prefill",
            not any(pre[r]["mismatches"] for r in pre),
            f"every batch's indexer reads, top-k and hidden states on every rank equal the replicated pool's "
            f"({len(r0['rows'])} batches x {n} ranks)",
        ),
        (
            "transfer",
            res["transfer_ok"],
            "SGLang's Mooncake senders and receivers report Success; the plugin's manifest check passed"
            + (f" ({res['reasons'][0]})" if res["reasons"] else ""),
        ),
        ("rebuilt KV", all(res["kv_equal"]), rebuilt),
        ("decode step", res["step"]["ok"], step),
    ]
    ok = all(c[1] for c in checks)
    lines = [
        f"{args.requests} requests of {args.request_len}+ tokens, chunked prefill of {args.chunk} tokens per batch, "
        f"page size {args.page_size}, {n} prefill CP ranks (gloo) and {decode}",
        "SGLang classes run: KVCacheConfigurator (pool and allocator builders, with the plugin's hooks), "
        f"{r0['classes']['pool']} (the plugin's, over SGLang's {' + '.join(r0['classes']['pool_sglang_bases'])}), "
        f"{r0['classes']['allocator']}, prepare_kv_shard_forward; "
        f"stock {r0['classes']['stock']}; MooncakeKVManager, MooncakeKVSender, MooncakeKVReceiver, "
        f"MooncakeTransferEngine; decode {res['decode_pool']}"
        + (" (built directly, as a decode server's under --dcp-size)" if size > 1 else ""),
        "",
        f"{'per prefill rank':<34}{'stock (replicated)':>20}{'kv-cache-sharding':>20}{'cp-shared-kv (ours)':>22}",
        f"{'  KV held':<34}{_fmt_bytes(r0['stock_held']):>20}{_fmt_bytes(r0['kv_held']):>20}"
        f"{_fmt_bytes(r0['kv_held']):>22}",
        f"{'  view / scratch buffers':<34}{'0 B':>20}"
        f"{(_fmt_bytes(r0['upstream_scratch']) if r0['upstream_scratch'] else 'n/a'):>20}"
        f"{_fmt_bytes(r0['arena']):>22}",
        "  (kv-cache-sharding on CPU: not run, its gather needs CUDA; its KV held is taken as ours, each page on one",
        "   rank in both; its scratch is SGLang's own sizing)",
        "",
        f"{'batch':<7}{'requests (id:prefix->len)':<44}{'read':<20}"
        + "".join(f"{'rank ' + str(r) + ' recv':>12}" for r in range(min(n, 4))),
    ]
    for i, row in enumerate(r0["rows"]):
        reqs = " ".join(f"{r}:{p}->{s}" for r, p, s in row["requests"])
        read = "prefix view" if row["read"] == "materialized" else "current chunk only"
        recv = "".join(f"{_fmt_bytes(pre[r]['rows'][i]['bytes_received']):>12}" for r in range(min(n, 4)))
        lines.append(f"{row['batch']:<7}{reqs[:43]:<44}{read:<20}{recv}")
    lines.append("  (stock: nothing received, every rank holds every page)")
    lines.append("")
    sent = "  ".join(f"rank {r}: {_fmt_bytes(res['sent'][r]['bytes_sent'])}" for r in sorted(res["sent"]))
    lines.append(f"written to the decode by each prefill rank (its owned pages and each request's aux slot): {sent}")
    if size > 1:
        held = "  ".join(f"rank {d}: {_fmt_bytes(b)}" for d, b in enumerate(res["decode_held"]))
        lines.append(f"KV held per decode rank: {held}")
    peak = "  ".join(f"rank {r}: {_fmt_bytes(res['rss'][r])}" for r in sorted(res["rss"]))
    lines.append(f"peak memory per process: {peak}  decode: {_fmt_bytes(_peak_rss())}")
    if size > 1:
        ranks_rss = "  ".join(f"rank {d}: {_fmt_bytes(b)}" for d, b in enumerate(res["decode_rank_peak_rss"]))
        lines.append(f"  the decode's ranks (this process only drives them): {ranks_rss}")
    floor = "  ".join(f"rank {r}: {_fmt_bytes(pre[r]['rss_after_imports'])}" for r in sorted(pre))
    lines.append(
        f"  of which torch's, SGLang's and the hooks' imports, before any KV: {floor}  "
        f"decode: {_fmt_bytes(res['decode_rss_after_imports'])}"
    )
    lines.append(f"wall time {seconds:.0f} s")
    lines.append("")
    for name, passed, what in checks:
        lines.append(f"{'PASS' if passed else 'FAIL'} {name}: {what}")
    numbers = {
        "options": vars(args),
        "passed": ok,
        "checks": {name: passed for name, passed, _ in checks},
        "per_rank": {
            str(r): {
                "kv_held_bytes": pre[r]["kv_held"],
                "stock_kv_held_bytes": pre[r]["stock_held"],
                "view_arena_bytes": pre[r]["arena"],
                "upstream_scratch_bytes_by_sglang_sizing": pre[r]["upstream_scratch"],
                "bytes_received_per_batch": [row["bytes_received"] for row in pre[r]["rows"]],
                "bytes_sent_to_decode": res["sent"][r]["bytes_sent"],
                "peak_rss_bytes": res["rss"][r],
                "rss_after_imports_bytes": pre[r]["rss_after_imports"],
                "open_files": res["sent"][r]["open_files"],
            }
            for r in sorted(pre)
        },
        "decode": {
            "cp_size": size,
            "kv_held_bytes": res["decode_held"],
            "rank_peak_rss_bytes": res.get("decode_rank_peak_rss"),
            "step": res["step"],
            "peak_rss_bytes": _peak_rss(),
            "rss_after_imports_bytes": res["decode_rss_after_imports"],
            "open_files": res["decode_open_files"],
        },
        "batches": r0["rows"],
        "classes": r0["classes"],
        "wall_s": round(seconds, 1),
    }
    return lines, numbers, ok


def _plot(path: Path, numbers: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = numbers["per_rank"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["stock (replicated)", "kv-cache-sharding (sizing)", "cp-shared-kv (ours)"]
    r0 = ranks["0"]
    held = [r0["stock_kv_held_bytes"], r0["kv_held_bytes"], r0["kv_held_bytes"]]
    scratch = [0, r0["upstream_scratch_bytes_by_sglang_sizing"] or 0, r0["view_arena_bytes"]]
    x = range(3)
    a.bar(x, [h / 2**20 for h in held], label="KV held")
    a.bar(x, [s / 2**20 for s in scratch], bottom=[h / 2**20 for h in held], label="view / scratch")
    a.set_xticks(list(x), names, fontsize=8)
    a.set_ylabel("MiB per prefill rank")
    a.legend()
    # Ranks often receive equal bytes: each rank's line has its own marker and dash, drawn larger and hollow
    # under the next one's, so every rank stays visible where the lines coincide.
    markers, dashes = "osD^v<>px*", ["-", "--", ":", "-."]
    for i, (r, v) in enumerate(ranks.items()):
        b.plot(
            range(1, len(v["bytes_received_per_batch"]) + 1),
            [y / 2**10 for y in v["bytes_received_per_batch"]],
            marker=markers[i % len(markers)],
            markersize=max(3, 11 - 1.5 * i),
            markerfacecolor="none",
            linestyle=dashes[i % len(dashes)],
            linewidth=max(1.0, 3.0 - 0.4 * i),
            label=f"rank {r}",
        )
    b.xaxis.get_major_locator().set_params(integer=True)
    b.set_xlabel("prefill batch")
    b.set_ylabel("KiB received (ours; stock: 0)")
    b.legend(title="equal values overlap" if _equal_lines(ranks) else None, fontsize=8)
    fig.suptitle("CP shared KV through SGLang's pools, per prefill rank")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _equal_lines(ranks: dict) -> bool:
    """Whether two ranks received equal bytes in every batch (their lines lie on each other)."""
    seen = [tuple(v["bytes_received_per_batch"]) for v in ranks.values()]
    return len(set(seen)) < len(seen)


# ------------------------------------------------------------------------------------------ CLI
class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (``error: ...``, exit code 2), as the demo's own refusals."""

    def error(self, message: str):
        _refuse(message)


def _refuse(line: str):
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog=PROG,
        description="SGLang's prefill CP path with --enable-cp-shared-kv on CPU ranks: chunked prefill through "
        "SGLang's pools, Mooncake transfer to a decode, every result checked against the replicated pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--cp-size", type=int, default=2, help="prefill context-parallel ranks (processes), 2 or more")
    ap.add_argument("--requests", type=int, default=3, help="requests, prefilled in order")
    ap.add_argument(
        "--request-len", type=int, default=320, help=f"prompt tokens of the first request (+{limits.STRIDE} per next)"
    )
    ap.add_argument("--chunk", type=int, default=128, help="chunked prefill: new tokens per batch (whole pages)")
    ap.add_argument(
        "--page-size",
        type=int,
        default=limits.PAGE_SIZE,
        help=f"tokens per KV page: {limits.PAGE_SIZE}, the only size SGLang's DSA pool stores",
    )
    ap.add_argument(
        "--topk",
        type=int,
        default=64,
        help="keys each query attends to (the DSA indexer's top-k), at most the longest prompt",
    )
    ap.add_argument(
        "--decode-cp-size",
        type=int,
        default=1,
        help="decode ranks sharing the decode's KV by page ownership (1: one decode holding every page)",
    )
    ap.add_argument("--out", default="demo_out", help="directory for cp_shared_kv_demo.json and .png")
    return ap


def _check(args) -> None:
    """Every refusal before any rank starts: the options, then what the host allows, then the plugin's settings."""
    from demo.sglang_parts import MODELS

    limits.check_counts(args.cp_size, args.requests, args.request_len, args.chunk, args.topk)
    limits.check_pages(args.page_size, args.chunk)
    limits.check_context(args.request_len, args.requests, args.chunk, limits.model_context(MODELS["dsa"]))
    limits.check_topk(args.topk, args.request_len, args.requests)
    limits.check_decode(args.decode_cp_size)
    limits.check_host(args.cp_size, limits.open_files_limit(), limits.available_memory(), args.decode_cp_size)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise limits.Refusal(f"--out {out} is not writable: it is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise limits.Refusal(f"--out {out} is not writable: {e.strerror}") from None
    limits.check_settings()


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        _check(args)
    except limits.Refusal as e:
        _refuse(str(e))
    _quiet()
    os.environ.setdefault("SGLANG_PLUGINS", "cp_shared_kv")
    os.environ["PYTHONWARNINGS"] = "ignore"  # the ranks' (and multiprocessing's) import-time warnings
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: SGLang's and our Triton kernels run interpreted
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    os.environ.update(MC_FORCE_TCP="1", MOONCAKE_PROTOCOL="tcp")
    t0 = time.monotonic()
    lengths = limits.request_lengths(args.request_len, args.requests)
    ranks = None
    with tempfile.TemporaryDirectory(prefix="cp_shared_kv_demo_") as tmp:
        try:
            from demo.sglang_parts import write_model_dirs

            write_model_dirs(Path(tmp), ["mla", "dsa"])
            context = limits.context_len(max(lengths), args.chunk)
            cfg = {"model_dir": tmp, "page_size": args.page_size, "lengths": lengths, "chunk": args.chunk}
            cfg.update(context_len=context, topk=args.topk)
            print(f"starting {args.cp_size} prefill CP ranks and the decode (SGLang import: ~20 s)", flush=True)
            ranks = _Ranks(args.cp_size, cfg)
            res = _decode(args, ranks, tmp)
        except KeyboardInterrupt:
            if ranks is not None:
                ranks.stop()
            print("interrupted: the demo stopped every process; nothing was written", file=sys.stderr, flush=True)
            os._exit(130)
        except DemoError as e:
            ranks.stop()
            print(f"error: {e}", file=sys.stderr, flush=True)
            os._exit(1)
    ranks.stop()
    lines, numbers, ok = _report(args, res, time.monotonic() - t0)
    out = Path(args.out).resolve()
    (out / "cp_shared_kv_demo.json").write_text(json.dumps(numbers, indent=1, default=str))
    print("\n".join(lines))
    plot = out / "cp_shared_kv_demo.png"
    # matplotlib in a process of its own (it needs neither torch nor SGLang): here it would add ~40 MiB to the
    # decode's peak after that peak was reported.
    plotter = mp.get_context("spawn").Process(target=_plot, args=(plot, numbers))
    plotter.start()
    plotter.join()
    if plotter.exitcode != 0:
        print(f"error: the plot failed (exit code {plotter.exitcode})", file=sys.stderr, flush=True)
        os._exit(1)
    print(f"output: {out / 'cp_shared_kv_demo.json'}")
    print(f"plot: {plot}", flush=True)
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # SGLang's connector threads block on their sockets: leave without joining them


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
