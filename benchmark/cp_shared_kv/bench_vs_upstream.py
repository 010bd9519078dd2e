"""Side by side on the same batches, through SGLang's own DSA attention backend: SGLang's stock
replicated DSA pool, SGLang 0.5.23's two sharded pools, and ours (``--enable-cp-shared-kv``).

Two CP ranks (NCCL on GPUs, gloo on CPU or with both ranks on one GPU). Every path is SGLang's
``DeepseekSparseAttnBackend`` (``vs_upstream_backend``) over SGLang's or our pool class:

- ``stock``: ``DSATokenToKVPool`` over the whole logical space (what every CP rank holds today);
- ``upstream``: ``PageInterleaveDSATokenToKVPool`` (``--enable-kv-cache-sharding``) with the
  ``PageShardSpec`` SGLang computes for these server limits (eight contexts of prefix scratch plus the
  chunk, double-buffered), its own NCCL gather communicator and side stream (one GPU per rank);
- ``layersplit``: ``LayerSplitDSATokenToKVPool`` (``--enable-dsa-cache-layer-split``): each rank keeps
  whole layers and the owner broadcasts a layer into the others' remote buffer, the next layer's
  broadcast started after attention as SGLang's decoder layer does (NCCL with one GPU per rank; its
  ``torch.distributed`` fallback on gloo);
- ``ours``: ``CPSharedDSATokenToKVPool`` (the class the plugin's pool hook installs).

Per batch and path, one forward as SGLang's model runs it: ``init_forward_metadata`` (the sharded
pools' batch plan inside it), then per layer the indexer's pool calls (index K store, then
``get_index_k_scale_buffer`` over the logical page table, DeepGEMM's ``fp8_mqa_logits`` and
``metadata.topk_transform``, which reaches sgl_kernel's fused top-k), ``forward_extend`` (latent write,
``get_key_buffer``, the prefill impl SGLang picks: ``flashmla_kv`` on H200 with an fp8 cache, i.e.
FlashMLA's fp8 paged kernel with sparse indices over the pool's own buffer), and a MoE layer's GEMMs
(``layer_compute.MoEStandIn``). The ops that cannot load where this runs have stand-ins
(``vs_upstream_stand_ins``), the same for every path, each timed and listed in the result. Not run:
the indexer's projections and norms (model weights; the same for every path).

Each forward runs several times on a GPU. The first warms compiles and registrations. Then the host
pass, ``--host-passes`` times (default 3): the device is drained before ``init_forward_metadata`` and
before each layer's pool calls, so a call's host time is its own work (``*_plan_host_us``,
``*_read_host_us_per_layer``, each the minimum over the passes: interference on the shared host only
adds), not time blocked on a launch queue that the layer's kernels filled. The plan's calls
(``begin_shard_extend``, ``translate_loc_to_scratch``) run inside ``init_forward_metadata`` as SGLang runs
them, after its first small launches and without a wait between them: nothing there can fill the launch
queue, and SGLang never waits there. ``--plan-drained-passes`` more passes drain before each plan call
as well (``*_plan_host_us_drained``: each call then starts on a just-drained device, which costs the host
more at its first CUDA calls). ``--busy-passes`` more passes keep the device busy instead: after each drain
a sleep kernel of about 4 ms is queued, so the metadata call and each layer's pool calls are made while the
device runs earlier work, as under SGLang's overlap scheduler (its default: a batch's metadata and launches
are made while the previous batch's forward runs), without a launch queue to wait on (``*_busy`` figures;
``*_busy_ended_calls``: timed calls at whose end the sleep had already finished, 0 when it covered them
all). The last forward is timed: wall clock and CUDA events for the forward, and events around each pool
read call (the read path: the plan, each layer's index and latent reads) and each stand-in. Its outputs
(attention output per layer, index K reads) are kept and compared across the paths after timing, by exact
digests. Bytes are the transports' own counts (ours: the transport's byte counter; SGLang's: its NCCL calls' sizes).

    python -m benchmark.cp_shared_kv.bench_vs_upstream                 # 2 GPUs, writes vs_upstream.json
    python -m benchmark.cp_shared_kv.bench_vs_upstream --device cpu --scale smoke --out vs_upstream_cpu

A scale too long for one sitting runs in pieces (``--batches FIRST:LAST``: the batches before FIRST
are written into every pool, nothing read or timed), and ``--merge`` joins the pieces' rows:

    python -m benchmark.cp_shared_kv.bench_vs_upstream --scale 128k --batches 1:16 --out vs_upstream_128k_a
    python -m benchmark.cp_shared_kv.bench_vs_upstream --scale 128k --batches 17:31 --out vs_upstream_128k_b
    python -m benchmark.cp_shared_kv.bench_vs_upstream --merge vs_upstream_32k vs_upstream_128k_a \\
        vs_upstream_128k_b --out vs_upstream
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from dataclasses import dataclass

import torch

from benchmark.cp_shared_kv.bench_common import save_plot, wait_polled, write_result

PATHS = ("stock", "upstream", "layersplit", "ours")
SHARDED = ("upstream", "ours")  # the page-interleave pools SGLang's backend plans per batch


@dataclass(frozen=True)
class Scale:
    """One workload: first-turn request lengths, new tokens per batch, second-turn new tokens per
    request, context length, layers, top-k, attention heads per rank, and the second turn's shape:
    ``shared`` (four requests continue requests 0, 0, 1, 2; the first turn measured too) or
    ``continue`` (every request continues its own cached prefix; the first turn only written)."""

    lengths: tuple[int, ...]
    chunk: int
    turn2_new: int
    context_len: int
    layers: int
    topk: int
    heads: int
    turn2: str = "shared"


SCALES = {
    # 4 requests growing to 32K in 8K chunks, and to 128K in 16K chunks; a second turn on their prefixes.
    "32k": Scale((32768, 30720, 28672, 26624), 8192, 1024, 34816, 4, 2048, 128),
    "128k": Scale((131072, 122880, 114688, 106496), 16384, 1024, 133120, 4, 2048, 128),
    # Multi-turn with 90% of each prompt cached (as SGLang PR #35309 measures): 8 requests of 100K
    # tokens, 90K of them a cached prefix, in 8K chunks.
    "prefix90": Scale((92160,) * 8, 8192, 10240, 103424, 4, 2048, 128, "continue"),
    # CPU smoke: the same shapes of batches, small.
    "smoke": Scale((640, 576, 512, 448), 256, 64, 1024, 2, 64, 4),
    "smoke_prefix90": Scale((576,) * 4, 128, 64, 1024, 2, 64, 4, "continue"),
    # CI: one layer, a few pages; still current, mixed, history and shared-prefix batches.
    "tiny": Scale((320, 256, 192, 128), 192, 64, 512, 1, 64, 4),
}


# ----------------------------------------------------------------------------------------------
# the workload: batches as the scheduler issues them
# ----------------------------------------------------------------------------------------------


def turn2_sources(scale: Scale) -> dict[int, int]:
    """Second-turn request slot -> the first-turn request whose cached prefix it continues."""
    n = len(scale.lengths)
    if scale.turn2 == "continue":
        return {n + i: i for i in range(n)}
    return dict(zip(range(n, n + 4), (0, 0, 1, 2)))


def schedule(scale: Scale, ps: int, cp_size: int = 2) -> list[list[tuple[int, int, int]]]:
    """Batches of ``(request slot, prefix_len, seq_len)``.

    Turn 1: the requests in order, ``chunk`` new tokens per batch; a request that finishes mid-batch
    leaves the rest of the budget to the next one. Turn 2: each ``turn2_sources`` request continues
    from its source's cached (page-aligned) prefix with ``turn2_new`` tokens, in chunks of the same
    budget, batched as SGLang's prefill admission (``PrefillAdder._kv_shard_reserve_scratch``) would
    against our view arena's spec: ``cp_size * sum_i ceil(prefix_pages_i / cp_size)`` pages of prefix
    per batch at most. SGLang's own scratch (eight contexts) admits every such batch too.
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
    from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_contexts, arena_regions

    max_prefix_pages = arena_regions(cp_size, ps, scale.context_len, scale.chunk, arena_contexts())[0] // ps
    cur, block, budget = [], 0, scale.chunk
    for slot, src in turn2_sources(scale).items():
        prefix, done = scale.lengths[src] // ps * ps, 0
        while done < scale.turn2_new:
            pages = -(-(prefix + done) // ps)
            need = -(-pages // cp_size)
            if cur and (budget == 0 or cp_size * (block + need) > max_prefix_pages):
                batches.append(cur)
                cur, block, budget = [], 0, scale.chunk
            take = min(budget, scale.turn2_new - done)
            cur.append((slot, prefix + done, prefix + done + take))
            block += need
            budget -= take
            done += take
    batches.append(cur)
    return batches


def written_only(scale: Scale, batches) -> int:
    """How many leading batches are only written (the cached first turn of a ``continue`` workload)."""
    n = len(scale.lengths)
    return sum(all(s < n for s, _, _ in b) for b in batches) if scale.turn2 == "continue" else 0


def shared_prefix_slots(scale: Scale) -> tuple[int, ...]:
    """Second-turn slots that continue the same request (``shared``: the first two)."""
    n = len(scale.lengths)
    return (n, n + 1) if scale.turn2 == "shared" else ()


def batch_kind(batch) -> str:
    prefixed = [p > 0 for _, p, _ in batch]
    return "current" if not any(prefixed) else "history" if all(prefixed) else "mixed"


# ----------------------------------------------------------------------------------------------
# one rank
# ----------------------------------------------------------------------------------------------


def _no_dcp(**extra):
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False, **extra)


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
    """What SGLang's sharded pools read of their ``GroupCoordinator``: size, rank, a CPU group, the
    device, and (layer split) the group's NCCL communicator, which SGLang's own CP group has on CUDA."""

    def __init__(self, rank: int, world: int, device: torch.device, cpu_group, pynccl_comm=None):
        self.world_size = world
        self.rank_in_group = rank
        self.cpu_group = cpu_group
        self.device = device
        self.pynccl_comm = pynccl_comm


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(device: torch.device, poll: bool) -> None:
    """Wait for the device's queued work before a host-pass call: ``torch.cuda.synchronize`` (``poll``
    False), or a loop on an event of the current stream, then the synchronize (which then finds at most the
    side streams' last work): the thread stays busy, as a server's scheduler is between its batches' calls,
    instead of waiting for milliseconds in the driver."""
    if device.type != "cuda":
        return
    if poll:
        wait_polled()
    torch.cuda.synchronize(device)


# GPU cycles of the sleep kernel a busy host pass queues before each timed call: about 4 ms on an H200,
# longer than SGLang's metadata call or a layer's pool calls take the host.
BUSY_CYCLES = 8_000_000


def _occupy(device: torch.device, cycles: int):
    """Queue ``cycles`` of a sleep kernel on the current stream and return an event recorded after it (None on
    CPU): the calls made next run while the device is busy, as a server's are while its previous batch runs."""
    if device.type != "cuda":
        return None
    torch.cuda._sleep(cycles)
    done = torch.cuda.Event()
    done.record()
    return done


def _calibrate(device: torch.device, calls: int = 200) -> dict[str, float]:
    """Host µs per call of two small calls (a stream lookup, a one-element torch op) back to back, the device
    drained first (``bench_host_calls.per_call_us``, one repeat): this process's host speed at this moment."""
    from benchmark.cp_shared_kv.bench_host_calls import per_call_us

    small = torch.zeros(1, device=device)
    fns = {"current_stream": lambda: torch.cuda.current_stream(device), "torch_add_": lambda: small.add_(1)}
    return {name: round(per_call_us(fn, calls, 1), 2) for name, fn in fns.items()}


class _Gate:
    """Start a timed section on every rank together: the device drained, then a gloo barrier."""

    def __init__(self, device: torch.device, cpu_group):
        self.device = device
        self.group = cpu_group

    def __call__(self) -> None:
        import torch.distributed as dist

        _sync(self.device)
        dist.barrier(group=self.group)


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


# The pool calls timed as the read path (the plan, then each layer's reads) and as writes.
PLAN_CALLS = ("begin_shard_extend", "translate_loc_to_scratch")
READ_CALLS = ("get_index_k_scale_buffer", "get_key_buffer", "prefetch_kv_buffer")
WRITE_CALLS = ("set_index_k_scale_buffer", "set_mla_kv_buffer")


_NSA = "sglang_cp_shared_kv.srt.layers.attention.nsa"
_POOL = "sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool"
# What ``--profile-host`` times (inclusive, by name): SGLang's calls that both paths make, then ours.
HOST_TIMER_TARGETS = (
    "sglang.srt.layers.attention.dsa_backend:DeepseekSparseAttnBackend.init_forward_metadata",
    "sglang.srt.layers.attention.kv_shard_hooks:prepare_kv_shard_forward",
    "sglang.srt.mem_cache.memory_pool:DSATokenToKVPool.get_index_k_scale_buffer",
    "sglang.srt.mem_cache.memory_pool:DSATokenToKVPool.set_index_k_scale_buffer",
    "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool.get_key_buffer",
    "sglang.srt.mem_cache.index_key_cache:IndexKeyCache.get_k_and_scale",
    "sglang.kernels.ops.kvcache.dsa_index_k_cache:GetKAndS.execute",
    f"{_POOL}:CPSharedKVPoolMixin.begin_shard_extend",
    f"{_POOL}:CPSharedKVPoolMixin.translate_loc_to_scratch",
    f"{_POOL}:CPSharedKVPoolMixin.get_key_buffer",
    f"{_POOL}:CPSharedIndexKeyCache.get_k_and_scale",
    f"{_POOL}:CPSharedIndexKeyCache.get_buffer",
    f"{_NSA}.read_state:BatchReadState.begin",
    f"{_NSA}.read_state:BatchReadState.check_overflow",
    f"{_NSA}.read_state:BatchReadState._plan",
    f"{_NSA}.read_state:BatchReadState._begin_materialized",
    f"{_NSA}.read_state:BatchReadState._begin_current",
    f"{_NSA}.read_state:BatchReadState._queue_plan",
    f"{_NSA}.read_state:BatchReadState.translate",
    f"{_NSA}.read_state:BatchReadState.translate_pages",
    f"{_NSA}.read_state:BatchReadState.index_pages",
    f"{_NSA}.read_state:BatchReadState.latent_rows",
    f"{_NSA}.read_state:plan_batch",
    f"{_NSA}.read_state:plan_meta_rows",
    f"{_NSA}.read_state:_check_shared_prefix",
    f"{_NSA}.read_state:_batch_pages",
    f"{_NSA}.read_state:check_arena_fits",
    f"{_NSA}.read_state:translate_locs",
    f"{_NSA}.slot_plan:DeviceFlagCheck.poll",
    f"{_NSA}.slot_plan:DeviceFlagCheck.watch",
    f"{_NSA}.slot_plan:DeviceFlagCheck.host_views",
    f"{_NSA}.materialize:ViewMaterializer.begin_planned",
    f"{_NSA}.materialize:ViewMaterializer.drain",
    f"{_NSA}.materialize:ViewMaterializer.layer_view",
    f"{_NSA}.materialize:ViewMaterializer._gather",
    f"{_NSA}.materialize:gather_page_buffers",
    f"{_NSA}.materialize:ViewMaterializer._pull",
    f"{_NSA}.materialize:ViewMaterializer.fence",
    f"{_NSA}.materialize:ViewMaterializer._start_prefetch",
    f"{_NSA}.materialize:ViewMaterializer._wait",
    "sglang_cp_shared_kv.srt.distributed.copy_engine:CopyEngineGroup.fence",
    "sglang_cp_shared_kv.srt.distributed.copy_engine:CopyEngineGroup.all_gather_into_many",
    "sglang_cp_shared_kv.srt.distributed.copy_engine:CopyEngineGroup._pulls",
    "sglang_cp_shared_kv.srt.distributed.copy_engine:CopyEngineGroup._signal",
    "torch:empty",
    "torch:empty_like",
    "torch.cuda:Event.record",
    "torch.cuda:Stream.wait_event",
    "torch.cuda:current_stream",
)


class _PoolProbe:
    """Wraps a pool instance's read and write calls (the backend finds them on the instance): host
    time per call class and, on CUDA, events around each call (the stream time the call's work takes
    where it is queued). Off between timed forwards."""

    def __init__(self, pool, device: torch.device, poll: bool = False):
        self.device, self.active, self.poll = device, False, poll
        # The host pass: the device drained before each read and write call, so a call's host time is its
        # own, not time spent blocked on a launch queue the forward's earlier kernels filled; before the plan
        # calls too with ``drain_plan`` (they run inside the metadata call, which starts drained).
        self.sync_each = False
        self.drain_plan = False
        self.busy_cycles = 0  # > 0: after each drain, this much sleep queued before the call (``_occupy``)
        self.reset()
        for kind, names in (("plan", PLAN_CALLS), ("read", READ_CALLS), ("write", WRITE_CALLS)):
            for name in names:
                fn = getattr(pool, name, None)
                if fn is not None:
                    setattr(pool, name, self._wrap(kind, fn, name))

    def reset(self) -> None:
        self.host = {"plan": 0.0, "read": 0.0, "write": 0.0}
        self.plan_calls: dict[str, float] = {}  # the plan's host seconds per pool call (where it goes)
        self.drained = 0.0  # host seconds spent draining the device before calls (the host pass)
        self.busy_ended = 0  # calls of a busy pass at whose end the device had finished the sleep
        self.events: dict[str, list] = {"plan": [], "read": []}

    def _wrap(self, kind: str, fn, name: str):
        def call(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            ev = busy = None
            if self.sync_each and (kind != "plan" or self.drain_plan):
                t = time.perf_counter()
                _drain(self.device, self.poll)
                if self.busy_cycles:
                    busy = _occupy(self.device, self.busy_cycles)
                self.drained += time.perf_counter() - t
            elif self.device.type == "cuda" and kind != "write":
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent = time.perf_counter() - t0
            if busy is not None and busy.query():
                self.busy_ended += 1
            self.host[kind] += spent
            if kind == "plan":
                self.plan_calls[name] = self.plan_calls.get(name, 0.0) + spent
            if ev is not None:
                ev[1].record()
                self.events[kind].append(ev)
            return out

        return call

    def device_us(self, kind: str) -> float:
        if self.device.type != "cuda":
            return self.host[kind] * 1e6
        return sum(a.elapsed_time(b) for a, b in self.events[kind]) * 1e3


def _count_bytes(name: str, pool, rank: int, box: list) -> None:
    """Count what SGLang's sharded pools receive, at their communication calls: the page-interleave
    pool's in-place NCCL all-gather (the output less this rank's part), the layer-split pool's
    owner broadcast (the whole buffer, on every rank but the owner)."""
    if name == "upstream":
        comm = pool.kv_gather_comm
        gather = comm.all_gather

        def counted_all_gather(out, send, *a, **k):
            box[0] += out.numel() * out.element_size() - send.numel() * send.element_size()
            return gather(out, send, *a, **k)

        comm.all_gather = counted_all_gather
    elif name == "layersplit":
        bcast = pool._broadcast_tensor_from_owner

        def counted_broadcast(tensor, layer_id, *a, **k):
            if pool._get_layer_owner_rank(layer_id) != rank:
                box[0] += tensor.numel() * tensor.element_size()
            return bcast(tensor, layer_id, *a, **k)

        pool._broadcast_tensor_from_owner = counted_broadcast


def _store_index_k(pool, layer: int, locs, k, scale) -> None:
    """The indexer's index-K store as SGLang's ``Indexer`` makes it: a layer-split pool drops its cached
    remote copy of the layer on every rank, and only the layer's owner writes."""
    if hasattr(pool, "invalidate_index_buffer_for_layer"):
        pool.invalidate_index_buffer_for_layer(layer)
    if hasattr(pool, "_is_layer_owned") and not pool._is_layer_owned(layer):
        return
    pool.set_index_k_scale_buffer(layer, locs, k, scale)


def _digest(t: torch.Tensor) -> tuple[int, int]:
    """Exact digest of a tensor's bytes: the sum of its 32-bit words and their position-weighted sum
    (integer sums wrap alike in any order, so equal bytes give equal digests on every device)."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int32)
    s1 = s2 = 0
    step = 1 << 26
    for i in range(0, w.numel(), step):
        x = w[i : i + step].to(torch.int64)
        pos = torch.arange(i, i + x.numel(), device=x.device, dtype=torch.int64) % 65521 + 1
        s1 += int(x.sum())
        s2 += int((x * pos).sum())
    return s1, s2


def _path_pool(name, rank, world, size, kwargs, group, scale, ps, device, cpu_group):
    """One path's pool (inside ``_no_dcp``); ours with its view arena attached. -> (pool, arena bytes)."""
    if name == "ours":
        from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_contexts
        from sglang_cp_shared_kv.srt.sglang_wiring.read_mode import prefetch_setting
        from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool
        from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import make_arena_spec

        pool = CPSharedDSATokenToKVPool(size, cp_rank=rank, cp_size=world, cp_group=group, **kwargs)
        arena = make_arena_spec(rank, world, ps, scale.context_len, scale.chunk, arena_contexts())
        return pool, pool.attach_view_arena(arena, bool(prefetch_setting()))
    if name == "upstream":
        from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

        spec = upstream_spec(rank, world, ps, scale.context_len, scale.chunk)
        shard_group = _ShardGroup(rank, world, device, cpu_group)
        return PageInterleaveDSATokenToKVPool(size, shard_spec=spec, shard_group=shard_group, **kwargs), 0
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    logical = world * (size // ps + 1) * ps - ps  # the same logical space, unsharded
    if name == "layersplit":
        from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool

        return LayerSplitDSATokenToKVPool(logical, layer_shard_rank=rank, layer_shard_size=world, **kwargs), 0
    pool = DSATokenToKVPool(logical, **kwargs)
    pool.dcp_replicated = True
    return pool, 0


def _rank(rank: int, world: int, args: dict) -> dict:
    import numpy as np
    import torch.distributed as dist
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    from benchmark.cp_shared_kv import vs_upstream_backend as sgl
    from benchmark.cp_shared_kv.vs_upstream_stand_ins import MOE, MoEForBatch, StandIns
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.sglang_wiring.pool_hooks import SharedPrefixHint, shared_prefix_from_paths

    scale = SCALES[args["scale"]]
    ps, kv_format = args["page_size"], args["kv_format"]
    fp8 = kv_format == "fp8"
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if args["device"] == "cuda" else torch.device("cpu")
    nccl = dist.get_backend() == "nccl"
    paths = [p for p in args["paths"] if p != "upstream" or nccl]
    layers = scale.layers
    n_req = len(scale.lengths)
    # Pool capacity per rank: every request's tokens (page-padded), over the ranks, plus slack.
    total_tokens = sum(-(-n // ps) * ps for n in scale.lengths) + len(turn2_sources(scale)) * (scale.turn2_new + ps)
    size = (-(-total_tokens // (world * ps)) + 2 * world) * ps
    kwargs = _dsa_kwargs(ps, layers, device, fp8)

    published = sgl.publish_dsa(kv_format, scale.heads, scale.topk, scale.context_len, ps, device)
    stand_ins = StandIns(device, cost=args.get("stand_ins_cost", "semantics"))
    stand_ins.heads = scale.heads
    stand_ins.install()
    group = CPGroup()
    cpu_group = dist.new_group(backend="gloo")  # the timing gate's barriers, SGLang's sharded pools' CPU group
    gate = _Gate(device, cpu_group)
    layer_split_group = None
    if "layersplit" in paths:
        comm = None
        if nccl:
            from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator

            comm = PyNcclCommunicator(group=cpu_group, device=device)
        layer_split_group = _ShardGroup(rank, world, device, cpu_group, comm)

    def ctx(name):
        """The parallel context a path runs in: the layer-split pool reads SGLang's attention-CP group."""
        if name != "layersplit":
            return _no_dcp()
        return _no_dcp(attn_cp_group=layer_split_group, attn_cp_size=world, tp_size=world, moe_tp_size=world)

    pools, arena_bytes_default = {}, 0
    for name in paths + ["stock"] * ("stock" not in paths):
        with ctx(name):
            pools[name], arena = _path_pool(name, rank, world, size, kwargs, group, scale, ps, device, cpu_group)
        arena_bytes_default = arena_bytes_default or arena
    max_len = max(scale.lengths) + scale.turn2_new + ps
    req_to_token = torch.zeros(
        (n_req + len(turn2_sources(scale)), -(-max_len // ps) * ps), dtype=torch.int32, device=device
    )
    backends = {}
    for name in paths:
        with ctx(name):
            backends[name] = sgl.make_backend(
                pools[name], req_to_token, published["config"], ps, scale.context_len, device
            )
    attn_layers = sgl.make_layers(layers, scale.heads)
    poll = args.get("host_drain") == "poll"
    probes = {name: _PoolProbe(pools[name], device, poll) for name in paths}
    sgl_bytes = {name: [0] for name in paths}
    for name in ("upstream", "layersplit"):
        if name in pools:
            _count_bytes(name, pools[name], rank, sgl_bytes[name])

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
    bases: dict[int, object] = {}

    def alloc(slot: int, prefix: int, seq: int, src: int | None = None) -> None:
        if src is not None and prefix and slot not in bases:  # a radix-cache hit: the source's pages and base
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
    turn2_src = turn2_sources(scale)
    cached = written_only(scale, batches)
    max_new = max(sum(n - p for _, p, n in b) for b in batches)
    moe = MoEForBatch(-(-max_new // world), device)
    rows_out, correct_all = [], True
    # Where a forward's host time goes (rank 0): named functions timed inclusively in a second host pass.
    timer = None
    if args.get("profile_host") and rank == 0:
        from benchmark.cp_shared_kv.host_timer import HostTimer

        timer = HostTimer(HOST_TIMER_TARGETS)

    def ours_transport():
        """Our view transport (the CP group or the copy engines), built at the first batch with a prefix."""
        views = pools["ours"].read.views
        return views.group if views is not None else None

    page_bytes = ps * (kwargs["kv_cache_dim"] + 132)

    def received(name: str) -> int:
        if name == "ours":
            return int(getattr(ours_transport(), "bytes_received", 0))
        return sgl_bytes[name][0]

    static_env = {
        "pool_tokens_per_rank": size,
        "prefill_impl": published["prefill_impl"],
        "decode_impl": published["decode_impl"],
        "heads_per_rank": scale.heads,
        "topk": scale.topk,
        "layers": layers,
        "written_only_batches": cached,
        "moe": moe.base.shape,
        "moe_tokens_per_rank": "ceil(new tokens / cp_size) per batch",
        "stand_ins": stand_ins.describe(),
        "paths": paths,
        "host_passes": args.get("host_passes", 1) if device.type == "cuda" else 0,
        "host_drain": args.get("host_drain", "sync") if device.type == "cuda" else None,
        # Where the host pass drains: before the metadata call and each read and write call ("metadata"), or
        # before each plan call as well ("each": the ``*_plan_host_us_drained`` figures).
        "plan_drain": "metadata" if device.type == "cuda" else None,
        "plan_drained_passes": args.get("plan_drained_passes", 0) if device.type == "cuda" else 0,
        "busy_passes": args.get("busy_passes", 0) if device.type == "cuda" else 0,
        "busy_cycles": BUSY_CYCLES,
    }
    static_env.update(_scratch(rank, world, ps, scale, page_bytes, arena_bytes_default))
    if device.type == "cuda":  # host speed before any forward (the peer at the same point, not yet busy)
        static_env["calibration_at_start_us"] = _calibrate(device)
    first, last = args.get("batches") or (1, len(batches))
    first = max(first, cached + 1)
    for bi, batch in enumerate(batches):
        if bi + 1 > last:
            break
        for slot, prefix, seq in batch:
            alloc(slot, prefix, seq, turn2_src.get(slot) if prefix and slot >= n_req else None)
        slots = [s for s, _, _ in batch]
        prefix_lens = [p for _, p, _ in batch]
        seq_lens = [n for _, _, n in batch]
        extend = [n - p for p, n in zip(prefix_lens, seq_lens)]
        new_tokens = sum(extend)
        req_idx = torch.tensor(slots, device=device)
        new_locs = torch.cat([req_to_token[s, p:n].long() for s, p, n in batch])
        g = torch.Generator(device).manual_seed(100 * bi)

        def rand(*shape, scale=1.0, dtype=torch.bfloat16):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        kv_new = [
            [
                rand(new_tokens, 1, 512, scale=0.25),
                rand(new_tokens, 1, 64, scale=0.25),
                rand(new_tokens, 128, scale=4.0, dtype=torch.float8_e4m3fn),
                torch.rand(new_tokens, 1, generator=g, device=device) + 0.5,
            ]
            for _ in range(layers)
        ]
        fb = sgl.forward_batch(req_idx, prefix_lens, seq_lens, new_locs, device)
        # The shared-prefix hint the plugin computes from the radix cache: a turn-2 request's prefix ends at
        # the node of the request it continues (one node per source request), a turn-1 chunk's at its own.
        radix = [[(turn2_src.get(s, s), p)] if p else [] for s, p, _ in batch]
        hint = shared_prefix_from_paths(radix, prefix_lens, ps)
        rids = tuple(f"r{b}" for b in range(len(prefix_lens)))
        hinted = SharedPrefixHint(rids, tuple(int(p) for p in prefix_lens), tuple(hint))

        def name_batch(pool) -> None:  # what the plugin's hooks hand the pool before the batch begins
            pool.shared_prefix_hint = hinted
            pool.name_next_batch(rids, prefix_lens)

        if bi + 1 < first:  # before the measured range: its KV in every pool, as the scheduler leaves it
            with _no_dcp():
                for name in pools:
                    pool = pools[name]
                    with ctx(name):
                        if name in SHARDED:
                            if name == "ours":
                                name_batch(pool)
                            from sglang.srt.layers.attention.kv_shard_hooks import prepare_kv_shard_forward

                            prepare_kv_shard_forward(pool, req_to_token, fb)
                        for layer in range(layers):
                            nope, rope, k, kscale = kv_new[layer]
                            _store_index_k(pool, layer, new_locs, k, kscale)
                            pool.set_mla_kv_buffer(attn_layers[layer], new_locs, nope, rope)
                        if name in SHARDED:
                            pool.end_shard_extend()
            continue

        # Queries (one set per batch, every layer): absorbed MLA q, the indexer's fp8 q and head weights.
        q_nope = rand(new_tokens, scale.heads, 512, scale=0.125)
        q_rope = rand(new_tokens, scale.heads, 64, scale=0.125)
        q_idx = rand(new_tokens, 64, 128, scale=2.0, dtype=torch.float8_e4m3fn)
        w_idx = rand(new_tokens, 64, scale=1 / 64, dtype=torch.float32)
        starts = np.cumsum([0] + seq_lens).tolist()
        q_starts = np.cumsum([0] + extend).tolist()
        spans = [(q_starts[b], q_starts[b + 1], starts[b], seq_lens[b]) for b in range(len(batch))]
        sample = torch.linspace(0, new_tokens - 1, min(new_tokens, 32)).long().to(device)
        row: dict = {"batch": bi + 1, "kind": batch_kind(batch), "new_tokens": new_tokens, "seq_tokens": sum(seq_lens)}
        row["shared_prefix"] = bool(shared_prefix_slots(scale)) and set(shared_prefix_slots(scale)) <= set(slots)
        row["prefix_pages_per_rank"] = sum(-(-(p // ps) // world) for p in prefix_lens)
        digests: dict[str, list] = {}
        samples: dict[str, list] = {}

        def forward(
            name: str,
            timed: bool,
            host_pass: bool = False,
            profile: bool = False,
            drain_plan: bool = False,
            busy: bool = False,
        ) -> None:
            """One forward of the batch: a warm-up (no flag), the host pass (each pool call's host time with
            the device drained before the metadata call and before each read and write call, ``drain_plan``:
            before each plan call too, only the plan's figures kept; ``busy``: a sleep queued after each drain,
            the ``*_busy`` figures: CUDA only; with ``profile`` timed by name, its figures not kept) or the
            timed one."""
            pool, backend, probe = pools[name], backends[name], probes[name]
            stand_ins.spans = spans
            stand_ins.take_us()
            probe.reset()
            probe.active = timed or host_pass
            probe.sync_each = host_pass
            probe.drain_plan = drain_plan
            probe.busy_cycles = BUSY_CYCLES if busy else 0
            counter = _SyncCounter(device)
            outs, reads = [], []
            gate()
            if profile and timer is not None:
                timer.start(name)
            t0 = time.perf_counter()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else None
            if ev:
                ev[0].record()
            if host_pass and not profile:  # this process's host speed just before the pass
                for key, us in _calibrate(device).items():
                    row[f"{name}_calibration_{key}_us"] = min(us, row.get(f"{name}_calibration_{key}_us", float("inf")))
            with ctx(name), counter:
                occupied = None
                if host_pass:
                    _drain(device, poll)
                    if busy:
                        occupied = _occupy(device, BUSY_CYCLES)
                h = time.perf_counter()
                if name == "ours":
                    name_batch(pool)
                drained = probe.drained
                backend.init_forward_metadata(fb)
                # With ``drain_plan`` the device is drained before each plan call inside: not the metadata's time.
                meta_host = time.perf_counter() - h - (probe.drained - drained)
                if occupied is not None and occupied.query():
                    probe.busy_ended += 1
                for layer in range(layers):
                    nope, rope, k, kscale = kv_new[layer]
                    # The indexer: store this chunk's index K (its owner only, under layer split), read the
                    # batch's, logits, top-k (SGLang's _get_topk_ragged, minus the projections).
                    _store_index_k(pool, layer, new_locs, k, kscale)
                    md = backend.get_indexer_metadata(layer, fb)
                    ks, ke = md.get_indexer_kvcache_range()
                    lens_cpu = md.get_indexer_seq_len_cpu()
                    k_fp8, k_scale = pool.get_index_k_scale_buffer(
                        layer,
                        md.get_indexer_seq_len(),
                        md.get_logical_page_table(),
                        int(lens_cpu.sum()),
                        int(lens_cpu.max()),
                    )
                    k_scale_f = k_scale.view(torch.float32).squeeze(-1)
                    logits = stand_ins.fp8_mqa_logits(
                        q_idx, (k_fp8.view(torch.float8_e4m3fn), k_scale_f), w_idx, ks, ke
                    )
                    topk = md.topk_transform(logits, scale.topk, ks=ks)
                    del logits
                    out = backend.forward_extend(
                        q_nope, nope, nope, attn_layers[layer], fb, q_rope=q_rope, k_rope=rope, topk_indices=topk
                    )
                    if name == "layersplit" and layer + 1 < layers:  # after attention, as DeepseekV2DecoderLayer
                        pool.prefetch_kv_buffer(layer + 1)
                    with stand_ins.timed(MOE):
                        moe(-(-new_tokens // world))
                    outs.append(out)
                    reads.append((k_fp8, k_scale))
                if name in SHARDED:
                    pool.end_shard_extend()
            if ev:
                ev[1].record()
            _sync(device)
            wall = time.perf_counter() - t0
            probe.active = probe.sync_each = probe.drain_plan = False
            probe.busy_cycles = 0
            if profile and timer is not None:
                timer.stop()
            stand = stand_ins.take_us()
            if host_pass and drain_plan:  # the plan's calls each on a just-drained device: those figures only
                _keep_min(row, f"{name}_plan_host_us_drained", probe.host["plan"] * 1e6)
                for call, sec in probe.plan_calls.items():
                    _keep_min(row, f"{name}_plan_host_us_drained_{call}", sec * 1e6)
            elif (host_pass and not profile) or (timed and device.type != "cuda"):  # on CPU calls run to their end
                # Repeated host passes keep each figure's minimum: the shared host's interference only adds.
                suffix = "_busy" if busy else ""
                if busy:
                    row[f"{name}_busy_ended_calls"] = row.get(f"{name}_busy_ended_calls", 0) + probe.busy_ended
                for key, us in (
                    ("metadata_host_us", meta_host * 1e6),
                    ("plan_host_us", probe.host["plan"] * 1e6),
                    ("read_host_us_per_layer", probe.host["read"] * 1e6 / layers),
                    ("write_host_us_per_layer", probe.host["write"] * 1e6 / layers),
                ):
                    _keep_min(row, f"{name}_{key}{suffix}", us)
                for call, sec in probe.plan_calls.items():  # the plan's calls, each its minimum over the passes
                    _keep_min(row, f"{name}_plan_host_us{suffix}_{call}", sec * 1e6)
            if not timed:
                return
            row[f"{name}_layer_time_us"] = round(wall * 1e6 / layers, 1)
            row[f"{name}_layer_time_device_us"] = round(ev[0].elapsed_time(ev[1]) * 1e3 / layers, 1) if ev else None
            row[f"{name}_read_time_us"] = round((probe.device_us("plan") + probe.device_us("read")) / layers, 1)
            row[f"{name}_plan_time_us"] = round(probe.device_us("plan"), 1)
            # The timed forward's host time in the pool calls, launch-queue back-pressure included.
            row[f"{name}_pool_host_us_timed_pass"] = round(sum(probe.host.values()) * 1e6, 1)
            row[f"{name}_stand_ins_us"] = stand
            sglang_ops = sum(v for k, v in stand.items() if k != MOE)  # the MoE is the layer's own compute
            row[f"{name}_stand_ins_us_per_layer"] = round(sglang_ops / layers, 1)
            row[f"{name}_forward_host_syncs"] = counter.count
            # The timed forward's outputs: digests now, a few rows kept to bound any difference.
            digests[name] = [(_digest(o), _digest(kf), _digest(kscl)) for o, (kf, kscl) in zip(outs, reads)]
            samples[name] = [o.reshape(new_tokens, -1)[sample].float().cpu() for o in outs]

        for name in paths:
            # A warm-up forward of every batch (a server meets each Triton specialization once, at its
            # first use: a timed forward must not pay it), then the timed one; bytes of the timed one.
            if args.get("warmup", True):  # off in the CPU test, which times nothing
                forward(name, False)
            if device.type == "cuda":
                for _ in range(args.get("host_passes", 1)):
                    forward(name, False, host_pass=True)
                for _ in range(args.get("plan_drained_passes", 0)):
                    forward(name, False, host_pass=True, drain_plan=True)
                for _ in range(args.get("busy_passes", 0)):
                    forward(name, False, host_pass=True, busy=True)
                if args.get("profile_host"):  # a second host pass (every rank), timed by name on rank 0
                    forward(name, False, host_pass=True, profile=True)
            before = received(name)
            forward(name, True)
            row[f"{name}_bytes_received"] = received(name) - before

        # -- correctness of the timed forwards, against the stock pool's --
        ref = digests["stock"]
        for name in paths:
            if name == "stock":
                continue
            ok = digests[name] == ref
            row[f"{name}_correct"] = ok
            if not ok:
                what = ("out", "index_k", "index_scale")
                row[f"{name}_mismatch"] = [
                    f"layer {li} {w}"
                    for li, (mine, theirs) in enumerate(zip(digests[name], ref))
                    for w, a, b in zip(what, mine, theirs)
                    if a != b
                ][:6]
                row[f"{name}_out_max_abs_diff_sampled"] = max(
                    float((a - b).abs().nan_to_num(float("inf")).max()) for a, b in zip(samples[name], samples["stock"])
                )
            correct_all &= ok
        if "ours" in paths:
            # The prefix pages ours must move (one owner's block per layer, latent + indexer): anything the
            # transport received beyond it is current-chunk pages (staged locally, so it should be 0).
            prefix_bytes = _prefix_bytes(batch, scale, ps, world, page_bytes, layers)
            row["ours_prefix_bytes_expected"] = prefix_bytes
            row["ours_current_chunk_bytes_gathered"] = row["ours_bytes_received"] - prefix_bytes
        rows_out.append(row)
        if rank == 0 and args.get("partial_out"):  # what a run cut short by its time limit still leaves
            part = [dict(r, scale=args["scale"]) for r in rows_out]
            env = dict(static_env, batches="partial")
            _write(
                args["partial_out"],
                part,
                {args["scale"]: summarize(part, env, correct_all)},
                {args["scale"]: env},
                correct_all,
            )
        print(
            f"rank {rank} batch {bi + 1}/{len(batches)} {row['kind']}: "
            + ", ".join(f"{k}={v}" for k, v in row.items() if k.endswith(("_layer_time_us", "_correct", "_mismatch"))),
            flush=True,
        )

    env = dict(static_env)
    if "ours" in pools:
        env["ours_transport"] = type(ours_transport()).__name__
        views = pools["ours"].read.views
        env["ours_prefetch"] = bool(views is not None and views.prefetch)
        env["ours_views"] = "read from the peers' pools" if views is not None and views.reads_pools else "all-gathered"
    if "upstream" in pools:
        from sglang.srt.environ import envs

        up = pools["upstream"]
        env["upstream_zero_sm_gather_setting"] = bool(envs.SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER.get())
        env["upstream_zero_sm_gather_used"] = bool(up._use_symmetric_scratch)
    if "layersplit" in pools:
        env["layersplit_transport"] = (
            "nccl" if layer_split_group.pynccl_comm is not None else "torch.distributed (gloo)"
        )
    if timer is not None:
        env["ours_forward_host_profile"] = "".join(
            f"## {name}: inclusive host time of each named function over the measured batches' second host pass "
            f"({timer.forwards.get(name, 0)} forwards, rank 0, the device drained before the metadata call and each read and write call)\n"
            f"{timer.report(name)}\n"
            for name in timer.totals
        )
    return {"rows": rows_out, "correct_all": correct_all, "env": env}


def _prefix_bytes(batch, scale: Scale, ps: int, world: int, page_bytes: int, layers: int) -> int:
    """Bytes of the prefix pages one rank receives for ``batch``: per request (a request reading the same
    prefix as an earlier one in the batch reads it through that one's pages), its prefix pages owned by
    the other ranks, latent + indexer rows, every layer."""
    seen, pages = set(), 0
    sources = turn2_sources(scale)
    for slot, prefix, _ in batch:
        key = (sources.get(slot, slot), prefix)
        if prefix and key not in seen:
            seen.add(key)
            pages += -(-(prefix // ps) // world)
    return (world - 1) * pages * page_bytes * layers


def _scratch(rank: int, world: int, ps: int, scale: Scale, page_bytes: int, arena_default: int) -> dict:
    """Fixed read memory of each sharded path, allocated at start-up and charged to the KV budget: our view
    arena (the default contexts, and as many contexts as SGLang's scratch holds: equal admission) and
    SGLang's double-buffered page-interleave scratch (its own rule)."""
    from sglang.srt.mem_cache import page_interleave

    from sglang_cp_shared_kv.srt.sglang_wiring.read_mode import prefetch_setting
    from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import (
        arena_bytes,
        arena_contexts,
        make_arena_spec,
        upstream_scratch_bytes,
    )

    token_bytes = page_bytes // ps
    contexts = page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS
    spec = make_arena_spec(rank, world, ps, scale.context_len, scale.chunk, arena_contexts())
    equal = make_arena_spec(rank, world, ps, scale.context_len, scale.chunk, contexts)
    return {
        "ours_arena_contexts": arena_contexts(),
        "ours_arena_bytes": arena_default or arena_bytes(spec, token_bytes, bool(prefetch_setting())),
        "ours_arena_bytes_equal_admission": arena_bytes(equal, token_bytes, bool(prefetch_setting())),
        "upstream_scratch_contexts": contexts,
        "upstream_scratch_bytes": upstream_scratch_bytes(spec, token_bytes, scale.context_len),
    }


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def _keep_min(row: dict, key: str, us: float) -> None:
    """``row[key]``: the least of the figures given for it, to 0.1 µs (a shared host's interference only adds)."""
    row[key] = round(min(us, row.get(key, float("inf"))), 1)


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def _total(rows: list[dict], key: str, minus: str | None = None) -> float | None:
    vals = [(r.get(key), r.get(minus, 0) if minus else 0) for r in rows]
    if not vals or any(v is None for v, _ in vals):
        return None
    return sum(v - m for v, m in vals)


GOALS = {  # key: (goal, "min" = at least, "max" = at most)
    "ours_vs_stock_layer_time": (0.99, "min"),
    "ours_vs_upstream_layer_time": (1.2, "min"),
    "ours_vs_upstream_read_time": (1.2, "min"),
    "ours_vs_layersplit_layer_time": (1.0, "min"),
    "peak_scratch_ratio_equal_admission": (0.5, "max"),
    "bytes_ratio": (1.0, "max"),
}


def summarize(rows: list[dict], env: dict, correct_all: bool) -> dict:
    """Ratios over the whole workload (total time of one path over another's: what a user waits for),
    stock and each rival over ours, so above 1 means ours is faster; the per-batch median beside each."""

    def ratio(num, den):
        return round(num / den, 3) if num is not None and den else None

    s: dict = {"correct_all": correct_all}
    paths = [p for p in PATHS if any(f"{p}_layer_time_us" in r for r in rows)]
    if "ours" in paths:
        for rival in (p for p in paths if p != "ours"):
            for what in ("layer_time", "read_time"):
                key = f"ours_vs_{rival}_{what}"
                s[key] = ratio(_total(rows, f"{rival}_{what}_us"), _total(rows, f"ours_{what}_us"))
                s[f"{key}_median_batch"] = _median([ratio(r[f"{rival}_{what}_us"], r[f"ours_{what}_us"]) for r in rows])
            s[f"ours_vs_{rival}_layer_time_without_stand_ins"] = ratio(
                _total(rows, f"{rival}_layer_time_us", f"{rival}_stand_ins_us_per_layer"),
                _total(rows, "ours_layer_time_us", "ours_stand_ins_us_per_layer"),
            )
            # Ours minus the rival per layer, in us: a fixed cost reads here, where a ratio hides it in long layers.
            s[f"ours_minus_{rival}_layer_us_median_batch"] = _median(
                [round(r["ours_layer_time_us"] - r[f"{rival}_layer_time_us"], 1) for r in rows]
            )
            s[f"ours_vs_{rival}_layer_time_device"] = ratio(
                _total(rows, f"{rival}_layer_time_device_us"), _total(rows, "ours_layer_time_device_us")
            )
    for rival in ("upstream", "layersplit"):
        if rival in paths and "ours" in paths:
            key = "bytes_ratio" if rival == "upstream" else "bytes_ratio_vs_layersplit"
            s[key] = ratio(_total(rows, "ours_bytes_received"), _total(rows, f"{rival}_bytes_received"))
    if "ours" in paths:
        s["ours_bytes_received"] = _total(rows, "ours_bytes_received")
        s["current_chunk_bytes_gathered"] = _total(rows, "ours_current_chunk_bytes_gathered")
    s["ours_arena_bytes"] = env.get("ours_arena_bytes")
    s["ours_arena_bytes_equal_admission"] = env.get("ours_arena_bytes_equal_admission")
    s["upstream_scratch_bytes"] = env.get("upstream_scratch_bytes")
    s["peak_scratch_ratio"] = ratio(env.get("ours_arena_bytes"), env.get("upstream_scratch_bytes"))
    s["peak_scratch_ratio_equal_admission"] = ratio(
        env.get("ours_arena_bytes_equal_admission"), env.get("upstream_scratch_bytes")
    )
    for name in paths:
        s[f"host_syncs_{name}_per_forward"] = _median([r.get(f"{name}_forward_host_syncs") for r in rows])
        if any(f"{name}_busy_ended_calls" in r for r in rows):
            s[f"{name}_busy_ended_calls"] = _total(rows, f"{name}_busy_ended_calls")
    # Host cost: what queuing the plan and each layer's reads costs the host, median over the batches
    # that read a prefix (history and mixed), and SGLang's whole init_forward_metadata beside it.
    for name in paths:
        for key in ("plan_host_us", "metadata_host_us", "read_host_us_per_layer") + tuple(
            f"{k}_busy" for k in ("plan_host_us", "metadata_host_us", "read_host_us_per_layer")
        ):
            vals = [r.get(f"{name}_{key}") for r in rows if r["kind"] != "current"]
            if any(v is not None for v in vals):
                s[f"{name}_{key}"] = _median(vals)
        keys = [f"plan_host_us_{call}" for call in PLAN_CALLS]  # where the plan's host time goes, call by call
        keys += ["plan_host_us_drained"] + [f"plan_host_us_drained_{call}" for call in PLAN_CALLS]
        keys += [f"plan_host_us_busy_{call}" for call in PLAN_CALLS]
        for key in keys:
            vals = [r.get(f"{name}_{key}") for r in rows if r["kind"] != "current"]
            if any(v is not None for v in vals):
                s[f"{name}_{key}"] = _median(vals)
    # Each stand-in's time per forward (median over the paths' timed forwards).
    stand = {}
    for r in rows:
        for name in paths:
            for op, us in (r.get(f"{name}_stand_ins_us") or {}).items():
                stand.setdefault(op, []).append(us)
    s["stand_ins"] = [
        dict(item, us_per_forward_median=_median(stand.get(item["op"], [])))
        for item in env.get("stand_ins", [])
        if item["op"] in stand or not stand
    ]
    s["goals"] = {
        k: {
            "goal": f"{'>=' if how == 'min' else '<='} {goal}",
            "value": s.get(k),
            "met": None if s.get(k) is None else (s[k] >= goal if how == "min" else s[k] <= goal),
        }
        for k, (goal, how) in GOALS.items()
    }
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
        ax.set_ylabel("layer time with the MoE stand-in (µs)")
        ax.set_title("DSA layer through SGLang's backend: stock / SGLang's sharded pools / ours (CP=2)")
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
    scale's summary computed again over all its rows, a scale correct only if every piece was. The
    pieces' commands and environments go into ``pieces``, so the piece files need not be kept."""
    from benchmark.cp_shared_kv.bench_common import RESULTS_DIR

    rows: list[dict] = []
    envs: dict[str, dict] = {}
    correct: dict[str, bool] = {}
    pieces: list[dict] = []
    for name in names:
        path = RESULTS_DIR / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"--merge: no result {path}")
        doc = json.loads(path.read_text())
        rows += doc["rows"]
        pieces += doc.get("pieces") or [{"command": doc["command"], "environment": doc["environment"]}]
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
    _write(out, rows, summaries, envs, all(correct.values()), pieces)
    _plot(out, rows)


def _write(
    name: str, rows: list[dict], summaries: dict[str, dict], envs: dict, ok: bool, pieces: list | None = None
) -> None:
    """The result file: every scale's summary; the headline is the first scale's (the others in by_scale)."""
    summary = dict(next(iter(summaries.values())), correct_all=ok, headline_scale=next(iter(summaries)))
    extra = {"by_scale": summaries, "run_environment": envs}
    if pieces:  # the machine is the pieces' (a merge only adds up their rows)
        extra["pieces"] = pieces
        extra["environment"] = pieces[0]["environment"]
    write_result(name, rows, summary, extra)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmark.cp_shared_kv.bench_vs_upstream", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--scale", choices=sorted(SCALES), nargs="+", default=["32k", "prefix90", "128k"])
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
        "--stand-ins-cost",
        choices=("semantics", "model"),
        default="semantics",
        help="semantics: the stand-ins compute what DeepGEMM's logits and the fused top-k compute (torch, slower "
        "than those kernels); model: they cost what those kernels cost (vs_upstream_stand_ins), exact across pools",
    )
    ap.add_argument(
        "--profile-host",
        action="store_true",
        help="time the named host calls of each path's forward on rank 0 (HOST_TIMER_TARGETS; GPU runs: a second "
        "host pass drained as the others, figures not kept), written to <out>_host_profile.txt",
    )
    ap.add_argument(
        "--host-passes",
        type=int,
        default=3,
        help="host passes per batch and path (GPU runs); each host figure is its minimum over them",
    )
    ap.add_argument(
        "--plan-drained-passes",
        type=int,
        default=2,
        help="host passes more per batch and path (GPU runs) that drain the device before each plan call too, "
        "for the *_plan_host_us_drained figures",
    )
    ap.add_argument(
        "--busy-passes",
        type=int,
        default=2,
        help="host passes more per batch and path (GPU runs) with a sleep kernel queued after each drain, so the "
        "calls run while the device is busy, as under SGLang's overlap scheduler: the *_busy figures",
    )
    ap.add_argument(
        "--host-drain",
        choices=("sync", "poll"),
        default="sync",
        help="how the host pass waits for the device before each pool call: torch.cuda.synchronize, or a busy "
        "loop on an event (the thread kept running, as a server's between its calls)",
    )
    a = ap.parse_args(argv)
    if a.host_passes < 1:
        raise SystemExit(f"--host-passes must be at least 1, got {a.host_passes}")
    if a.plan_drained_passes < 0:
        raise SystemExit(f"--plan-drained-passes must be at least 0, got {a.plan_drained_passes}")
    if a.busy_passes < 0:
        raise SystemExit(f"--busy-passes must be at least 0, got {a.busy_passes}")
    if a.merge:
        merge(a.merge, a.out)
        return
    from reference.spawn import spawn_ranks

    world = 2
    backend = a.backend or ("nccl" if a.device == "cuda" else "gloo")
    paths = [p for p in a.paths if p != "upstream" or backend == "nccl"]
    if "stock" not in paths:
        paths.insert(0, "stock")  # the reference every path is checked against
    if a.device == "cuda" and backend == "nccl" and torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    all_rows, summaries, envs = [], {}, {}
    ok = True
    for sc in a.scale:
        args = dict(device=a.device, scale=sc, kv_format=a.kv_format, page_size=a.page_size, paths=paths)
        args["profile_host"] = a.profile_host
        args["host_passes"] = a.host_passes
        args["plan_drained_passes"] = a.plan_drained_passes
        args["busy_passes"] = a.busy_passes
        args["host_drain"] = a.host_drain
        args["stand_ins_cost"] = a.stand_ins_cost
        args["batches"] = a.batches
        args["partial_out"] = f"{a.out}_partial"
        per_rank = spawn_ranks(_rank, world, args, backend=backend, timeout_s=a.timeout)
        r0 = per_rank[0]
        ok &= all(r["correct_all"] for r in per_rank)
        rows = [dict(row, scale=sc, kv_format=a.kv_format, page_size=a.page_size) for row in r0["rows"]]
        all_rows += rows
        summaries[sc] = summarize(rows, r0["env"], all(r["correct_all"] for r in per_rank))
        profile = r0["env"].pop("ours_forward_host_profile", None)
        if profile:
            from benchmark.cp_shared_kv.bench_common import RESULTS_DIR, command_line, environment

            head = f"# {command_line()}\n# {environment()}\n\n"
            (RESULTS_DIR / f"{a.out}_host_profile.txt").write_text(head + profile)
        envs[sc] = dict(r0["env"], batches="{}:{}".format(*a.batches) if a.batches else "all")
        # Written after every scale (a later scale that fails or times out keeps the earlier ones).
        _write(a.out, all_rows, summaries, envs, ok)
        from benchmark.cp_shared_kv.bench_common import RESULTS_DIR

        (RESULTS_DIR / f"{a.out}_partial.json").unlink(missing_ok=True)

    _plot(a.out, all_rows)


if __name__ == "__main__":
    main()
