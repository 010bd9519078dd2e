"""Pacing a pull from peer pools that lie on this GPU to the speed of a link they would cross.

On one GPU a "peer" pool is local HBM: copying its pages costs a fraction of what the same bytes
cost over NVLink (370 GB/s one-way per H200) or PCIe / a cross-node hop (50 GB/s). The rank model
(``rank_model.py``) makes the pull cost what it would cost on the link:

- **Copy-engine path** (the product's prefetch transport: each peer's block of the view pulled by
  ``cuMemcpyDtoDAsync``): the peers' blocks are copied for real (same bytes, same destination, on the
  same stream the product uses), cut into pieces; after each piece the stream waits on the GPU until
  the piece's link time has passed (``piece_bytes / link`` less what the local copy of the piece took at
  its measured speed). The wait is a one-thread kernel that spins on the GPU's global nanosecond timer
  (``%globaltimer``; if that kernel cannot be built, ``torch.cuda._sleep`` with its cycles calibrated):
  it holds one warp of one SM, where the real transfer holds none. A fixed ``latency`` (the ready/ack
  signal round trip of the product's copy-engine all-gather) is waited once per pull before the first
  piece.
- **SM path** (the product's in-line read: one ``pull_pages`` launch reading every owner's pages where
  they lie): the product's kernel runs for real over the pools on this GPU, then the stream waits until
  the pull's link time (``remote_bytes / link``) has passed since the kernel started (the kernel's own
  measured time on local pools is subtracted from the wait). On a real node the kernel's SMs wait on
  NVLink for that time; here one spinning warp stands for them, so the SMs the real kernel would hold
  while waiting are free here: in line nothing else runs on the stream meanwhile, so the layer's time
  is the same.

What the pacing cannot show: NVLink's own latency per request and its sharing with other traffic
(each rank's link also serves its peers' reads of its pages; the model's local copy puts those reads on
this GPU's HBM instead, the same bytes per GPU), and a late peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None

DEFAULT_LINK_GBPS = 370.0  # NVLink 4 copy, one-way per H200 (the figure the issue names)
SLOW_LINK_GBPS = 50.0  # PCIe or a cross-node hop
# A fixed wait per copy-engine pull (the signal round trip). 0 by default: the model's own fixed costs (the
# graph launch, the own gather, each piece's copy and wait nodes, about 2 us a piece on H200) stand for it.
DEFAULT_LATENCY_US = 0.0
MIN_PIECE_BYTES = 1 << 20
MAX_PIECES = 8


def link_time_us(nbytes: int, link_gbps: float, latency_us: float = 0.0) -> float:
    """The modeled time of ``nbytes`` over a link of ``link_gbps`` GB/s (10^9 B/s), plus ``latency_us``."""
    if link_gbps <= 0:
        raise ValueError(f"link speed must be > 0 GB/s, got {link_gbps}")
    return latency_us + nbytes / (link_gbps * 1e3)


def piece_size(total_bytes: int, min_piece: int = MIN_PIECE_BYTES, max_pieces: int = MAX_PIECES) -> int:
    """The piece a pull of ``total_bytes`` is cut into: about ``total / max_pieces``, at least ``min_piece``,
    so a long pull is paced evenly without thousands of launches."""
    return max(min_piece, -(-max(total_bytes, 1) // max_pieces))


def pieces(nbytes: int, size: int) -> list[tuple[int, int]]:
    """``[(start, end))`` byte ranges of at most ``size`` covering ``nbytes``."""
    return [(s, min(s + size, nbytes)) for s in range(0, max(nbytes, 0), size)]


def pad_us(piece_bytes: int, link_gbps: float, local_gbps: float) -> float:
    """The wait after a piece copied locally at ``local_gbps`` so that it costs ``piece_bytes / link``."""
    return max(0.0, piece_bytes / (link_gbps * 1e3) - piece_bytes / (local_gbps * 1e3))


if triton is not None:

    @triton.jit
    def _now_ns(dummy):
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit(do_not_specialize=["ns"])
    def _spin_kernel(ns):
        dummy = tl.program_id(0)
        t0 = _now_ns(dummy)
        t = t0
        while t - t0 < ns:
            t = _now_ns(dummy)


class Spinner:
    """A wait of a given number of µs on the current CUDA stream, measured by the GPU's clock.

    ``method`` is ``"globaltimer"`` (a Triton kernel spinning on ``%globaltimer``) or ``"sleep_cycles"``
    (``torch.cuda._sleep`` with cycles per µs calibrated here); on CPU ``"none"`` (no wait: the CPU
    model has no link to pace, only the arithmetic)."""

    def __init__(self, device: torch.device, prefer: str = "globaltimer"):
        self.device = device
        self.method = "none"
        self.cycles_per_us = None
        if device.type != "cuda":
            return
        if prefer == "globaltimer" and triton is not None:
            try:
                for ns in (1000, 1024, 1):  # every specialization built before any graph capture
                    _spin_kernel[(1,)](ns, num_warps=1)
                torch.cuda.synchronize(device)
                self.method = "globaltimer"
            except Exception as e:  # noqa: BLE001 - fall back to the cycle sleep, and say so
                self.error = f"{type(e).__name__}: {e}"[:300]
        if self.method == "none":
            self._calibrate_cycles()
            self.method = "sleep_cycles"

    def _calibrate_cycles(self) -> None:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize(self.device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        torch.cuda.synchronize(self.device)
        self.cycles_per_us = cycles / (e0.elapsed_time(e1) * 1e3)

    def wait_us(self, us: float) -> None:
        if us <= 0 or self.method == "none":
            return
        if self.method == "globaltimer":
            _spin_kernel[(1,)](int(us * 1e3), num_warps=1)
        else:
            torch.cuda._sleep(int(us * self.cycles_per_us))

    def describe(self) -> dict:
        out = {"method": self.method}
        if self.cycles_per_us:
            out["cycles_per_us"] = round(self.cycles_per_us, 1)
        if getattr(self, "error", None):
            out["globaltimer_error"] = self.error
        return out


def measure_local_copy_gbps(device: torch.device, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """One-way bytes per second (GB/s) of a device-to-device copy on this GPU (the local copy a paced
    piece makes); on CPU a host ``memcpy``'s speed (unused by the CPU model's pacing)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            dst.copy_(src)
        e1.record()
        torch.cuda.synchronize(device)
        sec = e0.elapsed_time(e1) / 1e3 / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sec = (time.perf_counter() - t0) / reps
    return nbytes / sec / 1e9


@dataclass
class PacedLink:
    """The link a rank's pull crosses: its speed, the copy-engine pull's fixed latency, the local copy
    speed the pads subtract, and the spinner that waits."""

    link_gbps: float
    latency_us: float
    local_gbps: float
    spinner: Spinner
    max_pieces: int = MAX_PIECES

    def copy_pull(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy-engine pull: ``dst.copy_(src)`` for each ``(src, dst)`` (contiguous uint8, one peer's block
        of a view buffer), cut into pieces, each padded to its link time, after one ``latency_us`` wait.
        Queued on the current stream; returns the bytes pulled."""
        total = 0
        size = piece_size(sum(src.numel() for src, _ in pairs), max_pieces=self.max_pieces)
        self.spinner.wait_us(self.latency_us)
        for src, dst in pairs:
            s, d = src.view(-1), dst.view(-1)
            for a, b in pieces(s.numel(), size):
                d[a:b].copy_(s[a:b])
                self.spinner.wait_us(pad_us(b - a, self.link_gbps, self.local_gbps))
            total += s.numel()
        return total

    def sm_pad_us(self, remote_bytes: int, kernel_local_us: float) -> float:
        """The wait after the SM pull kernel (``kernel_local_us`` on local pools) so that it costs the
        link time of ``remote_bytes``."""
        return max(0.0, link_time_us(remote_bytes, self.link_gbps) - kernel_local_us)

    def describe(self) -> dict:
        return {
            "link_gbps": self.link_gbps,
            "copy_engine_latency_us": self.latency_us,
            "local_copy_gbps_measured": round(self.local_gbps, 1),
            "spinner": self.spinner.describe(),
            "pieces": f"a pull cut into about {self.max_pieces} pieces, each at least {MIN_PIECE_BYTES} B, each padded",
        }
