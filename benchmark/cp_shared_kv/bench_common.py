"""Shared plumbing of the benchmarks: timing, environment record, JSON output, plots."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(os.environ.get("CP_SHARED_KV_RESULTS", Path(__file__).resolve().parents[2] / "docs" / "benchmarks"))


def git_commit() -> str | None:
    """The commit the run measured: ``$CP_SHARED_KV_COMMIT`` where the checkout has no git (a copied tree),
    else ``git rev-parse HEAD``; None when neither answers."""
    if os.environ.get("CP_SHARED_KV_COMMIT"):
        return os.environ["CP_SHARED_KV_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    return env


def command_line() -> str:
    """The command that ran, with the plugin's settings from the environment in front (``NAME=value``)."""
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_CP_SHARED_KV_")]
    argv = [Path(sys.executable).name, "-m", _module_name(), *sys.argv[1:]]
    return " ".join(shlex.quote(a) for a in [*settings, *argv])


def _module_name() -> str:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


def write_result(name: str, rows: list[dict], summary: dict, extra: dict | None = None) -> Path:
    """Write ``docs/benchmarks/<name>.json`` (or under ``$CP_SHARED_KV_RESULTS``)."""
    out_dir = RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "command": command_line(), "environment": environment(), "summary": summary, "rows": rows}
    if extra:
        doc.update(extra)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")
    return path


def flush_l2(buf: list[torch.Tensor] = []) -> None:  # noqa: B006 - one scratch buffer per process
    """Overwrite a buffer larger than L2 so the next kernel reads from HBM."""
    if not buf:
        buf.append(torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda"))
    buf[0].zero_()


def wait_polled() -> None:
    """Wait for the current stream's queued work in a busy loop on an event (the thread keeps running,
    never blocked in the driver)."""
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        pass


def cuda_time_us(
    fn: Callable[[], Any], iters: int = 50, warmup: int = 5, graph: bool = False, cold: bool = False
) -> float:
    """Median microseconds per call of ``fn`` on the current CUDA stream.

    With ``graph=True`` the call is captured once into a CUDA graph and replayed, which removes
    launch overhead: what a CUDA-graph-captured forward pass would pay. With ``cold=True`` L2 is
    flushed before every call (bandwidth numbers).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        run = g.replay
    else:
        run = fn
    times = []
    for _ in range(iters):
        if cold:
            flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def cuda_time_cold_us(fn: Callable[[], Any], iters: int = 30, warmup: int = 3) -> float:
    """``cuda_time_us`` with L2 flushed before every call."""
    return cuda_time_us(fn, iters=iters, warmup=warmup, cold=True)


def save_plot(name: str, draw: Callable[[Any], None]) -> Path | None:
    """Draw with matplotlib (Agg) into ``docs/benchmarks/<name>.png``; skip quietly without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    draw(ax)
    fig.tight_layout()
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path
