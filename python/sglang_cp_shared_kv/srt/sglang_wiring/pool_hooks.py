"""Pool selection in SGLang's KV cache configurator (the CP-shared pools and the widened allocator), and
the per-batch calls: the shared-prefix hint and ``prepare_kv_shard_forward``.

**Shared prefixes**: only the scheduler's radix tree knows which requests of a batch share prefix pages.
``hint_shared_prefix`` (after ``ForwardBatch.init_new``) hands the hint to the pool, keyed by the batch's
rids and prefix lens (SGLang's eager runner rebuilds the ForwardBatch before the backend begins it);
``prepare_forward`` names the batch, whose begin takes the hint if it is the hint's. Every CP rank holds the
same tree and batches, so every rank plans with the same hint; the read state checks it on the device."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import accumulate, takewhile

from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG
from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import (
    is_cp_shared_pool,
    read_mode_for,
    spec_for,
)

logger = logging.getLogger(__name__)


def cp_shared_pool_class(kind: str) -> type:
    """The CP-shared subclass of SGLang's ``"dsa"`` or ``"mla"`` pool, built in its place by SGLang's builder."""
    from sglang_cp_shared_kv.srt.sglang_wiring import sharded_kv_pool

    return {"dsa": sharded_kv_pool.CPSharedDSATokenToKVPool, "mla": sharded_kv_pool.CPSharedMLATokenToKVPool}[kind]


def build_allocator(configurator, pool, max_total_num_tokens: int):
    """SGLang's owner-rotating ``PageInterleavePoolAllocator`` over a CP-shared ``pool``, its admission held to
    the view arena; the arena attached to the pool; SGLang's Mooncake sender switched to its sharded path."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.runtime_context import get_disagg, get_parallel

    spec = spec_for(configurator)
    allocator = PageInterleavePoolAllocator(
        max_total_num_tokens,
        physical_page_size=pool.page_size,
        shard_size=pool.shard_size,
        dtype=configurator.kv_cache_dtype,
        device=configurator.device,
        kvcache=pool,
        need_sort=get_disagg().disaggregation_mode in ("decode", "prefill"),
        shard_spec=spec,  # SGLang's batch admission against the view arena's regions
    )
    # The read buffers, once: the bytes view_arena charged to the budget.
    pool.attach_view_arena(spec, read_mode_for(configurator).prefetch)
    # SGLang's Mooncake sender takes its sharded path (each CP rank sends the pages it owns) on this field;
    # set after the only pool builders that read it, before the KV manager is made.
    get_parallel().override_permanently(enable_kv_cache_sharding=True)
    logger.info("%s: Mooncake transfers send each CP rank's owned pages (SGLang's sharded sender path)", FLAG)
    return allocator


def check_built_pools(pool, allocator) -> None:
    """Refuse a pool or allocator that is not the CP-shared one (``CPSharedKVStartupError``)."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import CPSharedKVStartupError

    if not is_cp_shared_pool(pool):
        raise CPSharedKVStartupError(
            f"{FLAG}: SGLang built a {type(pool).__name__}, not the CP-shared pool (a pool-selecting option "
            "the startup checks do not know about is on); drop that option or the flag."
        )
    if not isinstance(allocator, PageInterleavePoolAllocator) or allocator.get_kvcache() is not pool:
        raise CPSharedKVStartupError(
            f"{FLAG}: SGLang built a {type(allocator).__name__} over the CP-shared pool, not the owner-rotating "
            "PageInterleavePoolAllocator; drop the option that selects it or the flag."
        )


@dataclass(frozen=True)
class SharedPrefixHint:
    """An extend batch's ``rids`` and ``extend_prefix_lens_cpu``, and its ``BatchInputs.shared_prefix`` pairs."""

    rids: tuple[str, ...]
    prefix_lens: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]

    def for_batch(self, rids: Sequence[str] | None, prefix_lens: Sequence[int] | None) -> list | None:
        """The pairs for a batch of these ``rids`` and ``prefix_lens`` if it is this hint's batch (SGLang may
        pad its prefix lens with prefix-free entries past the requests: no sharing there), else ``None``."""
        n = len(self.rids)
        if rids is None or prefix_lens is None or tuple(rids) != self.rids or len(prefix_lens) < n:
            return None
        if tuple(int(p) for p in prefix_lens[:n]) != self.prefix_lens or any(int(p) for p in prefix_lens[n:]):
            return None
        return [*self.pairs, *[(-1, 0)] * (len(prefix_lens) - n)]


def shared_prefix_from_paths(
    paths: Sequence[Sequence[tuple[Hashable, int]]], prefix_lens: Sequence[int], page_size: int
) -> list[tuple[int, int]]:
    """``BatchInputs.shared_prefix`` for a batch, from the radix paths its requests' prefixes end at.
    ``paths[b]``: request ``b``'s root-to-node path, root side first (the root left out), per node its identity
    and the KV tokens from the root to the node's end. Invariant (SGLang's radix cache keeps it): a request's
    first tokens, as far as its path and ``prefix_lens[b]`` both reach, sit at its path's KV locs. So two
    requests whose paths meet at a node hold the same logical pages up to its depth: the later one gets the
    first request through its deepest shared node as source, and the whole pages of that depth both prefixes
    hold. Host ints only.
    """
    first: dict[Hashable, tuple[int, int]] = {}  # node -> (first request through it, its depth in tokens)
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
        pages = min(tokens, int(prefix_lens[b]), int(prefix_lens[src])) // page_size if src >= 0 else 0
        out.append((src, pages) if pages else (-1, 0))
    return out


def shared_prefix_from_nodes(
    last_nodes: Sequence[object], prefix_lens: Sequence[int], page_size: int
) -> list[tuple[int, int]]:
    """``shared_prefix_from_paths`` from ``Req.last_node`` s in a tree of SGLang's ``TreeNode`` s."""
    paths = []
    for node in last_nodes:
        chain = []
        while node is not None and getattr(node, "parent", None) is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()  # root side first
        depths = accumulate(len(n.value) if n.value is not None else len(n.key) for n in chain)
        paths.append(list(zip(map(id, chain), depths)))
    return shared_prefix_from_paths(paths, prefix_lens, page_size)


def _radix_paths(tree_cache, last_nodes: list) -> list[list[tuple[int, int]]] | None:
    """Each request's root-to-``last_node`` path as ``(node id, KV tokens from the root)`` per node, from SGLang's
    ``UnifiedRadixCache``'s tree core; ``None`` where the cache is not one, or a node is unknown to it."""
    core = getattr(tree_cache, "tree_core", None)
    if core is None or not all(type(n) is int for n in last_nodes):
        return None
    try:
        infos = core.collect_path_info(last_nodes)
    except KeyError:  # a handle the tree does not hold (never for a locked prefix): no hint
        return None
    paths = []
    for path in infos:
        # Up to the first node with no KV on the device: nothing to share past it.
        held = list(takewhile(lambda info: info.full_value_len is not None, path))
        paths.append(list(zip((i.node_id for i in held), accumulate(i.full_value_len for i in held))))
    return paths


def batch_shared_prefix(
    batch, rids: Sequence[str] | None, prefix_lens: Sequence[int] | None, page_size: int
) -> SharedPrefixHint | None:
    """The hint of a ``ScheduleBatch`` whose ForwardBatch has these ``rids`` and ``prefix_lens``, from its
    requests' ``last_node`` s; ``None`` when no two requests share a whole prefix page. Host objects only."""
    reqs = batch.reqs
    if rids is None or prefix_lens is None or not len(reqs) == len(rids) == len(prefix_lens):
        return None
    if sum(int(p) >= page_size for p in prefix_lens) < 2:
        return None  # fewer than two requests with a whole prefix page: nothing to share
    nodes = [req.last_node for req in reqs]
    paths = _radix_paths(batch.tree_cache, nodes)
    if paths is not None:
        pairs = shared_prefix_from_paths(paths, prefix_lens, page_size)
    elif all(hasattr(n, "parent") for n in nodes):  # RadixCache's TreeNode objects
        pairs = shared_prefix_from_nodes(nodes, prefix_lens, page_size)
    else:
        return None
    if not any(pages for _, pages in pairs):
        return None
    return SharedPrefixHint(tuple(rids), tuple(int(p) for p in prefix_lens), tuple(pairs))


def hint_shared_prefix(forward_batch, batch, pool) -> None:
    """After ``ForwardBatch.init_new``: hand an extend batch's shared-prefix hint (``None``: no sharing) to a
    CP-shared ``pool``. Every extend batch replaces it, so a hint never outlives the next batch."""
    if forward_batch.forward_mode.is_extend_or_draft_extend_or_mixed():
        rids, prefix_lens = forward_batch.rids, forward_batch.extend_prefix_lens_cpu
        pool.shared_prefix_hint = batch_shared_prefix(batch, rids, prefix_lens, pool.page_size)


def prepare_forward(pool, req_to_token, forward_batch) -> bool:
    """``prepare_kv_shard_forward`` for a CP-shared ``pool``: name the batch, begin or end its read state, and
    record its metrics. Returns whether the batch is an extend."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import SlotOverflowError
    from sglang_cp_shared_kv.srt.sglang_wiring import metrics

    prefix_lens = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
    pool.name_next_batch(getattr(forward_batch, "rids", None), prefix_lens)
    observed = metrics.get()
    if observed is not None:
        observed.batch_done(pool.read.counters)  # every layer of the previous batch has read its view
    if not forward_batch.forward_mode.is_extend_or_draft_extend_or_mixed():
        pool.end_shard_extend()
        return False
    if forward_batch.req_pool_indices is None or prefix_lens is None or seq_lens is None:
        raise RuntimeError("KV-sharded attention requires request indices and CPU length metadata")
    try:
        pool.begin_shard_extend(req_to_token, forward_batch.req_pool_indices, prefix_lens, seq_lens)
    except SlotOverflowError:
        if observed is not None:
            observed.series(observed.slot_overflows).inc()
        raise
    if observed is not None:
        observed.batch_begun(pool)
    return True
