"""The whole pipeline on one machine: CP prefill ranks with a sharded KV pool, Mooncake PD, decode.

1. A replicated baseline runs the request stream through the tiny DSA stack (chunked prefill,
   one full pool).
2. ``--cp-size`` prefill ranks (spawned processes, gloo) run the same stream; each stores only the
   KV pages it owns and reads through the materialized view (current-reuse where a batch has no
   prefix). As on the SGLang path, a view covers the prefixes only (the current chunk is staged
   locally) and lives in a view arena allocated once per rank, sized as the plugin sizes it
   (``arena_contexts()`` contexts of the longest request, the chunk, one page).
3. Every rank sends its owned pages of each finished request to a separate non-CP decode process
   over the Mooncake transfer engine on 127.0.0.1; the decode side checks the N manifests,
   rebuilds the full KV and runs one decode step.
4. Prefill outputs, rebuilt KV and the decode step are compared bit for bit with the baseline.

    scripts/demo.sh [--cp-size 4] [--page-size 16] [--kv-format fp8] ...   (--help lists every option)

On CPU the read path's kernels run as their torch formulations (``--triton``: Triton's interpreter).
Every check runs before the report; the numbers go to a JSON file and the plot is written last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import queue
import re
import resource
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from sglang_cp_shared_kv.reference.decode_step import decode_one_token
from sglang_cp_shared_kv.reference.dsa_reference import QUERY_BLOCK_BYTES
from sglang_cp_shared_kv.reference.dsa_stack import (
    LayerOutput,
    RequestSpec,
    StackConfig,
    TinyDSAStack,
    check_requests,
    run_chunked_prefill,
    schedule_chunked_prefill,
)
from sglang_cp_shared_kv.reference.read_path import staged_view_pages
from sglang_cp_shared_kv.reference.spawn import RankFailure, spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import arena_tokens
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_HEAD_DIM, INDEX_TOKEN_BYTES, KV_FORMATS, mla_row_bytes
from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_regions
from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import ARENA_CONTEXTS, ARENA_CONTEXTS_ENV, arena_contexts

START_S = 120.0  # the decode process's start-up
STALL_S = 120.0  # the decode side gives up when the prefill ranks report no progress for this long
RANKS_LIMIT_S = 7 * 24 * 3600.0  # no wall-clock limit on the ranks: they fail on their own, or on Ctrl-C
PLOT_NAME = "cp_shared_kv_demo.png"
JSON_NAME = "cp_shared_kv_demo.json"
BATCH_ROWS = 20  # batches listed in the table; a longer run lists its first and last ones (all in the JSON)
# Memory model for the up-front check (conservative): a process with torch, gloo and Mooncake loaded;
# per token of the chunk, the projections, attention temporaries and one batch of outputs per layer.
PROCESS_BYTES = 450 << 20
CHUNK_TOKEN_BYTES = 160 << 10
CHUNK_TOKEN_LAYER_BYTES = 48 << 10


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


# --------------------------------------------------------------------------------------------- up-front checks


def estimate_peak_bytes(
    cp_size: int,
    requests: int,
    request_len: int,
    chunk: int,
    page_size: int,
    layers: int,
    kv_format: str,
    contexts: int = ARENA_CONTEXTS,
) -> int:
    """A conservative estimate of the memory the whole demo needs at its peak, all processes together.

    The parent (replicated baseline, the rebuilt KV it checks), ``cp_size`` prefill ranks (their pool
    share, one layer's view, the indexer's decoded keys) and the decode process (full pool, rebuilt
    copies) and its view arena (``contexts`` contexts). Per process the chunk costs ``CHUNK_TOKEN_*_BYTES``
    a token; the query-blocked DSA references add at most one block, or one query's keys when a single
    query needs more.
    """
    lens = [request_len + 7 * i for i in range(requests)]
    tokens = sum(lens)
    token_bytes = layers * (mla_row_bytes(kv_format) + INDEX_TOKEN_BYTES)
    pool = (sum(-(-n // page_size) for n in lens) + cp_size * (requests + 1)) * page_size * token_bytes
    kv = tokens * token_bytes  # every request's KV once (the rebuilt copies, the decode pool)
    keys = tokens * (INDEX_HEAD_DIM * 4 + INDEX_TOKEN_BYTES + 24)  # decoded indexer keys, their rows
    block = max(2 * QUERY_BLOCK_BYTES, max(lens) * (INDEX_HEAD_DIM * 4 + 64))
    work = min(chunk, tokens) * (CHUNK_TOKEN_BYTES + layers * CHUNK_TOKEN_LAYER_BYTES) + keys + block
    parent = PROCESS_BYTES + pool + 3 * kv + work + (64 << 20)  # + matplotlib
    prefix, chunk_tokens = arena_regions(cp_size, page_size, max(lens), chunk, contexts)
    arena = arena_tokens(prefix, chunk_tokens, page_size) * token_bytes // layers
    rank = PROCESS_BYTES + pool // cp_size + 2 * tokens * token_bytes // layers + arena + work
    decode = PROCESS_BYTES + pool + 3 * kv
    return parent + cp_size * rank + decode


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, or ``None`` where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _largest_fitting(args: argparse.Namespace, name: str, budget: int) -> int:
    """The largest value of option ``name`` (``request_len`` or ``cp_size``) whose estimate fits ``budget``."""
    lo, hi = 0, getattr(args, name)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = {**vars(args), name: mid}
        est = estimate_peak_bytes(
            trial["cp_size"] or 1,
            trial["requests"],
            trial["request_len"] or 1,
            trial["chunk"],
            trial["page_size"],
            trial["layers"],
            trial["kv_format"],
            trial["contexts"],
        )
        lo, hi = (mid, hi) if est <= budget else (lo, mid - 1)
    return lo


def _check_writable(out: Path) -> str | None:
    """Why ``out`` cannot take the plot, or ``None`` once a file was written and removed there."""
    if out.exists() and not out.is_dir():
        return "it is a file, not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".demo-write-check-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def preflight(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[RequestSpec], Path]:
    """Every check that needs no work: one ``ap.error`` line (exit 2) for the first problem found."""
    for name in ("cp_size", "requests", "request_len", "chunk", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        ap.error(f"--page-size must be a power of two, got {args.page_size}")
    if args.page_size > args.request_len:
        fit = 1 << (args.request_len.bit_length() - 1)
        ap.error(
            f"--page-size {args.page_size} is larger than --request-len {args.request_len}: each request would be "
            f"one part-filled page on one rank, nothing to shard; use --page-size {fit} or less"
        )
    if args.triton and not _interpreting():
        ap.error("--triton on CPU runs Triton's interpreter: start with TRITON_INTERPRET=1 (scripts/demo.sh sets it)")
    try:
        args.contexts = arena_contexts()  # the view arena's prefix contexts, as the plugin reads them
    except ValueError as e:
        ap.error(str(e))
    need = estimate_peak_bytes(
        args.cp_size,
        args.requests,
        args.request_len,
        args.chunk,
        args.page_size,
        args.layers,
        args.kv_format,
        args.contexts,
    )
    have = available_memory_bytes()
    if have is not None and need > 0.9 * have:
        fit = _largest_fitting(args, "request_len", int(0.9 * have))
        if fit >= args.page_size:
            hint = f"--request-len {fit} fits"
        else:
            cp_fit = _largest_fitting(args, "cp_size", int(0.9 * have))
            hint = f"--cp-size {cp_fit} fits" if cp_fit >= 1 else "fewer or shorter requests"
        ap.error(
            f"this run needs about {_fmt_bytes(need)} of memory ({args.cp_size} ranks + baseline + decode) and "
            f"{_fmt_bytes(have)} is available: {hint}"
        )
    try:
        specs = build_requests(args.requests, args.request_len, args.page_size)
    except ValueError as e:
        ap.error(str(e))
    # No scheduler holds a batch back for the view arena here (SGLang's admission does): check the stream.
    prefix, chunk = arena_regions(args.cp_size, args.page_size, max(s.length for s in specs), args.chunk, args.contexts)
    arena_pages = arena_tokens(prefix, chunk, args.page_size) // args.page_size
    for i, batch in enumerate(schedule_chunked_prefill(specs, args.chunk)):
        need = staged_view_pages(batch.seq_lens, batch.prefix_lens, args.cp_size, args.page_size)
        if batch.kind != "current" and need > arena_pages:
            ap.error(
                f"prefill batch {i + 1} reads {need} pages, more than the view arena's {arena_pages} "
                f"({ARENA_CONTEXTS_ENV}={args.contexts}): raise {ARENA_CONTEXTS_ENV}"
            )
    out = Path(args.out).expanduser().resolve()
    why = _check_writable(out)
    if why is not None:
        ap.error(f"--out {out} is not writable: {why}")
    return specs, out


def _interpreting() -> bool:
    from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import interpreting

    return interpreting()


def build_parser() -> argparse.ArgumentParser:
    """The demo's options, each with its help and default."""
    ap = argparse.ArgumentParser(
        prog=os.environ.get("CP_SHARED_KV_DEMO_PROG", "python -m sglang_cp_shared_kv.reference.demo"),
        description=(
            "CP shared-KV on CPU: prefill ranks that each hold 1/N of the KV pages, a Mooncake decode process "
            "over 127.0.0.1 that rebuilds the full KV, and bit-for-bit checks of both against a replicated run. "
            "Prints a table per rank and one per prefill batch (its bytes, the view arena), writes the numbers "
            "(JSON) and a plot; exits 1 on any mismatch, 2 on a bad option."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--cp-size",
        type=int,
        default=4,
        help="prefill context-parallel ranks (processes); 1 runs the baseline: one rank holding every page, "
        "nothing shared (the SGLang plugin refuses CP size 1)",
    )
    ap.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="tokens per KV page, a power of two up to --request-len (DSA serves 64; 16 gives the demo's short "
        "requests more pages to spread over the ranks)",
    )
    ap.add_argument(
        "--kv-format", choices=KV_FORMATS, default="fp8", help="MLA row format: fp8 (656 B a token) or bf16 (1152 B)"
    )
    ap.add_argument(
        "--requests", type=int, default=4, help="requests in the stream; each odd one shares half of the one before"
    )
    ap.add_argument("--request-len", type=int, default=384, help="tokens per request (each later one is 7 longer)")
    ap.add_argument("--chunk", type=int, default=256, help="chunked-prefill token budget per batch")
    ap.add_argument("--layers", type=int, default=2, help="DSA layers of the tiny model")
    ap.add_argument(
        "--out",
        default="demo_out",
        help=f"directory for the plot ({PLOT_NAME}) and the numbers ({JSON_NAME}), relative to the current directory",
    )
    ap.add_argument(
        "--triton",
        action="store_true",
        help="run the read path's Triton kernels under Triton's interpreter (slow on CPU) instead of their torch "
        "formulations",
    )
    return ap


# --------------------------------------------------------------------------------------------- processes


class _Progress:
    """Progress lines for a run of ``total`` batches: each batch when there are few, else every few seconds."""

    def __init__(self, label: str, every_s: float = 5.0):
        self.label, self.every_s, self.last = label, every_s, 0.0

    def __call__(self, i: int, total: int, result) -> None:
        now = time.monotonic()
        if total > 16 and 0 < i < total - 1 and now - self.last < self.every_s:
            return
        self.last = now
        c = result.counters
        moved = (
            "current-reuse, 0 B moved" if c.current_reuse_hits else f"{_fmt_bytes(c.bytes_materialized)} materialized"
        )
        if self.label == "baseline":
            moved = "replicated pool"
        _log(f"{self.label}: batch {i + 1}/{total} ({result.batch.kind}, {result.batch.num_tokens} tokens): {moved}")


def _digests(layers: list[LayerOutput]) -> list[tuple[str, str, str]]:
    """Per layer, SHA-256 of the top-k, output and LSE bytes: equal digests mean equal bits."""
    return [
        tuple(hashlib.sha256(t.contiguous().numpy().data).hexdigest() for t in (out.topk, out.out, out.lse))
        for out in layers
    ]


def _first_digest_mismatch(base: list, batch_kinds: list[str], got: list) -> str | None:
    if len(base) != len(got):
        return f"{len(got)} batches vs {len(base)}"
    for i, (a, b) in enumerate(zip(base, got)):
        for layer, (da, db) in enumerate(zip(a, b)):
            for name, x, y in zip(("topk", "out", "lse"), da, db):
                if x != y:
                    return f"batch {i + 1} ({batch_kinds[i]}) layer {layer}: {name} differs"
    return None


# --------------------------------------------------------------------------------------------- decode


def wait_while_progressing(
    wait: Callable[[float], Any], last_progress: Callable[[], float], stall_s: float, what: str, tick_s: float = 1.0
) -> Any:
    """``wait(tick_s)`` until it returns a finished state, for as long as the senders make progress.

    ``last_progress()`` is the wall-clock time (``time.time()``) of their latest report; more than
    ``stall_s`` without one raises ``RuntimeError`` naming ``what``. No limit on the total wait.
    """
    while not (state := wait(tick_s)).finished:
        idle = time.time() - last_progress()
        if idle > stall_s:
            raise RuntimeError(f"no progress from the prefill ranks for {idle:.0f} s while waiting for {what}")
    return state


def _decode_main(cfg: dict, heartbeat, outbox: mp.Queue) -> None:
    """The non-CP decode server: receive every request over Mooncake, check, rebuild, decode one step.

    It waits for each request as long as the prefill ranks keep reporting progress (``heartbeat``:
    the time of their last batch or send), and gives up after ``STALL_S`` without any.
    """
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
            states[i] = wait_while_progressing(
                lambda timeout_s, i=i: rx.wait(f"req-{i}", timeout_s), lambda: heartbeat.value, STALL_S, f"req-{i}"
            )
        failed = {i: rx.failure_reason(f"req-{i}") for i, s in states.items() if s != TransferState.SUCCESS}
        tables = [rx.dst_pages(f"req-{i}").tolist() for i in range(len(lens))]
        rebuilt = [
            [(pool.latent_pages(layer)[t].clone(), pool.index[layer][t].clone()) for layer in range(n_layers)]
            for t in (torch.tensor(p) for p in tables)
        ]
        step = None
        if not failed:
            stack = TinyDSAStack(cfg["config"], cfg["kv_format"])
            step, _ = decode_one_token(
                stack,
                pool,
                tables,
                lens,
                cfg["new_ids"],
                lambda: int(rx.alloc_pages(1)[0]),
                use_triton=cfg["use_triton"],
            )
        outbox.put(("result", pickle.dumps({"failed": failed, "tables": tables, "rebuilt": rebuilt, "step": step})))
        rx.close()
        engine.close()
    except BaseException as exc:  # the parent reports it
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))


# --------------------------------------------------------------------------------------------- prefill


def _prefill_rank(rank: int, world: int, cfg: dict, decode_address: str, heartbeat) -> dict:
    """One CP rank: sharded chunked prefill, then send every finished request's owned pages."""
    _env()
    from sglang_cp_shared_kv.reference.mooncake.engine import MooncakeEngine
    from sglang_cp_shared_kv.reference.mooncake.owned_page_sender import OwnedPageSender

    group = CPGroup()
    heartbeat.value = time.time()  # up and joined: progress
    t0 = time.monotonic()
    log = _Progress("prefill")
    digests, batches = [], []

    def on_batch(i: int, total: int, result) -> None:
        heartbeat.value = time.time()
        digests.append(_digests(result.layers))
        batches.append((result.batch.kind, asdict(result.counters)))
        if rank == 0:
            log(i, total, result)

    run = run_chunked_prefill(
        cfg["requests"],
        chunk_size=cfg["chunk"],
        page_size=cfg["page_size"],
        kv_format=cfg["kv_format"],
        group=group,
        config=cfg["config"],
        use_triton=cfg["use_triton"],
        on_batch=on_batch,
        keep_outputs=False,
        stage_current=True,
        view_arena=cfg["view_arena"],
    )
    prefill_s = time.monotonic() - t0
    if rank == 0:
        _log(f"prefill: {len(batches)} batches done on {world} ranks in {prefill_s:.1f} s; sending over Mooncake")
    t_send = time.monotonic()
    engine = MooncakeEngine()
    sender = OwnedPageSender(run.pool, engine, decode_address).start()
    for i, pages in enumerate(run.request_pages):
        sender.submit(f"req-{i}", torch.tensor(pages, dtype=torch.int64))
    sent = []
    for i in range(len(run.request_pages)):
        sender.wait(f"req-{i}")
        heartbeat.value = time.time()
        r = sender.pop(f"req-{i}")
        sent.append(
            {"state": r.state.name, "reason": r.reason, "pages": r.pages, "nbytes": r.nbytes, "entries": r.entries}
        )
    send_s = time.monotonic() - t_send
    sender.close()
    engine.close()
    owned = {p for pages in run.request_pages for p in pages if p % world == rank}
    return {
        "batches": batches,
        "digests": digests,
        "owned_pages": len(owned),
        "page_bytes": run.pool.page_bytes,
        "allocated_bytes": run.pool.allocated_bytes,
        "arena_bytes": run.arena_bytes,
        "sent": sent,
        "prefill_s": prefill_s,
        "send_s": send_s,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


class _Children(threading.Thread):
    """Starts the decode process and the prefill ranks, and collects their results.

    It runs in its own thread with SIGINT blocked, so the processes it starts inherit that mask: a
    Ctrl-C reaches only the parent, which stops them (no traceback from every child).
    """

    def __init__(self, cfg: dict, heartbeat):
        super().__init__(name="demo-children", daemon=True)
        self.cfg, self.heartbeat = cfg, heartbeat
        self.ranks: list[dict] | None = None
        self.dec: dict | None = None
        self.error: str | None = None
        self.stop = threading.Event()  # set on Ctrl-C: start nothing more

    def run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        cfg, ctx = self.cfg, mp.get_context("spawn")
        outbox = ctx.Queue()
        decode = ctx.Process(target=_decode_main, args=(cfg, self.heartbeat, outbox), daemon=True)
        try:
            decode.start()
            kind, address = outbox.get(timeout=START_S)
            if kind != "address":
                raise RuntimeError(f"decode process failed to start: {address}")
            _log(f"decode: non-CP decode process listening at {address} (Mooncake over TCP on 127.0.0.1)")
            if self.stop.is_set():
                raise RuntimeError("interrupted")
            _log(f"prefill: spawning {cfg['cp_size']} CP rank{'s' if cfg['cp_size'] > 1 else ''} (gloo)")
            self.ranks = spawn_ranks(
                _prefill_rank, cfg["cp_size"], cfg, address, self.heartbeat, timeout_s=RANKS_LIMIT_S
            )
            _log("decode: waiting for the rebuilt KV and the decode step")
            while True:
                try:
                    kind, payload = outbox.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not decode.is_alive():
                        raise RuntimeError(f"decode process died with exit code {decode.exitcode}") from None
            if kind != "result":
                raise RuntimeError(f"decode process failed: {payload}")
            self.dec = pickle.loads(payload)
        except (RankFailure, RuntimeError, queue.Empty) as e:
            self.error = f"{type(e).__name__}: {e}" if not isinstance(e, queue.Empty) else "decode did not start"
        finally:
            decode.join(timeout=10)
            if decode.is_alive():
                decode.kill()


def _stop_children() -> None:
    """Kill every process this demo started (the decode process and the prefill ranks)."""
    for p in mp.active_children():
        p.kill()
    for p in mp.active_children():
        p.join(timeout=5)


# Mooncake's glog lines that carry no news: its notices and warnings, and one "error" at start-up.
_NOISE = re.compile(
    rb"^(WARNING: Logging before InitGoogleLogging\(\)"
    rb"|[IW]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\]"
    rb"|E\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] Local segment descriptor not found)"
)


class _NativeLogFilter:
    """Route file descriptor 2 (this process's and every child's) through a thread that drops ``_NOISE``.

    Python's own messages (tracebacks, ``print(file=sys.stderr)``) pass unchanged.
    """

    def __init__(self) -> None:
        self.saved = os.dup(2)
        read_fd, write_fd = os.pipe()
        sys.stderr.flush()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self.thread = threading.Thread(target=self._pump, args=(read_fd, os.dup(self.saved)), daemon=True)
        self.thread.start()

    @staticmethod
    def _pump(read_fd: int, out_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as src:
            for line in src:
                if not _NOISE.match(line):
                    os.write(out_fd, line)
        os.close(out_fd)

    def stop(self) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)  # the pipe's last writer closes: the pump drains it and ends
        os.close(self.saved)
        self.thread.join(timeout=2)


# --------------------------------------------------------------------------------------------- report


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def capacity_multiplier(per_rank_bytes: list[int], replicated_bytes: int) -> float:
    """How many times a full copy fits, per rank, against the fullest rank: ``replicated / max(per rank)``."""
    fullest = max(per_rank_bytes, default=0)
    return replicated_bytes / fullest if fullest else 0.0


def format_report(
    per_rank: list[dict], replicated_pages: int, page_bytes: int, shared_prefixes: bool, layers: int
) -> list[str]:
    """The per-rank table (one row per rank, so it stays narrow at any CP size) and its notes.

    ``per_rank[r]``: ``owned_pages``, ``sent_bytes``, ``send_s``, ``peak_rss``.
    """
    n = len(per_rank)
    full = replicated_pages * page_bytes
    held = [r["owned_pages"] * page_bytes for r in per_rank]
    head = f"{'rank':>6} {'KV pages held':>14} {'KV bytes held':>14} {'share of a full copy':>21} "
    head += f"{'sent to decode':>15} {'send time':>10} {'peak RSS':>10}"
    lines = [head]
    for r, (row, b) in enumerate(zip(per_rank, held)):
        lines.append(
            f"{r:>6} {row['owned_pages']:>14} {_fmt_bytes(b):>14} {b / full if full else 0:>21.3f} "
            f"{_fmt_bytes(row['sent_bytes']):>15} {row['send_s']:>8.1f} s {_fmt_bytes(row['peak_rss']):>10}"
        )
    total_sent = sum(r["sent_bytes"] for r in per_rank)
    lines.append(
        f"{'all':>6} {sum(r['owned_pages'] for r in per_rank):>14} {_fmt_bytes(sum(held)):>14} "
        f"{sum(held) / full if full else 0:>21.3f} {_fmt_bytes(total_sent):>15}"
    )
    lines.append(
        f"{'repl.':>6} {replicated_pages:>14} {_fmt_bytes(full):>14} {1.0:>21.3f}   <- a replicated pool holds "
        "this on every rank"
    )
    lines.append("")
    holding = sum(1 for b in held if b)
    mult = capacity_multiplier(held, full)
    if n == 1:
        note = "CP size 1: the baseline, one rank holds every page"
    elif holding < n:
        note = f"{holding} of {n} ranks hold pages; this stream has too few pages for the other {n - holding}"
    else:
        note = f"all {n} ranks hold pages"
    lines.append(f"capacity per rank: {mult:.1f}x a full copy fits in the KV memory of the fullest rank")
    lines.append(f"  ({note})")
    if shared_prefixes:
        lines.append("sent to decode: a shared prefix page goes once per request that reads it (the decode side")
        lines.append("  keeps no prefix cache here), so the total can exceed the KV held")
    lines.append(f"(KV bytes: MLA rows plus indexer keys, {layers} layer{'s' if layers > 1 else ''})")
    return lines


TOTALS = ("tokens", "bytes_received", "bytes_materialized", "current_chunk_bytes_gathered")


def format_batches(
    batches: list[dict], arena: dict, cp_size: int, layers: int, max_rows: int = BATCH_ROWS
) -> list[str]:
    """The per-batch table of one rank (every rank moves the same bytes), under the view arena's size.

    ``batches[i]``: ``kind``, ``requests`` (their ids), ``tokens`` and the batch's ``BatchCounters``
    fields (bytes summed over the layers, pages per layer). ``arena``: ``bytes``, ``prefix_tokens``,
    ``chunk_tokens``, ``contexts``, ``context_len``. More than ``max_rows`` batches: the first and last.
    """
    mib = arena["bytes"] / 2**20
    lines = [
        f"view arena: {mib:.2f} MiB per rank, allocated once: {arena['prefix_tokens']} prefix tokens "
        f"({arena['contexts']} contexts of {arena['context_len']}) + {arena['chunk_tokens']} chunk + a page",
        f"{'batch':>6} {'kind':<8} {'reqs':>4} {'tokens':>7} {'view pages':>10} {'staged pages':>12} "
        f"{'received':>12} {'materialized':>12} {'chunk gathered':>14}",
    ]

    def row(label: str, kind: str, reqs: int, b: dict, pages: str) -> str:
        moved = [_fmt_bytes(b[k]) for k in TOTALS[1:]]
        return (
            f"{label:>6} {kind:<8} {reqs:>4} {b['tokens']:>7} {pages:>23} {moved[0]:>12} {moved[1]:>12} {moved[2]:>14}"
        )

    half = max_rows // 2
    shown = (
        range(len(batches)) if len(batches) <= max_rows else [*range(half), *range(len(batches) - half, len(batches))]
    )
    for i in shown:
        if len(batches) > max_rows and i == len(batches) - half:
            lines.append(f"{'...':>6} ({len(batches) - max_rows} more batches, every one in the JSON)")
        b = batches[i]
        lines.append(
            row(str(i + 1), b["kind"], len(b["requests"]), b, f"{b['view_pages']:>10} {b['pages_staged']:>12}")
        )
    total = {k: sum(b[k] for b in batches) for k in TOTALS}
    lines.append(row("all", "", len({r for b in batches for r in b["requests"]}), total, ""))
    n = cp_size
    received = (
        f"from the other {n - 1} rank{'s' if n > 2 else ''}, {n - 1}/{n} of materialized" if n > 1 else "none at CP 1"
    )
    lines.append(f"(one rank, {layers} layer{'s' if layers > 1 else ''}; pages per layer; received: {received};")
    lines.append("  chunk gathered: current-chunk bytes all-gathered, 0 as the chunk is staged; current: 0 B moved)")
    return lines


def plot_demo(
    path: Path,
    per_rank_bytes: list[int],
    replicated_bytes: int,
    batches: list[tuple[str, dict]],
    sent_bytes: list[int],
    send_s: list[float],
) -> Path:
    """Three panels: KV held per rank, bytes materialized per prefill batch, the Mooncake transfer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    mib = float(1 << 20)
    n = len(per_rank_bytes)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.6))
    ranks = list(range(n))
    tick_size = 9 if n <= 8 else 7
    a1.bar(ranks, [b / mib for b in per_rank_bytes], color="C0", label="sharded: pages this rank owns")
    a1.axhline(replicated_bytes / mib, color="C3", ls="--", label="replicated: a full copy on every rank")
    a1.set_xlabel("CP rank")
    a1.set_ylabel("KV held (MiB, all layers)")
    a1.set_title(f"KV held per rank, CP={n}")
    a1.set_ylim(0, replicated_bytes / mib * 1.35 or 1.0)
    a1.set_xticks(ranks)
    a1.tick_params(axis="x", labelsize=tick_size)
    a1.legend(fontsize=8, loc="upper right")

    colors = {"current": "C2", "history": "C1", "mixed": "C4"}
    xs = list(range(1, len(batches) + 1))
    ys = [c["bytes_materialized"] / mib for _, c in batches]
    a2.bar(xs, ys, color=[colors[k] for k, _ in batches])
    for kind, color in colors.items():
        a2.bar([xs[0]], [0], color=color, label=kind)
    top = max(ys, default=0) or 1.0
    for x, y, (_kind, c) in zip(xs, ys, batches):
        if c["current_reuse_hits"] and y == 0:
            a2.text(x, top * 0.02, "current-reuse: 0 B", rotation=90, ha="center", va="bottom", fontsize=7, color="C2")
    a2.set_ylim(0, top * 1.15)
    a2.set_xlabel("prefill batch")
    a2.set_ylabel("materialized (MiB, all layers, one rank)")
    a2.set_title("bytes materialized per prefill batch")
    a2.xaxis.set_major_locator(MaxNLocator(integer=True))
    a2.legend(fontsize=8, loc="upper left")

    a3.bar(ranks, [b / mib for b in sent_bytes], color="C5")
    tallest = max(sent_bytes, default=0) / mib or 1.0
    for r, (b, t) in enumerate(zip(sent_bytes, send_s)):
        a3.text(
            r, b / mib + tallest * 0.02, f"{t:.1f} s", ha="center", va="bottom", fontsize=7, rotation=90 if n > 8 else 0
        )
    a3.set_ylim(0, tallest * 1.25)
    a3.set_xlabel("CP rank")
    a3.set_ylabel("sent to decode (MiB)")
    a3.set_title(f"Mooncake to decode: {sum(sent_bytes) / mib:.2f} MiB, {max(send_s, default=0):.1f} s")
    a3.set_xticks(ranks)
    a3.tick_params(axis="x", labelsize=tick_size)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    specs, out_dir = preflight(ap, args)
    _env()
    # The CPU matmuls of the reference kernels split their reductions by thread count: every process
    # (baseline, ranks, decode) runs one thread so that equal bytes give equal bits.
    torch.set_num_threads(1)
    log_filter = _NativeLogFilter()
    children: list[_Children] = []
    try:
        return _run(args, specs, out_dir, children)
    except KeyboardInterrupt:
        for c in children:
            c.stop.set()
        _stop_children()
        print("interrupted: the prefill ranks and the decode process are stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        log_filter.stop()


def _run(args: argparse.Namespace, specs: list[RequestSpec], out_dir: Path, started: list[_Children]) -> int:
    t_start = time.monotonic()
    config = StackConfig(num_layers=args.layers)
    use_triton = bool(args.triton)
    lens = [s.length for s in specs]
    shared = [(i, s.prefix_from, s.prefix_len) for i, s in enumerate(specs) if s.prefix_from is not None]
    new_ids = torch.randint(0, config.vocab, (len(specs),), generator=torch.Generator().manual_seed(7))
    sharing = f"; odd ones share their first {shared[0][2]} tokens with the one before" if shared else ""
    sizes = ", ".join(map(str, lens)) if len(lens) <= 6 else f"{lens[0]} to {lens[-1]}"
    _log(f"{len(specs)} request{'s' if len(specs) > 1 else ''} ({sizes} tokens{sharing})")
    _log(
        f"CP={args.cp_size}, page size {args.page_size}, {args.kv_format} KV, {args.layers} layers, "
        f"chunk {args.chunk}, kernels: {'Triton (interpreter)' if use_triton else 'torch formulations'}"
    )
    _log(f"output: {out_dir / PLOT_NAME}")
    _log(f"output: {out_dir / JSON_NAME}")
    # The view arena the plugin would allocate for these limits: its longest request, the chunk.
    arena_prefix, arena_chunk = arena_regions(args.cp_size, args.page_size, max(lens), args.chunk, args.contexts)
    arena_rows = arena_tokens(arena_prefix, arena_chunk, args.page_size)
    _log(f"view arena: {arena_rows} tokens per rank, allocated once; views hold the prefixes, the chunk is staged")

    cfg = {
        "page_size": args.page_size,
        "kv_format": args.kv_format,
        "config": config,
        "lens": lens,
        "cp_size": args.cp_size,
        "new_ids": new_ids,
        "requests": specs,
        "chunk": args.chunk,
        "use_triton": use_triton,
        "view_arena": (arena_prefix, arena_chunk),
    }
    heartbeat = mp.get_context("spawn").Value("d", time.time())
    children = _Children(cfg, heartbeat)
    started.append(children)
    children.start()

    # The replicated baseline runs here while the ranks run in their processes.
    _log("baseline: replicated pool, same stream (in this process, alongside the ranks)")
    base_digests, kinds, schedule = [], [], []
    progress = _Progress("baseline")

    def on_base_batch(i: int, total: int, result) -> None:
        base_digests.append(_digests(result.layers))
        kinds.append(result.batch.kind)
        schedule.append(result.batch)
        progress(i, total, result)

    base = run_chunked_prefill(
        specs,
        chunk_size=args.chunk,
        page_size=args.page_size,
        kv_format=args.kv_format,
        config=config,
        cp_size=args.cp_size,
        use_triton=use_triton,
        on_batch=on_base_batch,
        keep_outputs=False,
    )
    _log(f"baseline: done in {time.monotonic() - t_start:.1f} s")
    while children.is_alive():
        children.join(timeout=0.2)
    if children.error is not None:
        print(f"FAIL: {children.error}", file=sys.stderr)
        return 1
    ranks, dec = children.ranks, children.dec

    # ---- checks
    checks = {}
    mism = [_first_digest_mismatch(base_digests, kinds, r["digests"]) for r in ranks]
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
        ref, _ = decode_one_token(
            stack, base.pool, base.request_pages, lens, new_ids, lambda: next(spare), use_triton=use_triton
        )
        step_ok = all(
            torch.equal(a.topk, b.topk) and torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)
            for a, b in zip(ref, dec["step"])
        )
    checks["decode step on rebuilt KV equals replicated"] = step_ok

    # ---- report
    page_bytes = ranks[0]["page_bytes"]
    all_pages = {p for pages in base.request_pages for p in pages}
    rows = [
        {
            "owned_pages": r["owned_pages"],
            "sent_bytes": sum(s["nbytes"] for s in r["sent"]),
            "send_s": r["send_s"],
            "peak_rss": r["peak_rss"],
        }
        for r in ranks
    ]
    batches = ranks[0]["batches"]
    hits = sum(c["current_reuse_hits"] for _, c in batches)
    arena = {
        "contexts": args.contexts,
        "context_len": max(lens),
        "prefix_tokens": arena_prefix,
        "chunk_tokens": arena_chunk,
        "tokens": arena_rows,
        "bytes": ranks[0]["arena_bytes"],
        "mib": round(ranks[0]["arena_bytes"] / 2**20, 3),
    }
    per_batch = [
        {
            "batch": i + 1,
            "kind": kind,
            "requests": list(sb.requests),
            "prefix_lens": list(sb.prefix_lens),
            "seq_lens": list(sb.seq_lens),
            "tokens": sb.num_tokens,
            **c,
        }
        for i, ((kind, c), sb) in enumerate(zip(batches, schedule))
    ]
    print()
    for line in format_report(rows, len(all_pages), page_bytes, bool(shared), args.layers):
        print(line)
    print()
    print(
        f"prefill batches: {len(kinds)} ("
        + ", ".join(f"{kinds.count(k)} {k}" for k in ("current", "history", "mixed"))
        + f"); current-reuse: {hits} layer reads with 0 bytes moved"
    )
    for line in format_batches(per_batch, arena, args.cp_size, args.layers):
        print(line)
    if dec["failed"]:
        print(f"transfer failures: {dec['failed']}")
    print()
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    for r, m in enumerate(mism):
        if m is not None:
            print(f"      rank {r}: {m}")
    numbers = {
        "options": {k: v for k, v in vars(args).items() if k not in ("out", "contexts")},
        "view_arena": arena,
        "batches": per_batch,
        "ranks": [
            {
                **row,
                "arena_bytes": r["arena_bytes"],
                **{k: sum(c[k] for _, c in r["batches"]) for k in TOTALS if k != "tokens"},
            }
            for row, r in zip(rows, ranks)
        ],
        "checks": checks,
        "passed": all(checks.values()),
    }
    try:
        (out_dir / JSON_NAME).write_text(json.dumps(numbers, indent=1) + "\n")
        print(f"numbers: {out_dir / JSON_NAME}")
    except OSError as e:
        print(f"numbers: not written ({out_dir / JSON_NAME}: {e.strerror or e})")
    sys.stdout.flush()
    try:
        plot = plot_demo(
            out_dir / PLOT_NAME,
            [r["owned_pages"] * page_bytes for r in rows],
            len(all_pages) * page_bytes,
            batches,
            [r["sent_bytes"] for r in rows],
            [r["send_s"] for r in rows],
        )
        print(f"plot: {plot}")
    except ImportError:
        print("plot: skipped (matplotlib is not installed)")
    except OSError as e:
        print(f"plot: not written ({out_dir / PLOT_NAME}: {e.strerror or e})")
    _log(f"done in {time.monotonic() - t_start:.0f} s")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
