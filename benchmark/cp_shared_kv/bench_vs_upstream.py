"""Side by side on the same batches: SGLang's stock replicated DSA pool, SGLang 0.5.23's own
``--enable-kv-cache-sharding`` (the page-interleave pool), and ours (``--enable-cp-shared-kv``).

Two CP ranks (NCCL on GPUs, gloo on CPU). Every path is SGLang's own class with its own tensors:

- ``stock``: ``DSATokenToKVPool`` over the whole logical space (what every CP rank holds today);
- ``upstream``: ``PageInterleaveDSATokenToKVPool`` with the ``PageShardSpec`` that
  ``page_interleave.make_page_shard_spec`` computes for these server limits (eight contexts of
  prefix scratch plus the chunk, double-buffered), its own gather communicator and side stream
  (CUDA only: it builds a ``PyNcclCommunicator``);
- ``ours``: ``CPSharedDSATokenToKVPool`` (the class the plugin's pool hook installs).

Logical pages come from one ``PageInterleavePoolAllocator`` (SGLang's owner-rotating allocator,
with per-request rotation bases, as the scheduler drives it), so the three paths see the same
``req_to_token``. The workload is chunked prefill as the scheduler issues it: four requests in
chunks of ``chunk`` new tokens per batch (a later chunk of one request beside the first chunk of
the next makes the mixed batches), then a second turn in which four requests reuse first-turn
prefixes from the radix cache (two of them the same one: ours reads it once, through the hint the
plugin's ``ForwardBatch.init_new`` hook derives from the radix paths, handed to the pool as that hook does).

Per batch: SGLang's ``prepare_kv_shard_forward`` (``kv_shard_hooks``) with a stand-in forward
batch holding the four fields it reads. ``DSABackend.init_forward_metadata`` needs a model
runner and reaches sgl_kernel ops, so it is not called; the pool calls it makes are driven in
its order instead. Per layer: the indexer K write and read (``set_index_k_scale_buffer``,
``get_index_k_scale_buffer`` with logical pages), then the latent write (``set_mla_kv_buffer``)
and read (``translate_loc_to_scratch`` of the page table, ``get_key_buffer``).

Correctness (every batch and layer): indexer reads equal byte for byte across the paths; the
indexer top-k of sampled queries (plain-torch reference over those reads) is identical; sparse
MLA over each path's buffer and translated rows (FlashMLA sparse prefill on GPU, our torch
reference on CPU) gives bit-identical output and LSE.

Measured per batch, in the same run: the read path's host-inclusive and device time per layer
(the plan amortized over the layers plus that layer's reads, after its writes), the whole forward
(every layer's writes, reads and sparse prefill back to back, upstream's layer-ahead gather in
flight), bytes received per rank, peak view / scratch memory, and host syncs per forward
(``torch.cuda.set_sync_debug_mode``), ours and upstream's apart.

    python -m benchmark.cp_shared_kv.bench_vs_upstream                 # 2 GPUs, writes vs_upstream.json
    python -m benchmark.cp_shared_kv.bench_vs_upstream --device cpu --scale smoke --out vs_upstream_cpu

A scale too long for one sitting runs in pieces (``--batches FIRST:LAST``: the batches before FIRST
are written into every pool, planned and ended, nothing read or timed), and ``--merge`` joins the
pieces' rows into one result with the summary over all of them:

    python -m benchmark.cp_shared_kv.bench_vs_upstream --scale 128k --batches 1:16 --out vs_upstream_128k_a
    python -m benchmark.cp_shared_kv.bench_vs_upstream --scale 128k --batches 17:31 --out vs_upstream_128k_b
    python -m benchmark.cp_shared_kv.bench_vs_upstream --merge vs_upstream_32k vs_upstream_128k_a \
        vs_upstream_128k_b --out vs_upstream
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmark.cp_shared_kv.bench_common import save_plot, write_result

PATHS = ("stock", "upstream", "ours")


@dataclass(frozen=True)
class Scale:
    """Sizes of one run: request lengths, new tokens per batch, second-turn new tokens, context."""

    lengths: tuple[int, ...]
    chunk: int
    turn2_new: int
    context_len: int
    layers: int
    topk: int
    sample_queries: int


SCALES = {
    # 4 requests growing to 32K in 8K chunks, and to 128K in 16K chunks.
    "32k": Scale((32768, 30720, 28672, 26624), 8192, 1024, 34816, 4, 2048, 64),
    "128k": Scale((131072, 122880, 114688, 106496), 16384, 1024, 133120, 4, 2048, 64),
    # CPU smoke: the same shapes of batches, small.
    "smoke": Scale((640, 576, 512, 448), 256, 64, 1024, 2, 64, 8),
    # CI: one layer, a few pages; still current, mixed, history and shared-prefix batches.
    "tiny": Scale((320, 256, 192, 128), 192, 64, 512, 1, 64, 4),
}


# ----------------------------------------------------------------------------------------------
# the workload: batches as the scheduler issues them
# ----------------------------------------------------------------------------------------------


def schedule(scale: Scale, ps: int, cp_size: int = 2) -> list[list[tuple[int, int, int]]]:
    """Batches of ``(request slot, prefix_len, seq_len)``.

    Turn 1: requests 0..3 in order, ``chunk`` new tokens per batch; a request that finishes
    mid-batch leaves the rest of the budget to the next one. Turn 2 (one batch): slots 4..7
    continue requests 0, 0, 1, 2 from their cached (page-aligned) prefixes with ``turn2_new`` tokens,
    batched as SGLang's prefill admission (``PrefillAdder._kv_shard_reserve_scratch``) would against
    our view arena's spec (the allocator's): ``cp_size * sum_i ceil(prefix_pages_i / cp_size)`` pages
    of prefix per batch at most. SGLang's own scratch (eight contexts) admits every such batch too.
    """
    batches, cur = [], []
    budget = scale.chunk
    for slot, length in enumerate(scale.lengths):
        done = 0
        while done < length:
            take = min(budget, length - done)
            cur.append((slot, done, done + take))
            done += take
            budget -= take
            if budget == 0:
                batches.append(cur)
                cur, budget = [], scale.chunk
    if cur:
        batches.append(cur)
    from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_regions
    from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import arena_contexts

    max_prefix_pages = arena_regions(cp_size, ps, scale.context_len, scale.chunk, arena_contexts())[0] // ps
    cur, block = [], 0
    for slot, src in zip(range(4, 8), (0, 0, 1, 2)):
        prefix = scale.lengths[src] // ps * ps
        need = -(-(prefix // ps) // cp_size)
        if cur and cp_size * (block + need) > max_prefix_pages:
            batches.append(cur)
            cur, block = [], 0
        cur.append((slot, prefix, prefix + scale.turn2_new))
        block += need
    batches.append(cur)
    return batches


SHARED_PREFIX_SLOTS = (4, 5)  # turn-2 requests that both continue request 0


def batch_kind(batch) -> str:
    prefixed = [p > 0 for _, p, _ in batch]
    return "current" if not any(prefixed) else "history" if all(prefixed) else "mixed"


# ----------------------------------------------------------------------------------------------
# one rank
# ----------------------------------------------------------------------------------------------


class _Layer:
    def __init__(self, layer_id: int):
        self.layer_id = layer_id


def _no_dcp():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)


def _dsa_kwargs(ps: int, layers: int, device: torch.device, fp8: bool) -> dict:
    return dict(
        page_size=ps,
        kv_lora_rank=512,
        dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=layers,
        device=str(device),
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=656 if fp8 else 576,
    )


class _ShardGroup:
    """What SGLang's page-interleave pool reads of its ``GroupCoordinator``: size, rank, a CPU group, the device."""

    def __init__(self, rank: int, world: int, device: torch.device, cpu_group):
        self.world_size = world
        self.rank_in_group = rank
        self.cpu_group = cpu_group
        self.device = device


def upstream_spec(rank: int, world: int, ps: int, context_len: int, chunked_prefill_size: int):
    """``PageShardSpec`` by ``page_interleave.make_page_shard_spec``'s own rule (eight contexts + the chunk)."""
    from sglang.srt.mem_cache import page_interleave
    from sglang.srt.utils.common import ceil_align

    granule = world * ps
    return page_interleave.PageShardSpec(
        shard_rank=rank,
        shard_size=world,
        page_size=ps,
        max_prefix_tokens=page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS * ceil_align(context_len, granule),
        chunk_tokens=ceil_align(chunked_prefill_size, ps),
    )


def _chunk_tensors(tokens: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    nope = torch.randn(tokens, 1, 512, generator=g).to(torch.bfloat16)
    rope = torch.randn(tokens, 1, 64, generator=g).to(torch.bfloat16)
    k = (torch.randn(tokens, 128, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(tokens, 1, generator=g) + 0.5
    return [t.to(device) for t in (nope, rope, k, scale)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Gate:
    """Start a timed section on every rank together: the device drained, then a gloo barrier.

    Without it a rank that finished its untimed work (the correctness checks) first would time its
    wait for the other inside the next section's first collective.
    """

    def __init__(self, device: torch.device, cpu_group):
        self.device = device
        self.group = cpu_group

    def __call__(self) -> None:
        import torch.distributed as dist

        _sync(self.device)
        dist.barrier(group=self.group)


def _begin_batch(name: str, pool, hint, req_to_token: torch.Tensor, fb) -> None:
    """A sharded pool's batch start as SGLang makes it: for ours, the shared-prefix hint the plugin's
    ``ForwardBatch.init_new`` hook hands the batch; then ``prepare_kv_shard_forward``."""
    from sglang.srt.layers.attention.kv_shard_hooks import prepare_kv_shard_forward

    if name == "ours":
        pool.read.shared_prefix = hint
    prepare_kv_shard_forward(pool, req_to_token, fb)


class _SyncCounter:
    """Counts host syncs (CUDA sync-debug warnings) while active; 0 on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.count = 0

    def __enter__(self):
        if self.device.type == "cuda":
            self._ctx = warnings.catch_warnings(record=True)
            self._log = self._ctx.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self.count += sum("synchroniz" in str(w.message) for w in self._log)
            self._ctx.__exit__(*exc)
        return False


def _sparse_attention(q, kv_rows, rows, kv_format: str, device: torch.device):
    """Sparse MLA over a whole buffer and its row ids: FlashMLA on GPU, the torch reference on CPU."""
    from sglang_cp_shared_kv.srt.mem_cache.kv_formats import decode_mla_rows

    sm_scale = 576**-0.5
    if device.type == "cuda":
        import flash_mla

        kv = decode_mla_rows(kv_rows, kv_format).to(torch.bfloat16).unsqueeze(1)
        out, _, lse = flash_mla.flash_mla_sparse_fwd(q, kv, rows.int().unsqueeze(1), sm_scale, 512, use_legacy=True)
        return out, lse
    from sglang_cp_shared_kv.reference.dsa_reference import sparse_mla

    # The reference reads row 0 for invalid (-1) slots and masks them; a buffer's row 0 may be a
    # never-written trash row, so hand it only the rows the queries select (row 0: a valid one).
    valid = rows >= 0
    picked = kv_rows[rows.clamp(min=0).reshape(-1)]
    local = torch.arange(picked.shape[0], device=rows.device).view_as(rows)
    return sparse_mla(q, picked, kv_format, torch.where(valid, local, -1), sm_scale)


def _topk_positions(k_u8, k_scale, q_u8, q_scale, weights, key_lens: list[int], q_req, q_pos, topk: int):
    """Top-k visible key positions per sampled query (score desc, position asc), -1 padded; plain torch."""
    from sglang_cp_shared_kv.reference.dsa_reference import indexer_scores

    starts = [0]
    for n in key_lens[:-1]:
        starts.append(starts[-1] + n)
    out = torch.full((len(q_req), topk), -1, dtype=torch.int64, device=k_u8.device)
    for t, (b, pos) in enumerate(zip(q_req, q_pos)):
        keys = k_u8[starts[b] : starts[b] + pos + 1].unsqueeze(0)
        scales = k_scale.reshape(-1)[starts[b] : starts[b] + pos + 1].unsqueeze(0)
        s = indexer_scores(q_u8[t : t + 1], q_scale[t : t + 1], weights[t : t + 1], keys, scales)[0]
        order = torch.sort(-s, stable=True).indices[:topk]
        out[t, : order.numel()] = order
    return out


def _relative_paths(text: str) -> str:
    """A profile's file names relative to this checkout or to the package directory that holds them."""
    import site
    import sysconfig

    root = str(Path(__file__).resolve().parents[2]) + "/"
    dirs = {sysconfig.get_paths()["purelib"], *site.getsitepackages(), *sys.path[1:]}
    for d in sorted((d for d in dirs if d and Path(d).is_absolute()), key=len, reverse=True):
        text = text.replace(d.rstrip("/") + "/", "")
    return text.replace(root, "")


def _rank(rank: int, world: int, args: dict) -> dict:
    import numpy as np
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import shared_prefix_from_paths
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    scale = SCALES[args["scale"]]
    ps, fp8 = args["page_size"], args["kv_format"] == "fp8"
    kv_format = args["kv_format"]
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if args["device"] == "cuda" else torch.device("cpu")
    paths = [p for p in args["paths"] if p != "upstream" or device.type == "cuda"]
    layers = scale.layers
    # Pool capacity per rank: every request's tokens (page-padded), over the ranks, plus slack.
    total_tokens = sum(-(-n // ps) * ps for n in scale.lengths) + 4 * (scale.turn2_new + ps)
    size = (-(-total_tokens // (world * ps)) + 2 * world) * ps
    kwargs = _dsa_kwargs(ps, layers, device, fp8)
    group = CPGroup()
    import torch.distributed as dist

    cpu_group = dist.new_group(backend="gloo")  # the timing gate's barriers, and SGLang's pool's CPU group
    gate = _Gate(device, cpu_group)
    pools: dict[str, object] = {}
    with _no_dcp():
        if "ours" in paths:
            pools["ours"] = CPSharedDSATokenToKVPool(size, cp_rank=rank, cp_size=world, cp_group=group, **kwargs)
            # The view arena the plugin's allocator hook attaches, sized from the same server limits.
            from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import (
                arena_contexts,
                make_arena_spec,
                prefetch_enabled,
            )

            arena = make_arena_spec(rank, world, ps, scale.context_len, scale.chunk, arena_contexts())
            ours_arena_bytes = pools["ours"].attach_view_arena(arena, prefetch_enabled())
        phys = size // ps + 1
        if "upstream" in paths:
            from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

            spec = upstream_spec(rank, world, ps, scale.context_len, scale.chunk)
            pools["upstream"] = PageInterleaveDSATokenToKVPool(
                size, shard_spec=spec, shard_group=_ShardGroup(rank, world, device, cpu_group), **kwargs
            )
        stock = DSATokenToKVPool(world * phys * ps - ps, **kwargs)  # the same logical space, unsharded
        pools["stock"] = stock
    stock.dcp_replicated = True
    some_sharded = pools.get("ours") or pools.get("upstream")
    allocator = PageInterleavePoolAllocator(
        size,
        physical_page_size=ps,
        shard_size=world,
        dtype=kwargs["dtype"],
        device=str(device),
        kvcache=some_sharded,
        need_sort=True,
    )
    max_len = max(scale.lengths) + scale.turn2_new + ps
    req_to_token = torch.zeros((8, -(-max_len // ps) * ps), dtype=torch.int32, device=device)
    bases: dict[int, object] = {}

    def alloc(slot: int, prefix: int, seq: int, src: int | None = None) -> None:
        if src is not None and prefix:  # a radix-cache hit: the source request's pages and base
            req_to_token[slot, :prefix] = req_to_token[src, :prefix]
            bases[slot] = bases[src]
        t = lambda v: torch.tensor([v], device=device)  # noqa: E731
        last = int(req_to_token[slot, prefix - 1]) if prefix else 0
        rb = [bases.get(slot)]
        out = allocator.alloc_extend(t(prefix), t(prefix), t(seq), t(seq), t(last), seq - prefix, rotation_bases=rb)
        if out is None:
            raise RuntimeError(f"allocator out of pages for slot {slot} ({prefix} -> {seq})")
        bases[slot] = rb[0]
        req_to_token[slot, prefix:seq] = out.to(torch.int32)

    batches = schedule(scale, ps, world)
    turn2_src = {4: 0, 5: 0, 6: 1, 7: 2}
    gen = torch.Generator().manual_seed(1234)
    rows_out, correct_all = [], True
    profiler = None
    if args.get("profile_host") and rank == 0:  # where our forward's host time goes (cProfile, rank 0)
        import cProfile

        profiler = cProfile.Profile()
    up_scratch = 0
    if "upstream" in pools:
        up_scratch = sum(t.numel() * t.element_size() for s in pools["upstream"]._slots for t in s.tensors.values())
    page_bytes = ps * (kwargs["kv_cache_dim"] + 132)

    first, last = args.get("batches") or (1, len(batches))
    for bi, batch in enumerate(batches):
        if bi + 1 > last:
            break
        for slot, prefix, seq in batch:
            alloc(slot, prefix, seq, turn2_src.get(slot) if prefix and slot >= 4 else None)
        slots = [s for s, _, _ in batch]
        prefix_lens = [p for _, p, _ in batch]
        seq_lens = [n for _, _, n in batch]
        extend = [n - p for p, n in zip(prefix_lens, seq_lens)]
        new_tokens = sum(extend)
        req_idx = torch.tensor(slots, device=device)
        new_locs = torch.cat([req_to_token[s, p:n].long() for s, p, n in batch])
        every = torch.cat([req_to_token[s, :n].long() for s, _, n in batch])
        max_seq = max(seq_lens)
        lens_t = torch.tensor(seq_lens, device=device)
        table = req_to_token[req_idx, :max_seq].long()
        logical_pages = req_to_token[req_idx, :max_seq:ps].long() // ps
        chunks = [_chunk_tensors(new_tokens, 100 * bi + layer, device) for layer in range(layers)]
        # Sampled queries (correctness) and all-query pseudo-random keys (the timed sparse prefill).
        q_req = [b for b in range(len(batch)) for _ in range(extend[b])]
        q_pos = [p + j for p, e in zip(prefix_lens, extend) for j in range(e)]
        pick = sorted(set(np.linspace(0, new_tokens - 1, scale.sample_queries).astype(int).tolist()))
        s_req, s_pos = [q_req[i] for i in pick], [q_pos[i] for i in pick]
        q_idx = (torch.randint(0, 256, (len(pick), 64, 128), generator=gen, dtype=torch.uint8)).to(device)
        q_scale = (torch.rand(len(pick), 64, generator=gen) + 0.5).to(device)
        weights = torch.randn(len(pick), 64, generator=gen).to(device)
        q_attn = (torch.randn(len(pick), 128, 576, generator=gen) * 0.5).to(torch.bfloat16).to(device)
        q_starts = torch.tensor([sum(seq_lens[:b]) for b in range(len(batch))], device=device)
        qr, qp = torch.tensor(q_req, device=device), torch.tensor(q_pos, device=device)
        rand_pos = (torch.rand(new_tokens, scale.topk, generator=gen).to(device) * (qp + 1).unsqueeze(1)).long()
        fwd_tokens = (q_starts[qr].unsqueeze(1) + rand_pos).reshape(-1)  # index into `every`
        q_fwd = None
        if device.type == "cuda":
            q_fwd = (torch.randn(new_tokens, 128, 576, generator=gen) * 0.5).to(torch.bfloat16).to(device)
        fb = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            req_pool_indices=req_idx,
            extend_prefix_lens_cpu=prefix_lens,
            seq_lens_cpu=seq_lens,
        )
        # The shared-prefix hint the plugin computes from the radix cache: a turn-2 request's prefix ends at
        # the node of the request it continues (one node per source request), a turn-1 chunk's at its own.
        radix = [[(turn2_src.get(s, s), p)] if p else [] for s, p, _ in batch]
        hint = shared_prefix_from_paths(radix, prefix_lens, ps)
        if bi + 1 < first:  # before the measured range: its KV in every pool, as the scheduler leaves it
            with _no_dcp():
                for name in paths:
                    pool = pools[name]
                    if name != "stock":
                        _begin_batch(name, pool, hint, req_to_token, fb)
                    for layer in range(layers):
                        nope, rope, k, kscale = chunks[layer]
                        pool.set_index_k_scale_buffer(layer, new_locs, k, kscale)
                        pool.set_mla_kv_buffer(_Layer(layer), new_locs, nope, rope)
                    if name != "stock":
                        pool.end_shard_extend()
            continue
        row: dict = {"batch": bi + 1, "kind": batch_kind(batch), "new_tokens": new_tokens, "seq_tokens": sum(seq_lens)}
        row["shared_prefix"] = set(SHARED_PREFIX_SLOTS) <= set(slots)
        results: dict[str, list] = {}

        for name in paths:
            pool = pools[name]
            sharded = name != "stock"
            # -- correctness + read timing: each layer's writes, then its timed reads. Twice: the first
            # pass warms what a server's warm-up would (Triton compiles per shape, the transport's
            # registration), the second is what the row records. --
            for _warm_then_timed in range(2):
                begin_t = begin_dev = 0.0
                gate()
                counter = _SyncCounter(device)
                t0 = time.perf_counter()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
                if ev:
                    ev[0].record()
                with _no_dcp(), counter:
                    if sharded:
                        _begin_batch(name, pool, hint, req_to_token, fb)
                if ev:
                    ev[1].record()
                _sync(device)
                begin_t = (time.perf_counter() - t0) * 1e6
                begin_dev = ev[0].elapsed_time(ev[1]) * 1e3 if ev else 0.0
                read_t, read_dev, per_layer = [], [], []
                with _no_dcp():
                    for layer in range(layers):
                        nope, rope, k, kscale = chunks[layer]
                        with counter:
                            pool.set_index_k_scale_buffer(layer, new_locs, k, kscale)
                        gate()
                        t0 = time.perf_counter()
                        if ev:
                            ev[0].record()
                        with counter:
                            got_k, got_s = pool.get_index_k_scale_buffer(
                                layer, lens_t, logical_pages, sum(seq_lens), max_seq
                            )
                        _sync(device)
                        t_idx = time.perf_counter() - t0
                        if ev:
                            ev[1].record()
                            ev[1].synchronize()
                        d_idx = ev[0].elapsed_time(ev[1]) * 1e3 if ev else 0.0
                        with counter:
                            pool.set_mla_kv_buffer(_Layer(layer), new_locs, nope, rope)
                        gate()
                        t0 = time.perf_counter()
                        if ev:
                            ev[0].record()
                        with counter:
                            rows = pool.translate_loc_to_scratch(table) if sharded else table
                            kv = pool.get_key_buffer(layer)
                        if ev:
                            ev[1].record()
                        _sync(device)
                        read_t.append(t_idx * 1e6 + (time.perf_counter() - t0) * 1e6)
                        read_dev.append(d_idx + (ev[0].elapsed_time(ev[1]) * 1e3 if ev else 0.0))
                        # The kernels' inputs: sampled queries' top-k, then sparse MLA over the buffer.
                        kv_u8 = kv.view(torch.uint8).reshape(kv.shape[0], -1)
                        topk = _topk_positions(
                            got_k, got_s, q_idx, q_scale, weights, seq_lens, s_req, s_pos, scale.topk
                        )
                        valid = topk >= 0
                        tok_rows = rows[torch.tensor(s_req, device=device).unsqueeze(1), topk.clamp(min=0)]
                        tok_rows = torch.where(valid, tok_rows.long(), torch.full_like(tok_rows.long(), -1))
                        out, lse = _sparse_attention(q_attn, kv_u8, tok_rows, kv_format, device)
                        per_layer.append((got_k.cpu(), got_s.cpu(), topk.cpu(), out.cpu(), lse.cpu()))
                results[name] = per_layer
                if name == "ours" and device.type != "cuda":  # the view and staging buffers this batch holds
                    r = pool.read
                    views = []
                    if r.views is not None and r.mode == "materialized":  # the staged pages live past the view
                        views += [t for vs in r.views._views for t in vs.values()]
                    else:
                        views += [t for t in (r.stage_latent, r.stage_index) if t is not None]
                    row["ours_peak_view_bytes"] = int(sum(t.numel() * t.element_size() for t in views))
                if sharded:
                    pool.end_shard_extend()
                row[f"{name}_layer_time_us"] = round(begin_t / layers + sum(read_t) / layers, 1)
                row[f"{name}_layer_time_device_us"] = round(begin_dev / layers + sum(read_dev) / layers, 1)
                row[f"{name}_host_syncs"] = counter.count

        # -- correctness across paths --
        ref = results["stock"]
        for name in paths:
            if name == "stock":
                continue
            ok = all(all(torch.equal(a, b) for a, b in zip(mine, theirs)) for mine, theirs in zip(results[name], ref))
            row[f"{name}_correct"] = ok
            if not ok:
                names = ("index_k", "index_scale", "topk", "out", "lse")
                row[f"{name}_mismatch"] = [
                    f"layer {li} {n}"
                    for li, (mine, theirs) in enumerate(zip(results[name], ref))
                    for n, a, b in zip(names, mine, theirs)
                    if not torch.equal(a, b)
                ][:6]
            correct_all &= ok

        # -- bytes received per rank --
        if "ours" in pools:
            c = pools["ours"].read.counters
            row["ours_bytes_received"] = int(c.bytes_received) if c is not None else 0
            # Bytes of the current chunk that went through the gather (staged locally instead: 0).
            row["ours_current_chunk_bytes_gathered"] = int(c.current_chunk_bytes_gathered) if c is not None else 0
        if "upstream" in pools:
            block = pools["upstream"]._block_pages
            row["upstream_bytes_received"] = (world - 1) * block * page_bytes * layers

        # -- the whole forward, back to back, per path (GPU only: FlashMLA over every query) --
        if device.type == "cuda":
            for name in paths:
                if profiler is not None and name == "ours":
                    profiler.enable()
                pool = pools[name]
                sharded = name != "stock"
                torch.cuda.reset_peak_memory_stats(device)
                base_mem = torch.cuda.memory_allocated(device)
                counter = _SyncCounter(device)
                gate()
                t0 = time.perf_counter()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                # Host time spent inside the pool's calls (no sync in between: what the host pays to
                # queue them): the batch plan, then per layer the reads and the writes.
                host = {"plan": 0.0, "read": 0.0, "write": 0.0}
                with _no_dcp(), counter:
                    h = time.perf_counter()
                    if sharded:
                        _begin_batch(name, pool, hint, req_to_token, fb)
                    rows = pool.translate_loc_to_scratch(every) if sharded else every
                    host["plan"] += time.perf_counter() - h
                    fwd_rows = rows[fwd_tokens].reshape(new_tokens, scale.topk)
                    for layer in range(layers):
                        nope, rope, k, kscale = chunks[layer]
                        h = time.perf_counter()
                        pool.set_index_k_scale_buffer(layer, new_locs, k, kscale)
                        h1 = time.perf_counter()
                        pool.get_index_k_scale_buffer(layer, lens_t, logical_pages, sum(seq_lens), max_seq)
                        h2 = time.perf_counter()
                        pool.set_mla_kv_buffer(_Layer(layer), new_locs, nope, rope)
                        h3 = time.perf_counter()
                        kv = pool.get_key_buffer(layer)
                        h4 = time.perf_counter()
                        host["write"] += (h1 - h) + (h3 - h2)
                        host["read"] += (h2 - h1) + (h4 - h3)
                        kv_u8 = kv.view(torch.uint8).reshape(kv.shape[0], -1)
                        _sparse_attention(q_fwd, kv_u8, fwd_rows, kv_format, device)
                e1.record()
                _sync(device)
                row[f"{name}_forward_us"] = round((time.perf_counter() - t0) * 1e6, 1)
                row[f"{name}_plan_host_us"] = round(host["plan"] * 1e6, 1)
                row[f"{name}_read_host_us_per_layer"] = round(host["read"] * 1e6 / layers, 1)
                row[f"{name}_write_host_us_per_layer"] = round(host["write"] * 1e6 / layers, 1)
                row[f"{name}_forward_device_us"] = round(e0.elapsed_time(e1) * 1e3, 1)
                row[f"{name}_forward_host_syncs"] = counter.count
                if profiler is not None and name == "ours":
                    profiler.disable()
                if name == "ours":  # allocated beyond the pool and its arena during the forward
                    row["ours_peak_extra_bytes"] = int(torch.cuda.max_memory_allocated(device) - base_mem)
                if sharded:
                    pool.end_shard_extend()
        rows_out.append(row)
        print(
            f"rank {rank} batch {bi + 1}/{len(batches)} {row['kind']}: "
            + ", ".join(f"{k}={v}" for k, v in row.items() if k.endswith(("_layer_time_us", "_correct", "_mismatch"))),
            flush=True,
        )

    env = {"upstream_scratch_bytes": up_scratch, "pool_tokens_per_rank": size}
    if "ours" in pools:
        env["ours_arena_bytes"] = ours_arena_bytes
        views = pools["ours"].read.views
        env["ours_transport"] = getattr(views.group, "backend", None) if views is not None else None
        env["ours_prefetch"] = bool(views is not None and views.prefetch)
    if "upstream" in pools:
        from sglang.srt.environ import envs

        up = pools["upstream"]
        env["upstream_zero_sm_gather_setting"] = bool(envs.SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER.get())
        env["upstream_zero_sm_gather_used"] = bool(up._use_symmetric_scratch)
        try:
            from sglang.srt.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

            env["nccl_version"] = NCCLLibrary().ncclGetRawVersion()
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            env["nccl_version"] = f"unknown: {e}"
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats("sglang_cp_shared_kv", 60)  # our calls, inclusive
        env["ours_forward_host_profile"] = _relative_paths(text.getvalue())
    return {"rows": rows_out, "correct_all": correct_all, "env": env}


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def summarize(rows: list[dict], env: dict, correct_all: bool) -> dict:
    def ratio(num, den):
        return round(num / den, 3) if num is not None and den else None

    has_up = any("upstream_layer_time_us" in r for r in rows)
    s: dict = {"correct_all": correct_all}
    s["ours_arena_bytes"] = env.get("ours_arena_bytes")
    s["upstream_scratch_bytes"] = env.get("upstream_scratch_bytes") or None
    s["current_chunk_bytes_gathered"] = sum(r.get("ours_current_chunk_bytes_gathered", 0) for r in rows)
    if has_up:
        s["ours_vs_upstream_layer_time"] = _median(
            [ratio(r["upstream_layer_time_us"], r["ours_layer_time_us"]) for r in rows]
        )
        s["ours_vs_upstream_layer_time_device"] = _median(
            [ratio(r["upstream_layer_time_device_us"], r["ours_layer_time_device_us"]) for r in rows]
        )
        fwd = [ratio(r.get("upstream_forward_us"), r.get("ours_forward_us")) for r in rows]
        s["ours_vs_upstream_forward_time"] = _median(fwd)
        ours_b = sum(r["ours_bytes_received"] for r in rows)
        up_b = sum(r["upstream_bytes_received"] for r in rows)
        s["bytes_ratio"] = ratio(ours_b, up_b)
        shared = [r for r in rows if r.get("shared_prefix")]
        s["bytes_ratio_shared_prefix_turn"] = ratio(
            sum(r["ours_bytes_received"] for r in shared), sum(r["upstream_bytes_received"] for r in shared)
        )
        # Fixed read memory, both allocated at start-up and charged to the KV budget: our view arena
        # against SGLang's double-buffered scratch.
        s["peak_scratch_ratio"] = ratio(env.get("ours_arena_bytes"), env["upstream_scratch_bytes"])
        s["host_syncs_upstream_per_forward"] = _median([r.get("upstream_forward_host_syncs") for r in rows])
        s["upstream_zero_sm_gather_used"] = env.get("upstream_zero_sm_gather_used")
    s["host_syncs_ours_per_forward"] = _median(
        [r.get("ours_forward_host_syncs", r.get("ours_host_syncs")) for r in rows]
    )
    s["host_syncs_sglang_metadata_per_forward"] = None  # init_forward_metadata not run: see the module docstring
    # Host cost (GPU runs): what queuing the plan and each layer's reads costs the host, median over
    # the batches that read a view (history and mixed), and SGLang's own for the same calls.
    for name in ("ours", "upstream", "stock"):
        for key in ("plan_host_us", "read_host_us_per_layer"):
            vals = [r.get(f"{name}_{key}") for r in rows if r["kind"] != "current"]
            if any(v is not None for v in vals):
                s[f"{name}_{key}"] = _median(vals)
    if has_up:
        wins = [k for k in ("ours_vs_upstream_layer_time", "ours_vs_upstream_forward_time") if (s[k] or 0) < 1.0]
        wins += [k for k in ("bytes_ratio", "peak_scratch_ratio") if (s[k] or 0) > 1.0]
        s["upstream_wins_on"] = wins
    return s


def _plot(name: str, rows: list[dict]) -> None:
    def draw(ax):
        xs = list(range(len(rows)))
        for path in PATHS:
            key = f"{path}_layer_time_us"
            if rows and all(key in r for r in rows):
                ax.plot(xs, [r[key] for r in rows], marker="o", label=path)
        ax.set_yscale("log")
        ax.set_xlabel("batch (all scales in order)")
        ax.set_ylabel("read path per layer, host-inclusive (µs)")
        ax.set_title("read path per layer: stock / SGLang page-interleave / ours (CP=2)")
        ax.legend()

    save_plot(name, draw)


def _batch_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo, hi = 0, -1
    if not sep or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST with 1 <= FIRST <= LAST, got {text!r}")
    return lo, hi


def merge(names: list[str], out: str) -> None:
    """One result from several runs' (a scale's pieces, other scales): their rows in order, each
    scale's summary computed again over all its rows, a scale correct only if every piece was."""
    from benchmark.cp_shared_kv.bench_common import RESULTS_DIR

    rows: list[dict] = []
    envs: dict[str, dict] = {}
    correct: dict[str, bool] = {}
    for name in names:
        path = RESULTS_DIR / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"--merge: no result {path}")
        doc = json.loads(path.read_text())
        rows += doc["rows"]
        for sc, env in doc["run_environment"].items():
            ok = bool(doc["by_scale"][sc]["correct_all"])
            if sc in envs:
                env = dict(envs[sc], batches=f"{envs[sc].get('batches')},{env.get('batches')}")
            envs[sc] = env
            correct[sc] = correct.get(sc, True) and ok
    seen = [(r["scale"], r["batch"]) for r in rows]
    if len(set(seen)) != len(seen):
        raise SystemExit("--merge: the results measure some batch of a scale twice")
    rows.sort(key=lambda r: (list(envs).index(r["scale"]), r["batch"]))
    summaries = {sc: summarize([r for r in rows if r["scale"] == sc], env, correct[sc]) for sc, env in envs.items()}
    _write(out, rows, summaries, envs, all(correct.values()))
    _plot(out, rows)


def _write(name: str, rows: list[dict], summaries: dict[str, dict], envs: dict, ok: bool) -> None:
    """The result file: every scale's summary, and their medians as the headline."""
    first = next(iter(summaries.values()))
    summary = {k: _median([s.get(k) for s in summaries.values()]) for k in first}
    summary["current_chunk_bytes_gathered"] = sum(s["current_chunk_bytes_gathered"] for s in summaries.values())
    summary["correct_all"] = ok
    summary["upstream_wins_on"] = sorted({w for s in summaries.values() for w in s.get("upstream_wins_on", [])})
    write_result(name, rows, summary, {"by_scale": summaries, "run_environment": envs})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmark.cp_shared_kv.bench_vs_upstream", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--scale", choices=sorted(SCALES), nargs="+", default=["32k", "128k"])
    ap.add_argument("--kv-format", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--out", default="vs_upstream", help="result name under docs/benchmarks/ (default: %(default)s)")
    ap.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="CP group backend (default: nccl on cuda, gloo on cpu); gloo on cuda runs both ranks on one GPU, "
        "without the upstream path (its gather communicator is NCCL)",
    )
    ap.add_argument(
        "--batches",
        type=_batch_range,
        default=None,
        metavar="FIRST:LAST",
        help="measure only these batches of the scale (1-based, inclusive); the earlier ones are only written",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="NAME",
        default=None,
        help="join these results (names under docs/benchmarks/) into --out instead of running",
    )
    ap.add_argument("--timeout", type=float, default=560.0)
    ap.add_argument(
        "--profile-host",
        action="store_true",
        help="cProfile our forward's host work on rank 0 (GPU runs), written to <out>_host_profile.txt",
    )
    a = ap.parse_args(argv)
    if a.merge:
        merge(a.merge, a.out)
        return
    from sglang_cp_shared_kv.reference.spawn import spawn_ranks

    world = 2
    backend = a.backend or ("nccl" if a.device == "cuda" else "gloo")
    paths = [p for p in a.paths if p != "upstream" or backend == "nccl"]
    if a.device == "cuda" and backend == "nccl" and torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    all_rows, summaries, envs = [], {}, {}
    ok = True
    for sc in a.scale:
        args = dict(device=a.device, scale=sc, kv_format=a.kv_format, page_size=a.page_size, paths=paths)
        args["profile_host"] = a.profile_host
        args["batches"] = a.batches
        per_rank = spawn_ranks(_rank, world, args, backend=backend, timeout_s=a.timeout)
        r0 = per_rank[0]
        ok &= all(r["correct_all"] for r in per_rank)
        rows = [dict(row, scale=sc, kv_format=a.kv_format, page_size=a.page_size) for row in r0["rows"]]
        all_rows += rows
        summaries[sc] = summarize(rows, r0["env"], all(r["correct_all"] for r in per_rank))
        profile = r0["env"].pop("ours_forward_host_profile", None)
        if profile:
            from benchmark.cp_shared_kv.bench_common import RESULTS_DIR

            (RESULTS_DIR / f"{a.out}_host_profile.txt").write_text(profile)
        envs[sc] = dict(r0["env"], batches="{}:{}".format(*a.batches) if a.batches else "all")
        # Written after every scale (a later scale that fails or times out keeps the earlier ones).
        _write(a.out, all_rows, summaries, envs, ok)

    _plot(a.out, all_rows)


if __name__ == "__main__":
    main()
