"""The view arena, a CP-shared pool's read buffer ``[prefix view | chunk | trash]``,
sized once from the server's limits: its regions are the allocator's ``PageShardSpec``
(SGLang's admission keeps each batch inside it), its bytes are charged to the KV budget
in place of SGLang's page-interleave scratch (about ``contexts / 16`` of it)."""

from __future__ import annotations

import logging

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


def builds_cp_shared_pool(kvc) -> bool:
    """Whether this KV cache configurator builds a CP-shared pool: flag on, a prefill
    server, not a draft."""
    from sglang.srt.runtime_context import get_disagg

    prefill = get_disagg().disaggregation_mode == "prefill"
    return runtime_enabled() and prefill and not kvc.is_draft_worker


def make_arena_spec(cp_rank, cp_size, page_size, context_len, chunk_tokens, contexts):
    """SGLang's ``PageShardSpec`` with the arena's regions (``arena_regions``)."""
    from sglang.srt.mem_cache.page_interleave import PageShardSpec

    check_int("cp_size", cp_size, 2)
    limits = context_len, chunk_tokens, contexts
    prefix, chunk = arena_regions(cp_size, page_size, *limits)
    sizes = dict(page_size=page_size, max_prefix_tokens=prefix, chunk_tokens=chunk)
    return PageShardSpec(shard_rank=cp_rank, shard_size=cp_size, **sizes)


def spec_for(kvc):
    """This CP rank's arena spec, from SGLang's parallel and schedule settings."""
    from sglang.srt.runtime_context import get_parallel, get_schedule

    p, chunk = get_parallel(), get_schedule().chunked_prefill_size
    if chunk is None or chunk <= 0:
        raise ValueError(f"{FLAG} needs --chunked-prefill-size > 0 for its view arena")
    limits = kvc.page_size, kvc.model_config.context_len, chunk, arena_contexts()
    return make_arena_spec(p.attn_cp_rank, p.attn_cp_size, *limits)


def _token_bytes(kvc) -> int:
    from sglang.srt.mem_cache import page_interleave

    return page_interleave._page_shard_row_bytes(kvc)


def read_mode_for(kvc) -> ReadMode:
    """This server's read mode (``choose_read_mode``) from its limits."""
    spec, context = spec_for(kvc), kvc.model_config.context_len
    token_bytes = _token_bytes(kvc)
    return choose_read_mode(spec.shard_size, context, spec.chunk_tokens, token_bytes)


def arena_bytes(spec, token_bytes: int, prefetch: bool = False) -> int:
    """Bytes of one arena: ``materialize.arena_tokens`` of ``token_bytes`` each."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import arena_tokens

    prefix, chunk, ps = spec.max_prefix_tokens, spec.chunk_tokens, spec.page_size
    return arena_tokens(prefix, chunk, ps, prefetch) * token_bytes


def upstream_scratch_bytes(spec, token_bytes: int, context_len: int) -> int:
    """SGLang's page-interleave scratch here: its contexts, the chunk, a page, twice."""
    from sglang.srt.mem_cache import page_interleave

    contexts = page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS
    prefix = contexts * ceil_align(context_len, spec.shard_size * spec.page_size)
    return 2 * (prefix + spec.chunk_tokens + spec.page_size) * token_bytes


def charge_arena(kvc) -> int:
    """The view arena's bytes, charged to the KV budget in place of SGLang's scratch."""
    spec, token_bytes, mode = spec_for(kvc), _token_bytes(kvc), read_mode_for(kvc)
    arena, mib = arena_bytes(spec, token_bytes, mode.prefetch), 2**20
    theirs = upstream_scratch_bytes(spec, token_bytes, kvc.model_config.context_len)
    layers = max(int(getattr(kvc.model_config, "num_hidden_layers", 1) or 1), 1)
    chunk = f"{'2 x ' if mode.prefetch else ''}{spec.chunk_tokens}"
    logger.info(
        f"{FLAG}: view arena {arena / mib:.1f} MiB per rank ({spec.max_prefix_tokens} "
        f"prefix + {chunk} chunk tokens), charged to the KV budget: about "
        f"{arena // (token_bytes * layers)} fewer cached tokens; SGLang's "
        f"--enable-kv-cache-sharding scratch would take {theirs / mib:.1f} MiB; "
        f"{mode.describe()}"
    )
    return arena


def is_cp_shared_pool(pool) -> bool:
    """Whether ``pool`` is a CP-shared pool (``sharded_kv_pool``, imported here)."""
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedKVPoolMixin

    return isinstance(pool, CPSharedKVPoolMixin)


def serves_arena(allocator) -> bool:
    """Whether ``allocator`` hands out a CP-shared pool's slots."""
    get_kvcache = getattr(allocator, "get_kvcache", None)
    return get_kvcache is not None and is_cp_shared_pool(get_kvcache())


def log_deferred(adder, prefix_len: int, extend_len: int) -> None:
    """SGLang's admission deferred a request for the view arena: say why it waits."""
    spec = getattr(adder, "kv_shard_scratch_spec", None)
    if spec is not None and serves_arena(adder.token_to_kv_pool_allocator):
        logger.info(
            f"{FLAG}: a request (prefix {prefix_len}, new {extend_len} tokens) waits "
            "for a later batch: this batch's views would exceed the view arena "
            f"({spec.max_prefix_tokens} prefix + {spec.chunk_tokens} chunk tokens; "
            f"{ARENA_CONTEXTS_ENV} raises the prefix part)"
        )
