"""Spawn ``cp_size`` ranks on this host with a loopback rendezvous, and collect what each returns.

Used by the multi-rank tests and the demo (with ``wait_until``, their bounded polling). Every rank runs ``fn(cp_rank, cp_size,
*args)`` in its own process with ``torch.distributed`` initialized (gloo on CPU, NCCL when
``backend="nccl"``) and the caller's environment: forked from a forkserver that imported torch and SGLang
once where there is no CUDA device, spawned where there is. A rank that raises, dies or outlives the
deadline fails the whole run with a message naming the rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class RankFailure(RuntimeError):
    """One or more ranks raised, died, or timed out."""


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 0.005) -> None:
    """Poll ``cond`` every ``poll_s`` until it holds, or raise ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a CPU rank imports anyway, about 11 s of a 2-core machine per process: a forkserver imports it once.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "sglang.srt.server_args",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.model_executor.forward_batch_info",
]


def _context():
    """A forkserver with SGLang imported where no CUDA device is (a CUDA parent must not fork: spawn there)."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # a module that does not import is skipped
    return ctx


def _rank_main(fn, cp_rank, cp_size, port, backend, timeout_s, args, results, threads, env):
    os.environ.clear()  # the caller's environment now, not the forkserver's when it started
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(cp_rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=cp_rank,
            world_size=cp_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            out = fn(cp_rank, cp_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensor bytes; the queue's own pickler would pass shared-memory handles
        # that die with this process.
        results.put((cp_rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including assertion failures
        results.put((cp_rank, False, traceback.format_exc()))


def spawn_ranks(
    fn: Callable[..., Any],
    cp_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 180.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(cp_rank, cp_size, *args)`` on ``cp_size`` spawned ranks; return results by rank."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, cp_size, port, backend, timeout_s, args, results, threads_per_rank, dict(os.environ)),
            daemon=True,
        )
        for r in range(cp_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[bool, Any]] = {}
    failures: list[str] = []
    try:
        while len(got) < cp_size:
            try:
                rank, ok, out = results.get(timeout=0.5)
                got[rank] = (ok, out)
                if not ok:
                    failures.append(f"rank {rank} raised:\n{out}")
                    break
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                time.sleep(0.5)  # a result may still be in flight
                while True:
                    try:
                        rank, ok, out = results.get_nowait()
                    except queue.Empty:
                        break
                    got[rank] = (ok, out)
                    if not ok:
                        failures.append(f"rank {rank} raised:\n{out}")
                dead = [r for r in dead if r not in got]
                if dead or failures:
                    failures += [f"rank {r} died with exit code {procs[r].exitcode}" for r in dead]
                    break
            if time.monotonic() > deadline:
                missing = [r for r in range(cp_size) if r not in got]
                failures.append(f"ranks {missing} did not finish within {timeout_s:.0f} s")
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if not failures else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    if failures:
        raise RankFailure("\n".join(failures))
    return [pickle.loads(got[r][1]) for r in range(cp_size)]
