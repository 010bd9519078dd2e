"""Slot-remap plan vs a compact unique-page remap, end to end (plan + one layer's gather).

The slot plan (ours) gives every page position its own slot: static shapes, no host sync, but a
prefix page shared by several requests is gathered once per request. The compact remap
deduplicates pages with ``torch.unique`` (+ inverse) and sizes owner blocks with ``bincount``:
fewer bytes, but dynamic shapes and host syncs. Each row times, from the host, plan + gather of
this rank's send block (fp8 latent + indexer pages, page size 64) on one GPU, and reports the
pages each approach gathers (the slot plan's buffer-size cost). The plan alone is timed too, through
its Triton kernels (one program up to 8192 page positions, blocks above) and through its torch
formulation, and at 8K tokens inside a CUDA graph.

    python -m benchmark.cp_shared_kv.bench_plan
    python -m benchmark.cp_shared_kv.bench_plan --meta-placement   # the plan's lengths: device vs pinned
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmark.cp_shared_kv.bench_common import cuda_time_us, save_plot, write_result
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_page_buffers
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import PLAN_META_ROWS, plan_batch
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import (
    DeviceFlagCheck,
    build_slot_plan,
    plan_meta,
    slots_per_rank,
)
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES, MLA_FP8_ROW_BYTES

PS = 64
CP = 8  # plan for a CP=8 group; this GPU plays rank 0
BUSY_CYCLES = 4_000_000  # ~2 ms of queued GPU work (the previous layer), ahead of the plan


def unique_plan(page_table: torch.Tensor, pages_per_req: list[int], cp_size: int, rank: int, trash_page: int):
    """The rejected alternative: dedupe pages, then group them by owner (syncs three times)."""
    b, max_pages = page_table.shape
    cols = torch.arange(max_pages, device=page_table.device).expand(b, max_pages)
    lens = torch.tensor(pages_per_req, device=page_table.device).unsqueeze(1)
    valid = cols < lens
    flat = page_table[valid].long()  # boolean-mask indexing: sync
    uniq, inv = torch.unique(flat, return_inverse=True)  # dynamic size: sync
    owner = uniq % cp_size
    counts = torch.bincount(owner, minlength=cp_size)
    s = int(counts.max())  # sync
    order = torch.argsort(owner, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_owner = torch.empty_like(order)
    rank_in_owner[order] = torch.arange(len(order), device=order.device) - starts[owner[order]]
    slot_of_pos = (owner * s + rank_in_owner)[inv]
    table = torch.zeros(b, max_pages, dtype=torch.int32, device=page_table.device)
    table[valid] = slot_of_pos.to(torch.int32)
    send = torch.full((s,), trash_page, dtype=torch.int64, device=page_table.device)
    mine = uniq[owner == rank] // cp_size  # boolean mask: sync
    send[: len(mine)] = mine
    return table, send, s


def _workload(n_req: int, total_pages: int, shared_frac: float, phys_pages: int, device: str):
    """``n_req`` requests of equal length sharing their first ``shared_frac`` of pages (a common prompt).

    Each request's pages cycle through owners, as SGLang's page-interleave allocator hands them out
    (each owner's physical pages from 1 up: page 0 is the trash page).
    """
    per_req = max(1, total_pages // n_req)
    shared = int(per_req * shared_frac) if n_req > 1 else 0
    next_phys = [1] * CP

    def alloc(n: int, first_owner: int) -> torch.Tensor:
        owners = [(first_owner + i) % CP for i in range(n)]
        pages = []
        for o in owners:
            pages.append(next_phys[o] * CP + o)
            next_phys[o] += 1
        assert max(next_phys) <= phys_pages, "pool too small"
        return torch.tensor(pages, dtype=torch.int64)

    common = alloc(shared, 0)
    table = torch.zeros(n_req, per_req, dtype=torch.int32)
    for i in range(n_req):
        own = alloc(per_req - shared, shared % CP)
        table[i] = torch.cat([common, own]).to(torch.int32)
    return table.to(device), [per_req] * n_req, n_req * per_req - (n_req - 1) * shared


def _host_time_us(fn, iters: int, until_done: bool = True) -> float:
    """Median host microseconds of ``fn``: until its GPU work is done, or (``until_done=False``) to issue it."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if until_done:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def _busy_wall_us(fn, iters: int, busy_cycles: int) -> float:
    """Wall time of ``fn`` enqueued behind ``busy_cycles`` of GPU work, as inside a forward pass.

    A plan that never waits for the GPU is enqueued while the queued work runs; one that syncs
    waits for it first, then does its host work: the difference is what a forward pass exposes.
    """
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(busy_cycles)
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]


def run(
    requests: list[int], pages_list: list[int], shared_frac: float, iters: int, max_gather_pages: int
) -> list[dict]:
    rows = []
    for total_pages in pages_list:
        phys = total_pages // CP + 64 * CP
        latent = torch.zeros(phys + 1, PS * MLA_FP8_ROW_BYTES, dtype=torch.uint8, device="cuda")
        index = torch.zeros(phys + 1, PS * INDEX_TOKEN_BYTES, dtype=torch.uint8, device="cuda")
        for n_req in requests:
            if n_req > total_pages:
                continue
            table, pages, unique_pages = _workload(n_req, total_pages, shared_frac, phys, "cuda")
            gather = total_pages <= max_gather_pages

            def ours():
                plan = build_slot_plan(table, pages, CP, PS, phys)
                if gather:
                    gather_page_buffers([latent, index], plan.send_pages(0))
                return plan

            def compact():
                _, send, _ = unique_plan(table, pages, CP, 0, phys)
                if gather:
                    gather_page_buffers([latent, index], send)

            def plan_only(use_triton=None):
                return build_slot_plan(table, pages, CP, PS, phys, use_triton=use_triton)

            plan = ours()
            _, _, s_unique = unique_plan(table, pages, CP, 0, phys)
            t_ours, t_unique = _host_time_us(ours, iters), _host_time_us(compact, iters)
            t_plan = _host_time_us(plan_only, iters)
            t_plan_torch = _host_time_us(lambda: plan_only(use_triton=False), iters)  # noqa: B023
            t_plan_launch = _host_time_us(plan_only, iters, until_done=False)
            busy_us = _busy_wall_us(lambda: None, iters, BUSY_CYCLES)
            b_ours = _busy_wall_us(ours, iters, BUSY_CYCLES) - busy_us
            b_unique = _busy_wall_us(compact, iters, BUSY_CYCLES) - busy_us
            row = {
                "requests": n_req,
                "pages": sum(pages),
                "unique_pages": unique_pages,
                "shared_prefix_frac": shared_frac if n_req > 1 else 0.0,
                "includes_gather": gather,
                "plan_kernel": "plan_batch",
                "slot_plan_only_us": round(t_plan, 1),
                "slot_plan_only_torch_us": round(t_plan_torch, 1),
                "slot_plan_launch_us": round(t_plan_launch, 1),
                "slot_plan_us": round(t_ours, 1),
                "unique_plan_us": round(t_unique, 1),
                "speedup": round(t_unique / t_ours, 2),
                "queued_gpu_work_us": round(busy_us, 1),
                "slot_plan_exposed_us": round(b_ours, 1),
                "unique_plan_exposed_us": round(b_unique, 1),
                "speedup_behind_queued_work": round(b_unique / max(b_ours, 1.0), 2),
                "slot_view_pages": plan.view_pages,
                "unique_view_pages": CP * s_unique,
                "view_size_cost": round(plan.view_pages / (CP * s_unique), 3),
            }
            print(row)
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


def graph_plan_gather_us(tokens: int, n_req: int) -> dict:
    """Device time of plan + gather for one batch of ``tokens`` tokens, captured in a CUDA graph
    (what a graph-captured forward pays; the plan's host lengths are copied before capture)."""
    total_pages = tokens // PS
    phys = total_pages // CP + 64 * CP
    latent = torch.zeros(phys + 1, PS * MLA_FP8_ROW_BYTES, dtype=torch.uint8, device="cuda")
    index = torch.zeros(phys + 1, PS * INDEX_TOKEN_BYTES, dtype=torch.uint8, device="cuda")
    table, pages, _ = _workload(n_req, total_pages, 0.0, phys, "cuda")
    meta = plan_meta(pages, table.device)
    plan = build_slot_plan(table, pages, CP, PS, phys, meta=meta)
    outs = [torch.empty(plan.slots_per_rank, b.shape[1], dtype=torch.uint8, device="cuda") for b in (latent, index)]

    def step():
        p = build_slot_plan(table, pages, CP, PS, phys, meta=meta)
        gather_page_buffers([latent, index], p.send_pages(0), outs)

    def plan_step():
        build_slot_plan(table, pages, CP, PS, phys, meta=meta)

    def eager_plan():  # the host lengths copied too, as an eager forward does
        build_slot_plan(table, pages, CP, PS, phys)

    return {
        "tokens": tokens,
        "requests": n_req,
        "cp_size": CP,
        "graph_plan_gather_us": round(cuda_time_us(step, iters=50, graph=True), 2),
        "graph_plan_us": round(cuda_time_us(plan_step, iters=50, graph=True), 2),
        "eager_plan_gather_us": round(cuda_time_us(step, iters=50), 2),
        "eager_plan_launch_us": round(_host_time_us(eager_plan, 50, until_done=False), 2),
    }


def meta_placement_rows(requests: tuple[int, ...] = (1, 4, 16, 64), total_pages: int = 8192) -> list[dict]:
    """The read path's plan launch (``plan_batch``) with its host lengths in device memory against read in
    place from pinned host memory (``plan_meta(..., out=...)``): the launch's device time (replayed in a CUDA
    graph: the kernel alone) and the host time to issue lengths + launch."""
    rows = []
    for n_req in requests:
        phys = total_pages // CP + 64 * CP
        table, pages, _ = _workload(n_req, total_pages, 0.5, phys, "cuda")
        rows_idx = torch.arange(n_req, device="cuda")
        s, m = slots_per_rank(pages, CP), len(PLAN_META_ROWS) * n_req
        flags = DeviceFlagCheck()
        pinned = flags.host_buffer(m + CP + 1 + n_req, table.device)
        device_meta = plan_meta(pages, table.device)

        def launch(meta, out=None):
            plan_batch(table, rows_idx, 1, meta, table.shape[1], sum(pages), CP, s, 0, None, 0, 0, flags=out)

        in_place = plan_meta(pages, table.device, out=pinned[:m])
        row = {"requests": n_req, "pages": sum(pages), "cp_size": CP}
        row["device_meta_kernel_us"] = round(cuda_time_us(lambda: launch(device_meta), iters=50, graph=True), 2)
        row["pinned_meta_kernel_us"] = round(
            cuda_time_us(lambda: launch(in_place, pinned[m:]), iters=50, graph=True), 2
        )
        row["copied_meta_issue_us"] = round(_host_time_us(lambda: launch(plan_meta(pages, table.device)), 50, False), 2)
        row["pinned_meta_issue_us"] = round(
            _host_time_us(lambda: launch(plan_meta(pages, table.device, out=pinned[:m]), pinned[m:]), 50, False), 2
        )
        print(row)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--meta-placement",
        action="store_true",
        help="only the plan launch with its lengths on the device vs read in place from pinned memory",
    )
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--pages", type=int, nargs="+", default=[1024, 16384, 131072, 1048576])
    ap.add_argument("--shared-frac", type=float, default=0.5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-gather-pages", type=int, default=131072, help="above this, time the plan alone")
    args = ap.parse_args()
    if args.meta_placement:
        rows = meta_placement_rows()
        summary = {
            "pinned_vs_device_meta_kernel_us_max": max(
                r["pinned_meta_kernel_us"] - r["device_meta_kernel_us"] for r in rows
            ),
            "pinned_vs_copied_meta_issue_us_median": sorted(
                r["pinned_meta_issue_us"] - r["copied_meta_issue_us"] for r in rows
            )[len(rows) // 2],
        }
        write_result("plan_meta_placement", rows, summary, extra={"cp_size": CP})
        return
    rows = run(args.requests, args.pages, args.shared_frac, args.iters, args.max_gather_pages)
    graph_rows = [graph_plan_gather_us(8192, n) for n in (1, 4, 16)]
    for r in graph_rows:
        print(r)
    with_gather = [r for r in rows if r["includes_gather"]]
    summary = {
        "plan_speedup_vs_unique": round(min(r["speedup_behind_queued_work"] for r in with_gather), 2)
        if with_gather
        else None,
        "plan_speedup_vs_unique_idle_gpu_min": round(min(r["speedup"] for r in with_gather), 2)
        if with_gather
        else None,
        "plan_speedup_vs_unique_median": sorted(r["speedup"] for r in rows)[len(rows) // 2],
        "view_size_cost_max": max(r["view_size_cost"] for r in rows),
        "plan_plus_gather_8k_graph_us": max(r["graph_plan_gather_us"] for r in graph_rows),
        "plan_8k_graph_us": max(r["graph_plan_us"] for r in graph_rows),
        "plan_8k_eager_launch_us": max(r["eager_plan_launch_us"] for r in graph_rows),
        "slot_plan_only_us_at_max_pages": max(
            r["slot_plan_only_us"] for r in rows if r["pages"] == max(x["pages"] for x in rows)
        ),
        "unique_plan_us_at_max_pages": max(
            r["unique_plan_us"] for r in rows if r["pages"] == max(x["pages"] for x in rows)
        ),
        "goal": ">= 4x faster end to end (plan + gather); at 8K tokens plan + gather <= 12 us",
    }
    write_result("plan", rows, summary, extra={"cp_size": CP, "page_size": PS, "graph_rows": graph_rows})

    def draw(ax):
        for n_req in sorted({r["requests"] for r in rows}):
            sel = [r for r in rows if r["requests"] == n_req]
            ax.plot([r["pages"] for r in sel], [r["speedup"] for r in sel], marker="o", label=f"{n_req} requests")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page positions in the batch")
        ax.set_ylabel("unique-remap time / slot-plan time")
        ax.set_title("slot plan vs compact unique remap (plan + gather)")
        ax.legend(fontsize=7)

    save_plot("plan", draw)


if __name__ == "__main__":
    main()
