"""What a device-side wait between two processes on one GPU costs (the one-GPU proxy's artifact?).

The side-by-side harness runs both CP ranks' processes on one GPU. The stock pool never makes one
rank's stream wait for the other's; ours does at every layer of a history batch (the copy engines'
``ready`` wait before the pull of the peer's view part). Two processes share a GPU by time slices,
so a stream that waits for the other process may wait for the other context's slice to come round,
not for the bytes. Real prefill CP keeps each rank on its own GPU, and its layers synchronize the
ranks anyway (SGLang's CP all-gathers per layer, on both pools).

Each of 2 ranks (processes on one GPU, gloo for set-up) runs a layer-like step (bf16 GEMMs of
about ``--layer-ms``) per iteration, then per mode:

- ``none``: nothing more;
- ``exchange``: a ``CopyEngineGroup`` all-gather of ``--part-mb`` per rank on the compute stream
  (ready wait, pull, ack wait: a device-side wait for the other process each way);
- ``exchange_side``: the same on a side stream, joined at the next iteration's start (our prefetch);
- ``copy_local``: a device copy of the same bytes, no wait for the other process.

Timed with CUDA events and the wall clock over ``--iters`` iterations after warm-up; per mode the
median iteration time and its excess over ``none``.

    python -m benchmark.cp_shared_kv.probe_shared_gpu_wait --out shared_gpu_wait
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MODES = ("none", "exchange", "exchange_side", "copy_local")


def _rank(rank: int, world: int, args: dict) -> dict:
    from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    group = CPGroup()
    part = int(args["part_mb"] * 2**20)
    arena = torch.zeros(world * part, dtype=torch.uint8, device=device)
    mine = arena[rank * part : (rank + 1) * part]
    scratch = torch.empty_like(mine)
    ce = CopyEngineGroup(group, [arena])
    side = torch.cuda.Stream(device)
    joined = torch.cuda.Event()
    n = 4096
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    # GEMMs per layer step: calibrated on this rank, then agreed on (the larger count) by both.
    for _ in range(5):  # cuBLAS's first calls pick and load kernels
        a @ b
    torch.cuda.synchronize()
    group.barrier()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 20
    gemms = max(1, round(args["layer_ms"] * 1e-3 / per / world))  # two processes share the GPU
    gemms = max(group.all_gather_object(gemms))
    out: dict = {"gemms_per_step": gemms, "gemm_ms_alone": round(per * 1e3, 3)}

    def step(mode: str) -> None:
        main = torch.cuda.current_stream(device)
        for _ in range(gemms):
            a @ b
        if mode == "exchange":
            ce.all_gather_into_many([arena], [mine])
        elif mode == "exchange_side":
            joined.record(main)
            joined.wait(side)
            ce.all_gather_into_many([arena], [mine], stream=side)
            joined.record(side)
            joined.wait(main)  # the next step's kernels follow the transfer, as a prefetched view's reader does
        elif mode == "copy_local":
            scratch.copy_(mine)

    for mode in MODES:
        for _ in range(args["warmup"]):
            step(mode)
        torch.cuda.synchronize()
        group.barrier()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args["iters"] + 1)]
        t0 = time.perf_counter()
        events[0].record()
        for i in range(args["iters"]):
            step(mode)
            events[i + 1].record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        its = [events[i].elapsed_time(events[i + 1]) for i in range(args["iters"])]
        out[mode] = {
            "median_ms": round(statistics.median(its), 3),
            "min_ms": round(min(its), 3),
            "max_ms": round(max(its), 3),
            "wall_ms_per_iter": round(wall * 1e3 / args["iters"], 3),
        }
        group.barrier()
    for mode in MODES[1:]:
        out[mode]["excess_ms_vs_none"] = round(out[mode]["median_ms"] - out["none"]["median_ms"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    from benchmark.cp_shared_kv.bench_common import write_result
    from reference.spawn import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer-ms", type=float, nargs="+", default=[5.0, 20.0, 60.0])
    ap.add_argument("--part-mb", type=float, default=12.0, help="bytes each rank contributes (a 32K view's half)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="shared_gpu_wait")
    a = ap.parse_args(argv)
    rows = []
    for layer_ms in a.layer_ms:
        args = dict(layer_ms=layer_ms, part_mb=a.part_mb, iters=a.iters, warmup=a.warmup)
        per_rank = spawn_ranks(_rank, 2, args, backend="gloo", timeout_s=240)
        for rank, r in enumerate(per_rank):
            row = {"layer_ms_target": layer_ms, "rank": rank, "part_mb": a.part_mb, **r}
            rows.append(row)
            print(row, flush=True)
    summary = {
        f"excess_ms_{mode}_at_{row['layer_ms_target']:g}ms": row[mode]["excess_ms_vs_none"]
        for row in rows
        if row["rank"] == 0
        for mode in MODES[1:]
    }
    write_result(a.out, rows, summary)


if __name__ == "__main__":
    main()
