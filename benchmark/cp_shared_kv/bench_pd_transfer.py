"""PD transfer through SGLang's Mooncake connector: the plugin's sharded send against SGLang's stock one.

The same KV (requests of ``--pages`` pages of the tiny DSA model: every layer's latent rows and
indexer page) goes from prefill to one decode over the real Mooncake engine (TCP, 127.0.0.1) in two
ways, side by side in one process:

- ``sharded``: ``--cp-size`` prefill CP ranks, each with the plugin's CP-shared pool built by SGLang's
  configurator, each sending its owned pages with SGLang's ``MooncakeKVSender`` in sharded mode and
  the plugin's manifest on its Success status; the decode checks the manifests (flag on);
- ``stock``: one prefill rank with SGLang's stock replicated pool holding every page, sending them all
  with SGLang's non-sharded sender (flag off: what a prefill without the plugin does).

Timed from the first ``send`` to the last receiver's Success (the decode thread has parsed every
status), per repeat; each repeat's decode pages are compared with the replicated pool's, byte for byte.

    python -m benchmark.cp_shared_kv.bench_pd_transfer                      # writes pd_transfer.json
    python -m benchmark.cp_shared_kv.bench_pd_transfer --cp-size 2 --pages 64 --requests 2 --repeats 1 --out pd_smoke
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import tempfile
import threading
import time
from pathlib import Path

PS = 64
ADDR = {"sharded": "127.0.0.1:1", "stock": "127.0.0.1:2"}  # bootstrap addresses (no HTTP request is made)


def _wait(cond, what: str, timeout_s: float = 120.0) -> None:
    from reference.spawn import wait_until

    wait_until(cond, what, timeout_s, poll_s=0.001)


def _prefill(sp, pool, rank: int, cp_size: int, executor):
    """An engine and SGLang's prefill KV manager (bootstrap thread and transfer worker) over ``pool``."""
    import torch
    from sglang.srt.disaggregation.mooncake.conn import FastQueue
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

    engine = MooncakeTransferEngine("127.0.0.1")
    aux = torch.zeros(8, 64, dtype=torch.uint8)
    for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer, aux]:
        engine.register(buf.data_ptr(), buf.nbytes)
    mgr = sp.mooncake_manager(DisaggregationMode.PREFILL, engine, sp.kv_args(pool, aux, rank, PS), rank, cp_size)
    mgr.transfer_queues = [FastQueue()]
    mgr.start_prefill_thread()
    threading.Thread(target=mgr.transfer_worker, args=(mgr.transfer_queues[0], executor), daemon=True).start()
    return mgr


def run(cp_size: int, pages: int, requests: int, repeats: int, model_dir: str) -> list[dict]:
    import numpy as np
    import torch
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver, MooncakeKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    from demo import sglang_parts as sp
    from demo.tiny_model import _Layer

    server_args = prepare_server_args(sp.prefill_cp_argv(model_dir, PS, cp_size))
    server_args.resolve_once()

    def flag(on: bool) -> None:  # the record as the launcher passes it (CPU cannot resolve the flag)
        server_args.__dict__["enable_cp_shared_kv"] = on
        publish(server_args, role="scheduler")

    flag(True)
    model_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    per_rank = (-(-pages * requests // cp_size) + 2) * PS
    ranks, allocator = [], None
    for rank in range(cp_size):
        pool, alloc = sp.build_pool_and_allocator(model_config, per_rank, requests, PS, (rank, cp_size))
        ranks.append(pool)
        allocator = allocator or alloc  # every rank's allocator draws the same pages
    stock, decode = sp.stock_dsa_pools([cp_size * ranks[0].phys_pages * PS - PS, (pages * requests + 1) * PS], PS)
    logical = []
    g = torch.Generator().manual_seed(0)
    with sp.no_dcp():
        for _ in range(requests):
            n = pages * PS
            locs = sp.new_request_locs(allocator, n)
            logical.append((locs[::PS] // PS).numpy().astype(np.int32))
            for layer in range(len(stock.kv_buffer)):
                nope = torch.randn(n, 1, 512, generator=g).to(torch.bfloat16)
                rope = torch.randn(n, 1, 64, generator=g).to(torch.bfloat16)
                k = (torch.randn(n, 128, generator=g) * 4).to(torch.float8_e4m3fn)
                scale = torch.rand(n, 1, generator=g) + 0.5
                for pool in [*ranks, stock]:
                    pool.set_mla_kv_buffer(_Layer(layer), locs, nope, rope)
                    pool.set_index_k_scale_buffer(layer, locs, k, scale)
    page_bytes = sum(b[0].nbytes * PS for b in stock.kv_buffer) + sum(
        b[0].nbytes for b in stock.index_k_with_scale_buffer
    )

    executor = concurrent.futures.ThreadPoolExecutor(cp_size + 1)
    senders_of = {
        "sharded": [_prefill(sp, pool, r, cp_size, executor) for r, pool in enumerate(ranks)],
        "stock": [_prefill(sp, stock, 0, 1, executor)],
    }
    d_engine = MooncakeTransferEngine("127.0.0.1")
    d_aux = torch.zeros(8, 64, dtype=torch.uint8)
    for buf in [*decode.kv_buffer, *decode.index_k_with_scale_buffer, d_aux]:
        d_engine.register(buf.data_ptr(), buf.nbytes)
    d_mgr = sp.mooncake_manager(DisaggregationMode.DECODE, d_engine, sp.kv_args(decode, d_aux, 0, PS), 0, 1)
    d_mgr.start_decode_thread()
    infos = {
        "sharded": sp.prefill_info(cp_size, PS),
        "stock": sp.prefill_info(1, PS, sharded=False),
    }
    for kind, info in infos.items():
        d_mgr._resolve_rank_mapping(info)
        d_mgr.prefill_info_table[ADDR[kind]] = info
        for cp in info.target_cp_ranks:
            d_mgr.connection_pool[f"{ADDR[kind]}_0_{cp}_{info.target_tp_rank}"] = [
                {"rank_ip": "127.0.0.1", "rank_port": senders_of[kind][cp].rank_port, "is_dummy": False}
            ]
    dst = [np.arange(1 + r * pages, 1 + (r + 1) * pages, dtype=np.int32) for r in range(requests)]
    rows, room, registered = [], 1000, set()
    for rep in range(repeats):
        for kind in ("sharded", "stock"):
            flag(kind == "sharded")
            decode.kv_buffer[0].zero_()
            receivers, senders = [], []
            for r in range(requests):
                room += 1
                snd = [MooncakeKVSender(m, ADDR[kind], room) for m in senders_of[kind]]
                for s in snd:
                    s.init(pages, aux_index=r % 8)
                rcv = MooncakeKVReceiver(d_mgr, ADDR[kind], room)
                rcv.init(0)
                if kind not in registered:  # the decode's KV registration, once per prefill, as SGLang sends it
                    assert rcv._register_kv_args()
                    _wait(lambda k=kind: all(m.decode_kv_args_table for m in senders_of[k]), "registration")
                    registered.add(kind)
                rcv.send_metadata(dst[r], r % 8, [dst[r].copy()], 0)
                receivers.append(rcv)
                senders.append(snd)
            for snd in senders:
                for s in snd:
                    _wait(lambda s=s: s.poll() == KVPoll.WaitingForInput, f"{kind}: destinations")
            t0 = time.perf_counter()
            for snd, lp in zip(senders, logical):
                for s in snd:  # each CP rank's sender keeps the pages it owns (SGLang's filter)
                    s.send(lp, [lp.copy()])
            for rcv in receivers:
                _wait(lambda rcv=rcv: rcv.poll() in (KVPoll.Success, KVPoll.Failed), f"{kind}: transfer")
            seconds = time.perf_counter() - t0
            ok = all(rcv.poll() == KVPoll.Success for rcv in receivers)
            exact = all(
                torch.equal(
                    decode.kv_buffer[layer].view(-1, PS, decode.kv_buffer[layer].shape[-1])[torch.from_numpy(d).long()],
                    stock.kv_buffer[layer].view(-1, PS, stock.kv_buffer[layer].shape[-1])[torch.from_numpy(lp).long()],
                )
                and torch.equal(
                    decode.index_k_with_scale_buffer[layer][torch.from_numpy(d).long()],
                    stock.index_k_with_scale_buffer[layer][torch.from_numpy(lp).long()],
                )
                for d, lp in zip(dst, logical)
                for layer in range(len(stock.kv_buffer))
            )
            for rcv in receivers:
                rcv.clear()
            for snd in senders:
                for s in snd:
                    s.clear()
            nbytes = requests * pages * page_bytes
            rows.append(
                {
                    "cp_size": cp_size,
                    "path": kind,
                    "repeat": rep,
                    "requests": requests,
                    "pages_per_request": pages,
                    "bytes": nbytes,
                    "bytes_per_rank": nbytes // (cp_size if kind == "sharded" else 1),
                    "seconds": round(seconds, 4),
                    "gbps": round(nbytes / seconds / 1e9, 3),
                    "success": ok,
                    "exact": exact,
                }
            )
            print(f"cp {cp_size} {kind} repeat {rep}: {rows[-1]['gbps']} GB/s, exact {exact}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    from benchmark.cp_shared_kv.bench_common import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp-size", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pages", type=int, default=64, help="pages (64 tokens) per request")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="pd_transfer")
    args = ap.parse_args(argv)
    os.environ.setdefault("SGLANG_PLUGINS", "cp_shared_kv")
    os.environ.update(MC_FORCE_TCP="1", MOONCAKE_PROTOCOL="tcp")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from sglang.srt.plugins import load_plugins

    from demo.sglang_parts import write_model_dirs

    load_plugins()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_model_dirs(Path(tmp), ["mla", "dsa"])
        for n in args.cp_size:
            rows += run(n, args.pages, args.requests, args.repeats, tmp)
    summary = {}
    for n in args.cp_size:

        def median(kind, n=n):
            xs = sorted(r["gbps"] for r in rows if r["cp_size"] == n and r["path"] == kind)
            return xs[len(xs) // 2]

        summary[f"cp{n}_sharded_gbps"] = median("sharded")
        summary[f"cp{n}_stock_gbps"] = median("stock")
        summary[f"cp{n}_sharded_vs_stock"] = round(median("sharded") / median("stock"), 2)
    summary["all_exact"] = all(r["exact"] and r["success"] for r in rows)
    path = write_result(args.out, rows, summary)
    print(f"wrote {path}")
    os._exit(0)  # SGLang's connector threads block on their sockets


if __name__ == "__main__":
    main()
