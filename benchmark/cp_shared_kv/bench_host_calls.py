"""Host time of a call made back to back: the calibration the side-by-side harness records.

``bench_vs_upstream`` times two small calls this way just before each host pass (``calibration_*`` in its
JSON), so a run's host figures can be read against this process's host speed at that moment.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


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
