"""The view arena: the read buffer of a CP-shared pool, ``[prefix view | current chunk | trash page]``,
sized once from the server's limits (``docs/sglang_plugin.md``, "View arena").

The allocator gets its region sizes (``view_arena_size``) as its ``PageShardSpec``, so SGLang's own
admission (``PrefillAdder._kv_shard_reserve_scratch``) keeps every batch inside the arena, and its bytes are
charged to the KV budget in place of SGLang's page-interleave scratch (eight contexts, twice)::

    arena / page-interleave scratch = contexts / 16
    (prefix dominated; 1/8 with the default 2)
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import (
    ARENA_CONTEXTS_ENV,
    arena_contexts,
    arena_regions,
    ceil_align,
)
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG, runtime_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.read_mode import ReadMode, choose_read_mode
from sglang_cp_shared_kv.srt.utils import check_int

logger = logging.getLogger(__name__)


def builds_cp_shared_pool(configurator: Any) -> bool:
    """Whether this KV cache configurator builds a CP-shared pool: flag on, a prefill server, not a draft."""
    from sglang.srt.runtime_context import get_disagg

    return runtime_enabled() and get_disagg().disaggregation_mode == "prefill" and not configurator.is_draft_worker


def read_mode_for(configurator: Any) -> ReadMode:
    """This server's read mode (``read_mode.choose_read_mode``) from its limits."""
    from sglang.srt.mem_cache import page_interleave

    spec = spec_for(configurator)
    token_bytes = page_interleave._page_shard_row_bytes(configurator)
    return choose_read_mode(spec.shard_size, configurator.model_config.context_len, spec.chunk_tokens, token_bytes)


def make_arena_spec(
    cp_rank: int, cp_size: int, page_size: int, context_len: int, chunk_tokens: int, contexts: int
) -> Any:
    """SGLang's ``PageShardSpec`` with our region sizes (``view_arena_size.arena_regions``)."""
    from sglang.srt.mem_cache.page_interleave import PageShardSpec

    check_int("cp_size", cp_size, 2)
    prefix, chunk = arena_regions(cp_size, page_size, context_len, chunk_tokens, contexts)
    return PageShardSpec(
        shard_rank=cp_rank, shard_size=cp_size, page_size=page_size, max_prefix_tokens=prefix, chunk_tokens=chunk
    )


def arena_bytes(spec: Any, token_bytes: int, prefetch: bool = False) -> int:
    """Bytes of one arena: ``materialize.arena_tokens`` of ``token_bytes`` each."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import arena_tokens

    return arena_tokens(spec.max_prefix_tokens, spec.chunk_tokens, spec.page_size, prefetch) * token_bytes


def upstream_scratch_bytes(spec: Any, token_bytes: int, context_len: int) -> int:
    """What SGLang's page-interleave scratch takes for the same server: eight contexts + the chunk + a page, twice."""
    from sglang.srt.mem_cache import page_interleave

    contexts = page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS
    prefix = contexts * ceil_align(context_len, spec.shard_size * spec.page_size)
    return 2 * (prefix + spec.chunk_tokens + spec.page_size) * token_bytes


def spec_for(configurator: Any) -> Any:
    """The arena spec of this process's CP rank, from SGLang's parallel context and schedule limits."""
    from sglang.srt.runtime_context import get_parallel, get_schedule

    parallel = get_parallel()
    chunk = get_schedule().chunked_prefill_size
    if chunk is None or chunk <= 0:
        raise ValueError(f"{FLAG} needs chunked prefill (--chunked-prefill-size > 0) to size its view arena")
    return make_arena_spec(
        parallel.attn_cp_rank,
        parallel.attn_cp_size,
        configurator.page_size,
        configurator.model_config.context_len,
        chunk,
        arena_contexts(),
    )


def charge_arena(kvc) -> int:
    """The view arena's bytes, charged to the KV budget in place of SGLang's page-interleave scratch."""
    from sglang.srt.mem_cache import page_interleave

    spec = spec_for(kvc)
    token_bytes = page_interleave._page_shard_row_bytes(kvc)
    mode = read_mode_for(kvc)
    arena = arena_bytes(spec, token_bytes, mode.prefetch)
    theirs = upstream_scratch_bytes(spec, token_bytes, kvc.model_config.context_len)
    layers = max(int(getattr(kvc.model_config, "num_hidden_layers", 1) or 1), 1)
    logger.info(
        "%s: view arena %.1f MiB per rank (%d prefix + %s%d chunk tokens), charged to the KV budget: about %d "
        "fewer cached tokens; SGLang's --enable-kv-cache-sharding scratch would take %.1f MiB; %s",
        FLAG,
        arena / 2**20,
        spec.max_prefix_tokens,
        "2 x " if mode.prefetch else "",
        spec.chunk_tokens,
        arena // (token_bytes * layers),
        theirs / 2**20,
        mode.describe(),
    )
    return arena


def is_cp_shared_pool(pool: Any) -> bool:
    """Whether ``pool`` is a CP-shared pool (``sharded_kv_pool``, imported only when asked)."""
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedKVPoolMixin

    return isinstance(pool, CPSharedKVPoolMixin)


def serves_arena(allocator) -> bool:
    """Whether ``allocator`` hands out a CP-shared pool's slots."""
    get_kvcache = getattr(allocator, "get_kvcache", None)
    return get_kvcache is not None and is_cp_shared_pool(get_kvcache())


def log_deferred(adder, prefix_len: int, extend_len: int) -> None:
    """``PrefillAdder._kv_shard_reserve_scratch`` deferred a request: say why it waits for a later batch."""
    spec = getattr(adder, "kv_shard_scratch_spec", None)
    if spec is not None and serves_arena(adder.token_to_kv_pool_allocator):
        logger.info(
            "%s: a request (prefix %d, new %d tokens) waits for a later batch: this batch's views would exceed "
            "the view arena (%d prefix + %d chunk tokens; %s raises the prefix part)",
            FLAG,
            prefix_len,
            extend_len,
            spec.max_prefix_tokens,
            spec.chunk_tokens,
            ARENA_CONTEXTS_ENV,
        )
