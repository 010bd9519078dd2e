"""PD transfer: N owned-page senders vs one raw-engine writer moving the same pages, on loopback.

Sharded: N spawned sender processes (one per prefill CP rank, each holding only its
owned pages) send a request through ``OwnedPageSender`` to one ``DecodeReceiver``
process. The clock runs from a common start instant to the last rank's SUCCESS, so
it includes planning, every write call, the manifests, the decode side's checks and
the verdicts.

Raw engine: one process holding the whole (replicated) request calls
``TransferEngine.batch_transfer_sync_write`` directly on the same decode pool, with
the request's pages contiguous on both sides (one entry per layer and buffer: the
best case for a single writer). Only the write call is timed.

``sharded_vs_raw_engine`` = raw seconds / sharded seconds (> 1: the sharded transfer
is faster). ``bytes_per_rank_fraction`` = the largest rank's share of the request's
bytes (ideal 1/N). Both processes sets run Mooncake over TCP on 127.0.0.1.

    python -m benchmark.cp_shared_kv.bench_pd_transfer
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import threading
import time

BENCH_ENV = {"MC_FORCE_TCP": "1", "MC_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
START_DELAY_S = 0.3  # every process sleeps until a shared monotonic instant, then starts


def _setup_process() -> None:
    os.environ.update(BENCH_ENV)
    import torch

    torch.set_num_threads(1)


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))


def _fill(pool, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for buf in list(pool.latent) + list(pool.index):
        buf.random_(generator=g)


# ---------------------------------------------------------------------------- processes
def _decode_proc(cfg: dict, cmd: mp.Queue, out: mp.Queue) -> None:
    _setup_process()
    from sglang_cp_shared_kv.reference.mooncake import DecodeReceiver, MooncakeEngine, make_decode_pool

    pool = make_decode_pool(cfg["page_size"], cfg["n_pages"] + 4, cfg["layers"], cfg["kv_format"])
    receiver = DecodeReceiver(pool, MooncakeEngine(), cp_size=cfg["n"]).start()
    out.put(
        {
            "address": receiver.address,
            "session_id": receiver.engine.session_id,
            "latent_base": [t.data_ptr() for t in pool.latent],
            "index_base": [t.data_ptr() for t in pool.index],
        }
    )
    while (msg := cmd.get()) is not None:
        op, rid = msg
        if op == "add":
            assert receiver.wait_for_senders(60), receiver.connected_ranks
            out.put(receiver.add_request(rid, cfg["n_pages"]).tolist())
        elif op == "release":
            state = receiver.wait(rid, 60)
            receiver.release(rid)
            out.put(state.name)
    receiver.close()


def _sender_proc(cfg: dict, rank: int, address: str, cmd: mp.Queue, out: mp.Queue) -> None:
    _setup_process()
    from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
    from sglang_cp_shared_kv.reference.mooncake import MooncakeEngine, OwnedPageSender
    from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
    from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

    own = PageOwnership(cfg["n"], cfg["page_size"])
    phys = -(-cfg["n_pages"] // cfg["n"]) + 1
    pool = ShardedMLAPool(own, rank, phys, cfg["layers"], cfg["kv_format"])
    _fill(pool, rank)
    table = BalancedPageAllocator(own, phys).alloc(cfg["n_pages"], first_owner=0)
    sender = OwnedPageSender(pool, MooncakeEngine(), address).start()
    out.put(("ready", rank))
    while (msg := cmd.get()) is not None:
        rid, t_start = msg
        deadline = time.monotonic() + 60
        while sender.destination_pages(rid) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        _sleep_until(t_start)
        sender.submit(rid, table)
        sender.wait(rid, 60)
        done = time.monotonic()
        res = sender.pop(rid)
        out.put((rank, done, {**vars(res), "state": res.state.name}))
    sender.close()


def _raw_proc(cfg: dict, boot: dict, cmd: mp.Queue, out: mp.Queue) -> None:
    _setup_process()
    from mooncake.engine import TransferEngine

    from sglang_cp_shared_kv.reference.mooncake.decode_pool import make_decode_pool
    from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES

    n_pages, ps = cfg["n_pages"], cfg["page_size"]
    pool = make_decode_pool(ps, n_pages, cfg["layers"], cfg["kv_format"])  # the whole request, replicated
    _fill(pool, 99)
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    bufs = list(pool.latent) + list(pool.index)
    for b in bufs:
        assert engine.register_memory(b.data_ptr(), b.numel()) == 0
    src = [t.data_ptr() for t in pool.latent] + [t.data_ptr() for t in pool.index]
    dst = list(boot["latent_base"]) + list(boot["index_base"])
    lengths = [n_pages * ps * pool.row_bytes] * len(pool.latent) + [n_pages * ps * INDEX_TOKEN_BYTES] * len(pool.index)
    out.put("ready")

    def write(t_start: float, low_priority: bool, result: list) -> None:
        if low_priority:  # as the sender's worker thread runs (see OwnedPageSender)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        _sleep_until(t_start)
        t0 = time.monotonic()
        rc = engine.batch_transfer_sync_write(boot["session_id"], src, dst, lengths)
        result.append((rc, time.monotonic() - t0, sum(lengths), len(src)))

    while (msg := cmd.get()) is not None:
        result: list = []
        th = threading.Thread(target=write, args=(*msg, result))  # a fresh thread: niceness is per thread
        th.start()
        th.join()
        out.put(result[0])
    for b in bufs:
        engine.unregister_memory(b.data_ptr())


# ---------------------------------------------------------------------------- driver
def run_config(cfg: dict, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    n = cfg["n"]
    d_cmd, d_out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_decode_proc, args=(cfg, d_cmd, d_out), daemon=True)]
    procs[0].start()
    boot = d_out.get(timeout=120)
    s_cmd = [ctx.Queue() for _ in range(n)]
    s_out = ctx.Queue()
    r_cmd, r_out = ctx.Queue(), ctx.Queue()
    procs += [
        ctx.Process(target=_sender_proc, args=(cfg, r, boot["address"], s_cmd[r], s_out), daemon=True) for r in range(n)
    ]
    procs.append(ctx.Process(target=_raw_proc, args=(cfg, boot, r_cmd, r_out), daemon=True))
    for p in procs[1:]:
        p.start()
    try:
        for _ in range(n):
            s_out.get(timeout=180)
        r_out.get(timeout=180)
        sharded, raw, raw_low, per_rank = [], [], [], None
        for i in range(repeats + 1):  # the first round warms connections up and is dropped
            rid = f"req{i}"
            d_cmd.put(("add", rid))
            d_out.get(timeout=60)
            t_start = time.monotonic() + START_DELAY_S
            for q in s_cmd:
                q.put((rid, t_start))
            done = [s_out.get(timeout=120) for _ in range(n)]
            d_cmd.put(("release", rid))
            assert d_out.get(timeout=60) == "SUCCESS"
            assert all(d[2]["state"] == "SUCCESS" for d in done), done
            # the raw writer uses the same decode pages, now free again
            raw_round = []
            for low_priority in (False, True):
                r_cmd.put((time.monotonic() + START_DELAY_S, low_priority))
                rc, raw_s, raw_bytes, raw_entries = r_out.get(timeout=120)
                assert rc == 0, f"raw batch_transfer_sync_write returned {rc}"
                raw_round.append(raw_s)
            if i == 0:
                continue
            sharded.append(max(d[1] for d in done) - t_start)
            raw.append(raw_round[0])
            raw_low.append(raw_round[1])
            per_rank = sorted((d[2] for d in done), key=lambda r: r["request_id"])
        for q in s_cmd:  # senders first, so the receiver never sees a sender vanish mid-run
            q.put(None)
        r_cmd.put(None)
        for p in procs[1:]:
            p.join(30)
        d_cmd.put(None)
        procs[0].join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    total = raw_bytes
    sharded_s, raw_s = statistics.median(sharded), statistics.median(raw)
    rank_bytes = [r["nbytes"] for r in per_rank]
    assert sum(rank_bytes) == total
    return {
        **cfg,
        "tokens": cfg["n_pages"] * cfg["page_size"],
        "request_bytes": total,
        "raw_engine_s": raw_s,
        "sharded_s": sharded_s,
        "raw_engine_gbps": total / raw_s / 1e9,
        "sharded_gbps": total / sharded_s / 1e9,
        "sharded_vs_raw_engine": raw_s / sharded_s,
        "raw_engine_entries": raw_entries,
        "sharded_entries_per_rank": [r["entries"] for r in per_rank],
        "sharded_calls_per_rank": [r["calls"] for r in per_rank],
        "bytes_per_rank": rank_bytes,
        "bytes_per_rank_fraction": max(rank_bytes) / total,
        "ideal_fraction": 1 / cfg["n"],
        "sharded_rank_write_s": [r["write_s"] for r in per_rank],
        "raw_engine_low_priority_s": statistics.median(raw_low),
        "sharded_vs_raw_engine_low_priority": statistics.median(raw_low) / sharded_s,
        "raw_engine_runs_s": raw,
        "raw_engine_low_priority_runs_s": raw_low,
        "sharded_runs_s": sharded,
    }


def _machine() -> dict:
    from importlib.metadata import version

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "mooncake": version("mooncake-transfer-engine-non-cuda"),
        "transport": "Mooncake TCP (MC_FORCE_TCP=1) on 127.0.0.1",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="4:fp8:64,2:fp8:64,4:bf16:64,4:fp8:16", help="N:format:page_size,...")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from benchmark.cp_shared_kv.bench_common import write_result

    rows = []
    for spec in args.configs.split(","):
        n, kv_format, ps = spec.split(":")
        cfg = {"n": int(n), "kv_format": kv_format, "page_size": int(ps), "layers": args.layers}
        cfg["n_pages"] = args.tokens // cfg["page_size"]
        row = run_config(cfg, args.repeats)
        rows.append(row)
        print(
            f"N={row['n']} {kv_format} ps={ps}: {row['request_bytes'] / 1e6:.0f} MB  raw {row['raw_engine_s'] * 1e3:.1f} ms "
            f"({row['raw_engine_gbps']:.2f} GB/s)  sharded {row['sharded_s'] * 1e3:.1f} ms ({row['sharded_gbps']:.2f} GB/s)  "
            f"ratio {row['sharded_vs_raw_engine']:.2f}x  largest rank share {row['bytes_per_rank_fraction']:.4f}",
            flush=True,
        )
    head = rows[0]
    summary = {
        "sharded_vs_raw_engine": round(head["sharded_vs_raw_engine"], 3),
        "bytes_per_rank_fraction": round(head["bytes_per_rank_fraction"], 5),
        "headline_config": {k: head[k] for k in ("n", "kv_format", "page_size", "layers", "tokens")},
        "sharded_vs_raw_engine_min_over_configs": round(min(r["sharded_vs_raw_engine"] for r in rows), 3),
        "sharded_vs_raw_engine_low_priority": round(head["sharded_vs_raw_engine_low_priority"], 3),
        "goal": ">= 0.8",
    }
    notes = (
        "Medians over the repeats; each round runs the sharded transfer, then the raw writer, then the raw "
        "writer from a lowest-priority thread, so load drift on the host hits all three alike. "
        "raw_engine_* times the batch_transfer_sync_write call alone; sharded_* runs from the common start "
        "instant to the last rank's SUCCESS (planning, writes, manifests, checks, verdicts)."
    )
    write_result("pd_transfer", rows, summary, extra={"machine": _machine(), "notes": notes})


if __name__ == "__main__":
    main()
