"""Host cost of the calls the read path queues, each alone, side by side in one run.

The read path's host time is a sum of small calls: torch ops, Triton launches, CUDA driver calls
through ctypes (the copy-engine all-gather), stream and event calls. This times each one, back to
back on an idle GPU (the host never waits: every call only queues work), with CUDA's sync-debug
mode off ("default"), on ("warn") and on with every warning recorded ("warn_recorded", as the side-by-side
harness's sync counter keeps it in the forward it counts). Reported
per call in µs (median of repeats) and as a ratio to one small torch op.

``--peer`` times the same calls in the setting of the one-GPU side-by-side harness: two processes on
one GPU, the timed one (rank 0) beside a second (rank 1) that, while rank 0 times, is ``idle`` (blocked
in a gloo barrier), keeps the GPU busy with GEMMs polled by ``gpu`` events, or waits for them in
``sync`` (``torch.cuda.synchronize``, which spins a core). Rows carry the peer's activity; the run
records the CPUs this process may use and its cgroup's CPU limit.

    python -m benchmark.cp_shared_kv.bench_host_calls
    python -m benchmark.cp_shared_kv.bench_host_calls --peer idle gpu sync --out host_calls_peer

Among the calls: replays of CUDA graphs that hold some of them (``captured_graphs``), and the copy
engines' fence made call by call and as one captured graph.

``--spacing`` times each call made alone instead: after the device is drained, drained and the thread
asleep, after other work that evicts the caches, after waiting for queued GPU work in the driver or
in a busy loop, or while the device runs queued work (``spacing`` in each row; ``loop`` is back to back).

    python -m benchmark.cp_shared_kv.bench_host_calls --spacing loop drained idle churn --out host_calls_spacing
    python -m benchmark.cp_shared_kv.bench_host_calls --spacing loop waited polled --calls 300 --out host_calls_wait
    python -m benchmark.cp_shared_kv.bench_host_calls --spacing loop drained busy --calls 300 --out host_calls_busy
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from benchmark.cp_shared_kv.bench_common import wait_polled, write_result
from sglang_cp_shared_kv.srt.distributed.copy_engine import WAIT_GEQ, driver
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import prefetch_stream
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import (
    gather_page_buffers,
    prepare_gather,
    translate_locs,
)
from sglang_cp_shared_kv.srt.utils import current_stream_handle


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the host time of ``calls`` back-to-back calls, per call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


SPACINGS = ("loop", "drained", "idle", "churn", "waited", "polled", "busy")
# GPU cycles of the sleep kernel queued before a "waited", "polled" or "busy" call: about 2 ms on an H200.
_SLEEP_CYCLES = 4_000_000


def spaced_call_us(fn: Callable[[], object], calls: int, spacing: str, scratch: np.ndarray) -> float:
    """Median host µs of one call made alone, ``calls`` times: after the device is drained (``drained``,
    as the side-by-side harness's host pass makes each pool call), drained and the thread asleep 2 ms
    (``idle``), or after writing ``scratch`` (``churn``: other work evicting the caches, as a forward's
    other code does between two pool calls); or after waiting for 2 ms of queued GPU work, in
    ``torch.cuda.synchronize`` (``waited``: as the side-by-side harness's host pass drains by default) or in a
    busy loop on an event (``polled``: its ``--host-drain poll``); or after the device is drained and 2 ms of
    GPU work queued, the call made while that work runs (``busy``: as a server makes a batch's calls while its
    previous batch runs, the harness's ``--busy-passes``)."""
    times = []
    for _ in range(calls):
        if spacing in ("waited", "polled"):
            torch.cuda._sleep(_SLEEP_CYCLES)
            if spacing == "polled":
                wait_polled()
        torch.cuda.synchronize()
        if spacing == "busy":
            torch.cuda._sleep(_SLEEP_CYCLES)
        elif spacing == "idle":
            time.sleep(2e-3)
        elif spacing == "churn":
            scratch += 1
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def calls_under_test() -> dict[str, Callable[[], object]]:
    dev = torch.device("cuda")
    d = driver()
    small = torch.zeros(64, dtype=torch.int64, device=dev)
    word = torch.zeros(2, dtype=torch.int64, device=dev)
    latent = torch.zeros((64, 64 * 656), dtype=torch.uint8, device=dev)
    index = torch.zeros((64, 64 * 132), dtype=torch.uint8, device=dev)
    ids = torch.arange(32, device=dev)
    outs = [
        torch.empty((32, latent.shape[1]), dtype=torch.uint8, device=dev),
        torch.empty((32, index.shape[1]), dtype=torch.uint8, device=dev),
    ]
    _, prepared = prepare_gather([latent, index], ids, outs)
    event, side = torch.cuda.Event(), prefetch_stream(dev)
    host = np.arange(65, dtype=np.int64)
    # The read state's translate_locs on a 4-request page table of 8K tokens each (SGLang's int32 locs).
    page_pos = torch.arange(4 * 8192 // 64, dtype=torch.int32, device=dev)
    locs = torch.arange(4 * 8192, dtype=torch.int32, device=dev).view(4, 8192)

    def stream_handle() -> int:
        return current_stream_handle(dev)

    def write64() -> None:
        d.check(d.write64(stream_handle(), word.data_ptr(), 1, 0), "write")

    def copy8() -> None:
        d.check(d.copy(word.data_ptr() + 8, word.data_ptr(), 8, stream_handle()), "copy")

    def wait64() -> None:  # already satisfied: the GPU passes it at once
        d.check(d.wait64(stream_handle(), word.data_ptr(), 0, WAIT_GEQ), "wait")

    def switch_streams() -> None:
        main = torch.cuda.current_stream(dev)
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main)

    def fork() -> None:
        event.record(torch.cuda.current_stream(dev))
        side.wait_event(event)

    graphs = captured_graphs(prepared, d, word, stream_handle)
    return {
        **graphs,
        "torch_add_": lambda: small.add_(1),
        "torch_empty": lambda: torch.empty(64, dtype=torch.int64, device=dev),
        "index_select": lambda: small.index_select(0, ids),
        "current_stream": lambda: torch.cuda.current_stream(dev),
        "current_stream_handle": lambda: current_stream_handle(dev),
        "event_record_and_wait": fork,
        "set_stream_twice": switch_streams,
        "triton_gather_jit": lambda: gather_page_buffers([latent, index], ids, outs),
        "triton_gather_prepared": prepared,
        "translate_locs": lambda: translate_locs(page_pos, locs, 64),
        "driver_write64": write64,
        "driver_copy8": copy8,
        "driver_wait64": wait64,
        "pin_memory_copy": lambda: torch.from_numpy(host).pin_memory().to(dev, non_blocking=True),
    }


def captured_graphs(
    prepared, d, word: torch.Tensor, stream_handle: Callable[[], int]
) -> dict[str, Callable[[], object]]:
    """Replays of CUDA graphs holding calls above, each captured, replayed once and drained before it is
    kept (progress printed: a capture or replay that never returns is named by the last line): the
    gather launch alone (``graph_kernel``), with each of a batch start's stream calls (a 64-bit write, an
    8-byte copy, a satisfied 64-bit wait), and with all three (``graph_plan_fence``). A graph the driver
    refuses is left out, its error printed. Then the copy engines' fence path: the three stream calls one by
    one (``driver_fence_calls``) and captured by the driver, one ``cuGraphLaunch`` (``driver_graph_fence``).
    (An event record captured into a graph, replayed back to back,
    crashed this process on an H200 with torch 2.11: not timed.)"""

    def write() -> None:
        d.check(d.write64(stream_handle(), word.data_ptr(), 1, 0), "write")

    def copy() -> None:
        d.check(d.copy(word.data_ptr() + 8, word.data_ptr(), 8, stream_handle()), "copy")

    def wait() -> None:  # satisfied: word[1] >= 0 always
        d.check(d.wait64(stream_handle(), word.data_ptr() + 8, 0, WAIT_GEQ), "wait")

    bodies = {
        "graph_kernel": [prepared],
        "graph_kernel_write64": [prepared, write],
        "graph_kernel_copy8": [prepared, copy],
        "graph_kernel_wait64": [prepared, wait],
        "graph_plan_fence": [write, copy, wait, prepared],
    }
    out = {}
    for name, calls in bodies.items():
        graph = torch.cuda.CUDAGraph()
        print(f"{name}: capturing", flush=True)
        try:
            with torch.cuda.graph(graph):
                for call in calls:
                    call()
            print(f"{name}: replaying", flush=True)
            graph.replay()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the other calls still timed
            print(f"{name}: not captured: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        out[name] = graph.replay
    # The copy engines' fence path: the three stream calls captured through the driver, launched by ctypes.
    side = torch.cuda.Stream()

    def fence_calls(h: int) -> None:
        d.check(d.write64(h, word.data_ptr(), 1, 0), "write")
        d.check(d.copy(word.data_ptr() + 8, word.data_ptr(), 8, h), "copy")
        d.check(d.wait64(h, word.data_ptr() + 8, 0, WAIT_GEQ), "wait")

    exe = d.capture(side.cuda_stream, fence_calls)
    if exe:
        out["driver_graph_fence"] = lambda: d.check(d.graph_launch(exe, stream_handle()), "cuGraphLaunch")
        out["driver_fence_calls"] = lambda: fence_calls(stream_handle())
    return out


def time_calls(calls: dict[str, Callable[[], object]], n: int, repeats: int, modes: Sequence[str]) -> list[dict]:
    """One row per call and sync-debug mode: its host µs per call (``per_call_us``). Mode ``warn_recorded`` is
    ``warn`` with every warning recorded (``warnings.catch_warnings(record=True)``, action ``always``), as a
    sync counter keeps it; its rows name the warnings recorded meanwhile."""
    rows = []
    for mode in modes:
        with warnings.catch_warnings(record=mode == "warn_recorded") as log:
            if log is not None:
                warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if mode == "warn_recorded" else mode)
            try:
                for name, fn in calls.items():
                    seen = len(log) if log is not None else 0
                    row = {"call": name, "sync_debug": mode, "host_us": round(per_call_us(fn, n, repeats), 2)}
                    if log is not None:
                        row["warnings"] = len(log) - seen
                        row["warning_texts"] = sorted({str(w.message)[:160] for w in log[seen:]})
                    rows.append(row)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    return rows


def _keep_gpu_busy(done: Callable[[], bool], wait: str) -> int:
    """GEMMs on this process's stream until ``done()``, two in flight at most, each pair waited for by
    polling an event (``gpu``: the host mostly asleep) or by ``torch.cuda.synchronize`` (``sync``: a spin).
    Returns the GEMMs run."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ev, runs = torch.cuda.Event(), 0
    while not done():
        a @ a
        a @ a
        runs += 2
        if wait == "sync":
            torch.cuda.synchronize()
        else:
            ev.record()
            while not ev.query():
                time.sleep(2e-4)
    torch.cuda.synchronize()
    return runs


def _peer_rank(rank: int, world: int, args: dict) -> dict:
    """Rank 0 times the calls once per peer activity; rank 1 performs that activity meanwhile."""
    import torch.distributed as dist

    out: dict = {}
    torch.zeros(1, device="cuda")  # both processes hold a context on the GPU throughout
    calls = calls_under_test() if rank == 0 else None
    if calls is not None:
        for fn in calls.values():
            fn()
    for peer in args["peers"]:
        dist.barrier()
        if rank == 0:
            out[peer] = time_calls(calls, args["calls"], args["repeats"], ("default",))
            dist.barrier()  # rank 0 done: the peer's activity ends
        elif peer == "idle":
            dist.barrier()
        else:
            work = dist.barrier(async_op=True)
            out[peer] = _keep_gpu_busy(work.is_completed, peer)
            work.wait()
    return out


def cpu_limits() -> dict:
    """The CPUs this process may run on and its cgroup's CPU quota (``max`` when none)."""
    limits: dict = {"cpus_allowed": len(os.sched_getaffinity(0))}
    try:
        limits["cgroup_cpu_max"] = Path("/sys/fs/cgroup/cpu.max").read_text().strip()
    except OSError:
        limits["cgroup_cpu_max"] = None
    return limits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--peer",
        nargs="+",
        choices=("idle", "gpu", "sync"),
        help="time the calls in one of two processes on one GPU, beside each of these peer activities",
    )
    p.add_argument(
        "--spacing",
        nargs="+",
        choices=SPACINGS,
        help="time each call alone between these (loop: back to back, as without this option); sync-debug off",
    )
    p.add_argument("--watchdog-s", type=int, default=600, help="print every stack and exit after this long")
    p.add_argument("--out", default="host_calls", help="result name under docs/benchmarks/ (default: %(default)s)")
    a = p.parse_args()
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)  # a hung call: its stack, then exit
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_calls times CUDA calls: it needs a CUDA GPU, and none is visible here")
    if a.peer:
        from reference.spawn import spawn_ranks

        args = {"peers": a.peer, "calls": a.calls, "repeats": a.repeats}
        timed, peer = spawn_ranks(_peer_rank, 2, args, backend="gloo", timeout_s=600)
        rows = [dict(r, peer=name, peer_gemms=peer.get(name, 0)) for name in a.peer for r in timed[name]]
    elif a.spacing:
        calls = calls_under_test()
        for fn in calls.values():
            fn()
        scratch = np.zeros(8 << 20, dtype=np.uint8)  # 8 MiB: more than a core's L2
        rows = []
        for spacing in a.spacing:
            for name, fn in calls.items():
                us = (
                    per_call_us(fn, a.calls, a.repeats)
                    if spacing == "loop"
                    else spaced_call_us(fn, a.calls, spacing, scratch)
                )
                rows.append(
                    {"call": name, "sync_debug": "default", "peer": "none", "spacing": spacing, "host_us": round(us, 2)}
                )
                print(f"{spacing} {name}: {us:.2f} us", flush=True)
    else:
        calls = calls_under_test()
        for fn in calls.values():  # compile, allocate, warm
            fn()
        modes = ("default", "warn", "warn_recorded")
        rows = [dict(r, peer="none") for r in time_calls(calls, a.calls, a.repeats, modes)]

    def setting(r: dict) -> tuple:
        return r["peer"], r.get("spacing", "loop"), r["sync_debug"]

    base = {setting(r): r["host_us"] for r in rows if r["call"] == "torch_add_"}
    summary = {}
    for r in rows:
        r["vs_torch_op"] = round(r["host_us"] / base[setting(r)], 2)
        peer, spacing, mode = setting(r)
        print(
            f"{peer:>5} {spacing:>7} {mode:>4} {r['call']:<24} {r['host_us']:8.2f} µs  {r['vs_torch_op']:5.2f}x a torch op"
        )
        suffix = {"default": "", "warn": "_sync_debug", "warn_recorded": "_sync_debug_recorded"}[mode]
        suffix += ("" if peer == "none" else f"_peer_{peer}") + ("" if spacing == "loop" else f"_{spacing}")
        summary[f"{r['call']}_us{suffix}"] = r["host_us"]
    write_result(a.out, rows, summary, extra=cpu_limits())


if __name__ == "__main__":
    main()
