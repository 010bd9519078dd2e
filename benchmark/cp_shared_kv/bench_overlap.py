"""Overlap proxy on one GPU: what building the next layer's view costs a real layer, cause by cause.

One process stands for CP rank 0 of a CP-2 prefill. A layer is ``layer_compute``'s attention (FlashMLA's
fp8 paged kernel as SGLang's DSA backend calls it, 4096 queries, top-k 2048, over the layer's view)
followed by its MoE stand-in (fp8 GEMMs of DeepSeek-V3.2's routed + shared experts, EP 8). The view of
``C`` prefix tokens holds ``C / 2`` tokens this rank owns, gathered from its pool pages by our Triton
gather kernel (``materialize_kernels``, 656-B latent rows + 132-B indexer records per token), and
``C / 2`` of the peer, pulled from another buffer of the same bytes on this GPU (the peer's arena).

Per context, a variant runs ``--layers`` layers per forward, timed with CUDA events from the end of
layer 0 to the end of the last (steady state: each layer's view was prefetched during the layer
before). Two ways, both in the JSON: ``--paired`` variants each ``--pairs`` times back to back with the
same layer without a view, the order alternating, reported as the median and quartiles of the pairs'
ratios (the GPU's clock state moves a forward by up to ~15% here; a pair shares it); ``--variants``
``--reps`` times round-robin, per-layer medians and spreads. ``summary`` (``--resummarize`` recomputes
it from the rows) takes the paired variant running ``ViewMaterializer``'s default options. Variants:

- ``none``: the layer alone (every layer reads a view built before timing);
- ``inline_*``: the view built on the compute stream before the layer's attention;
- ``prefetch_*``: layer ``l + 1``'s view built on a side stream while layer ``l`` computes. Switches:
  the peer's part by copy engine (``cuMemcpyDtoDAsync``) or by SM (the gather kernel);
  side-stream priority (highest, the wired path's, or normal); where the side stream starts (with
  the layer, or after its attention: behind the MoE only); the copies split into pieces each started
  with one step of the layer; the gather kernel's grid (one program per page, or a capped count);
  only the copy engines, or only the gather kernel;
- ``*_real``: the wired path's ``ViewMaterializer`` (arena, copy-engine transport, its side stream
  and event waits and host launches) over a pool of this rank's pages, with its prefetch options
  (gather on the compute or the side stream, side-stream priority); ``*_attention_only``: the layer
  without its MoE, one FlashMLA kernel. Beside them,
  ``side_vs_attention``: when a gather or a copy-engine copy queued on the side stream finishes
  beside one attention kernel. Its peer is emulated: the
  ``CopyEngineGroup`` it drives pulls from a local buffer of the peer's arena shape and its peer's
  signals are already set (the waits never block), so it issues every driver call of the real
  transport, but the bytes come from this GPU's memory instead of over NVLink (on two GPUs each HBM
  serves the peer's read of its part instead: the same traffic per GPU) and no peer is ever late.

``CUDA_DEVICE_MAX_CONNECTIONS`` is set per process: ``--connections`` runs a child per value.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmark.cp_shared_kv.bench_common import command_line, environment
from benchmark.cp_shared_kv.layer_compute import AttentionStep, MoEStandIn, attention_inputs, moe_shape
from reference.kv_formats import quantize_mla_fp8
from sglang_cp_shared_kv.srt.distributed.copy_engine import CopyEngineGroup, driver
from sglang_cp_shared_kv.srt.distributed.peer_watchdog import PeerWatchdog
from sglang_cp_shared_kv.srt.layers.attention.nsa import materialize
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer, allocate_arena
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_launch, word_pair
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import plan_batch
from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import PageBuffers
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import pages_for_lens, plan_meta_rows, slots_per_rank
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES, MLA_FP8_ROW_BYTES
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

PS = 64
CP = 2
QUERIES = 4096  # the chunk's tokens on this rank
LATENT_PAGE = PS * MLA_FP8_ROW_BYTES
INDEX_PAGE = PS * INDEX_TOKEN_BYTES
MOE_STEPS = 3  # the MoE split into steps, for the split-copy variant
LATE_PEER_US = 300  # the emulated peer's lag behind this rank, per layer (late-peer variant)
CLOCK_HZ = 1.98e9  # H200 SM clock: torch.cuda._sleep takes cycles

# name -> switches; the peer's part: "ce" copy engine, "sm" gather kernel, None not moved.
VARIANTS = {
    "none": {},
    "inline_ce": {"inline": True, "peer": "ce"},
    "inline_sm": {"inline": True, "peer": "sm"},
    "prefetch_ce": {"peer": "ce"},
    "prefetch_ce_prio_normal": {"peer": "ce", "priority": 0},
    "prefetch_sm": {"peer": "sm"},
    "prefetch_sm_prio_normal": {"peer": "sm", "priority": 0},
    "prefetch_ce_only": {"peer": "ce", "own": "ce"},
    "prefetch_gather_only": {"peer": None},
    "prefetch_ce_after_attention": {"peer": "ce", "start": "after_attention"},
    "prefetch_ce_split": {"peer": "ce", "pieces": 1 + MOE_STEPS},
    "prefetch_ce_grid_132": {"peer": "ce", "programs": 132},
    "prefetch_ce_grid_16": {"peer": "ce", "programs": 16},
    "prefetch_ce_grid_16_after_attention": {"peer": "ce", "programs": 16, "start": "after_attention"},
    "inline_real": {"real": True, "prefetch": False},
    "prefetch_real": {"real": True, "prefetch": True},
    "prefetch_real_late_peer": {"real": True, "prefetch": True, "late_peer_us": LATE_PEER_US},
    "prefetch_real_normal_priority": {"real": True, "prefetch": True, "priority": 0},
    "prefetch_real_gather_compute": {"real": True, "prefetch": True, "gather": "compute"},
    # The layer without its MoE: one attention kernel holding every SM.
    "none_attention_only": {"attention_only": True},
    "inline_real_attention_only": {"real": True, "prefetch": False, "attention_only": True},
    "prefetch_real_attention_only": {"real": True, "prefetch": True, "attention_only": True},
    "prefetch_real_gather_compute_attention_only": {
        "real": True,
        "prefetch": True,
        "gather": "compute",
        "attention_only": True,
    },
}
PAIRED_VARIANTS = [
    "inline_real",
    "prefetch_real",
    "prefetch_real_normal_priority",
    "prefetch_real_gather_compute",
    "inline_real_attention_only",
    "prefetch_real_attention_only",
    "prefetch_real_gather_compute_attention_only",
]
CHILD_VARIANTS = ["none", "inline_ce", "prefetch_ce", "inline_real", "prefetch_real", "prefetch_real_late_peer"]


def _stream(priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(priority=priority) if priority else torch.cuda.Stream()


def local_copy_engine_group(arena: list[torch.Tensor], peer: list[torch.Tensor], late: bool = False) -> CopyEngineGroup:
    """A rank-0-of-2 ``CopyEngineGroup`` whose peer is emulated: it pulls from ``peer`` (buffers of the
    arena's shapes on this GPU) and finds the peer's ready and ack counters already past any call
    (``late``: at 0, for the caller to raise)."""
    g = CopyEngineGroup.__new__(CopyEngineGroup)
    g.cpu_group, g.rank, g.size, g.device = None, 0, CP, arena[0].device
    g._driver = driver()
    g.signals = torch.zeros(4, CP, dtype=torch.int64, device=g.device)  # ready, ack, fence words
    g.signals[:2, 1] = 0 if late else 1 << 62
    g.outbox = torch.zeros(1, dtype=torch.int64, device=g.device)
    g._signals_at, g._outbox_at = g.signals.data_ptr(), g.outbox.data_ptr()
    g.buffers = [b.view(torch.uint8).view(-1) for b in arena]
    g._sink = torch.zeros(4, CP, dtype=torch.int64, device=g.device)  # the peer's signal slots
    g._peer_signals = {1: g._sink.data_ptr()}
    g._peer_buffers = {1: [b.data_ptr() for b in peer]}
    g._opened, g.calls, g._pull_cache, g.bytes_received = [], 0, {}, 0
    g.watchdog = PeerWatchdog(60.0, lambda what: [1], lambda: None)  # the emulated peer never stops
    return g


def latent_pages(n: int, device) -> torch.Tensor:
    """``n`` latent pages of valid 656-B fp8 rows (one random page, repeated)."""
    page = quantize_mla_fp8(torch.randn(PS, 512), torch.randn(PS, 64)).view(1, -1).to(device)
    return page.expand(n, -1).contiguous()


def index_pages(n: int, device) -> torch.Tensor:
    return torch.randint(0, 256, (n, INDEX_PAGE), dtype=torch.uint8, device=device)


class Context:
    """One context's buffers: a pool of this rank's pages per layer, two view sets, the peer's part."""

    def __init__(self, context: int, layers: int, device: torch.device, seed: int = 0):
        torch.manual_seed(seed)
        self.context, self.layers, self.device = context, layers, device
        pages = context // PS
        self.slots = pages // CP  # pages per rank's block
        s = self.slots
        # Pool per layer: 2 * S pages, this rank's S at random page ids among them.
        self.pool = [(latent_pages(2 * s, device), index_pages(2 * s, device)) for _ in range(layers + 1)]
        self.own_pages = torch.randperm(2 * s, device=device)[:s].contiguous()
        self.views = [
            (
                torch.empty(pages, LATENT_PAGE, dtype=torch.uint8, device=device),
                torch.empty(pages, INDEX_PAGE, dtype=torch.uint8, device=device),
            )
            for _ in range(2)
        ]
        self.peer = (latent_pages(s, device), index_pages(s, device))
        self.peer_ids = torch.arange(s, device=device)
        self.real_pool = None
        self.d = driver()
        for v in range(2):  # valid fp8 rows everywhere the attention may read
            for part in self.view_build(0, v, peer="ce"):
                part()
        torch.cuda.synchronize()

    def kv_rows(self, v: int) -> torch.Tensor:
        return self.views[v][0].view(-1, MLA_FP8_ROW_BYTES)

    def view_build(self, layer: int, v: int, peer="ce", own="sm", programs=None, pieces=1) -> list:
        """Layer ``layer``'s view into set ``v`` as ``pieces`` callables (each queues its share on the current stream)."""
        s, out = self.slots, self.views[v]
        src = self.pool[layer]
        parts = []
        for j in range(pieces):
            lo, hi = j * s // pieces, (j + 1) * s // pieces
            ops = []
            if own == "sm":
                pairs = [word_pair(a, o[lo:hi]) for a, o in zip(src, out)]
                ops.append(gather_launch(pairs, self.own_pages[lo:hi], programs=programs))
            elif own == "ce":  # no SM: contiguous pool pages by copy engine (not the real gather)
                ops += [self._ce(o[lo:hi], a[lo:hi]) for a, o in zip(src, out)]
            if peer == "sm":
                pairs = [word_pair(a, o[s + lo : s + hi]) for a, o in zip(self.peer, out)]
                ops.append(gather_launch(pairs, self.peer_ids[lo:hi], programs=programs))
            elif peer == "ce":
                ops += [self._ce(o[s + lo : s + hi], a[lo:hi]) for a, o in zip(self.peer, out)]
            parts.append(lambda ops=ops: [op() for op in ops])
        return parts

    def _ce(self, dst: torch.Tensor, src: torch.Tensor):
        d, n = self.d, dst.numel()

        def op():
            stream = torch.cuda.current_stream().cuda_stream
            d.copy(dst.data_ptr(), src.data_ptr(), n, stream)

        return op


def _synthetic_forward(ctx: Context, attn: AttentionStep, moe_steps: list, cfg: dict, side, layers: int):
    """Queue one forward of ``layers`` layers; returns (start, end) events around layers 1..L-1."""
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    peer, own = cfg.get("peer", "ce"), cfg.get("own", "sm")
    programs, pieces = cfg.get("programs"), cfg.get("pieces", 1)
    building = "peer" in cfg
    prefetch = building and not cfg.get("inline")
    # Piece k of a prefetched view starts with step gate[k] of the layer (0: attention, 1..: MoE steps).
    gate = list(range(pieces)) if pieces > 1 else [1 if cfg.get("start") == "after_attention" else 0]
    ready = None
    if prefetch:  # layer 0's view, built before the forward as the previous forward's prefetch would
        for part in ctx.view_build(0, 0, peer, own, programs):
            part()
    for layer in range(layers):
        v = layer % 2
        if layer == 1:
            start.record(main)
        if building and not prefetch:
            for part in ctx.view_build(layer, v, peer, own, programs):
                part()
        parts = []
        if prefetch:
            if ready is not None:
                main.wait_event(ready)
            parts = ctx.view_build(layer + 1, 1 - v, peer, own, programs, pieces)
        for j, step in enumerate([lambda v=v: attn(ctx.kv_rows(v)), *moe_steps]):
            for k, part in enumerate(parts):
                if gate[k] == j:  # the side stream starts this piece when the layer reaches step j
                    fork = torch.cuda.Event()
                    fork.record(main)
                    side.wait_event(fork)
                    with torch.cuda.stream(side):
                        part()
                    if k == len(parts) - 1:
                        ready = torch.cuda.Event()
                        ready.record(side)
            step()
    end.record(main)
    if ready is not None:
        main.wait_event(ready)
    return start, end


class RealPipeline:
    """The wired path's materializer over an emulated peer (see the module docstring)."""

    def __init__(self, ctx: Context, cfg: dict):
        prefetch = cfg["prefetch"]
        self.ctx, self.late_peer_us = ctx, cfg.get("late_peer_us", 0)
        late_peer_us = self.late_peer_us
        device, c, layers = ctx.device, ctx.context, ctx.layers
        pages = c // PS
        own = PageOwnership(CP, PS)
        # Logical pages 1..2 * pages (page 0: trash); the request's pages rotate owners by position.
        evens = np.random.default_rng(1).permutation(np.arange(2, 2 * pages + 1, 2))[: pages // 2]
        odds = np.random.default_rng(2).permutation(np.arange(1, 2 * pages + 1, 2))[: pages // 2]
        table = np.empty(pages, dtype=np.int64)
        table[0::2], table[1::2] = evens, odds
        self.table = torch.from_numpy(table).to(device=device, dtype=torch.int32).unsqueeze(0)
        if ctx.real_pool is None:  # one pool serves every pipeline of the context (read only)
            logical = 2 * pages + 1
            latent = [latent_pages(logical, device) for _ in range(layers + 1)]
            index = [index_pages(logical, device) for _ in range(layers + 1)]
            ctx.real_pool = PageBuffers(own, 0, MLA_FP8_ROW_BYTES, latent, index)
        self.pool = ctx.real_pool
        # Two contexts of prefix, as the plugin's arena (ARENA_CONTEXTS): two view sets fit.
        self.arena = allocate_arena(2 * c, 0, PS, MLA_FP8_ROW_BYTES, True, device, prefetch=True)
        self.arena["latent"].copy_(latent_pages(self.arena["latent"].shape[0], device))
        self.peer = [
            latent_pages(self.arena["latent"].shape[0], device),
            index_pages(self.arena["index"].shape[0], device),
        ]
        self.group = local_copy_engine_group(list(self.arena.values()), self.peer, late=bool(late_peer_us))
        self.peer_stream = torch.cuda.Stream()
        self.mat = ViewMaterializer(
            self.pool,
            self.group,
            prefetch=prefetch,
            arena=self.arena,
            prefetch_gather=cfg.get("gather", "side"),
            prefetch_priority=cfg.get("priority", materialize.HIGHEST_STREAM_PRIORITY),
        )
        self.begin()
        self.mat.drain()
        torch.cuda.synchronize()

    def begin(self):
        """A one-request history batch: its prefix pages planned and begun, a staged page past the view."""
        pages = pages_for_lens([self.ctx.context], PS)
        rows = torch.arange(1, device=self.table.device)
        meta = torch.tensor(plan_meta_rows(pages), dtype=torch.int64).to(self.table.device)
        s = slots_per_rank(pages, CP)
        plan = plan_batch(self.table, rows, 1, meta, self.table.shape[1], sum(pages), CP, s, 0, None, 0, 0)
        counters = self.mat.begin_planned(plan, "history", 1)
        self.mat.fence()
        return counters

    def peer_signals(self, delay_us: int, target: int) -> None:
        """The emulated peer sets its ready and ack counters to ``target`` ``delay_us`` after the compute
        stream reaches this point (it enters the layer that much later than this rank)."""
        fork = torch.cuda.Event()
        fork.record()
        self.peer_stream.wait_event(fork)
        d, stream = self.group._driver, self.peer_stream.cuda_stream
        with torch.cuda.stream(self.peer_stream):
            if delay_us:
                torch.cuda._sleep(int(delay_us * 1e-6 * CLOCK_HZ))
        for which in (0, 1):
            d.write64(stream, self.group.signals[which, 1].data_ptr(), target)

    def before_layer(self, layer: int) -> None:
        """Late peer: the counters of the all-gathers ``layer_view(layer)`` issues (its own layer's in line
        when not prefetched, the next one's ahead), late by ``late_peer_us``."""
        if not self.late_peer_us:
            return
        calls = (1 if layer == 0 or not self.mat.prefetch else 0) + (1 if self.mat.prefetch else 0)
        self.peer_signals(self.late_peer_us, self.group.calls + calls)


def _real_forward(rp: RealPipeline, attn: AttentionStep, moe_steps: list, layers: int):
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rp.begin()
    for layer in range(layers):
        if layer == 1:
            start.record(main)
        rp.before_layer(layer)
        view = rp.mat.layer_view(layer)
        attn(view.kv_rows)
        for step in moe_steps:
            step()
    end.record(main)
    rp.mat.drain()
    return start, end


def run_context(context: int, names: list[str], layers: int, reps: int, log, paired=(), pairs: int = 0) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.time()
    ctx = Context(context, layers, device)
    q, idx, seqlens = attention_inputs(QUERIES, context, context, device=device)
    attn = AttentionStep(q, idx, seqlens, use_kernel=True)
    moe = MoEStandIn(QUERIES, device=device)
    moe_steps = moe.steps(MOE_STEPS)
    sides = {p: _stream(p) for p in (materialize.HIGHEST_STREAM_PRIORITY, 0)}
    reals = {}
    for name in dict.fromkeys([*names, *paired]):
        cfg = VARIANTS[name]
        if cfg.get("real"):
            reals[name] = RealPipeline(ctx, cfg)
    log(f"context {context}: setup {time.time() - t0:.1f}s")

    def forward(name):
        cfg = VARIANTS[name]
        steps = [] if cfg.get("attention_only") else moe_steps
        if cfg.get("real"):
            return _real_forward(reals[name], attn, steps, layers)
        side = sides[cfg.get("priority", materialize.HIGHEST_STREAM_PRIORITY)]
        return _synthetic_forward(ctx, attn, steps, cfg, side, layers)

    paired_rows = _paired(forward, paired, pairs, layers, log) if paired else {}
    diagnosis = _side_vs_attention(ctx, attn, sides[materialize.HIGHEST_STREAM_PRIORITY], max(reps, 5))

    times = {n: [] for n in names}
    errors = {}
    for rep in range(reps + 1):  # the first round warms up
        for name in names:
            if name in errors:
                continue
            try:
                start, end = forward(name)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - record and go on with the other variants
                errors[name] = f"{type(e).__name__}: {e}"
                log(f"  {name}: {errors[name]}")
                torch.cuda.synchronize()
                continue
            if rep:
                times[name].append(start.elapsed_time(end) * 1000.0 / (layers - 1))
    # The view alone, no compute: what building it costs (the exposed fractions' denominators).
    alone = {}
    for key, peer in (("ce", "ce"), ("sm", "sm")):
        parts = ctx.view_build(1, 0, peer=peer)
        alone[key] = _time_us(lambda parts=parts: [p() for p in parts], reps=max(reps, 5))
    real = reals.get("inline_real")
    if real is not None:
        real.begin()
        alone["real"] = _time_us(lambda: real.mat._gather(1, 0), reps=max(reps, 5))
    row = {
        "context_tokens": context,
        "cp_size": CP,
        "view_pages": 2 * ctx.slots,
        "view_bytes": 2 * ctx.slots * (LATENT_PAGE + INDEX_PAGE),
        "peer_bytes": ctx.slots * (LATENT_PAGE + INDEX_PAGE),
        "view_alone_us": {k: round(v, 1) for k, v in alone.items()},
        "per_layer_us": {n: _stats(t) for n, t in times.items() if t},
        "errors": errors,
        "paired": paired_rows,
        "side_vs_attention": diagnosis,
    }
    log(f"context {context}: done in {time.time() - t0:.1f}s: " + json.dumps(row["per_layer_us"]))
    return row


def _paired(forward, names: list[str], pairs: int, layers: int, log) -> dict:
    """Each variant against its layer without a view (``none`` or ``none_attention_only``), run back to
    back ``pairs`` times, the order alternating: the GPU's clock state, which moves the layer by up to
    ~10% between forwards here, cancels in each pair's ratio."""
    raw = {n: [] for n in names}
    errors = {}
    for r in range(pairs + 1):  # pair 0 warms up
        for name in names:
            if name in errors:
                continue
            base = "none_attention_only" if VARIANTS[name].get("attention_only") else "none"
            order = (base, name) if r % 2 else (name, base)
            try:
                got = {}
                for n in order:
                    start, end = forward(n)
                    torch.cuda.synchronize()
                    got[n] = start.elapsed_time(end) * 1000.0
            except Exception as e:  # noqa: BLE001 - record and go on with the other variants
                errors[name] = f"{type(e).__name__}: {e}"
                log(f"  paired {name}: {errors[name]}")
                continue
            if r:
                raw[name].append((got[name], got[base]))
    out = {}
    for name, pairs_ in raw.items():
        if not pairs_:
            continue
        ratios = sorted(v / b for v, b in pairs_)
        diffs = sorted(v - b for v, b in pairs_)
        q = len(ratios) // 4
        out[name] = {
            "base": "none_attention_only" if VARIANTS[name].get("attention_only") else "none",
            "pairs": len(ratios),
            "ratio_median": round(statistics.median(ratios), 4),
            "ratio_q1": round(ratios[q], 4),
            "ratio_q3": round(ratios[-1 - q], 4),
            "layer_us_median": round(statistics.median(v for v, _ in pairs_) / (layers - 1), 1),
            "base_layer_us_median": round(statistics.median(b for _, b in pairs_) / (layers - 1), 1),
            "layer_diff_us_median": round(statistics.median(diffs) / (layers - 1), 1),
        }
    return {"variants": out, "errors": errors}


def _side_vs_attention(ctx: Context, attn: AttentionStep, side, reps: int) -> dict:
    """When a side-stream piece of the view finishes if queued as one attention kernel starts: the
    owned-page gather (SMs) and the copy-engine copy of the peer's part, each also timed alone."""
    main = torch.cuda.current_stream()
    pieces = {
        "gather_own_pages": ctx.view_build(1, 0, peer=None)[0],
        "copy_engine_peer_part": ctx.view_build(1, 0, peer="ce", own=None)[0],
    }
    out = {}
    for name, piece in pieces.items():
        done, attn_done, alone = [], [], []
        for r in range(reps + 1):
            fork, side_end, main_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            fork.record(main)
            side.wait_event(fork)
            with torch.cuda.stream(side):
                piece()
            side_end.record(side)
            attn(ctx.kv_rows(1))
            main_end.record(main)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(main)
            piece()
            b.record(main)
            torch.cuda.synchronize()
            if r:
                done.append(fork.elapsed_time(side_end) * 1000.0)
                attn_done.append(fork.elapsed_time(main_end) * 1000.0)
                alone.append(a.elapsed_time(b) * 1000.0)
        out[name] = {
            "side_done_us": round(statistics.median(done), 1),
            "attention_done_us": round(statistics.median(attn_done), 1),
            "alone_us": round(statistics.median(alone), 1),
        }
    return out


def _time_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(out)


def _stats(t: list[float]) -> dict:
    t = sorted(t)
    return {
        "median": round(statistics.median(t), 1),
        "min": round(t[0], 1),
        "max": round(t[-1], 1),
        "reps": len(t),
    }


def derive(row: dict) -> dict:
    """Per variant: overhead vs no view, and the exposed fraction of the view's in-line cost."""
    per = row["per_layer_us"]
    if "none" not in per:
        return {}
    none = per["none"]["median"]
    out = {}
    for name, s in per.items():
        if name == "none":
            continue
        cfg = VARIANTS[name]
        base = "inline_real" if cfg.get("real") else ("inline_sm" if cfg.get("peer") == "sm" else "inline_ce")
        view = per[base]["median"] - none if base in per else None
        d = {"overhead_vs_none": round(s["median"] / none - 1, 4), "exposed_us": round(s["median"] - none, 1)}
        if view is not None and not cfg.get("inline") and cfg.get("prefetch", True):
            d["exposed_fraction"] = round((s["median"] - none) / view, 3) if view > 0 else None
        out[name] = d
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--variants", nargs="*", default=[n for n in VARIANTS if n not in PAIRED_VARIANTS])
    ap.add_argument("--connections", type=int, nargs="*", default=[1, 32], help="CUDA_DEVICE_MAX_CONNECTIONS children")
    ap.add_argument("--connection-contexts", type=int, nargs="+", default=[131072], help="contexts of the children")
    ap.add_argument("--connection-reps", type=int, default=4)
    ap.add_argument("--paired", nargs="*", default=PAIRED_VARIANTS, help="variants timed in pairs with no view")
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--out", default="docs/benchmarks/overlap_1gpu.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resummarize", action="store_true", help="recompute --out's summary from its rows, no GPU")
    args = ap.parse_args()
    out = Path(args.out)
    if args.resummarize:
        doc = json.loads(out.read_text())
        doc["summary"] = summarize(doc)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        return

    def log(msg):
        print(msg, flush=True)

    doc = {
        "name": "overlap_1gpu",
        "command": command_line(),
        "environment": environment(),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)"),
        "layer": {
            "attention": AttentionStep(*attention_inputs(8, 64, 64, device="cuda")).describe(),
            "moe": moe_shape(QUERIES),
            "queries": QUERIES,
            "layers_per_forward": args.layers,
            "timed": "layers 1..L-1 of each forward (CUDA events), reps round-robin over variants",
        },
        "variants": {n: VARIANTS[n] for n in args.variants},
        "rows": [],
    }
    for c in args.contexts:
        try:
            paired = [] if args.child else args.paired
            row = run_context(c, args.variants, args.layers, args.reps, log, paired, args.pairs)
        except Exception as e:  # noqa: BLE001 - one context failing leaves the others
            row = {"context_tokens": c, "error": f"{type(e).__name__}: {e}"}
            log(f"context {c}: {row['error']}")
            torch.cuda.empty_cache()
        torch.cuda.empty_cache()
        row["derived"] = derive(row) if "per_layer_us" in row else {}
        doc["rows"].append(row)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    if not args.child:
        doc["connections"] = {}
        for n in args.connections:
            child_out = out.with_name(f"{out.stem}_conn{n}.json")
            cmd = [sys.executable, "-m", "benchmark.cp_shared_kv.bench_overlap", "--child", "--out", str(child_out)]
            cmd += ["--contexts", *map(str, args.connection_contexts), "--layers", str(args.layers)]
            cmd += ["--reps", str(args.connection_reps)]
            cmd += ["--variants", *[v for v in CHILD_VARIANTS if v in args.variants]]
            env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=str(n))
            log(f"child CUDA_DEVICE_MAX_CONNECTIONS={n}")
            r = subprocess.run(cmd, env=env, timeout=1200)
            if r.returncode == 0 and child_out.exists():
                child = json.loads(child_out.read_text())
                doc["connections"][str(n)] = [
                    {k: row.get(k) for k in ("context_tokens", "per_layer_us", "derived", "error")}
                    for row in child["rows"]
                ]
                child_out.unlink()
            else:
                doc["connections"][str(n)] = {"error": f"child exited {r.returncode}"}
        doc["summary"] = summarize(doc)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"wrote {out}")


def wired_variant() -> str:
    """The paired variant that runs the wired path's defaults (``ViewMaterializer``'s prefetch options)."""
    import inspect

    params = inspect.signature(ViewMaterializer.__init__).parameters
    want = (params["prefetch_gather"].default, params["prefetch_priority"].default)
    for name in PAIRED_VARIANTS:
        cfg = VARIANTS[name]
        got = (cfg.get("gather", "side"), cfg.get("priority", materialize.HIGHEST_STREAM_PRIORITY))
        if cfg.get("prefetch") and not cfg.get("attention_only") and got == want:
            return name
    raise ValueError(f"no paired variant runs the wired defaults {want}")


def summarize(doc: dict) -> dict:
    """Headline keys from the paired runs: the wired path's prefetch against the same layer with no
    view (overhead, from the median pair ratio) and against the view built in line (exposed fraction:
    overhead prefetched / overhead in line), per context; the same for every prefetch variant."""
    wired = wired_variant()
    per_variant = {}
    for row in doc["rows"]:
        got = row.get("paired", {}).get("variants", {})
        for name, d in got.items():
            if not VARIANTS[name].get("prefetch"):
                continue
            inline = got.get("inline_real_attention_only" if VARIANTS[name].get("attention_only") else "inline_real")
            over = d["ratio_median"] - 1
            view = inline["ratio_median"] - 1 if inline else None
            per_variant.setdefault(name, {})[str(row["context_tokens"])] = {
                "overhead": round(over, 4),
                "inline_overhead": None if view is None else round(view, 4),
                "exposed_fraction": round(over / view, 3) if view and view > 0 else None,
            }
    pick = per_variant.get(wired, {})
    return {
        "wired_variant": wired,
        "prefetch_exposed_fraction_real_layer": {c: v["exposed_fraction"] for c, v in pick.items()},
        "prefetch_layer_overhead_real_layer": {c: v["overhead"] for c, v in pick.items()},
        "by_variant": per_variant,
        "cause": CAUSE,
    }


# What the numbers say, kept beside the code that measured it (docs/design.md gives the reasoning).
CAUSE = (
    "HBM bandwidth at long contexts, not the view waiting for SMs: pieces of the view on the side stream "
    "beside one FlashMLA kernel finish in about their own time while it runs (side_vs_attention). At "
    "32K-128K the view, in line or ahead, costs the real layer nothing measurable; at 512K FlashMLA reads "
    "its 413 MB view from HBM and the view's bytes cost the layer about 1% whether moved beside it or "
    "before it, so the prefetch hides little there. A normal-priority side stream cost 2.8% at 32K (the "
    "highest priority stays); unpaired, the view behind the MoE and CUDA_DEVICE_MAX_CONNECTIONS 1 or 32 "
    "moved nothing beyond their noise, split copies and a gather capped at 16 programs did worse. The "
    "wired default gathers on the "
    "compute stream and pulls on the side stream (+0.9% at 512K, +1.2% with both on the side stream, "
    "within the pairs' spread)."
)


if __name__ == "__main__":
    main()
