"""Can a host thread release a stream blocked in ``cuStreamWaitValue64``? One process, one GPU, no peer.

Each variant queues on a "main" stream a wait for a word to equal 1, checks that the stream is blocked, then
writes 1 by the variant's means and reports whether the stream passed within 2 s. A variant whose release
fails leaves its process's stream blocked, so each runs in its own process (``--variant``).

``python -m benchmark.cp_shared_kv.release_probe`` prints one line per variant.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

VARIANTS = {
    "legacy_main/side_write64": "main: the legacy default stream; release: cuStreamWriteValue64 on a torch side stream",
    "legacy_main/side_write64_thread": "the same, from another thread (as the watchdog)",
    "legacy_main/side_fill": "main: legacy; release: word.fill_(1) on a torch side stream",
    "legacy_main/fresh_stream_write64": "main: legacy; release: cuStreamWriteValue64 on a new non-blocking stream "
    "(cuStreamCreate)",
    "pool_main/side_write64": "main: a torch pool stream; release: cuStreamWriteValue64 on another pool stream",
    "legacy_graph/side_write64": "main: legacy, the wait inside a graph; release: cuStreamWriteValue64 on a side "
    "stream",
    "legacy_main/host_word": "main: legacy, the word in pinned host memory; release: a host store (no CUDA call)",
    "legacy_main/high_prio_write64": "main: legacy; release: cuStreamWriteValue64 on a high-priority torch stream",
    "graph_kernel/side_write64": "main: legacy, a graph of the wait then a kernel; release: cuStreamWriteValue64",
    "graph_kernel/side_clone_write64": "the same graph; release: a clone kernel on the side stream, then the write",
}


def run_variant(name: str) -> bool:
    import torch

    from sglang_cp_shared_kv.srt.distributed.copy_engine import WAIT_EQ, driver

    d = driver()
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    host = name.endswith("host_word")
    word = torch.zeros(1, dtype=torch.int64, pin_memory=True) if host else torch.zeros(1, dtype=torch.int64, device=dev)
    side = torch.cuda.Stream(dev, priority=-1 if "high_prio" in name else 0)
    main = torch.cuda.Stream(dev) if name.startswith("pool_main") else torch.cuda.default_stream(dev)
    torch.cuda.synchronize()
    if name.startswith(("legacy_graph", "graph_kernel")):
        cap, x = torch.cuda.Stream(dev), torch.zeros(1024, device=dev)

        def body(h: int) -> None:
            d.wait64(h, word.data_ptr(), 1, WAIT_EQ)
            if name.startswith("graph_kernel"):
                with torch.cuda.stream(cap):
                    x.add_(1)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=cap, capture_error_mode="relaxed"):
            body(cap.cuda_stream)
        with torch.cuda.stream(main):
            graph.replay()
    else:
        d.wait64(main.cuda_stream, word.data_ptr(), 1, WAIT_EQ)
    event = torch.cuda.Event()
    event.record(main)
    time.sleep(0.3)
    blocked = not event.query()

    def release() -> None:
        if host:
            word.numpy()[0] = 1
        elif name.endswith("side_fill"):
            with torch.cuda.stream(side):
                word.fill_(1)
        elif name.endswith("side_clone_write64"):
            with torch.cuda.device(dev), torch.cuda.stream(side):
                word.clone()
                d.write64(side.cuda_stream, word.data_ptr(), 1)
        elif name.endswith("fresh_stream_write64"):
            _, s = d.cu.cuStreamCreate(d.cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
            d.write64(s, word.data_ptr(), 1)
        else:
            with torch.cuda.device(dev):
                d.write64(side.cuda_stream, word.data_ptr(), 1)

    if name.endswith("_thread"):
        t = threading.Thread(target=release)
        t.start()
        t.join()
    else:
        release()
    end = time.monotonic() + 2
    while not event.query() and time.monotonic() < end:
        time.sleep(0.01)
    passed = event.query()
    print(f"{name}: blocked before the release {blocked}, passed after it {passed}", flush=True)
    return passed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant")
    ap.add_argument("--only", help="comma-separated name prefixes of the variants to run")
    args = ap.parse_args(argv)
    if args.variant:
        run_variant(args.variant)
        sys.stdout.flush()
        import os

        os._exit(0)  # a blocked stream would hang the interpreter's exit
    ap_names = [n for n in VARIANTS if not args.only or n.startswith(tuple(args.only.split(",")))]
    for name in ap_names:
        what = VARIANTS[name]
        print(f"# {name}: {what}", flush=True)
        try:
            out = subprocess.run(
                [sys.executable, "-m", "benchmark.cp_shared_kv.release_probe", "--variant", name],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            print((out.stdout + out.stderr[-1500:]).strip(), flush=True)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
