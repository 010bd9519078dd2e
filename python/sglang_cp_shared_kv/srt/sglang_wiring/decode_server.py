"""A PD decode server under ``--dcp-size N`` with the flag: its DSA pool sharded by page ownership.

SGLang's DCP allocator hands out widened pages of ``64 * N`` slots: widened page ``P`` is logical pages
``P * N .. P * N + N - 1``, one per rank, each at physical page ``P`` of its owner (``lp % N``, ``lp // N``),
so the CP-shared pool sits under SGLang's allocator unchanged, latent and indexer rows alike, and the
decode asks the prefill for logical 64-token pages (``transfer_page_size``), which the prefill routes
to their owners (``decode_routes``). Per decode step, with ``decode_cp``'s pieces:

- the indexer reads its keys through ``indexer_pages`` (another rank's page: the trash page) and its
  top-k is ``owned_topk`` over the DCP group: the replicated indexer's, the same on every rank;
- the attention attends over the selected token locs this rank owns (``owned_loc_rows``) and returns
  ``(out, lse)`` as SGLang's DCP merge takes them (``for_dcp_merge``: base 2, an empty row weightless).

Only decode batches run on such a server (PD: the prefill runs the extends).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa import decode_cp_checks
from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import (
    for_dcp_merge,
    indexer_pages,
    owned_loc_rows,
    owned_scores,
    owned_topk,
)
from sglang_cp_shared_kv.srt.mem_cache.placement import debug_enabled
from sglang_cp_shared_kv.srt.sglang_wiring import startup_checks
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG, runtime_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import CPSharedKVStartupError
from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import is_cp_shared_pool

logger = logging.getLogger(__name__)


def builds_pool(kvc) -> bool:
    """Whether this KV cache configurator builds a decode CP pool: flag on, a decode
    server with ``--dcp-size`` > 1, not a draft."""
    from sglang.srt.runtime_context import get_disagg, get_parallel

    decode = get_disagg().disaggregation_mode == "decode"
    return runtime_enabled() and decode and get_parallel().attn_dcp_size > 1 and not kvc.is_draft_worker


def is_decode_pool(pool) -> bool:
    """Whether ``pool`` is a CP-shared pool of a decode server (sharded over its DCP ranks)."""
    from sglang.srt.runtime_context import get_disagg

    return is_cp_shared_pool(pool) and get_disagg().disaggregation_mode == "decode"


def check_built_pools(pool, allocator) -> str:
    """Refuse a pool that is not CP-shared, or an allocator whose pages do not rotate owners;
    the line to log."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    if not is_cp_shared_pool(pool):
        raise CPSharedKVStartupError(
            f"{FLAG}: SGLang built a {type(pool).__name__} on the decode CP server, not the CP-shared pool "
            "(an option the startup checks do not know selects it); drop that option or the flag."
        )
    n, ps = pool.shard_size, pool.page_size
    if not isinstance(allocator, PagedTokenToKVPoolAllocator) or allocator.page_size != n * ps:
        raise CPSharedKVStartupError(
            f"{FLAG}: SGLang built a {type(allocator).__name__} (page size {allocator.page_size}) over the "
            f"decode CP pool, not its DCP allocator of {n * ps}-token pages whose {ps}-token pages rotate "
            "owners; drop the option that selects it, or the flag."
        )
    return (
        f"{FLAG}: decode CP pool, rank {pool.shard_rank} of {n}: {pool.size} latent and indexer rows here, "
        f"{allocator.size} tokens across the ranks (SGLang's DCP keeps every indexer row on every rank)"
    )


def transfer_page_size(pool, page_size: int) -> int:
    """The page size a decode asks the prefill for: a decode CP pool's own 64-token pages (logical
    pages, routed to their owners by the prefill), not SGLang's widened allocator page."""
    return pool.page_size if is_decode_pool(pool) else page_size


@functools.cache
def _group(process_group) -> CPGroup:
    return CPGroup(process_group)


def dcp_group() -> CPGroup:
    """The decode's DCP group (SGLang's ``dcp_group``), as the top-k's collectives take it."""
    from sglang.srt.runtime_context import get_parallel

    return _group(get_parallel().dcp_group.device_group)


def indexer_page_table(pool, logical_pages: torch.Tensor) -> torch.Tensor:
    """``DSAIndexerMetadata.get_page_table_64`` on a decode CP pool: each page of this rank's
    indexer buffer (``indexer_pages``)."""
    return indexer_pages(logical_pages, pool.shard_size, pool.shard_rank)


def indexer_topk(pool, logits: torch.Tensor, lengths: torch.Tensor, logical_pages: torch.Tensor, topk: int):
    """``DSAIndexerMetadata.topk_transform`` of a decode batch on a decode CP pool: the replicated
    indexer's top-k from this rank's ``logits [B, L]`` (``owned_topk`` over the DCP group)."""
    rows, group = logical_pages.shape[0], dcp_group()
    logits, lengths = logits[:rows], lengths[:rows]
    selected = owned_topk(logits, lengths, logical_pages, pool.page_size, topk, group)
    if debug_enabled():
        owned, _ = owned_scores(logits, lengths, logical_pages, pool.page_size, group.size, group.rank)
        decode_cp_checks.check_decode_topk(selected, owned, group)
    return selected


def flashmla_kv_heads(heads: int) -> int:
    """FlashMLA decode's query head count for ``heads`` heads (SGLang's rule)."""
    return 64 if heads <= 64 else 128 if heads <= 128 else heads


def forward_decode(backend, q, k, layer, forward_batch, save_kv_cache: bool, q_rope, k_rope, topk_indices):
    """``DeepseekSparseAttnBackend.forward_decode`` on a decode CP pool: this rank's
    ``(out [R, H, D_v], lse [R, H])`` over the selected locs it owns, for SGLang's DCP merge."""
    from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode
    from sglang.kernels.ops.attention.utils import concat_mla_absorb_q_general

    pool, metadata, impl = backend.token_to_kv_pool, backend.forward_metadata, backend.dsa_decode_impl
    if not forward_batch.forward_mode.is_decode():
        raise NotImplementedError(f"{FLAG}: a decode CP pool runs decode batches only")
    if k is not None and save_kv_cache:
        pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
    heads, d = layer.tp_q_head_num, layer.head_dim
    if q_rope is not None:  # SGLang's concat (its CUDA kernel on a GPU), as its own decode does
        q = concat_mla_absorb_q_general(
            q.view(-1, heads, layer.v_head_dim), q_rope.view(-1, heads, d - layer.v_head_dim)
        )
    q = q.reshape(-1, heads, d)
    topk = backend._pad_topk_indices(topk_indices, q.shape[0])
    locs = transform_index_page_table_decode(page_table=metadata.page_table_1, topk_indices=topk, page_size=1)
    rows = owned_loc_rows(locs, pool.ownership, pool.shard_rank)
    kv = pool.get_key_buffer(layer.layer_id)
    if impl == "flashmla_sparse":
        attend = functools.partial(_flashmla_sparse, backend, q, layer=layer)
    elif impl == "flashmla_kv":
        attend = functools.partial(_flashmla_kv, backend, q, layer=layer, metadata=metadata)
    else:
        raise NotImplementedError(f"{FLAG}: decode CP over --dsa-decode-backend {impl}")
    out, lse = attend(kv, rows)
    out, lse = for_dcp_merge(out[:, :heads], lse[:, :heads])
    if debug_enabled():
        _say_checked()
        decode_cp_checks.check_decode_attention(out, lse, kv, locs, pool.page_size, attend, dcp_group())
    return out, lse


@functools.cache
def _say_checked() -> None:
    logger.info(f"{FLAG}: debug mode: every decode CP step's top-k and attention are checked against the "
                "replicated ones (syncs)")  # fmt: skip


def _padded_heads(q: torch.Tensor, heads: int) -> torch.Tensor:
    if q.shape[1] == heads:
        return q
    out = q.new_zeros(q.shape[0], heads, q.shape[2])
    out[:, : q.shape[1]] = q
    return out


def _flashmla_sparse(backend, q, kv, rows, *, layer):
    """FlashMLA's sparse kernel over a bf16 cache: ``(out [R, H', D_v], natural lse [R, H'])`` (SGLang's
    wrapper returns the legacy kernel's LSE in base 2)."""
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd

    block = 128 if backend.device_sm_major >= 10 else 64  # the kernel's head multiple
    q = _padded_heads(q, -(-q.shape[1] // block) * block)
    out, _, lse2 = flash_mla_sparse_fwd(
        q=q, kv=kv, indices=rows.unsqueeze(1), sm_scale=layer.scaling, d_v=layer.v_head_dim
    )
    return out, lse2 * 0.6931471805599453  # ln(2)


def _flashmla_kv(backend, q, kv, rows, *, layer, metadata):
    """FlashMLA's sparse decode over the fp8 cache: ``(out [R, H', D_v], natural lse [R, H'])``."""
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_with_kvcache

    q = _padded_heads(q, backend.flashmla_kv_num_q_heads).unsqueeze(1)
    out, lse = flash_mla_with_kvcache(
        q=q,
        k_cache=kv.view(-1, backend.physical_page_size, 1, backend.kv_cache_dim),
        cache_seqlens=metadata.dsa_cache_seqlens_int32,
        head_dim_v=layer.v_head_dim,
        tile_scheduler_metadata=metadata.flashmla_metadata.flashmla_metadata,
        num_splits=metadata.flashmla_metadata.num_splits,
        softmax_scale=layer.scaling,
        indices=rows.to(torch.int32).unsqueeze(1),
        block_table=torch.empty((q.shape[0], 0), dtype=torch.int32, device=q.device),
        is_fp8_kvcache=True,
        kv_format=backend.flashmla_kv_format,
    )
    return out[:, 0], lse[:, :, 0]


# -- startup: the decode CP server's rules and SGLang's DSA DCP overrides --


def decode_cp_rejections(server_args: Any) -> list[str]:
    """A decode CP server's rules on the model and the resolved values: a DSA model whose latent and
    indexer pages it shards, FlashMLA's decode kernel for its cache, a CUDA device."""
    from sglang.srt.arg_groups import overrides
    from sglang.srt.configs import model_config as mc

    cfg = overrides.resolving_view(server_args)
    device = cfg.device != "cuda" and f"--device {cfg.device}: the decode kernels are FlashMLA's; run on CUDA GPUs"
    if str(cfg.model_path).lower() in ("none", "dummy"):
        return startup_checks._lines(device)
    hf = overrides.model_config_of(server_args).hf_config
    arch = (hf.architectures or ["?"])[0]
    if not mc.is_deepseek_dsa(hf):  # the other rules are a DSA model's
        return startup_checks._lines(
            f"{arch} on a decode CP server (--dcp-size {cfg.dcp_size}): the flag shards a DSA model's latent "
            "and indexer pages there; serve a DSA model (DeepSeek-V3.2, GLM-5) or drop the flag",
        )
    pooled = mc.get_dsa_index_kpool(hf) != 1 or mc.get_dsa_index_kpool_compress(hf)
    return startup_checks._lines(
        device,
        pooled and "the model pools indexer keys (index_kpool > 1 or compressed); serve a model with index_kpool = 1",
        not pooled
        and cfg.page_size != 64
        and f"--page-size {cfg.page_size}: SGLang's DSA pool stores 64-token indexer pages; set --page-size 64",
        decode_backend_rejection(cfg.dsa_decode_backend, cfg.kv_cache_dtype),
    )


def decode_backend_rejection(backend: str | None, kv_cache_dtype: str) -> str | None:
    """The line refusing a decode kernel a decode CP pool cannot run, or None."""
    fp8 = str(kv_cache_dtype).startswith("fp8")
    fits = {"flashmla_kv": fp8, "flashmla_sparse": not fp8}
    if fits.get(backend):
        return None
    want = "flashmla_kv" if fp8 else "flashmla_sparse"
    return (
        f"--dsa-decode-backend {backend} on a decode CP server (--dcp-size) over a {kv_cache_dtype} cache: "
        f"its partial attention needs FlashMLA's LSE; use --dsa-decode-backend {want}"
    )


def default_decode_backend(kv_cache_dtype: Any) -> str:
    return "flashmla_kv" if str(kv_cache_dtype).startswith("fp8") else "flashmla_sparse"


class _Colocated:
    """A resolving view that reads as a non-PD server (``disaggregation_mode`` ``"null"``)."""

    def __init__(self, cfg: Any):
        self._cfg = cfg

    def __getattr__(self, name: str) -> Any:
        return "null" if name == "disaggregation_mode" else getattr(self._cfg, name)


def decode_cp_overrides(cfg: Any, sglang_overrides) -> dict:
    """SGLang's DSA DCP overrides (``_dsa_dcp_overrides``) on a decode CP server with the flag: the
    flag's rules first (one line each), then SGLang's own but its PD refusal, with FlashMLA's decode
    kernel for the cache in place of its trtllm default (SM100 only)."""
    startup_checks._raise(startup_checks.flag_rejections(cfg, decode_cp=True))
    out = dict(sglang_overrides(_Colocated(cfg)))
    for name in ("dsa_prefill_backend", "dsa_decode_backend"):
        if getattr(cfg, name) is None:
            out.pop(name, None)
    if cfg.dsa_decode_backend is None:
        out["dsa_decode_backend"] = default_decode_backend(cfg.kv_cache_dtype)
    return out
