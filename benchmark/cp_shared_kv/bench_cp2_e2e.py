"""CP end to end on N GPUs (NCCL): plan + gather + all-gather vs a raw all-gather of the same bytes.

Per configuration (KV format, batch context), every rank holds its share of a sharded pool; a
history batch (every request reads a prefix) is planned once, then each layer's view is built
(owned-page gather straight into the view, then one in-place NCCL all-gather group of latent and
indexer pages; large views in pipeline chunks whose gathers overlap the previous chunk's
all-gather). The baseline is one ``all_gather_into_tensor`` of exactly the bytes each rank sends.
Each is timed twice: from an idle GPU (host launch overhead included, as before) and with the host
queued ahead of the GPU (``*_device_us``: device time, as inside a forward pass). The view is also
timed for several pipeline chunk sizes (``chunk_sweep``). Also measured:

- one-layer-ahead prefetch: the view of layer l+1 is built on a side stream while FlashMLA's
  sparse prefill of layer l runs; the exposed time per layer is reported next to the attention time,
  and ``prefetch_exposed_fraction``: exposed view time per layer / the view time a layer adds
  without prefetch (0: all hidden, 1: nothing hidden). Three forwards of ``--layers`` layers are
  timed alike, in turn within each iteration (``forward_times_us``): attention alone, views built in
  line, views prefetched;
- the copy-engine transport (``copy_engine.CopyEngineGroup``: peers' parts pulled from a view arena
  registered once, no SMs): the same view and prefetch timings (``*_copy_engine``), beside NCCL's;
- current-reuse vs materialize for current-only chunks (time and bytes).

    python -m benchmark.cp_shared_kv.bench_cp2_e2e --world-size 2
    python -m benchmark.cp_shared_kv.bench_cp2_e2e --backend gloo --contexts 32768 --name cp2_e2e_smoke  # 1 GPU
"""

from __future__ import annotations

import argparse

import torch

from benchmark.cp_shared_kv.bench_common import cuda_time_us, save_plot, write_result
from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.reference.read_path import ReadPath, pack_index_records
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer, allocate_arena, prefetch_stream
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_page_buffers
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import pages_for_lens, pipeline_chunks, slots_per_rank
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

PS = 64
N_REQ = 4
CHUNK = 4096  # query tokens per batch (sparse prefill)
TOPK = 2048
HEADS = 128  # DeepSeek-V3.2
CHUNK_SWEEP = (0, 16384, 32768, 65536, 131072)  # pipeline chunk tokens per rank; 0: one piece
QUEUE_AHEAD_CYCLES = 6_000_000  # ~3 ms of GPU sleep that the host enqueues the timed calls behind
QUEUED_REPS = 4  # calls per queued timing (amortizes the ranks' start skew)


def _queued_once_us(fn, group: CPGroup, reps: int, cycles: int = QUEUE_AHEAD_CYCLES) -> float:
    """Device microseconds per call of ``reps`` calls of ``fn``, enqueued while the GPU sleeps
    ``cycles`` (so launch overhead is hidden, as in a forward pass), every rank starting together
    after a barrier."""
    torch.cuda.synchronize()
    group.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps


def queued_time_us(fn, group: CPGroup, iters: int, reps: int = QUEUED_REPS) -> float:
    """Median device microseconds per call of ``fn`` with the host queued ahead of the GPU.

    The GPU sleeps while the host enqueues ``reps`` calls, so launch overhead is hidden as in a
    forward pass; ranks start together after a barrier (their remaining skew is part of the time,
    divided by ``reps``, for the baseline and the view alike).
    """
    for _ in range(2):
        fn()
    times = sorted(_queued_once_us(fn, group, reps) for _ in range(iters))
    return times[len(times) // 2]


def _setup(world, rank, kv_format, ctx_tokens, layers):
    own = PageOwnership(world, PS)
    pages_per_req = ctx_tokens // N_REQ // PS
    phys = N_REQ * (-(-pages_per_req // world)) + 4
    pool = ShardedMLAPool(own, rank, phys, layers, kv_format, with_indexer=True, device="cuda")
    for buf in pool.latent + pool.index:
        buf.random_(0, 120)  # finite e4m3 / bf16 bytes
    alloc = BalancedPageAllocator(own, phys)
    table = torch.zeros(N_REQ, pages_per_req, dtype=torch.int32)
    for b in range(N_REQ):
        table[b] = alloc.alloc(pages_per_req, b % world).to(torch.int32)
    return pool, table.cuda(), [pages_per_req * PS] * N_REQ


def _flash_mla():
    try:
        import flash_mla

        return flash_mla
    except ImportError:
        return None


def _copy_engine_materializer(pool, group, table, seq_lens, prefix_lens) -> ViewMaterializer:
    """A materializer whose views are pulled by the copy engines from an arena registered for this batch."""
    probe = ViewMaterializer(pool, group)
    probe.begin_batch(table, seq_lens, prefix_lens)
    arena = allocate_arena(probe.plan.view_pages * PS, 0, PS, pool.row_bytes, pool.with_indexer, pool.device)
    mat = ViewMaterializer(pool, CopyEngineGroup(group, list(arena.values())), arena=arena, pipeline_chunk_tokens=0)
    mat.begin_batch(table, seq_lens, prefix_lens)
    return mat


def _rank_main(rank, world, formats, contexts, layers, iters, backend="nccl", chunk_sweep=True):
    if backend == "gloo":  # the one-GPU smoke: every rank on the same device
        torch.cuda.set_device(0)
    group = CPGroup()
    torch.manual_seed(rank)
    rows, reuse_rows = [], []
    flash_mla = _flash_mla()
    for kv_format in formats:
        for ctx in contexts:
            pool, table, seq_lens = _setup(world, rank, kv_format, ctx, layers)
            prefix_lens = [n - CHUNK // N_REQ for n in seq_lens]  # a history batch: every request reads a prefix
            mat = ViewMaterializer(pool, group)
            torch.cuda.synchronize()
            group.barrier()
            plan_us = cuda_time_us(lambda: mat.begin_batch(table, seq_lens, prefix_lens), iters=iters)
            mat.begin_batch(table, seq_lens, prefix_lens)
            plan = mat.plan
            layer_us = cuda_time_us(lambda: mat.layer_view(0), iters=iters)
            layer_device_us = queued_time_us(lambda: mat.layer_view(0), group, iters)
            send_bytes = plan.slots_per_rank * pool.page_bytes_per_layer
            send = torch.empty(send_bytes, dtype=torch.uint8, device="cuda")
            recv = torch.empty(world * send_bytes, dtype=torch.uint8, device="cuda")
            raw_us = cuda_time_us(lambda: group.all_gather_into(recv, send), iters=iters)
            raw_device_us = queued_time_us(lambda: group.all_gather_into(recv, send), group, iters)
            ce_mat = _copy_engine_materializer(pool, group, table, seq_lens, prefix_lens)
            ce_us = cuda_time_us(lambda: ce_mat.layer_view(0), iters=iters)  # noqa: B023
            ce_device_us = queued_time_us(lambda: ce_mat.layer_view(0), group, iters)  # noqa: B023
            sweep = _chunk_sweep(pool, group, table, seq_lens, prefix_lens, world, iters) if chunk_sweep else {}
            send_pages = plan.send_pages(rank)
            sources = (pool.latent_pages(0), pool.index[0])
            blocks = [
                torch.empty(plan.slots_per_rank, src.shape[1], dtype=torch.uint8, device="cuda") for src in sources
            ]
            gather_only_us = cuda_time_us(lambda: gather_page_buffers(sources, send_pages, blocks), iters=iters)
            view_bytes = plan.view_pages * pool.page_bytes_per_layer
            row = {
                "kv_format": kv_format,
                "context_tokens": ctx,
                "requests": N_REQ,
                "view_pages": plan.view_pages,
                "pipeline_chunks": plan.chunks,
                "bytes_per_rank_sent": send_bytes,
                "view_bytes": view_bytes,
                "plan_us": round(plan_us, 1),
                "layer_view_us": round(layer_us, 1),
                "raw_all_gather_us": round(raw_us, 1),
                "gather_only_us": round(gather_only_us, 1),
                "layer_view_busbw_GBps": round(view_bytes * (world - 1) / world / layer_us / 1e3, 1),
                "raw_busbw_GBps": round(view_bytes * (world - 1) / world / raw_us / 1e3, 1),
                "layer_view_vs_raw_all_gather": round(raw_us / layer_us, 3),
                "layer_view_device_us": round(layer_device_us, 1),
                "raw_all_gather_device_us": round(raw_device_us, 1),
                "layer_view_vs_raw_all_gather_device": round(raw_device_us / layer_device_us, 3),
                "layer_view_copy_engine_us": round(ce_us, 1),
                "layer_view_copy_engine_device_us": round(ce_device_us, 1),
                "layer_view_copy_engine_vs_raw_all_gather": round(raw_us / ce_us, 3),
                "layer_view_copy_engine_vs_raw_all_gather_device": round(raw_device_us / ce_device_us, 3),
                "chunk_sweep": sweep,
            }
            if flash_mla is not None and kv_format == "bf16":
                mats = [ViewMaterializer(pool, group), ViewMaterializer(pool, group)]  # double buffer
                for m in mats:
                    m.begin_batch(table, seq_lens, prefix_lens)
                row.update(_prefetch(flash_mla, mats, layers, iters, group))
                mats = [_copy_engine_materializer(pool, group, table, seq_lens, prefix_lens) for _ in range(2)]
                row.update({f"{k}_copy_engine": v for k, v in _prefetch(flash_mla, mats, layers, iters, group).items()})
                del mats
            rows.append(row)
            torch.cuda.empty_cache()
        reuse_rows.append(_current_reuse(world, rank, group, kv_format, iters))
    return rows, reuse_rows


def _chunk_sweep(pool, group, table, seq_lens, prefix_lens, world, iters) -> dict:
    """Layer-view time for each pipeline chunk size of ``CHUNK_SWEEP`` (one run per distinct chunk count)."""
    out, seen = {}, {}
    s = slots_per_rank(pages_for_lens(seq_lens, PS), world)
    for chunk_tokens in CHUNK_SWEEP:
        k = pipeline_chunks(s, PS, chunk_tokens or None)
        if k not in seen:
            mat = ViewMaterializer(pool, group, pipeline_chunk_tokens=chunk_tokens)
            mat.begin_batch(table, seq_lens, prefix_lens)
            seen[k] = {
                "chunks": k,
                "layer_view_us": round(cuda_time_us(lambda: mat.layer_view(0), iters=iters), 1),  # noqa: B023
                "layer_view_device_us": round(queued_time_us(lambda: mat.layer_view(0), group, iters), 1),  # noqa: B023
            }
            del mat
            torch.cuda.empty_cache()
        out[str(chunk_tokens)] = seen[k]
    return out


def forward_times_us(fns, group: CPGroup, iters: int) -> list[float]:
    """Median device microseconds of each of ``fns`` (whole forwards), measured in turn within every
    iteration (drift hits them alike), each started on every rank together (device drained, barrier)
    with the host queued ahead of the GPU, as inside a forward pass."""
    for fn in fns:
        fn()
    # The GPU sleeps longer than a forward's enqueue takes the host.
    times = [[_queued_once_us(fn, group, 1, 4 * QUEUE_AHEAD_CYCLES) for fn in fns] for _ in range(iters)]
    return [sorted(t)[iters // 2] for t in zip(*times)]


def _prefetch(flash_mla, mats, layers, iters, group):
    """Exposed per-layer time of building layer l+1's view on a side stream during layer l's attention
    (``mats``: two materializers of the batch, the double buffer), against the same forward of
    attention alone and the one that builds each view in line, all three timed alike."""
    rows_in_view = mats[0].plan.view_pages * PS
    q = (torch.randn(CHUNK, HEADS, 576, device="cuda") / 8).to(torch.bfloat16)
    idx = torch.randint(0, rows_in_view, (CHUNK, 1, TOPK), dtype=torch.int32, device="cuda")
    side = prefetch_stream(torch.device("cuda", torch.cuda.current_device()))  # the wired path's side stream
    main = torch.cuda.current_stream()

    def attn(view):
        kv = view.kv_rows.view(torch.bfloat16).view(-1, 1, 576)
        return flash_mla.flash_mla_sparse_fwd(q, kv, idx, 576**-0.5, 512, use_legacy=True)

    view0 = mats[0].layer_view(0)

    def forward_attention_only():
        for _ in range(layers):
            attn(view0)

    def forward_no_prefetch():
        for layer in range(layers):
            attn(mats[layer % 2].layer_view(layer))

    def forward_prefetch():
        done = [None] * layers
        ready = [torch.cuda.Event() for _ in range(layers)]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            views = [mats[0].layer_view(0)]
            ready[0].record(side)
        for layer in range(layers):
            if layer + 1 < layers:
                with torch.cuda.stream(side):
                    if layer >= 1:
                        side.wait_event(done[layer - 1])  # its buffers were read by attention(layer - 1)
                    views.append(mats[(layer + 1) % 2].layer_view(layer + 1))
                    ready[layer + 1].record(side)
            main.wait_event(ready[layer])
            attn(views[layer])
            done[layer] = torch.cuda.Event()
            done[layer].record(main)

    fwd = (forward_attention_only, forward_no_prefetch, forward_prefetch)
    attn_fwd_us, serial_us, overlap_us = forward_times_us(fwd, group, max(5, iters // 3))
    attn_us = attn_fwd_us / layers
    exposed = overlap_us / layers - attn_us
    view = serial_us / layers - attn_us  # what the view adds to a layer when nothing overlaps
    return {
        "sparse_prefill_us": round(attn_us, 1),
        "sparse_prefill_shape": f"q {CHUNK}x{HEADS}x576, topk {TOPK}",
        "layers_timed": layers,
        "serial_per_layer_us": round(serial_us / layers, 1),
        "prefetch_per_layer_us": round(overlap_us / layers, 1),
        "prefetch_exposed_per_layer_us": round(exposed, 1),
        "prefetch_exposed_fraction": round(max(exposed, 0.0) / view, 3) if view > 0 else None,
    }


def _current_reuse(world, rank, group, kv_format, iters):
    """A current-only batch (no prefixes): current-reuse vs forced materialization."""
    ctx = 4 * CHUNK
    pool, table, seq_lens = _setup(world, rank, kv_format, ctx, 1)
    t = sum(seq_lens)
    kv_rows = torch.randint(0, 120, (t, pool.row_bytes), dtype=torch.uint8, device="cuda")
    records = pack_index_records(
        torch.randint(0, 120, (t, 128), dtype=torch.uint8, device="cuda"), torch.ones(t, device="cuda")
    )
    out = {"kv_format": kv_format, "chunk_tokens": t}
    for name, reuse in (("current_reuse", True), ("materialize", False)):
        mat = ReadPath(pool, group, current_reuse=reuse)

        def step():
            mat.begin_batch(table, seq_lens, [0] * N_REQ)
            return mat.layer_view(0, kv_rows, records)

        out[f"{name}_us"] = round(cuda_time_us(step, iters=iters), 1)
        counters = mat.begin_batch(table, seq_lens, [0] * N_REQ)
        mat.layer_view(0, kv_rows, records)
        out[f"{name}_bytes_materialized"] = counters.bytes_materialized
    out["reuse_speedup"] = round(out["materialize_us"] / out["current_reuse_us"], 2)
    return out


def _worst(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=["fp8", "bf16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--name", default=None, help="result name (default cp<N>_e2e)")
    ap.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl",
        help="gloo: a smoke run with every rank on one GPU (its timings compare nothing)",
    )
    ap.add_argument(
        "--no-chunk-sweep",
        action="store_true",
        help="skip timing pipelined chunk sizes (the sweep decided nothing new)",
    )
    args = ap.parse_args()
    n = args.world_size
    results = spawn_ranks(
        _rank_main,
        n,
        args.formats,
        args.contexts,
        args.layers,
        args.iters,
        args.backend,
        not args.no_chunk_sweep,
        backend=args.backend,
        timeout_s=540,
    )
    rows, reuse = results[0]
    for r, (other, _) in enumerate(results[1:], start=1):  # report the slowest rank per row
        for row, o in zip(rows, other):
            row[f"rank{r}_layer_view_us"] = o["layer_view_us"]
            row[f"rank{r}_layer_view_device_us"] = o["layer_view_device_us"]
    for row in rows:
        print(row)
    for row in reuse:
        print(row)
    name = args.name or f"cp{n}_e2e"
    big = [r for r in rows if r["context_tokens"] >= 131072]
    summary = {
        f"cp{n}_vs_raw_allgather": min(r["layer_view_vs_raw_all_gather"] for r in big) if big else None,
        f"cp{n}_vs_raw_allgather_by_context": {
            f"{r['kv_format']}@{r['context_tokens']}": r["layer_view_vs_raw_all_gather"] for r in rows
        },
        f"cp{n}_vs_raw_allgather_device": min(r["layer_view_vs_raw_all_gather_device"] for r in big) if big else None,
        f"cp{n}_vs_raw_allgather_device_by_context": {
            f"{r['kv_format']}@{r['context_tokens']}": r["layer_view_vs_raw_all_gather_device"] for r in rows
        },
        "pipeline_chunks_by_context": {f"{r['kv_format']}@{r['context_tokens']}": r["pipeline_chunks"] for r in rows},
        "best_chunk_tokens_by_context_device": {
            f"{r['kv_format']}@{r['context_tokens']}": min(
                r["chunk_sweep"], key=lambda k, r=r: r["chunk_sweep"][k]["layer_view_device_us"]
            )
            for r in rows
            if r["chunk_sweep"]
        },
        "prefetch_exposed_per_layer_us": {
            f"{r['kv_format']}@{r['context_tokens']}": r.get("prefetch_exposed_per_layer_us")
            for r in rows
            if "prefetch_exposed_per_layer_us" in r
        },
        # Goal (copy engines): <= 0.10 at every context; NCCL's beside it.
        "prefetch_exposed_fraction": _worst([r.get("prefetch_exposed_fraction_copy_engine") for r in rows]),
        "prefetch_exposed_fraction_nccl": _worst([r.get("prefetch_exposed_fraction") for r in rows]),
        f"cp{n}_vs_raw_allgather_copy_engine": min(r["layer_view_copy_engine_vs_raw_all_gather"] for r in big)
        if big
        else None,
        "goal": "layer view >= 0.9x the raw all-gather bus bandwidth",
    }
    write_result(name, rows, summary, extra={"world_size": n})
    if n == 2:
        write_result(
            "current_reuse",
            reuse,
            {
                "reuse_speedup": {r["kv_format"]: r["reuse_speedup"] for r in reuse},
                "current_reuse_bytes_materialized": {
                    r["kv_format"]: r["current_reuse_bytes_materialized"] for r in reuse
                },
            },
            extra={"world_size": n},
        )

    def draw(ax):
        for fmt, style in (("fp8", "-"), ("bf16", "--")):
            sel = [r for r in rows if r["kv_format"] == fmt]
            ax.plot(
                [r["context_tokens"] for r in sel],
                [r["layer_view_busbw_GBps"] for r in sel],
                style,
                marker="o",
                color="C0",
                label=f"plan view ({fmt})",
            )
            ax.plot(
                [r["context_tokens"] for r in sel],
                [r["raw_busbw_GBps"] for r in sel],
                style,
                marker="s",
                color="C2",
                label=f"raw all-gather ({fmt})",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch context tokens")
        ax.set_ylabel("bus bandwidth GB/s")
        ax.set_title(f"CP={n}: gather + all-gather vs raw all-gather")
        ax.legend(fontsize=7)

    save_plot(name, draw)


if __name__ == "__main__":
    main()
