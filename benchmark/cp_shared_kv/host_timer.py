"""Where a forward's host time goes: named functions timed inclusively with ``perf_counter``.

cProfile hooks every Python call and C builtin, which inflates a path made of many small calls several
fold and hides ctypes calls in their callers. This times only the functions it is given (a few dozen,
by name), each call's wall time from entry to return, so a function's figure includes its callees and
the tracer's own cost stays near one ``perf_counter`` pair per call. Beside the wall time it keeps the
calling thread's CPU time (``time.thread_time``): a call whose wall time far exceeds its CPU time waited
(descheduled, or blocked in a lock or the driver) rather than worked. Off unless ``active``.

    timer = HostTimer(["pkg.mod:Class.method", "pkg.mod:function", ...])
    timer.start("ours"); ...; timer.stop()
    print(timer.report("ours"))
"""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Sequence


class HostTimer:
    """Inclusive host time and call count per target, ``"module:attr"`` or ``"module:Class.attr"``.

    A module-level function another module imported by name is timed where it is called: name that
    module (``"pkg.caller:function"``). Targets that do not exist are listed in ``missing``.
    """

    def __init__(self, targets: Sequence[str]):
        self.active = False
        # Per label (a path): target -> [wall seconds, calls, thread CPU seconds], and the forwards timed.
        self.totals: dict[str, dict[str, list[float]]] = {}
        self.forwards: dict[str, int] = {}
        self._label = ""
        self.missing: list[str] = []
        for target in targets:
            if not self._install(target):
                self.missing.append(target)

    def _install(self, target: str) -> bool:
        module_name, _, path = target.partition(":")
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            return False
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
            if owner is None:
                return False
        raw = inspect.getattr_static(owner, name, None)
        if raw is None:
            return False
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        fn = raw.__func__ if kind is not None else raw
        if not callable(fn):
            return False

        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                acc = self.totals[self._label].setdefault(target, [0.0, 0, 0.0])
                acc[0] += t1 - t0
                acc[1] += 1
                acc[2] += c1 - c0

        timed.__wrapped__ = fn
        setattr(owner, name, kind(timed) if kind is not None else timed)
        return True

    def start(self, label: str) -> None:
        """Time the next forward under ``label``."""
        self._label = label
        self.totals.setdefault(label, {})
        self.forwards[label] = self.forwards.get(label, 0) + 1
        self.active = True

    def stop(self) -> None:
        self.active = False

    def report(self, label: str) -> str:
        """One line per target that ran under ``label``: calls and µs per forward, µs per call (inclusive),
        and the share of that wall time the thread spent on a CPU."""
        forwards = max(self.forwards.get(label, 0), 1)
        lines = [f"{'target':<78} {'calls/fwd':>9} {'us/fwd':>9} {'us/call':>8} {'cpu %':>6}"]
        ran = [(t, s, n, c) for t, (s, n, c) in self.totals.get(label, {}).items() if n]
        for target, seconds, calls, cpu in sorted(ran, key=lambda x: -x[1]):
            lines.append(
                f"{target:<78} {calls / forwards:9.1f} {seconds * 1e6 / forwards:9.1f} {seconds * 1e6 / calls:8.1f}"
                f" {100 * cpu / max(seconds, 1e-12):6.0f}"
            )
        if self.missing:
            lines.append("not found: " + ", ".join(self.missing))
        return "\n".join(lines) + "\n"
