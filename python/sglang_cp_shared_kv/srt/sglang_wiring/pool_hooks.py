"""The CP-shared pools and allocator in SGLang's KV cache configurator, and the
per-batch calls: the radix tree's shared-prefix hint, ``prepare_kv_shard_forward``."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import accumulate, takewhile

from sglang_cp_shared_kv.srt.sglang_wiring import view_arena
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG

logger = logging.getLogger(__name__)


def cp_shared_pool_class(kind: str) -> type:
    """The CP-shared subclass of SGLang's ``"dsa"`` or ``"mla"`` pool."""
    from sglang_cp_shared_kv.srt.sglang_wiring import sharded_kv_pool as pools

    dsa, mla = pools.CPSharedDSATokenToKVPool, pools.CPSharedMLATokenToKVPool
    return {"dsa": dsa, "mla": mla}[kind]


def build_allocator(configurator, pool, max_total_num_tokens: int):
    """SGLang's owner-rotating allocator over a CP-shared ``pool``, admitting what fits
    the view arena (attached to the pool); SGLang's Mooncake sender on its sharded
    path."""
    from sglang.srt.mem_cache.allocator import page_interleave
    from sglang.srt.runtime_context import get_disagg, get_parallel

    spec = view_arena.spec_for(configurator)
    allocator = page_interleave.PageInterleavePoolAllocator(
        max_total_num_tokens,
        physical_page_size=pool.page_size,
        shard_size=pool.shard_size,
        dtype=configurator.kv_cache_dtype,
        device=configurator.device,
        kvcache=pool,
        need_sort=get_disagg().disaggregation_mode in ("decode", "prefill"),
        shard_spec=spec,
    )
    pool.attach_view_arena(spec, view_arena.read_mode_for(configurator).prefetch)
    # After the only pool builders that read it, before the KV manager is made.
    get_parallel().override_permanently(enable_kv_cache_sharding=True)
    sends = "send each CP rank's owned pages (SGLang's sharded sender path)"
    logger.info(f"{FLAG}: Mooncake transfers {sends}")
    return allocator


def check_built_pools(pool, allocator) -> None:
    """Refuse a pool or allocator that is not the CP-shared one."""
    from sglang.srt.mem_cache.allocator import page_interleave

    from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import CPSharedKVStartupError

    built = type(pool).__name__
    if view_arena.is_cp_shared_pool(pool):
        rotating = isinstance(allocator, page_interleave.PageInterleavePoolAllocator)
        if rotating and allocator.get_kvcache() is pool:
            return
        built = f"{type(allocator).__name__} over the CP-shared pool"
    raise CPSharedKVStartupError(
        f"{FLAG}: SGLang built a {built}, not the CP-shared pool and owner-rotating "
        "allocator (an option the startup checks do not know selects it); drop that "
        "option or the flag."
    )


@dataclass(frozen=True)
class SharedPrefixHint:
    """An extend batch's rids and prefix lens, and its ``BatchInputs.shared_prefix``."""

    rids: tuple[str, ...]
    prefix_lens: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]

    def for_batch(self, rids, prefix_lens) -> tuple | None:
        """The pairs if a batch of these rids and prefix lens is this hint's (padding
        past the requests, prefix-free, shares nothing), else None."""
        n = len(self.rids)
        if rids is None or prefix_lens is None or len(prefix_lens) < n:
            return None
        if tuple(rids) != self.rids or any(map(int, prefix_lens[n:])):
            return None
        if tuple(map(int, prefix_lens[:n])) != self.prefix_lens:
            return None
        return (*self.pairs, *[(-1, 0)] * (len(prefix_lens) - n))


def shared_prefix_from_paths(
    paths: Sequence[Sequence[tuple[Hashable, int]]], prefix_lens, page_size: int
) -> list[tuple[int, int]]:
    """``BatchInputs.shared_prefix`` from each request's radix path (per node from the
    root: its identity, its depth in KV tokens). The radix cache keeps a request's first
    tokens at its path's locs, so requests whose paths meet share pages to that depth: a
    request's source is the first request through its deepest shared node."""
    first: dict[Hashable, tuple[int, int]] = {}  # node: first request through it, depth
    out = []
    for b, path in enumerate(paths):
        best = (-1, 0)
        for node, depth in path:
            hit = first.get(node)
            if hit is None:
                first[node] = (b, depth)
            elif depth >= best[1]:
                best = (hit[0], depth)
        src, tokens = best
        pages = 0
        if src >= 0:
            pages = min(tokens, int(prefix_lens[b]), int(prefix_lens[src])) // page_size
        out.append((src, pages) if pages else (-1, 0))
    return out


def _radix_paths(tree_cache, last_nodes: list) -> list[list[tuple[int, int]]] | None:
    """Each request's path in SGLang's ``UnifiedRadixCache`` (node id, depth in KV
    tokens) up to the first node not on the device; None for any other cache or node."""
    core = getattr(tree_cache, "tree_core", None)
    if core is None or not all(type(n) is int for n in last_nodes):
        return None
    try:
        infos = core.collect_path_info(last_nodes)
    except KeyError:  # a handle the tree does not hold (never a locked prefix's)
        return None
    paths = []
    for path in infos:
        held = list(takewhile(lambda info: info.full_value_len is not None, path))
        depths = accumulate(info.full_value_len for info in held)
        paths.append(list(zip((info.node_id for info in held), depths)))
    return paths


def hint_shared_prefix(forward_batch, batch, pool) -> None:
    """After ``ForwardBatch.init_new``: an extend batch's shared-prefix hint to a
    CP-shared ``pool``; None unless two requests share a whole prefix page."""
    if not forward_batch.forward_mode.is_extend_or_draft_extend_or_mixed():
        return
    rids, lens = forward_batch.rids, forward_batch.extend_prefix_lens_cpu
    ps = pool.page_size
    pool.shared_prefix_hint = None
    if rids is None or lens is None or not len(batch.reqs) == len(rids) == len(lens):
        return
    if sum(int(p) >= ps for p in lens) < 2:
        return
    paths = _radix_paths(batch.tree_cache, [req.last_node for req in batch.reqs])
    pairs = shared_prefix_from_paths(paths, lens, ps) if paths is not None else []
    if any(pages for _, pages in pairs):
        hint = SharedPrefixHint(tuple(rids), tuple(map(int, lens)), tuple(pairs))
        pool.shared_prefix_hint = hint


def prepare_forward(pool, req_to_token, forward_batch) -> bool:
    """``prepare_kv_shard_forward`` for a CP-shared ``pool``: name the batch, begin or
    end its read state, record its metrics. Returns whether the batch is an extend."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import SlotOverflowError
    from sglang_cp_shared_kv.srt.sglang_wiring import metrics

    prefix_lens = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
    pool.name_next_batch(getattr(forward_batch, "rids", None), prefix_lens)
    observed = metrics.get()
    if observed is not None:
        observed.batch_done(pool.read.counters)  # the last batch's layers read all
    if not forward_batch.forward_mode.is_extend_or_draft_extend_or_mixed():
        pool.end_shard_extend()
        return False
    rows = forward_batch.req_pool_indices
    if rows is None or prefix_lens is None or seq_lens is None:
        raise RuntimeError("KV-sharded attention needs request indices and CPU lengths")
    try:
        pool.begin_shard_extend(req_to_token, rows, prefix_lens, seq_lens)
    except SlotOverflowError:
        if observed is not None:
            observed.series(observed.slot_overflows).inc()
        raise
    if observed is not None:
        observed.batch_begun(pool)
    return True
