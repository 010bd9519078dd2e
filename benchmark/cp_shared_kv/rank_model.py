"""One rank of a CP-N prefill node, modeled in one process on one GPU: what a DeepSeek-V3.2 layer costs
that rank with the replicated pool (stock) and with the sharded pool and its view (ours), the view's
pull from the peers paced to a link speed.

**The model.** Rank ``r`` (0) of a CP-N node holds ``T`` new tokens of a chunk of ``N * T`` tokens over a
prefix of ``P`` tokens (one request). The other ``N - 1`` ranks' pools are allocations on this GPU:
``N`` ``CPSharedDSATokenToKVPool`` (the plugin's pool class, one per rank, fp8 656-B rows and indexer
pages), written from a replicated ``DSATokenToKVPool`` (stock) through the pools' own masked store
(``store_rows``: logical page ``lp`` on rank ``lp % N``, physical page ``lp // N``). The batch's slot
plan is the product's layout (owner-major, ``S = ceil(P / 64 / N)`` slots per owner). Per layer both
sides run, for the rank's own ``T`` tokens:

- the q/kv projections (``q_a``+``kv_a`` fused 7168->2112, the indexer's ``wk``+``weights_proj``
  7168->192, ``q_b`` 1536->24576, the indexer's ``wq_b`` 1536->8192, ``o_proj`` 16384->7168) as fp8
  ``torch._scaled_mm``, the absorbed ``w_uk``/``w_uv`` as bf16 ``bmm`` over 128 heads;
- the indexer's K read (its pages gathered into one contiguous ``[keys, 132]`` buffer, as
  ``get_index_k_scale_buffer`` does), from the pool (stock) or the view (ours);
- the indexer logits: a stand-in for DeepGEMM ``fp8_mqa_logits`` (it cannot load on the box) with its
  FLOPs and its output bytes: one fp8 ``torch._scaled_mm`` per block of query rows, ``[rows, 64 heads *
  128] x [128 * 64, keys]`` into fp32 ``[rows, keys]``, keys = ``P + N * T / 2`` (the mean causal span
  of the rank's queries under prefill CP's zigzag split); its TFLOP/s is measured and printed beside the
  H200's fp8 dense peak;
- the top-k (k 2048) of each block's logits at a two-pass radix select's memory cost (two full reads of
  the fp32 logits, then ``torch.topk`` over ``4 k`` columns for the indices): sgl_kernel's fused top-k
  cannot load on the box, and ``torch.topk`` over whole rows ran about 13 reads' worth (the first run,
  ``rank_model_torch_topk.json``), which would lengthen the layer by more than the op it replaces;
- the chunk's latent rows stored (stock: all ``N * T`` rows into the pool; ours: into the staging pages
  after the view, then the owned ones into the pool through ``store_rows``, as the pool's
  ``set_mla_kv_buffer`` does);
- FlashMLA's sparse fp8 attention (``flash_mla_with_kvcache``, the ``flashmla_kv`` path SGLang's DSA
  backend takes for an fp8 cache on H200, ``layer_compute.AttentionStep``) for the rank's ``T`` queries x
  128 heads, top-k 2048 rows each, over the pool's rows (stock) or the view's (ours);
- the MoE GEMMs at EP 8 (``vs_upstream_stand_ins.MoEForBatch``: 32 local experts, top-8 of 256, the
  shared expert; fp8).

Ours adds the view of the prefix pages, built one of two ways (the product's two in-node paths):

- **in line**: at the layer's first read (the indexer's K read) one ``pull_pages`` launch (the product's
  kernel) reads every owner's pages where they lie, then the stream waits out the link time
  (``rank_model_pacing``);
- **prefetch**: layer ``l + 1``'s view built while layer ``l`` computes, as the product's
  ``ViewMaterializer._start_prefetch`` does with ``prefetch_gather="compute"``: the rank's own pages
  gathered (the product's gather kernel) on the compute stream at layer ``l``'s first read, the peers'
  blocks pulled on a highest-priority side stream by copies paced to the link (one CUDA graph per layer
  and view set, so the pacing's extra launches cost no host time), the next layer's first read waiting
  on one event. The peers' own gathers ran on their GPUs before: their blocks are prepared
  once, untimed. The product's ``ViewMaterializer`` itself is not driven (it needs a CP group of
  processes): this is its sequence of device work, rebuilt from its source.

**Pacing** (``rank_model_pacing``'s docstring has it whole): the copy-engine pull copies each peer's
block for real in pieces, each followed by a GPU-side wait (a one-warp kernel spinning on the global
timer) so the piece costs ``bytes / link``, after a fixed latency per pull; the SM pull runs the real
kernel on local pools, then waits until ``remote bytes / link`` has passed. Checked against what 2 H200s
measured for the CP-2 view (``--pacing-check``, the JSON's ``pacing_check``).

**What it cannot show**: the chunk's all-gather between the ranks and MoE dispatch/combine (network
work, absent on both sides: the layer here is shorter than a server's, so an overhead here is larger
than there), norms, rope and quantization kernels, the indexer's weights, routing imbalance, a late
peer, SGLang's host-side metadata (the two-process harness ``bench_vs_upstream`` times that), NVLink's
contention with the peers' reads of this rank's pages (the same bytes per GPU land on this GPU's HBM
here instead). SGLang's DSA backend is not driven here: its device work on the pool is rebuilt above.

Usage::

    python -m benchmark.cp_shared_kv.rank_model --out docs/benchmarks/rank_model.json
    python -m benchmark.cp_shared_kv.rank_model --n 8 --prefix 131072 --tokens 1024 --out part.json
    python -m benchmark.cp_shared_kv.rank_model --merge a.json b.json --out all.json
    python -m benchmark.cp_shared_kv.rank_model --markdown all.json --md-out docs/benchmarks/rank_model.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmark.cp_shared_kv import rank_model_pacing as pacing

PS = 64
LATENT_ROW = 656
INDEX_ROW = 132
PAGE_BYTES = PS * (LATENT_ROW + INDEX_ROW)  # 50432: a latent page and its indexer page
H200_FP8_DENSE_TFLOPS = 1979.0
H200_HBM_TBPS = 4.8
DEEPSEEK_LAYERS = 61
GOAL_PCT = 1.0


@dataclass(frozen=True)
class Shapes:
    """DeepSeek-V3.2 at attention TP 1 on a CP rank (``tiny()``: the same structure for CPU tests)."""

    hidden: int = 7168
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    heads: int = 128
    qk_nope: int = 128
    v_head: int = 128
    index_heads: int = 64
    index_dim: int = 128
    topk: int = 2048

    @staticmethod
    def tiny() -> Shapes:
        return Shapes(hidden=256, q_lora=64, heads=8, qk_nope=16, v_head=16, index_heads=4, index_dim=32, topk=64)


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _sync(device: torch.device) -> None:
    if _cuda(device):
        torch.cuda.synchronize(device)


class Timer:
    """Device time between two points of the current stream (CUDA events), or host time on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    @contextmanager
    def span(self, box: list):
        if _cuda(self.device):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            yield
            e1.record()
            torch.cuda.synchronize(self.device)
            box.append(e0.elapsed_time(e1) * 1e3)
        else:
            t0 = time.perf_counter()
            yield
            box.append((time.perf_counter() - t0) * 1e6)


# -- the pools: stock replicated, N sharded, the peers' gathered blocks, this rank's views --------------------------


def _publish(device: torch.device, shapes: Shapes, context_len: int) -> None:
    from benchmark.cp_shared_kv import vs_upstream_backend as sgl

    sgl.publish_dsa("fp8", shapes.heads, shapes.topk, context_len, PS, device)


def pool_kwargs(layers: int, device: torch.device) -> dict:
    """SGLang's DSA pool arguments for DeepSeek-V3.2's fp8 rows (656-byte latent rows, 128-dim indexer keys)."""
    return dict(
        page_size=PS,
        kv_lora_rank=512,
        dtype=torch.float8_e4m3fn,
        qk_rope_head_dim=64,
        layer_num=layers,
        device=str(device),
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=LATENT_ROW,
    )


def _pages(buf: torch.Tensor, width: int) -> torch.Tensor:
    """A pool buffer as uint8 pages ``[pages, width]``."""
    return buf.view(torch.uint8).view(-1, width)


class RankPools:
    """Rank ``rank`` of CP ``n`` with a prefix of ``prefix_pages`` pages and ``chunk_pages`` of new pages.

    Logical pages: the prefix is ``[n, n + P)`` (the allocators never hand out ``[0, n)``), the chunk the
    ``C`` pages after it. ``layers`` pool layers (distinct buffers, so consecutive layers do not read each
    other's bytes from L2)."""

    def __init__(self, n: int, rank: int, prefix_pages: int, chunk_pages: int, layers: int, device, seed: int = 0):
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
        from sglang.srt.runtime_context import get_parallel

        from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

        self.n, self.rank, self.p, self.c, self.layers, self.device = n, rank, prefix_pages, chunk_pages, layers, device
        first = n
        self.lp = torch.arange(first, first + prefix_pages, dtype=torch.int64, device=device)  # prefix pages
        self.chunk_lp = torch.arange(first + prefix_pages, first + prefix_pages + chunk_pages, device=device)
        top = first + prefix_pages + chunk_pages  # logical pages used
        kwargs = pool_kwargs(layers, device)
        g = torch.Generator(device=device).manual_seed(seed)
        with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
            self.stock = DSATokenToKVPool((top + 1) * PS, **kwargs)
            self.stock.dcp_replicated = True
            per_rank = (-(-top // n) + 2) * PS
            self.pools = [
                CPSharedDSATokenToKVPool(per_rank, cp_rank=o, cp_size=n, cp_group=None, **kwargs) for o in range(n)
            ]
        self.own = self.pools[rank]
        own = self.own.ownership
        # Stock: the logical cache, random bytes that decode finite (every byte < 0x78).
        for layer in range(layers):
            for buf in (self.stock.kv_buffer[layer], self.stock.index_key_cache.buffer[layer]):
                flat = buf.view(torch.uint8).view(-1)
                flat.copy_(torch.randint(0, 0x78, flat.shape, dtype=torch.uint8, device=device, generator=g))
        # The sharded pools: each written through its own masked store (its pages kept, the rest to trash).
        locs = (self.lp[:, None] * PS + torch.arange(PS, device=device)).reshape(-1)
        owner, phys = own.owner(self.lp), own.phys_page(self.lp)
        for o, pool in enumerate(self.pools):
            rows = pool.store_rows(locs)
            mine = owner == o
            for layer in range(layers):
                pool.kv_buffer[layer].view(-1, LATENT_ROW).index_copy_(
                    0, rows, self.stock.kv_buffer[layer].view(-1, LATENT_ROW).index_select(0, locs)
                )
                dst = _pages(pool.index_key_cache.buffer[layer], PS * INDEX_ROW)
                src = _pages(self.stock.index_key_cache.buffer[layer], PS * INDEX_ROW)
                dst.index_copy_(0, phys[mine], src.index_select(0, self.lp[mine]))
        # The slot plan of the batch's prefix: owner-major, S slots per owner, padding on the trash page.
        self.s = -(-prefix_pages // n)
        rank_in_owner = torch.zeros_like(self.lp)
        for o in range(n):
            m = owner == o
            rank_in_owner[m] = torch.arange(int(m.sum()), device=device)
        self.slot = owner * self.s + rank_in_owner  # the view's page table: slot of each prefix position
        self.slot_phys = torch.zeros(n * self.s, dtype=torch.int64, device=device)
        self.slot_phys[self.slot] = phys
        self.view_pages = n * self.s
        # The peers' blocks, gathered once on their GPUs (here: untimed, before): the copy-engine sources.
        from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_page_buffers

        self.peer_views = []
        for layer in range(layers):
            lat = torch.zeros((self.view_pages, PS * LATENT_ROW), dtype=torch.uint8, device=device)
            idx = torch.zeros((self.view_pages, PS * INDEX_ROW), dtype=torch.uint8, device=device)
            for o in range(n):
                if o == rank or self.s == 0:
                    continue
                blk = slice(o * self.s, (o + 1) * self.s)
                gather_page_buffers(self._sources(o, layer), self.slot_phys[blk], [lat[blk], idx[blk]])
            self.peer_views.append((lat, idx))
        # This rank's view sets: [view | staged chunk pages | a trash page], two for prefetch.
        rows = self.view_pages + chunk_pages + 1
        self.views = [
            (
                torch.zeros((rows, PS * LATENT_ROW), dtype=torch.uint8, device=device),
                torch.zeros((rows, PS * INDEX_ROW), dtype=torch.uint8, device=device),
            )
            for _ in range(2)
        ]
        self.table = torch.tensor(
            [[[self._sources(o, layer)[k].data_ptr() for o in range(n)] for k in range(2)] for layer in range(layers)],
            dtype=torch.int64,
            device=device,
        )
        self._pulls: dict[tuple[int, int], object] = {}
        self._gathers: dict[tuple[int, int], object] = {}

    def _sources(self, o: int, layer: int) -> list[torch.Tensor]:
        pool = self.pools[o]
        return [
            _pages(pool.kv_buffer[layer], PS * LATENT_ROW),
            _pages(pool.index_key_cache.buffer[layer], PS * INDEX_ROW),
        ]

    # byte counts
    @property
    def remote_bytes(self) -> int:
        """Bytes this rank pulls per layer: the peers' blocks of the view (padding slots included, as the
        product's all-gather moves them)."""
        return (self.n - 1) * self.s * PAGE_BYTES

    @property
    def own_bytes(self) -> int:
        return self.s * PAGE_BYTES

    def stock_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            _pages(self.stock.kv_buffer[layer], PS * LATENT_ROW),
            _pages(self.stock.index_key_cache.buffer[layer], PS * INDEX_ROW),
        )

    # the two ways the product fills a view
    def sm_pull(self, layer: int, vset: int) -> None:
        """The in-line view: every owner's block read from its pool in one launch (the product's kernel)."""
        from sglang_cp_shared_kv.srt.layers.attention.nsa import materialize_kernels as mk

        if self.s == 0:
            return
        lat, idx = self.views[vset]
        if not mk.triton_enabled(self.device):
            for k, out in enumerate((lat, idx)):
                mk.pull_pages_ref(
                    [self._sources(o, layer)[k] for o in range(self.n)],
                    self.slot_phys,
                    self.s,
                    out=out[: self.view_pages],
                )
            return
        launch = self._pulls.get((layer, vset))
        if launch is None:
            words = [mk.word_view(lat[: self.view_pages]), mk.word_view(idx[: self.view_pages])]
            strides = [PS * LATENT_ROW // 4, PS * INDEX_ROW // 4]
            launch = self._pulls[(layer, vset)] = mk.pull_launch(
                self.table, self.slot_phys, self.s, words, strides, layer
            )
        launch()

    def own_gather(self, layer: int, vset: int) -> None:
        """This rank's block of the view from its own pool (the product's gather kernel)."""
        from sglang_cp_shared_kv.srt.layers.attention.nsa import materialize_kernels as mk

        if self.s == 0:
            return
        launch = self._gathers.get((layer, vset))
        if launch is None:
            blk = slice(self.rank * self.s, (self.rank + 1) * self.s)
            lat, idx = self.views[vset]
            _, launch = mk.prepare_gather(self._sources(self.rank, layer), self.slot_phys[blk], [lat[blk], idx[blk]])
            self._gathers[(layer, vset)] = launch
        launch()

    def peer_pairs(self, layer: int, vset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(peer block, this rank's view block) for each peer and buffer: what the copy engines pull."""
        out = []
        src_lat, src_idx = self.peer_views[layer]
        lat, idx = self.views[vset]
        for o in range(self.n):
            if o == self.rank or self.s == 0:
                continue
            blk = slice(o * self.s, (o + 1) * self.s)
            out += [(src_lat[blk], lat[blk]), (src_idx[blk], idx[blk])]
        return out

    def view_matches(self, layer: int, vset: int) -> bool:
        """Whether the view holds, at each prefix position's slot, the stock pool's page (latent and indexer)."""
        lat, idx = self.views[vset]
        s_lat, s_idx = self.stock_pages(layer)
        return bool(torch.equal(lat[self.slot], s_lat[self.lp]) and torch.equal(idx[self.slot], s_idx[self.lp]))


# -- one layer's compute ---------------------------------------------------------------------------------------------


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


class LayerOps:
    """The layer's ops for ``tokens`` queries of rank 0 of CP ``n`` over ``prefix`` tokens (same for both sides)."""

    def __init__(self, shapes: Shapes, n: int, prefix: int, tokens: int, cache_rows: int, device, moe, kexp, seed=0):
        from benchmark.cp_shared_kv.layer_compute import AttentionStep, attention_inputs

        self.shapes, self.n, self.prefix, self.tokens, self.device = shapes, n, prefix, tokens, device
        sh, t = shapes, tokens
        self.fp8 = _cuda(device)
        g = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device=device) * scale

        def weight(k, m):  # stored [out, in]; fp8 on GPU
            w = rand(m, k, scale=k**-0.5)
            return _fp8(w * 16) if self.fp8 else w.to(torch.bfloat16)

        self.x = _fp8(rand(t, sh.hidden)) if self.fp8 else rand(t, sh.hidden).to(torch.bfloat16)
        self.xq = _fp8(rand(t, sh.q_lora)) if self.fp8 else rand(t, sh.q_lora).to(torch.bfloat16)
        self.xo = _fp8(rand(t, sh.heads * sh.v_head)) if self.fp8 else rand(t, sh.heads * sh.v_head).to(torch.bfloat16)
        qk = sh.qk_nope + sh.rope
        self.gemms = [
            ("qkv_a", self.x, weight(sh.hidden, sh.q_lora + sh.kv_lora + sh.rope)),
            ("indexer_wk_weights", self.x, weight(sh.hidden, sh.index_dim + sh.index_heads)),
            ("q_b", self.xq, weight(sh.q_lora, sh.heads * qk)),
            ("indexer_wq_b", self.xq, weight(sh.q_lora, sh.index_heads * sh.index_dim)),
        ]
        self.o_proj = ("o_proj", self.xo, weight(sh.heads * sh.v_head, sh.hidden))
        self.one = torch.ones((), device=device)
        self.q_nope = rand(sh.heads, t, sh.qk_nope).to(torch.bfloat16)
        self.w_uk = rand(sh.heads, sh.qk_nope, sh.kv_lora, scale=sh.qk_nope**-0.5).to(torch.bfloat16)
        self.o_lat = rand(sh.heads, t, sh.kv_lora).to(torch.bfloat16)
        self.w_uv = rand(sh.heads, sh.kv_lora, sh.v_head, scale=sh.kv_lora**-0.5).to(torch.bfloat16)
        # Indexer: keys each query scores (mean causal span under the zigzag split), the logits blocks.
        self.keys = _round_up(prefix + n * tokens // 2, 16)
        self.kdim = sh.index_heads * sh.index_dim
        self.q_idx = _fp8(rand(t, self.kdim)) if self.fp8 else rand(t, self.kdim).to(torch.bfloat16)
        self.kexp = kexp[: self.keys]
        budget = (2 << 30) if _cuda(device) else (16 << 20)
        self.block_rows = max(16, min(t, (budget // (self.keys * 4)) // 16 * 16))
        self.topk = min(sh.topk, self.keys)
        # Index-K pages the indexer reads: the prefix's and the chunk's (pages of the read buffer).
        self.index_pages = -(-(prefix + n * tokens) // PS)
        # Chunk store: every rank holds the whole chunk (N*T rows).
        self.chunk_rows = torch.randint(
            0, 0x78, (n * tokens, LATENT_ROW), dtype=torch.uint8, device=device, generator=g
        )
        # Attention: T queries x heads, top-k rows each, spread over the prefix and chunk rows.
        q, idx, seqlens = attention_inputs(t, cache_rows, prefix, sh.heads, sh.topk, device=device, seed=seed)
        self.attn = AttentionStep(q, idx, seqlens)
        self.moe = moe
        self.logit_flops = 2 * t * self.keys * self.kdim

    def projections(self) -> None:
        for _, a, w in self.gemms:
            self._mm(a, w)

    def _mm(self, a, w, out_dtype=torch.bfloat16):
        if self.fp8:
            return torch._scaled_mm(
                a, w.t(), scale_a=self.one, scale_b=self.one, out_dtype=out_dtype, use_fast_accum=True
            )
        return (a @ w.t()).to(out_dtype)

    def absorb(self) -> None:
        torch.bmm(self.q_nope, self.w_uk)

    def index_k(self, index_pages: torch.Tensor) -> torch.Tensor:
        """The indexer's K read: its pages into one contiguous buffer (``get_index_k_scale_buffer``)."""
        return index_pages[: self.index_pages].clone()

    def logits_topk(self) -> None:
        for s in range(0, self.tokens, self.block_rows):
            e = min(s + self.block_rows, self.tokens)
            out = self._mm(self.q_idx[s:e], self.kexp, out_dtype=LOGITS_OUT["dtype"])
            self.select(out)

    def select(self, out: torch.Tensor) -> torch.Tensor:
        """The top-k at a two-pass radix select's memory cost: two full reads of the logits (a per-row max
        and a per-row sum, the histogram and select passes' reads), then ``torch.topk`` over the row's
        first ``4 * k`` columns for the k indices (their write)."""
        out.amax(dim=1)
        out.sum(dim=1)
        return torch.topk(out[:, : min(out.shape[1], 4 * self.topk)], self.topk, dim=1, sorted=False).indices

    def logits_only(self) -> None:
        for s in range(0, self.tokens, self.block_rows):
            e = min(s + self.block_rows, self.tokens)
            self._mm(self.q_idx[s:e], self.kexp, out_dtype=LOGITS_OUT["dtype"])

    def attention(self, kv_rows: torch.Tensor) -> None:
        self.attn(kv_rows)

    def output(self) -> None:
        torch.bmm(self.o_lat, self.w_uv)
        self._mm(self.o_proj[1], self.o_proj[2])
        self.moe(self.tokens)


GRAPH_ERRORS: list[str] = []  # paced pulls that could not be captured (queued piece by piece instead)
LOGITS_OUT = {"dtype": torch.float32, "note": "fp32 out, as fp8_mqa_logits writes"}


def probe_logits_out(device) -> dict:
    """Whether fp8 ``torch._scaled_mm`` writes fp32 here (else bf16: half the op's output bytes, said so)."""
    if not _cuda(device):
        return LOGITS_OUT
    a = torch.zeros(16, 64, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(32, 64, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001
        LOGITS_OUT.update(
            dtype=torch.bfloat16, note=f"bf16 out (fp32 refused: {type(e).__name__}): half the op's output bytes"
        )
    return LOGITS_OUT


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_kexp(max_keys: int, kdim: int, device, fp8: bool) -> torch.Tensor:
    """The logits stand-in's key operand ``[keys, heads * dim]`` (random normal, built in pieces)."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    out = torch.empty((max_keys, kdim), dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(7)
    step = max(1, (256 << 20) // (kdim * 4))
    for s in range(0, max_keys, step):
        e = min(s + step, max_keys)
        out[s:e] = torch.randn(e - s, kdim, generator=g, device=device).clamp(-448, 448).to(dtype)
    return out


# -- a layer, stock and ours ---------------------------------------------------------------------------------------


class Runner:
    """Runs layers of one cell: ``stock``, ``inline`` (SM pull, paced) or ``prefetch`` (gather + paced
    copy-engine pull a layer ahead on a side stream)."""

    def __init__(self, pools: RankPools, ops: LayerOps, link: pacing.PacedLink, sm_kernel_us: float):
        self.pools, self.ops, self.link, self.sm_kernel_us = pools, ops, link, sm_kernel_us
        self.device = pools.device
        self.side = (
            torch.cuda.Stream(device=self.device, priority=torch.cuda.Stream.priority_range()[1])
            if _cuda(self.device)
            else None
        )
        self._pending = None  # (layer, vset, event) of the view built ahead
        # The paced pulls' graphs, kept with the pools (every T of a cell reuses them), captured here, before
        # any timing: a capture synchronizes the device.
        self._graphs = pools.__dict__.setdefault("ce_graphs", {})
        self._gkey = (link.link_gbps, link.latency_us)
        if self.side is not None:
            for layer in range(pools.layers):
                for vset in (0, 1):
                    self.ce_pull(layer, vset, replay=False)
            torch.cuda.synchronize(self.device)
        self.store_rows = pools.own.store_rows(
            (pools.chunk_lp[:, None] * PS + torch.arange(PS, device=self.device)).reshape(-1)[: ops.chunk_rows.shape[0]]
        )
        self.stock_chunk_rows = (pools.chunk_lp[:, None] * PS + torch.arange(PS, device=self.device)).reshape(-1)[
            : ops.chunk_rows.shape[0]
        ]
        self.stage_rows = (
            (pools.view_pages + torch.arange(pools.c, device=self.device))[:, None] * PS
            + torch.arange(PS, device=self.device)
        ).reshape(-1)[: ops.chunk_rows.shape[0]]

    def sm_view(self, layer: int, vset: int = 0) -> None:
        self.pools.sm_pull(layer, vset)
        self.link.spinner.wait_us(self.link.sm_pad_us(self.pools.remote_bytes, self.sm_kernel_us))

    def ce_pull(self, layer: int, vset: int, replay: bool = True) -> None:
        """The peers' blocks by paced copies on the current stream. On GPU one CUDA graph per (layer, set),
        captured once: the product queues its pulls with a few driver calls, and the pacing's extra launches
        (a wait per piece) must not cost host time the product does not spend."""
        pairs = self.pools.peer_pairs(layer, vset)
        if self.side is None or not pairs:
            self.link.copy_pull(pairs)
            return
        key = (*self._gkey, layer, vset)
        g = self._graphs.get(key)
        if g is None:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self.link.copy_pull(pairs)
            except Exception as e:  # noqa: BLE001 - queue the pieces one by one, and say so in the JSON
                GRAPH_ERRORS.append(f"{type(e).__name__}: {e}"[:300])
                g = False
            self._graphs[key] = g
        if g is False:
            if replay:
                self.link.copy_pull(pairs)
        elif replay:
            g.replay()

    def ce_view(self, layer: int, vset: int) -> None:
        """The copy-engine view built on the current stream: own gather, then the paced pulls."""
        self.pools.own_gather(layer, vset)
        self.ce_pull(layer, vset)

    def _start_prefetch(self, layer: int, vset: int) -> None:
        self.pools.own_gather(layer, vset)  # on the compute stream, as prefetch_gather="compute"
        if self.side is None:
            self.ce_pull(layer, vset)
            self._pending = (layer, vset, None)
            return
        gathered = torch.cuda.Event()
        gathered.record()
        with torch.cuda.stream(self.side):
            self.side.wait_event(gathered)
            self.ce_pull(layer, vset)
            done = torch.cuda.Event()
            done.record(self.side)
        self._pending = (layer, vset, done)

    def layer(self, mode: str, layer: int, next_layer: int, marks: list | None = None) -> None:
        ops, pools = self.ops, self.pools

        def mark(name):
            if marks is not None:
                marks.append((name, _event(self.device)))

        mark("start")
        ops.projections()
        ops.absorb()
        mark("projections")
        # The first read: the view (ours), then the indexer's K read.
        if mode == "stock":
            lat_pages, idx_pages = pools.stock_pages(layer)
            kv_rows = lat_pages.view(-1, LATENT_ROW)
        else:
            if mode == "inline":
                vset = 0
                self.sm_view(layer, vset)
            else:
                pending = self._pending
                if pending is None or pending[0] != layer:
                    raise RuntimeError(f"no view prefetched for layer {layer}")
                vset = pending[1]
                if pending[2] is not None:
                    torch.cuda.current_stream(self.device).wait_event(pending[2])
                self._start_prefetch(next_layer, 1 - vset)
            lat_pages, idx_pages = pools.views[vset]
            kv_rows = lat_pages.view(-1, LATENT_ROW)
        mark("view")
        ops.index_k(idx_pages)
        mark("index_k")
        ops.logits_topk()
        mark("logits_topk")
        # The chunk's latent rows stored.
        if mode == "stock":
            kv_rows.index_copy_(0, self.stock_chunk_rows, ops.chunk_rows)
        else:
            kv_rows.index_copy_(0, self.stage_rows, ops.chunk_rows)
            pools.own.kv_buffer[layer].view(-1, LATENT_ROW).index_copy_(0, self.store_rows, ops.chunk_rows)
        mark("store")
        ops.attention(kv_rows)
        mark("attention")
        ops.output()
        mark("o_proj_moe")

    def prime(self, mode: str, layer: int) -> None:
        """Before a timed run of ``prefetch``: the first layer's view built ahead, as after a layer 0."""
        if mode == "prefetch":
            self._pending = None
            self._start_prefetch(layer, 0)

    def drain(self) -> None:
        if self._pending is not None and self._pending[2] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending[2])
        self._pending = None


def _event(device):
    if _cuda(device):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def _elapsed_us(a, b) -> float:
    if isinstance(a, float):
        return (b - a) * 1e6
    return a.elapsed_time(b) * 1e3


# -- one cell --------------------------------------------------------------------------------------------------------


def time_modes(runner: Runner, modes: list[str], layers: int, rounds: int, pool_layers: int) -> dict[str, list[float]]:
    """Per-layer time of each mode, ``rounds`` rounds, modes in a rotating order within a round."""
    dev = runner.device
    out = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            _sync(dev)
            # One untimed layer first (its prefetch primes the first timed one), queued without a wait.
            runner.prime(mode, 0)
            runner.layer(mode, 0, 1 % pool_layers)
            t0 = _event(dev)
            for i in range(1, layers + 1):
                runner.layer(mode, i % pool_layers, (i + 1) % pool_layers)
            t1 = _event(dev)
            runner.drain()
            _sync(dev)
            out[mode].append(_elapsed_us(t0, t1) / layers)
    return out


def breakdown(runner: Runner, mode: str, reps: int = 3) -> dict[str, float]:
    """Each op's device time in one layer (events between the ops), median of ``reps`` layers."""
    dev = runner.device
    per: dict[str, list[float]] = {}
    for _ in range(reps):
        runner.prime(mode, 0)
        marks: list = []
        runner.layer(mode, 0, 1 % runner.pools.layers, marks)
        runner.drain()
        _sync(dev)
        for (_, a), (name, b) in zip(marks, marks[1:]):
            per.setdefault(name, []).append(_elapsed_us(a, b))
    return {k: round(statistics.median(v), 1) for k, v in per.items()}


def time_alone(device, fn, reps: int = 5) -> float:
    timer, box = Timer(device), []
    fn()
    _sync(device)
    for _ in range(reps):
        with timer.span(box):
            fn()
    return statistics.median(box)


def run_cell(args, shapes, n, prefix, tokens_list, links, device, moe, kexp, log) -> list[dict]:
    """Every ``tokens`` of one (N, prefix): the pools built once."""
    pool_layers = args.pool_layers
    chunk_pages_max = -(-(n * max(tokens_list)) // PS)
    t_build = time.perf_counter()
    pools = RankPools(n, 0, prefix // PS, chunk_pages_max, pool_layers, device, seed=n * 131 + prefix)
    _sync(device)
    build_s = time.perf_counter() - t_build
    # The views pulled both ways hold the owners' pages (checked on layer 0, both sets).
    pools.sm_pull(0, 0)
    dummy = pacing.PacedLink(links[0], 0.0, 1e9, pacing.Spinner(torch.device("cpu")))
    pools.own_gather(1 % pool_layers, 1)
    dummy.copy_pull(pools.peer_pairs(1 % pool_layers, 1))
    _sync(device)
    exact = pools.view_matches(0, 0) and pools.view_matches(1 % pool_layers, 1)
    sm_kernel_us = time_alone(device, lambda: pools.sm_pull(0, 0))
    gather_us = time_alone(device, lambda: pools.own_gather(0, 1))
    rows = []
    for tokens in tokens_list:
        t_cell = time.perf_counter()
        cache_rows = (prefix // PS + -(-(n * tokens) // PS) + 1) * PS
        ops = LayerOps(shapes, n, prefix, tokens, cache_rows, device, moe, kexp, seed=tokens)
        row = {
            "n": n,
            "prefix": prefix,
            "tokens": tokens,
            "chunk_tokens": n * tokens,
            "view_pages": pools.view_pages,
            "slots_per_rank": pools.s,
            "view_bytes": pools.view_pages * PAGE_BYTES,
            "pull_bytes": pools.remote_bytes,
            "own_gather_bytes": pools.own_bytes,
            "view_exact": exact,
            "pools_build_s": round(build_s, 2),
            "sm_pull_kernel_local_us": round(sm_kernel_us, 1),
            "own_gather_us": round(gather_us, 1),
            "logits": {"keys": ops.keys, "flops": ops.logit_flops, "block_rows": ops.block_rows},
            "links": {},
        }
        # Stock once per cell; ours per link speed, each mode timed in rounds beside a stock run.
        for li, gbps in enumerate(links):
            link = pacing.PacedLink(gbps, args.latency_us, args.local_gbps, args.spinner, args.max_pieces)
            runner = Runner(pools, ops, link, sm_kernel_us)
            if li == 0:
                for mode in ("stock", "inline", "prefetch"):  # warm-up (compiles, schedules)
                    runner.prime(mode, 0)
                    runner.layer(mode, 0, 1 % pool_layers)
                    runner.drain()
                _sync(device)
                row["stock_breakdown_us"] = breakdown(runner, "stock")
                lt = [time_alone(device, ops.logits_only, reps=3)]
                row["logits"]["us"] = round(lt[0], 1)
                row["logits"]["tflops"] = round(ops.logit_flops / (lt[0] * 1e-6) / 1e12, 1)
            times = time_modes(runner, ["stock", "inline", "prefetch"], args.layers, args.rounds, pool_layers)
            ce_us = time_alone(device, lambda: runner.ce_view(0, 1))
            sm_us = time_alone(device, lambda: runner.sm_view(0, 0))
            stock = statistics.median(times["stock"])
            res = {
                "link_gbps": gbps,
                "pull_modeled_us": round(pacing.link_time_us(pools.remote_bytes, gbps), 1),
                "ce_view_modeled_us": round(
                    gather_us + pacing.link_time_us(pools.remote_bytes, gbps, args.latency_us), 1
                ),
                "ce_view_measured_us": round(ce_us, 1),
                "sm_view_measured_us": round(sm_us, 1),
                "stock_us": round(stock, 1),
                "stock_rounds_us": [round(x, 1) for x in times["stock"]],
            }
            for mode in ("inline", "prefetch"):
                ours = statistics.median(times[mode])
                ratios = [o / s - 1 for o, s in zip(times[mode], times["stock"])]
                res[mode] = {
                    "ours_us": round(ours, 1),
                    "overhead_pct": round(100 * statistics.median(ratios), 2),
                    "overhead_pct_rounds": [round(100 * x, 2) for x in ratios],
                    "exposed_us": round(statistics.median([o - s for o, s in zip(times[mode], times["stock"])]), 1),
                    "pull_us": res["sm_view_measured_us"] if mode == "inline" else res["ce_view_measured_us"],
                }
            row["links"][str(int(gbps) if gbps == int(gbps) else gbps)] = res
            log(
                f"N={n} P={prefix} T={tokens} link={gbps}: stock {stock:.0f} us, inline "
                f"{res['inline']['overhead_pct']:+.2f}% prefetch {res['prefetch']['overhead_pct']:+.2f}% "
                f"(pull {res['pull_modeled_us']:.0f} us modeled, CE view {ce_us:.0f}, SM view {sm_us:.0f}); "
                f"logits stand-in {row['logits']['tflops']} TFLOP/s (H200 fp8 dense peak {H200_FP8_DENSE_TFLOPS:g})"
            )
        row["cell_s"] = round(time.perf_counter() - t_cell, 1)
        rows.append(row)
        del ops
    if _cuda(device):
        torch.cuda.empty_cache()
    return rows


# -- the pacing check against 2 H200s ----------------------------------------------------------------------------------

# The CP-2 view of 8fc65b5's bench_cp2_e2e on 2 H200s (fp8, 4 requests; its JSON in git history,
# docs/benchmarks/cp2_e2e.json at that commit): bytes each rank pulled, and the view's device time built
# by the copy engines (own gather + pulls) and by NCCL (own gather + all-gather).
TWO_H200 = {
    32768: {"bytes_per_rank_sent": 12910592, "copy_engine_device_us": 81.3, "nccl_device_us": 82.8},
    131072: {"bytes_per_rank_sent": 51642368, "copy_engine_device_us": 202.8, "nccl_device_us": 253.6},
    524288: {"bytes_per_rank_sent": 206569472, "copy_engine_device_us": 692.9, "nccl_device_us": 864.3},
}
TWO_H200_SOURCE = "git show 8fc65b5:docs/benchmarks/cp2_e2e.json (rows kv_format fp8: bytes_per_rank_sent, layer_view_copy_engine_device_us, layer_view_device_us)"


def pacing_check(rows: list[dict], link_gbps: float = pacing.DEFAULT_LINK_GBPS, tol: float = 0.2) -> dict:
    """The CP-2 view's device time in the model (cells with N 2 at the 370 GB/s link) against 2 H200s."""
    key = str(int(link_gbps))
    out = {"source": TWO_H200_SOURCE, "link_gbps": link_gbps, "tolerance": tol, "entries": []}
    for prefix, ref in TWO_H200.items():
        cell = next((r for r in rows if r["n"] == 2 and r["prefix"] == prefix and key in r["links"]), None)
        if cell is None:
            continue
        res = cell["links"][key]
        e = {
            "prefix": prefix,
            "bytes_model": cell["pull_bytes"],
            "bytes_2h200": ref["bytes_per_rank_sent"],
            "same_bytes": cell["pull_bytes"] == ref["bytes_per_rank_sent"],
            "copy_engine_model_us": res["ce_view_measured_us"],
            "copy_engine_2h200_us": ref["copy_engine_device_us"],
            "copy_engine_ratio": round(res["ce_view_measured_us"] / ref["copy_engine_device_us"], 3),
            "sm_model_us": res["sm_view_measured_us"],
            "nccl_2h200_us": ref["nccl_device_us"],
            "sm_vs_nccl_ratio": round(res["sm_view_measured_us"] / ref["nccl_device_us"], 3),
        }
        e["copy_engine_within_tol"] = abs(e["copy_engine_ratio"] - 1) <= tol
        e["sm_vs_nccl_within_tol"] = abs(e["sm_vs_nccl_ratio"] - 1) <= tol
        out["entries"].append(e)
    ents = out["entries"]
    out["copy_engine_pass"] = bool(ents) and all(e["copy_engine_within_tol"] and e["same_bytes"] for e in ents)
    out["sm_vs_nccl_pass"] = bool(ents) and all(e["sm_vs_nccl_within_tol"] for e in ents)
    return out


# -- the JSON --------------------------------------------------------------------------------------------------------


def _no_dirs(command: str | None) -> str | None:
    """A command with its files' folders dropped (where a run wrote its JSON is no part of the result)."""
    import re

    return None if command is None else re.sub(r"(?<=\s)/\S*/([^/\s]+)", r"\1", command)


def _cell_key(r: dict) -> tuple:
    return (r["n"], r["prefix"], r["tokens"])


def summarize(rows: list[dict], link_gbps: float) -> dict:
    key = str(int(link_gbps)) if link_gbps == int(link_gbps) else str(link_gbps)

    def ov(n, p, t, mode):
        r = next((r for r in rows if _cell_key(r) == (n, p, t) and key in r["links"]), None)
        return None if r is None else r["links"][key][mode]["overhead_pct"]

    big = [
        (r["links"][key]["prefetch"]["overhead_pct"], _cell_key(r))
        for r in rows
        if r["tokens"] >= 2048 and key in r["links"]
    ]
    worst = max(big) if big else (None, None)
    tflops = [r["logits"]["tflops"] for r in rows if r.get("logits", {}).get("tflops") is not None]
    missing = [
        {
            "n": r["n"],
            "prefix": r["prefix"],
            "tokens": r["tokens"],
            "overhead_pct": r["links"][key]["prefetch"]["overhead_pct"],
        }
        for r in rows
        if key in r["links"]
        and r["links"][key]["prefetch"]["overhead_pct"] > GOAL_PCT
        and (r["tokens"] >= 2048 or _cell_key(r) == (8, 131072, 1024))
    ]
    return {
        "link_gbps": link_gbps,
        "overhead_cp8_128k_1k_prefetch": ov(8, 131072, 1024, "prefetch"),
        "overhead_cp8_128k_1k_inline": ov(8, 131072, 1024, "inline"),
        "overhead_max_prefetch_2k_up": worst[0],
        "overhead_max_prefetch_2k_up_cell": list(worst[1]) if worst[1] else None,
        "logits_stand_in_tflops": round(statistics.median(tflops), 1) if tflops else None,
        "logits_stand_in_tflops_range": [min(tflops), max(tflops)] if tflops else None,
        "h200_fp8_dense_peak_tflops": H200_FP8_DENSE_TFLOPS,
        "goal_pct": GOAL_PCT,
        "goal_cells_missed": missing,
        "cells": len(rows),
    }


def _environment(device) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host_cpus": os.cpu_count(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    for name in ("triton", "sglang", "flash_mla"):
        try:
            mod = __import__(name)
            env[name] = getattr(mod, "__version__", "present")
        except Exception:  # noqa: BLE001
            env[name] = None
    try:
        from importlib.metadata import version

        env["sgl_flash_mla"] = version("sgl-flash-mla")
    except Exception:  # noqa: BLE001
        pass
    if _cuda(device):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        env["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        env["gpu"] = None
    return env


def _git_commit() -> str | None:
    try:
        if os.environ.get("RANK_MODEL_COMMIT"):
            return os.environ["RANK_MODEL_COMMIT"]
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


STAND_INS = [
    {
        "op": "deep_gemm.fp8_mqa_logits",
        "why": "DeepGEMM's extension does not load on the box (built for another torch)",
        "stand_in": "blocked fp8 torch._scaled_mm [rows, 64*128] x [64*128, keys] -> fp32 [rows, keys]: the op's FLOPs "
        "(2*T*keys*64*128) and output bytes; reads a 64x wider key operand than the op's [keys, 128] (from L2 "
        "in tiles); the relu and head weights are not applied",
        "speed": "measured per cell (logits.tflops), printed beside the H200's fp8 dense peak",
    },
    {
        "op": "sgl_kernel.fast_topk_transform_fused",
        "why": "sgl_kernel does not load on the box (built for another torch)",
        "stand_in": "a two-pass radix select's memory cost: two full reads of each block's fp32 logits (a per-row max "
        "and sum), then torch.topk(k=2048, sorted=False) over the first 4k columns for the indices; the page-table "
        "transform not applied. torch.topk over whole rows ran about 13 reads' worth (rank_model_torch_topk.json)",
        "speed": "stock_breakdown_us.logits_topk less logits.us; sgl_kernel's own speed is not measured (it cannot load)",
    },
    {
        "op": "get_index_k_scale_buffer (SGLang's Triton K gather)",
        "why": "SGLang's backend is not driven in the one-process model",
        "stand_in": "the indexer pages of the prefix and chunk copied into one contiguous buffer (the same bytes)",
        "speed": "stock_breakdown_us.index_k",
    },
    {
        "op": "MoE (EP 8) and the q/kv/o projections",
        "why": "no model weights",
        "stand_in": "random fp8 weights at DeepSeek-V3.2 shapes, torch._scaled_mm (tensor-wise scales, fast accumulation) "
        "and bf16 bmm for the absorbed w_uk/w_uv; the MoE is vs_upstream_stand_ins.MoEForBatch",
        "speed": "cuBLAS's; stock_breakdown_us.projections and o_proj_moe",
    },
]


def document(rows, args, device, links, extra) -> dict:
    doc = {
        "name": "rank_model",
        "label": f"MODEL: one rank of a CP-N node on one H200, the peers' pools on the same GPU, the view's pull paced to "
        f"{links[0]:g} GB/s one-way per GPU (also {', '.join(f'{x:g}' for x in links[1:]) or 'none'})",
        "command": _no_dirs("python -m benchmark.cp_shared_kv.rank_model " + " ".join(args.argv)),
        "git_commit": _git_commit(),
        "environment": _environment(device),
        "model": {
            "description": __doc__.split("**Pacing**")[0].strip(),
            "not_modelled": "chunk all-gather and MoE dispatch/combine (absent on both sides), norms/rope/quant kernels, "
            "routing imbalance, a late peer, SGLang's host metadata, NVLink contention with the peers' reads",
            "timing": f"{args.layers} layers per timed run after one untimed (its prefetch primes the next), "
            f"{args.rounds} rounds, modes in rotating order; overhead = median over rounds of ours/stock - 1 "
            "(ours and stock of the same round); exposed = median of ours - stock per layer",
            "pool_layers": args.pool_layers,
            "prefetch": "modelled from ViewMaterializer._start_prefetch (prefetch_gather='compute'): own gather on the "
            "compute stream at layer l's first read, the peers' blocks by paced copies on a highest-priority side "
            "stream, layer l+1's first read waits on its event; steady state (layer 0's in-line view, once per forward "
            f"of {DEEPSEEK_LAYERS} layers, not included)",
            "in_line": "the product's pull_pages kernel over the N pools, then a wait to the link time of the peers' bytes",
        },
        "pacing": {
            "method": pacing.__doc__.strip(),
            "link": extra.get("link"),
        },
        "stand_ins": STAND_INS,
        "rows": sorted(rows, key=_cell_key),
        "summary": summarize(rows, links[0]),
        "summary_by_link": {str(x): summarize(rows, x) for x in links},
        "pacing_check": pacing_check(rows),
        "startup_rule_inputs": startup_rule_inputs(rows, links),
    }
    doc.update(extra.get("top", {}))
    doc["ce_graph_errors"] = GRAPH_ERRORS[:5]
    return doc


def startup_rule_inputs(rows, links) -> dict:
    """Per cell: the modeled pull time, the stock layer time, their ratio, and which mode was cheaper."""
    out = {
        "note": "pull_modeled_us = peers' bytes / link; layer_us = the stock layer; the cheaper mode measured",
        "cells": [],
    }
    for r in sorted(rows, key=_cell_key):
        for res in r["links"].values():
            out["cells"].append(
                {
                    "n": r["n"],
                    "prefix": r["prefix"],
                    "tokens": r["tokens"],
                    "link_gbps": res["link_gbps"],
                    "pull_bytes": r["pull_bytes"],
                    "pull_modeled_us": res["pull_modeled_us"],
                    "layer_us": res["stock_us"],
                    "pull_over_layer": round(res["pull_modeled_us"] / res["stock_us"], 4),
                    "inline_overhead_pct": res["inline"]["overhead_pct"],
                    "prefetch_overhead_pct": res["prefetch"]["overhead_pct"],
                    "cheaper": "prefetch" if res["prefetch"]["ours_us"] < res["inline"]["ours_us"] else "inline",
                }
            )
    return out


def merge(paths: list[str]) -> tuple[list[dict], dict]:
    rows: dict[tuple, dict] = {}
    first = None
    for p in paths:
        doc = json.loads(Path(p).read_text())
        first = first or doc
        for r in doc["rows"]:
            old = rows.get(_cell_key(r))
            if old is None:
                rows[_cell_key(r)] = r
            else:
                old["links"].update(r["links"])
    return list(rows.values()), first


def repeat_section(paths: list[str]) -> dict:
    """Later runs of some cells (more rounds, another pacing), kept beside the table, not merged into it."""
    rows, first = merge(paths)
    cells = []
    for r in sorted(rows, key=_cell_key):
        for key, res in r["links"].items():
            cells.append(
                {
                    "n": r["n"],
                    "prefix": r["prefix"],
                    "tokens": r["tokens"],
                    "link_gbps": float(key),
                    "stock_us": res["stock_us"],
                    "inline_overhead_pct": res["inline"]["overhead_pct"],
                    "prefetch_overhead_pct": res["prefetch"]["overhead_pct"],
                    "prefetch_overhead_pct_rounds": res["prefetch"]["overhead_pct_rounds"],
                    "prefetch_exposed_us": res["prefetch"]["exposed_us"],
                    "ce_view_measured_us": res["ce_view_measured_us"],
                    "sm_view_measured_us": res["sm_view_measured_us"],
                }
            )
    return {
        "files": [Path(p).name for p in paths],
        "git_commit": first.get("git_commit"),
        "commands": sorted({_no_dirs(json.loads(Path(p).read_text())["command"]) for p in paths}),
        "link": first.get("pacing", {}).get("link"),
        "cells": cells,
        "pacing_check": pacing_check(rows),
    }


# -- markdown --------------------------------------------------------------------------------------------------------


def _k(prefix: int) -> str:
    return f"{prefix // 1024}K"


def _rule_fit(cells: list[dict]) -> dict:
    """The threshold on pull / layer (modeled pull over the stock layer) that, choosing prefetch at or above
    it and in line below, loses least against the cheaper mode measured in each cell (by tokens group)."""
    out = {}
    for name, keep in (
        ("tokens <= 1K", lambda c: c["tokens"] <= 1024),
        ("tokens >= 2K", lambda c: c["tokens"] >= 2048),
    ):
        group = [c for c in cells if keep(c)]
        if not group:
            continue
        best = None
        for x in sorted({0.0} | {c["pull_over_layer"] for c in group} | {1e9}):
            loss = sum(
                (c["prefetch_overhead_pct"] if c["pull_over_layer"] >= x else c["inline_overhead_pct"])
                - min(c["prefetch_overhead_pct"], c["inline_overhead_pct"])
                for c in group
            )
            if best is None or loss < best[1] - 1e-9:
                best = (x, loss)
        out[name] = {"prefetch_at_or_above": best[0], "summed_loss_pct_points": round(best[1], 2), "cells": len(group)}
    return out


def markdown(doc: dict) -> str:
    s = doc["summary"]
    links = [float(k) for k in doc["summary_by_link"]]
    env = doc["environment"]
    lines = [
        "# Rank model: one rank of a CP-N node (a model on one H200, not a node)",
        "",
        "Generated by `python -m benchmark.cp_shared_kv.rank_model --markdown docs/benchmarks/rank_model.json` "
        f"from `rank_model.json`: measured at commit `{(doc.get('git_commit') or '?')[:7]}` on {env.get('gpu')} "
        f"(torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, sgl-flash-mla "
        f"{env.get('sgl_flash_mla')}), {env.get('date_utc')}.",
        "",
        f"**{doc['label']}.** One process plays rank 0: the other ranks' pools are allocations on the same GPU, "
        "written through the plugin's pool class (`CPSharedDSATokenToKVPool.store_rows`) with the real page "
        "placement; the layer is DeepSeek-V3.2's on that rank for its own T tokens: fp8 projections, the indexer "
        "logits and top-k, FlashMLA's sparse fp8 attention (`flashmla_kv`) for T queries x 128 heads, the MoE at EP 8. "
        "Stock reads the replicated pool; ours builds the view of the prefix pages *in line* (the product's "
        "`pull_pages` kernel, then a wait to the link time of the peers' bytes) or *prefetched* a layer ahead (own "
        "gather on the compute stream, the peers' blocks by copies paced to the link on a highest-priority side "
        "stream, as the product's prefetch path does).",
        "",
        f"Command: `{doc['command']}`. Merged with its repeat by `{doc.get('merge_command')}`"
        + (
            f"; the repeat's commands: {'; '.join(f'`{c}`' for c in doc['repeat']['commands'])}"
            if doc.get("repeat")
            else ""
        )
        + ".",
        "",
        "## Summary",
        "",
        f"- CP 8, 128K prefix, 1K tokens per rank: **{s['overhead_cp8_128k_1k_prefetch']}%** with prefetch "
        f"(goal <= {GOAL_PCT:g}%), {s['overhead_cp8_128k_1k_inline']}% in line.",
        f"- Worst prefetch cell with >= 2K tokens per rank: **{s['overhead_max_prefetch_2k_up']}%** "
        f"(N, prefix, T = {s['overhead_max_prefetch_2k_up_cell']}).",
        f"- Logits stand-in: {s['logits_stand_in_tflops']} TFLOP/s median over the cells (range "
        f"{s['logits_stand_in_tflops_range']}), against the H200's fp8 dense peak of {H200_FP8_DENSE_TFLOPS:g}.",
        f"- Link: {s['link_gbps']:g} GB/s one-way per GPU (the table below also has "
        + ", ".join(f"{x:g}" for x in links[1:])
        + " GB/s).",
    ]
    missed = s.get("goal_cells_missed") or []
    key0 = str(int(links[0]))
    if missed:
        ratios = [
            r["links"][key0]["pull_modeled_us"] / r["links"][key0]["stock_us"]
            for m in missed
            for r in doc["rows"]
            if _cell_key(r) == (m["n"], m["prefix"], m["tokens"])
        ]
        lo_pull, hi_pull = min(ratios), max(ratios)
        lo_ov, hi_ov = min(m["overhead_pct"] for m in missed), max(m["overhead_pct"] for m in missed)
        lines += ["", "## Cells that miss the 1% goal (prefetch, the goal's cells)", ""]
        for m in missed:
            r = next(r for r in doc["rows"] if _cell_key(r) == (m["n"], m["prefix"], m["tokens"]))
            res = r["links"][key0]
            budget = res["stock_us"] * GOAL_PCT / 100
            exp = res["prefetch"]["exposed_us"]
            rounds = res["prefetch"]["overhead_pct_rounds"]
            lines.append(
                f"- N {m['n']}, {_k(m['prefix'])}, T {m['tokens']}: {m['overhead_pct']}% (by "
                f"{m['overhead_pct'] - GOAL_PCT:.2f} points): {exp:.0f} us exposed per layer against a 1% budget of "
                f"{budget:.0f} us; its rounds {min(rounds)}..{max(rounds)}%. The pull moves "
                f"{r['pull_bytes'] / 1e6:.1f} MB ({res['pull_modeled_us']:.0f} us at the link) and the own gather "
                f"{r['own_gather_bytes'] / 1e6:.1f} MB on the compute stream ({r['own_gather_us']:.0f} us alone)."
            )
        lines += [
            "",
            f"What the exposed time is made of, from these figures: the pull is {lo_pull:.1%}-{hi_pull:.1%} of the "
            f"layer in these cells and {lo_ov:.2f}-{hi_ov:.2f}% stays exposed (their rounds spread over several "
            "points); what stays is the pulled bytes' HBM traffic beside the "
            "layer's (the view's writes here, and on a node the peers' reads of this rank's pages: the same bytes "
            "per GPU), the own gather on the compute stream, and at T <= 1K the host's launches (below). What "
            "would take these cells under 1%: fewer bytes (reading only the pages the indexer's top-k selects, the "
            "shard-aware reads of design.md's next phase: at most 2048 rows per query instead of every prefix "
            "page), or the own gather off the compute stream. More link bandwidth does not help where the pull is "
            "already hidden.",
        ]
    rep = doc.get("repeat")
    if rep:
        rep_stock = next(
            (c["stock_us"] for c in rep["cells"] if (c["n"], c["prefix"], c["tokens"]) == (8, 131072, 1024)), 0
        )
        full_stock = next((r["links"][key0]["stock_us"] for r in doc["rows"] if _cell_key(r) == (8, 131072, 1024)), 0)
        lines += [
            "",
            f"## Repeat of the goal cells (commit `{(rep.get('git_commit') or '?')[:7]}`, 11 rounds, a paced pull in "
            "about 8 pieces and no added latency)",
            "",
            "| N | prefix | T/rank | stock us | in line % | prefetch % | prefetch rounds % | exposed us |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in rep["cells"]:
            if c["tokens"] < 1024 and c["n"] == 2:
                continue
            rr = c["prefetch_overhead_pct_rounds"]
            lines.append(
                f"| {c['n']} | {_k(c['prefix'])} | {c['tokens']} | {c['stock_us']:.0f} | {c['inline_overhead_pct']:+.2f} | "
                f"{c['prefetch_overhead_pct']:+.2f} | {min(rr)}..{max(rr)} | {c['prefetch_exposed_us']:.0f} |"
            )
        lines += [
            "",
            f"The repeat's CP-8 / 128K / 1K stock layer ran {rep_stock / 1e3:.1f} ms against the full run's "
            f"{full_stock / 1e3:.1f} ms: a fresh process that ran a few seconds of work, where the layer at T = 1K is "
            "likely bound by the host's launches (below), so ours' extra launches show as device time. The full "
            "run's figure, warm and in line with its neighbours, is the one the summary keeps; the repeat says the "
            "cell is at the goal's edge, not under it. At 512K the rounds of one cell spread over several points "
            "(clocks under 1.2-1.5 PFLOP/s of fp8 GEMMs): the prefetch figures there near 1% are within that "
            "spread of it.",
        ]
    for label, pc in (("full run", doc.get("pacing_check")), ("repeat", (rep or {}).get("pacing_check"))):
        if not pc or not pc.get("entries"):
            continue
        lines += [
            "",
            f"## Pacing check against 2 H200s ({label}): {'PASS' if pc['copy_engine_pass'] else 'FAIL'} (copy engines), "
            f"{'PASS' if pc['sm_vs_nccl_pass'] else 'FAIL'} (SM pull vs NCCL)",
            "",
            f"The CP-2 view's device time, same bytes, {pc['link_gbps']:g} GB/s, tolerance {pc['tolerance']:.0%}; "
            f"2-H200 figures from {pc['source']}.",
            "",
            "| prefix | bytes pulled | copy engines: model us | 2 H200 us | ratio | SM pull: model us | NCCL on 2 H200 us | ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for e in pc["entries"]:
            lines.append(
                f"| {_k(e['prefix'])} | {e['bytes_model']} {'(same)' if e['same_bytes'] else '(DIFFERENT)'} | "
                f"{e['copy_engine_model_us']:.0f} | {e['copy_engine_2h200_us']:.0f} | {e['copy_engine_ratio']:.2f} | "
                f"{e['sm_model_us']:.0f} | {e['nccl_2h200_us']:.0f} | {e['sm_vs_nccl_ratio']:.2f} |"
            )
    lines += [
        "",
        "Reading the check: the copy-engine view in the model costs its own gather, the pieces' copies and waits "
        "and its launches; in the full run (about 64 pieces, a 25 us latency added) it cost 1.26-1.66x what 2 H200s "
        "measured, so the table's prefetch pulls are dearer than a node's, not cheaper; with about 8 pieces and no "
        "added latency (the repeat) 128K and 512K come within 20% and 32K does not (a fixed cost of about 60 us in "
        "a cold process). The SM pull is paced to the same 370 GB/s; NCCL's all-gather on those 2 H200s moved the "
        "bytes at 242 GB/s bus bandwidth (512K), so the SM path here is 0.46-0.74 of NCCL's time. The product's "
        "in-node in-line path is the pull kernel, not NCCL, and its NVLink rate on 2 GPUs is not measured: if it "
        "ran at NCCL's rate, an in-line view would cost about 1.5x the pull column below.",
    ]
    for x in links:
        key = str(int(x)) if x == int(x) else str(x)
        lines += [
            "",
            f"## Link {x:g} GB/s one-way per GPU (full run)",
            "",
            "| N | prefix | T/rank | stock layer us | pull us (modeled) | in line us | in line % | in line exposed us "
            "| prefetch us | prefetch % | prefetch exposed us | CE view us | SM view us |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["rows"]:
            res = r["links"].get(key)
            if res is None:
                continue
            i, p = res["inline"], res["prefetch"]
            lines.append(
                f"| {r['n']} | {_k(r['prefix'])} | {r['tokens']} | {res['stock_us']:.0f} | {res['pull_modeled_us']:.0f} | "
                f"{i['ours_us']:.0f} | {i['overhead_pct']:+.2f} | {i['exposed_us']:.0f} | {p['ours_us']:.0f} | "
                f"{p['overhead_pct']:+.2f} | {p['exposed_us']:.0f} | {res['ce_view_measured_us']:.0f} | "
                f"{res['sm_view_measured_us']:.0f} |"
            )
    sri = doc.get("startup_rule_inputs", {}).get("cells", [])
    if sri:
        lines += [
            "",
            "## For the startup rule (in line or a layer ahead)",
            "",
            "`startup_rule_inputs` in the JSON lists per cell and link the modeled pull (peers' bytes / link), the "
            "stock layer, their ratio and both modes' overhead. The threshold on pull / layer that loses least "
            "against the cheaper mode measured in each cell (prefetch at or above it, in line below):",
            "",
        ]
        for name, fit in _rule_fit(sri).items():
            lines.append(
                f"- {name}: prefetch at pull / layer >= {fit['prefetch_at_or_above']:.3f} "
                f"({fit['cells']} cells; {fit['summed_loss_pct_points']} points lost over them in all)."
            )
        lines += [
            "",
            "At T <= 1K the prefetch costs 3-7% at 32K (and at 128K with T 512) where its pull is 35-450 us, and "
            "in line 1-3%. The layer there is likely bound by the host's launches in this model rather than the "
            "GPU's work: at CP 8 / 32K the breakdown below puts o_proj + MoE at 5.2 ms for T 512 against 4.1 ms for "
            "T 2K (time that does not grow with the work), and the MoE stand-in launches about a dozen kernels per "
            "expert for 32 experts. The prefetch adds launches and an event wait per layer, which then show as "
            "device time. A server's fused MoE launches far fewer kernels, so these cells likely overstate the "
            "prefetch's fixed cost; the model does not say by how much (not measured). At T >= 2K the prefetch is "
            "never dearer than in line beyond the rounds' spread.",
        ]
    lines += ["", "## Where the stock layer's time goes (full run, us, one layer)", ""]
    lines += [
        "| N | prefix | T | projections | index K read | logits + top-k (logits alone) | store | attention | o_proj + MoE |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r["n"] != 8:
            continue
        b = r.get("stock_breakdown_us", {})
        lines.append(
            f"| {r['n']} | {_k(r['prefix'])} | {r['tokens']} | {b.get('projections', 0):.0f} | {b.get('index_k', 0):.0f} | "
            f"{b.get('logits_topk', 0):.0f} ({r['logits'].get('us', 0):.0f}) | {b.get('store', 0):.0f} | "
            f"{b.get('attention', 0):.0f} | {b.get('o_proj_moe', 0):.0f} |"
        )
    fr = doc.get("first_run_torch_topk")
    if fr:
        lines += [
            "",
            f"A first run (`{fr['file']}`, commit `{(fr.get('git_commit') or '?')[:7]}`) is kept for its top-k: "
            f"{fr['why_superseded']}. Its summary: CP 8 / 128K / 1K {fr['summary']['overhead_cp8_128k_1k_prefetch']}% "
            f"prefetched, {fr['summary']['overhead_cp8_128k_1k_inline']}% in line.",
        ]
    lines += ["", "## Stand-ins (ops that cannot run on the box, and what runs instead)", ""]
    for st in doc["stand_ins"]:
        lines.append(f"- `{st['op']}`: {st['stand_in']}. Why: {st['why']}. Speed: {st['speed']}.")
    lines += [
        "- Real kernels: FlashMLA's sparse fp8 decode kernel (`flash_mla_with_kvcache`, through SGLang's wrapper), "
        "the product's gather and pull kernels, cuBLAS fp8 GEMMs.",
        "",
        "## What the model cannot show",
        "",
        doc["model"]["not_modelled"] + ". " + doc["model"]["prefetch"] + ".",
        "",
    ]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--prefix", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[pacing.DEFAULT_LINK_GBPS, pacing.SLOW_LINK_GBPS])
    ap.add_argument("--latency-us", type=float, default=pacing.DEFAULT_LATENCY_US)
    ap.add_argument("--max-pieces", type=int, default=pacing.MAX_PIECES, help="pieces a paced copy pull is cut into")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pool-layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (tests)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--time-budget-s", type=float, default=0, help="stop starting cells after this many seconds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", default=None, help="merge partial JSONs into --out")
    ap.add_argument("--repeat", nargs="+", default=None, help="with --merge: later runs of some cells, attached apart")
    ap.add_argument("--first-run", default=None, help="with --merge: a superseded run, its summary attached")
    ap.add_argument("--markdown", nargs="+", default=None, help="JSON(s) to render as the markdown table")
    ap.add_argument("--md-out", default=None)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    if args.markdown:
        rows, first = merge(args.markdown)
        doc = dict(first, rows=sorted(rows, key=_cell_key))
        text = markdown(doc)
        if args.md_out:
            Path(args.md_out).write_text(text)
        else:
            print(text)
        return 0
    if args.merge:
        rows, first = merge(args.merge)
        links = sorted({float(k) for r in rows for k in r["links"]}, reverse=True)
        doc = dict(first)
        doc["rows"] = sorted(rows, key=_cell_key)
        doc["summary"] = summarize(rows, links[0])
        doc["summary_by_link"] = {str(x): summarize(rows, x) for x in links}
        doc["pacing_check"] = pacing_check(rows)
        doc["startup_rule_inputs"] = startup_rule_inputs(rows, links)
        doc["merged_from"] = [Path(p).name for p in args.merge]
        doc["command"] = _no_dirs(doc.get("command"))
        doc["merge_command"] = _no_dirs("python -m benchmark.cp_shared_kv.rank_model " + " ".join(args.argv))
        if args.repeat:
            doc["repeat"] = repeat_section(args.repeat)
        if args.first_run:
            first_doc = json.loads(Path(args.first_run).read_text())
            doc["first_run_torch_topk"] = {
                "file": Path(args.first_run).name,
                "git_commit": first_doc.get("git_commit"),
                "command": _no_dirs(first_doc.get("command")),
                "why_superseded": "top-k by torch.topk over whole rows (about 13 reads of the logits, longer than the op it "
                "stands for) and each paced piece a Python launch (the copy-engine view 5x its link time)",
                "summary": first_doc.get("summary"),
            }
        Path(args.out).write_text(json.dumps(doc, indent=1))
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = Shapes.tiny() if args.tiny else Shapes()
    t_start = time.perf_counter()

    def log(msg):
        print(f"[rank_model {time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    _publish(device, shapes, max(args.prefix) + max(args.n) * max(args.tokens) + PS)
    probe_logits_out(device)
    args.spinner = pacing.Spinner(device)
    args.local_gbps = pacing.measure_local_copy_gbps(device, (256 << 20) if _cuda(device) else (4 << 20))
    spin_check = None
    if _cuda(device):
        spin_check = {
            "asked_us": 200.0,
            "measured_us": round(time_alone(device, lambda: args.spinner.wait_us(200.0)), 1),
        }
    log(f"spinner {args.spinner.describe()}, local copy {args.local_gbps:.0f} GB/s, spin check {spin_check}")
    from benchmark.cp_shared_kv.vs_upstream_stand_ins import MoEForBatch

    moe = MoEForBatch(max(args.tokens), device)
    max_keys = _round_up(max(args.prefix) + max(args.n) * max(args.tokens) // 2, 16)
    kexp = make_kexp(max_keys, shapes.index_heads * shapes.index_dim, device, _cuda(device))
    links = args.link_gbps
    extra = {
        "link": {
            "links_gbps": links,
            "copy_engine_latency_us": args.latency_us,
            "local_copy_gbps_measured": round(args.local_gbps, 1),
            "spinner": args.spinner.describe(),
            "spin_check": spin_check,
            "pieces": f"a pull cut into about {args.max_pieces} pieces of at least {pacing.MIN_PIECE_BYTES} B, each padded",
        },
        "top": {"shapes": asdict(shapes), "logits_out": LOGITS_OUT["note"]},
    }
    rows: list[dict] = []
    errors: list[dict] = []
    done_all = True
    for n in args.n:
        for prefix in args.prefix:
            if args.time_budget_s and time.perf_counter() - t_start > args.time_budget_s:
                log(f"time budget spent: N={n} prefix={prefix} not run")
                done_all = False
                continue
            try:
                rows += run_cell(args, shapes, n, prefix, args.tokens, links, device, moe, kexp, log)
            except Exception as e:  # noqa: BLE001 - keep the other cells; the error goes into the JSON
                import traceback

                log(f"N={n} prefix={prefix} FAILED: {type(e).__name__}: {e}")
                errors.append({"n": n, "prefix": prefix, "error": traceback.format_exc()[-2000:]})
                done_all = False
                if _cuda(device):
                    torch.cuda.empty_cache()
            extra["top"]["errors"] = errors
            if args.out:
                doc = document(rows, args, device, links, extra)
                doc["complete"] = False
                Path(args.out).write_text(json.dumps(doc, indent=1))
    doc = document(rows, args, device, links, extra)
    doc["complete"] = done_all
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    log(f"summary {json.dumps(doc['summary'])}")
    log(
        f"pacing check: copy engines {doc['pacing_check'].get('copy_engine_pass')}, SM vs NCCL {doc['pacing_check'].get('sm_vs_nccl_pass')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
