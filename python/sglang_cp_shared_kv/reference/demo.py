"""The whole pipeline on one machine: CP prefill ranks with a sharded KV pool, Mooncake PD, decode.

1. A replicated baseline runs the request stream through the tiny DSA stack (chunked prefill,
   one full pool).
2. ``--cp-size`` prefill ranks (spawned processes, gloo) run the same stream; each stores only the
   KV pages it owns and reads through the materialized view (current-reuse where a batch has no
   prefix).
3. Every rank sends its owned pages of each finished request to a separate non-CP decode process
   over the Mooncake transfer engine on 127.0.0.1; the decode side checks the N manifests,
   rebuilds the full KV and runs one decode step.
4. Prefill outputs, rebuilt KV and the decode step are compared bit for bit with the baseline.

    python -m sglang_cp_shared_kv.reference.demo [--cp-size 4] [--page-size 16] [--kv-format fp8] ...
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from sglang_cp_shared_kv.reference.decode_step import decode_one_token
from sglang_cp_shared_kv.reference.dsa_stack import (
    RequestSpec,
    StackConfig,
    TinyDSAStack,
    check_requests,
    first_mismatch,
    run_chunked_prefill,
)
from sglang_cp_shared_kv.reference.spawn import RankFailure, spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import KV_FORMATS

TIMEOUT_S = 120.0


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_requests(n: int, length: int, page_size: int) -> list[RequestSpec]:
    """``n`` requests of ``length`` tokens; every odd one shares the first half (whole pages) of its predecessor."""
    shared = (length // 2) // page_size * page_size
    specs = []
    for i in range(n):
        if i % 2 == 1 and shared > 0:
            specs.append(RequestSpec(length + 7 * i, prefix_from=i - 1, prefix_len=shared))
        else:
            specs.append(RequestSpec(length + 7 * i))
    check_requests(specs, page_size)
    return specs


def _env() -> None:
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    os.environ.setdefault("GLOG_minloglevel", "3")  # the engine's start-up notices ("No RDMA devices") are harmless


# --------------------------------------------------------------------------------------------- decode


def _decode_main(cfg: dict, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """The non-CP decode server: receive every request over Mooncake, check, rebuild, decode one step."""
    _env()
    torch.set_num_threads(1)
    from sglang_cp_shared_kv.reference.mooncake.decode_pool import make_decode_pool
    from sglang_cp_shared_kv.reference.mooncake.decode_receiver import DecodeReceiver
    from sglang_cp_shared_kv.reference.mooncake.engine import MooncakeEngine
    from sglang_cp_shared_kv.reference.mooncake.transfer_state import TransferState

    try:
        ps, n_layers = cfg["page_size"], cfg["config"].num_layers
        lens = cfg["lens"]
        n_pages = [-(-n // ps) for n in lens]
        engine = MooncakeEngine()
        pool = make_decode_pool(ps, sum(n_pages) + 2 * len(lens), n_layers, cfg["kv_format"])
        rx = DecodeReceiver(pool, engine, cp_size=cfg["cp_size"]).start()
        for i, n in enumerate(n_pages):
            rx.add_request(f"req-{i}", n)
        outbox.put(("address", rx.address))
        states = {}
        for i in range(len(lens)):
            states[i] = rx.wait(f"req-{i}", TIMEOUT_S)
        failed = {i: rx.failure_reason(f"req-{i}") for i, s in states.items() if s != TransferState.SUCCESS}
        tables = [rx.dst_pages(f"req-{i}").tolist() for i in range(len(lens))]
        rebuilt = [
            [(pool.latent_pages(layer)[t].clone(), pool.index[layer][t].clone()) for layer in range(n_layers)]
            for t in (torch.tensor(p) for p in tables)
        ]
        step = None
        if not failed:
            stack = TinyDSAStack(cfg["config"], cfg["kv_format"])
            step, _ = decode_one_token(stack, pool, tables, lens, cfg["new_ids"], lambda: int(rx.alloc_pages(1)[0]))
        outbox.put(("result", pickle.dumps({"failed": failed, "tables": tables, "rebuilt": rebuilt, "step": step})))
        rx.close()
        engine.close()
    except BaseException as exc:  # the parent reports it
        import traceback

        outbox.put(("error", f"{exc}\n{traceback.format_exc()}"))
    inbox.close()


# --------------------------------------------------------------------------------------------- prefill


def _prefill_rank(rank: int, world: int, cfg: dict, decode_address: str) -> dict:
    """One CP rank: sharded chunked prefill, then send every finished request's owned pages."""
    _env()
    from sglang_cp_shared_kv.reference.mooncake.engine import MooncakeEngine
    from sglang_cp_shared_kv.reference.mooncake.owned_page_sender import OwnedPageSender

    group = CPGroup()
    t0 = time.monotonic()

    def progress(i: int, total: int, result) -> None:
        if rank == 0:
            c = result.counters
            moved = (
                "current-reuse, 0 B moved"
                if c.current_reuse_hits
                else f"{_fmt_bytes(c.bytes_materialized)} materialized"
            )
            _log(f"prefill: batch {i + 1}/{total} ({c.kind}, {result.batch.num_tokens} tokens): {moved}")

    run = run_chunked_prefill(
        cfg["requests"],
        chunk_size=cfg["chunk"],
        page_size=cfg["page_size"],
        kv_format=cfg["kv_format"],
        group=group,
        config=cfg["config"],
        on_batch=progress,
    )
    prefill_s = time.monotonic() - t0
    if rank == 0:
        _log(f"prefill: {len(run.batches)} batches done on {world} ranks in {prefill_s:.1f} s; sending over Mooncake")
    engine = MooncakeEngine()
    sender = OwnedPageSender(run.pool, engine, decode_address).start()
    for i, pages in enumerate(run.request_pages):
        sender.submit(f"req-{i}", torch.tensor(pages, dtype=torch.int64))
    sent = []
    for i in range(len(run.request_pages)):
        sender.wait(f"req-{i}", TIMEOUT_S)
        r = sender.pop(f"req-{i}")
        sent.append(
            {"state": r.state.name, "reason": r.reason, "pages": r.pages, "nbytes": r.nbytes, "entries": r.entries}
        )
    sender.close()
    engine.close()
    owned = {p for pages in run.request_pages for p in pages if p % world == rank}
    return {
        "batches": [(b.batch.kind, asdict(b.counters)) for b in run.batches],
        "outputs": [b.layers for b in run.batches],
        "owned_pages": len(owned),
        "page_bytes": run.pool.page_bytes,
        "allocated_bytes": run.pool.allocated_bytes,
        "sent": sent,
        "prefill_s": prefill_s,
    }


# --------------------------------------------------------------------------------------------- report


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _plot(path: Path, per_rank_bytes: list[int], replicated_bytes: int, batches: list) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    n = len(per_rank_bytes)
    a1.bar([f"rank {r}" for r in range(n)], per_rank_bytes, color="C0", label="sharded (this project)")
    a1.axhline(replicated_bytes, color="C3", ls="--", label="replicated: every rank")
    a1.set_ylabel("KV bytes in use per rank")
    a1.set_title(f"KV bytes per rank, CP={n}")
    a1.legend(fontsize=8)
    colors = {"current": "C2", "history": "C1", "mixed": "C4"}
    xs = range(len(batches))
    a2.bar(xs, [c["bytes_materialized"] for _, c in batches], color=[colors[k] for k, _ in batches])
    for kind, color in colors.items():
        a2.bar([0], [0], color=color, label=kind)
    a2.set_xlabel("prefill batch")
    a2.set_ylabel("bytes materialized (all layers, one rank)")
    a2.set_title("materialized bytes per batch (0 = current-reuse)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CP shared-KV prefill + Mooncake PD decode, on CPU ranks.")
    ap.add_argument("--cp-size", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-format", choices=KV_FORMATS, default="fp8")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--request-len", type=int, default=384, help="tokens per request (each later one is 7 longer)")
    ap.add_argument("--chunk", type=int, default=256, help="chunked-prefill token budget per batch")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default="demo_out", help="where the plot goes")
    args = ap.parse_args(argv)
    for name in ("cp_size", "requests", "request_len", "chunk", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        ap.error(f"--page-size must be a power of two, got {args.page_size}")

    _env()
    # The CPU matmuls of the reference kernels split their reductions by thread count: every process
    # (baseline, ranks, decode) runs one thread so that equal bytes give equal bits.
    torch.set_num_threads(1)
    t_start = time.monotonic()
    config = StackConfig(num_layers=args.layers)
    try:
        specs = build_requests(args.requests, args.request_len, args.page_size)
    except ValueError as e:
        ap.error(str(e))
    lens = [s.length for s in specs]
    new_ids = torch.randint(0, config.vocab, (len(specs),), generator=torch.Generator().manual_seed(7))
    _log(
        f"{len(specs)} requests ({', '.join(map(str, lens))} tokens; odd ones share half of the previous prompt), "
        f"CP={args.cp_size}, page size {args.page_size}, {args.kv_format} KV, {args.layers} layers, chunk {args.chunk}"
    )

    _log("baseline: replicated pool, same stream")
    base = run_chunked_prefill(
        specs,
        chunk_size=args.chunk,
        page_size=args.page_size,
        kv_format=args.kv_format,
        config=config,
        layout_cp_size=args.cp_size,
    )

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    cfg = {
        "page_size": args.page_size,
        "kv_format": args.kv_format,
        "config": config,
        "lens": lens,
        "cp_size": args.cp_size,
        "new_ids": new_ids,
        "requests": specs,
        "chunk": args.chunk,
    }
    decode = ctx.Process(target=_decode_main, args=(cfg, inbox, outbox), daemon=True)
    decode.start()
    try:
        kind, address = outbox.get(timeout=TIMEOUT_S)
        if kind != "address":
            raise RuntimeError(f"decode process failed to start: {address}")
        _log(f"decode: non-CP decode process listening at {address} (Mooncake over TCP on 127.0.0.1)")
        _log(f"prefill: spawning {args.cp_size} CP ranks (gloo)")
        ranks = spawn_ranks(_prefill_rank, args.cp_size, cfg, address, timeout_s=4 * TIMEOUT_S)
        _log("decode: waiting for the rebuilt KV and the decode step")
        kind, payload = outbox.get(timeout=TIMEOUT_S)
        if kind != "result":
            raise RuntimeError(f"decode process failed: {payload}")
        dec = pickle.loads(payload)
    except (RankFailure, RuntimeError, queue.Empty) as e:
        print(f"FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        decode.join(timeout=10)
        if decode.is_alive():
            decode.kill()

    # ---- checks
    checks = {}
    mism = [first_mismatch(base, _as_run(base, r["outputs"])) for r in ranks]
    checks["prefill outputs (top-k, attention out, LSE) equal replicated, every rank"] = all(m is None for m in mism)
    rebuilt_ok = not dec["failed"]
    for i, pages in enumerate(base.request_pages):
        for layer, (lat, idx) in enumerate(dec["rebuilt"][i]):
            want_lat = base.pool.latent_pages(layer)[torch.tensor(pages)]
            want_idx = base.pool.index[layer][torch.tensor(pages)]
            rebuilt_ok &= torch.equal(lat, want_lat) and torch.equal(idx, want_idx)
    checks["rebuilt decode KV equals replicated pool, byte for byte"] = bool(rebuilt_ok)
    step_ok = False
    if dec["step"] is not None:
        stack = TinyDSAStack(config, args.kv_format)
        used = {p for pages in base.request_pages for p in pages}
        spare = iter(p for p in range(base.pool.phys_pages) if p not in used)
        ref, _ = decode_one_token(stack, base.pool, base.request_pages, lens, new_ids, lambda: next(spare))
        step_ok = all(
            torch.equal(a.topk, b.topk) and torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)
            for a, b in zip(ref, dec["step"])
        )
    checks["decode step on rebuilt KV equals replicated"] = step_ok

    # ---- report
    n = args.cp_size
    page_bytes = ranks[0]["page_bytes"]
    all_pages = {p for pages in base.request_pages for p in pages}
    repl_bytes = len(all_pages) * page_bytes
    per_rank = [r["owned_pages"] * page_bytes for r in ranks]
    batches = ranks[0]["batches"]
    total_mat = sum(c["bytes_materialized"] for _, c in batches)
    hits = sum(c["current_reuse_hits"] for _, c in batches)
    kinds = [k for k, _ in batches]
    sent = [sum(s["nbytes"] for s in r["sent"]) for r in ranks]
    print()
    print(f"{'':<34}" + "".join(f"{'rank ' + str(r):>14}" for r in range(n)) + f"{'replicated':>14}")
    print(
        f"{'KV bytes in use':<34}" + "".join(f"{_fmt_bytes(b):>14}" for b in per_rank) + f"{_fmt_bytes(repl_bytes):>14}"
    )
    print(f"{'  share of replicated':<34}" + "".join(f"{b / repl_bytes:>14.3f}" for b in per_rank) + f"{1.0:>14.3f}")
    print(
        f"{'bytes sent to decode (all reqs)':<34}"
        + "".join(f"{_fmt_bytes(b):>14}" for b in sent)
        + f"{_fmt_bytes(sum(sent)):>14}"
    )
    print()
    print(f"logical capacity multiplier      {n}x (each rank's physical pages hold 1/{n} of the logical space)")
    print(
        f"prefill batches                  {len(kinds)}: "
        + ", ".join(f"{kinds.count(k)} {k}" for k in ("current", "history", "mixed"))
    )
    print(f"bytes materialized (rank 0)      {_fmt_bytes(total_mat)} over {len(kinds)} batches x {args.layers} layers")
    print(f"current-reuse hits               {hits} layer reads with 0 bytes moved")
    if dec["failed"]:
        print(f"transfer failures                {dec['failed']}")
    plot = _plot(Path(args.out) / "cp_shared_kv_demo.png", per_rank, repl_bytes, batches)
    if plot:
        print(f"plot                             {plot}")
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for r, m in enumerate(mism):
        if m is not None:
            print(f"      rank {r}: {m}")
    _log(f"done in {time.monotonic() - t_start:.0f} s")
    return 0 if all(checks.values()) else 1


def _as_run(base, outputs):
    """A PrefillRun-shaped view of one rank's outputs, for ``first_mismatch``."""
    from sglang_cp_shared_kv.reference.dsa_stack import BatchResult, PrefillRun

    return PrefillRun(
        [BatchResult(b.batch, layers, b.counters) for b, layers in zip(base.batches, outputs)],
        base.pool,
        base.request_pages,
    )


if __name__ == "__main__":
    sys.exit(main())
