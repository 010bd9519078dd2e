"""Hooks on SGLang's KV cache configurator: swap in the CP-shared pools and widen the allocator.

All three are AROUND hooks that call the stock step unchanged unless ``--enable-cp-shared-kv``
is on in this process's published server args (and the configurator builds a target, not a
draft, pool):

- ``_build_dsa_kv_pool`` / ``_build_mla_kv_pool``: the stock builder runs with our pool class
  in place of ``DSATokenToKVPool`` / ``MLATokenToKVPool`` (same constructor arguments, so
  every size, dtype and layer decision stays SGLang's).
- ``_build_token_to_kv_pool_allocator``: over a CP-shared pool, SGLang's own owner-rotating
  ``PageInterleavePoolAllocator`` (logical index space ``size * N``, logical pages ``lp``
  drawn for owner ``lp % N``: the same arithmetic as ``PageOwnership``), handed our view
  arena's ``PageShardSpec`` (``view_arena``), so the scheduler widens its capacity and rotation
  bases and SGLang's own scratch admission keeps every prefill batch's views inside the arena.
  Then the process is marked as transferring sharded KV (see ``transfer``).

An AFTER hook on ``_init_pools`` then refuses to go on, one line per problem, unless every
plugin hook is installed in this process and the pool and allocator SGLang built are ours.
An AROUND hook on ``prepare_kv_shard_forward`` hands the batch's request ids to the pool (for
the slot-overflow error).
"""

from __future__ import annotations

import logging

from sglang_cp_shared_kv.srt.sglang_wiring.server_args_hook import FLAG, runtime_enabled

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"


def _active(configurator) -> bool:
    from sglang.srt.runtime_context import get_disagg

    # On a decode server the flag only checks manifests (``decode_manifest``): its pool stays stock.
    return runtime_enabled() and get_disagg().disaggregation_mode == "prefill" and not configurator.is_draft_worker


def _check_built(pool) -> None:
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedKVPoolMixin

    if not isinstance(pool, CPSharedKVPoolMixin):
        raise RuntimeError(
            f"{FLAG}: SGLang built a {type(pool).__name__} instead of the CP-shared pool "
            "(a pool-selecting option the startup checks do not know about is on)"
        )


def _swap_pool_class(original, configurator, kwargs: dict, class_arg: str, pool_class: str):
    """Run SGLang's pool builder, with ``sharded_kv_pool.<pool_class>`` as its ``class_arg`` when the flag is on."""
    if not _active(configurator):
        return original(configurator, **kwargs)
    from sglang_cp_shared_kv.srt.sglang_wiring import sharded_kv_pool

    pool = original(configurator, **{**kwargs, class_arg: getattr(sharded_kv_pool, pool_class)})
    _check_built(pool)
    return pool


def build_dsa_kv_pool(original, configurator, **kwargs):
    return _swap_pool_class(original, configurator, kwargs, "dsa_pool_class", "CPSharedDSATokenToKVPool")


def build_mla_kv_pool(original, configurator, **kwargs):
    return _swap_pool_class(original, configurator, kwargs, "mla_pool_class", "CPSharedMLATokenToKVPool")


def build_allocator(original, configurator, **kwargs):
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedKVPoolMixin

    pool = kwargs.get("token_to_kv_pool")
    if not isinstance(pool, CPSharedKVPoolMixin) or kwargs.get("token_to_kv_pool_allocator") is not None:
        return original(configurator, **kwargs)
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.runtime_context import get_disagg

    from sglang_cp_shared_kv.srt.sglang_wiring.transfer import enable_sharded_transfer
    from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import spec_for

    spec = spec_for(configurator)
    allocator = PageInterleavePoolAllocator(
        kwargs["sizes"].max_total_num_tokens,
        physical_page_size=pool.page_size,
        shard_size=pool.shard_size,
        dtype=configurator.kv_cache_dtype,
        device=configurator.device,
        kvcache=pool,
        need_sort=get_disagg().disaggregation_mode in ("decode", "prefill"),
        shard_spec=spec,  # SGLang's batch admission against our view arena's regions
    )
    allocator.cp_shared_arena = True
    pool.attach_view_arena(spec)  # the read buffers, once: the bytes view_arena charged to the KV budget
    logger.info(
        "%s: allocator widened to %d logical slots over %d CP ranks; per batch at most %d prefix + %d chunk tokens",
        FLAG,
        allocator.size,
        pool.shard_size,
        spec.max_prefix_tokens,
        spec.chunk_tokens,
    )
    enable_sharded_transfer()
    return allocator


def check_built_pools(result, configurator, **_kwargs):
    """AFTER hook on ``_init_pools``: the flag's pool and allocator, and every hook, or a refusal."""
    if not _active(configurator):
        return result
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedKVPoolMixin
    from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import CPSharedKVStartupError, hook_rejections

    lines = hook_rejections()
    pool, allocator = result.token_to_kv_pool, result.token_to_kv_pool_allocator
    if not isinstance(pool, CPSharedKVPoolMixin):
        lines.append(
            f"{FLAG}: SGLang built a {type(pool).__name__}, not the CP-shared pool (a pool-selecting option "
            "the startup checks do not know about is on); drop that option or the flag."
        )
    elif not isinstance(allocator, PageInterleavePoolAllocator) or allocator.get_kvcache() is not pool:
        lines.append(
            f"{FLAG}: SGLang built a {type(allocator).__name__} over the CP-shared pool, not the owner-rotating "
            "PageInterleavePoolAllocator; drop the option that selects it or the flag."
        )
    if lines:
        raise CPSharedKVStartupError("\n".join(lines))
    return result


def name_batch_requests(original, pool, req_to_token, forward_batch):
    """Give a CP-shared pool the batch's request ids before SGLang's backend begins the batch (for errors)."""
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedKVPoolMixin

    if isinstance(pool, CPSharedKVPoolMixin):
        pool.read.request_ids = getattr(forward_batch, "rids", None)
    return original(pool, req_to_token, forward_batch)


# (target, hook, kind) for ``sglang_wiring.register``.
HOOKS = [
    (f"{_CONFIGURATOR}._build_dsa_kv_pool", build_dsa_kv_pool, "around"),
    (f"{_CONFIGURATOR}._build_mla_kv_pool", build_mla_kv_pool, "around"),
    (f"{_CONFIGURATOR}._build_token_to_kv_pool_allocator", build_allocator, "around"),
    (f"{_CONFIGURATOR}._init_pools", check_built_pools, "after"),
    ("sglang.srt.layers.attention.kv_shard_hooks.prepare_kv_shard_forward", name_batch_requests, "around"),
]
