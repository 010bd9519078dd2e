"""Startup checks for ``--enable-cp-shared-kv``, run inside SGLang's argument resolution.

Every rejection is one line naming the offending flag and the fix; all of a configuration's rejections are
raised together in one ``CPSharedKVStartupError`` (a ``ValueError``). What is accepted is exactly what the
pools, their read path and the PD manifest honour (the table in ``docs/sglang_plugin.md``): a PD prefill
server over Mooncake, interleaved prefill CP over N > 1 ranks, an MLA model on CUDA on a prefill kernel that
reads through the kv-shard contract; a PD decode server only checks the manifests (``decode_manifest``), on
Mooncake, non-CP, its pool, model and kernels SGLang's.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_HEAD_DIM as _INDEX_HEAD_DIM
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG

logger = logging.getLogger(__name__)

# DSA prefill kernels whose reads go through the kv-shard pool contract the sharded pool implements
# (translated page tables + ``get_key_buffer`` + logical indexer pages); others read the pool otherwise.
DSA_PREFILL_BACKENDS = ("flashmla_sparse", "trtllm")
# Plain-MLA prefill backends that consume the same contract in 0.5.23.
MLA_PREFILL_BACKENDS = ("fa3",)
_DSA_PAGE_SIZE = 64  # DSATokenToKVPool asserts 64-token pages on CUDA


class CPSharedKVStartupError(ValueError):
    """The configuration (or the SGLang it runs in) does not support ``--enable-cp-shared-kv``: one line per problem."""


def _line(what: str, fix: str) -> str:
    return f"{FLAG}: {what}; {fix}."


def _lines(checks: list[tuple[Any, str, str]]) -> list[str]:
    return [_line(what, fix) for rejected, what, fix in checks if rejected]


# Both servers' rejection of SGLang's own sharding (what, fix).
_KV_CACHE_SHARDING = (
    "--enable-kv-cache-sharding is SGLang's own page sharding of the same pool",
    "pass only one of the two flags",
)


def _not_wired(flag: str, value: Any) -> str:
    return f"{flag} is not set" if value in (None, "null", "") else f"{flag} {value} is not wired"


def model_config_rejections(model_path: Any, revision: str | None = None) -> list[str]:
    """The model config must be readable here, without the network: a local checkpoint or a cached model."""
    path = str(model_path)
    if path.lower() in ("none", "dummy"):
        return [_line(f"--model-path {path} carries no model config to check for MLA", "pass a real MLA checkpoint")]
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return []
        return [_line(f"--model-path {path} has no config.json", "pass a Hugging Face checkpoint directory")]
    if os.path.exists(path):
        return []  # a single-file checkpoint: SGLang reads its config locally
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json", revision=revision)
    except Exception:  # not a valid repo id either
        cached = None
    if isinstance(cached, str):
        return []
    return [
        _line(
            f"--model-path {path} is neither a local directory nor a model in the Hugging Face cache, and the "
            "model config is checked before anything goes to the network",
            f"download it first (huggingface-cli download {path}) or pass its local directory",
        )
    ]


def _is_pow2(n: Any) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def _staging_buffer_rejections(why: str) -> list[str]:
    from sglang.srt.environ import envs

    staged = envs.SGLANG_DISAGG_STAGING_BUFFER.get()
    return _lines([(staged, f"SGLANG_DISAGG_STAGING_BUFFER{why}", "unset SGLANG_DISAGG_STAGING_BUFFER")])


def decode_rejections(cfg: Any) -> list[str]:
    """A decode server with the flag: non-CP, Mooncake, checking the prefill ranks' manifests."""
    cp_flags = [
        f
        for f, on in (
            ("--enable-prefill-cp", cfg.enable_prefill_cp),
            ("--enable-cp-decode-attn-tp", cfg.enable_cp_decode_attn_tp),
            (f"--attn-cp-size {cfg.attn_cp_size}", (cfg.attn_cp_size or 1) > 1),
            (f"--dcp-size {cfg.dcp_size}", (cfg.dcp_size or 1) > 1),
        )
        if on
    ]
    checks = [  # (rejected, what, fix)
        (
            cfg.disaggregation_transfer_backend != "mooncake",
            f"--disaggregation-transfer-backend {cfg.disaggregation_transfer_backend}: the manifests ride on the "
            "Mooncake connector's status messages",
            "use --disaggregation-transfer-backend mooncake",
        ),
        (
            cp_flags,
            f"{', '.join(cp_flags)} on the decode server: it stays non-CP (it receives whole pages and checks "
            "the manifests); the KV is sharded on the prefill server (--disaggregation-mode prefill)",
            f"drop {', '.join(f.split()[0] for f in cp_flags)} here",
        ),
        (cfg.enable_kv_cache_sharding, *_KV_CACHE_SHARDING),
    ]
    return _lines(checks) + _staging_buffer_rejections(": staged transfers are not wired with the manifest check")


def flag_rejections(cfg: Any) -> list[str]:
    """Checks that need only the flags (a record or a resolving view)."""
    if cfg.disaggregation_mode == "decode":
        return decode_rejections(cfg)
    out = model_config_rejections(cfg.model_path, getattr(cfg, "revision", None))
    checks = [  # (rejected, what, fix)
        (
            not cfg.enable_prefill_cp,
            "the KV is sharded over the prefill context-parallel ranks, and prefill CP is off",
            "add --enable-prefill-cp",
        ),
        (
            cfg.cp_strategy != "interleave",
            f"{_not_wired('--cp-strategy', cfg.cp_strategy)} (the write path needs every rank to hold the whole chunk "
            "after the interleave all-gather; DeepSeek-V3.2 / GLM-5 require interleave)",
            "use --cp-strategy interleave",
        ),
        (
            cfg.disaggregation_mode != "prefill",
            f"{_not_wired('--disaggregation-mode', cfg.disaggregation_mode)} (batches would decode from a pool that "
            "holds 1/N of every page, and the widened allocator has no decode allocation)",
            "run it on the PD prefill server (--disaggregation-mode prefill) and, to check the manifests, "
            "on its decode server (--disaggregation-mode decode)",
        ),
        (
            cfg.disaggregation_transfer_backend != "mooncake",
            _not_wired("--disaggregation-transfer-backend", cfg.disaggregation_transfer_backend)
            + ": it has no owned-page sender",
            "use --disaggregation-transfer-backend mooncake",
        ),
        (cfg.enable_kv_cache_sharding, *_KV_CACHE_SHARDING),
        (
            cfg.enable_dsa_cache_layer_split,
            "--enable-dsa-cache-layer-split splits the same DSA cache by layer instead of by page",
            "drop --enable-dsa-cache-layer-split",
        ),
        (
            cfg.dcp_size is not None and cfg.dcp_size > 1,
            f"--dcp-size {cfg.dcp_size} (decode context parallelism) also widens the allocator index space",
            "drop --dcp-size",
        ),
        (
            cfg.enable_cp_decode_attn_tp,
            "--enable-cp-decode-attn-tp is a decode-time CP mode; the sharded pool serves prefill only",
            "drop --enable-cp-decode-attn-tp",
        ),
        (
            cfg.page_size is not None and not _is_pow2(cfg.page_size),
            f"--page-size {cfg.page_size} is not a power of two (page ownership is shift/mask arithmetic)",
            "use a power of two, e.g. --page-size 64",
        ),
        (
            cfg.pp_size is not None and cfg.pp_size > 1,
            f"--pp-size {cfg.pp_size}: pipeline-parallel layer slices of the sharded pool are not wired",
            "use --pp-size 1",
        ),
    ]
    return out + _lines(checks) + _plumbing_rejections(cfg) + _setting_rejections()


def _setting_rejections() -> list[str]:
    """The feature's environment settings, read here so a bad value stops the server at startup."""
    from sglang_cp_shared_kv.srt.distributed.copy_engine import transport_setting
    from sglang_cp_shared_kv.srt.environ import envs
    from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_contexts

    out = []
    settings = (
        envs.SGLANG_CP_SHARED_KV_TRANSPORT,
        envs.SGLANG_CP_SHARED_KV_ARENA_CONTEXTS,
        envs.SGLANG_CP_SHARED_KV_PREFETCH,
        envs.SGLANG_CP_SHARED_KV_PEER_TIMEOUT,
        envs.SGLANG_DEBUG_CP_SHARED_KV,
    )
    for setting in settings:  # a value that does not parse would read as the default, with a warning
        if not setting.is_set():
            continue
        try:
            setting.parse(os.environ[setting.name])
        except ValueError as e:
            out.append(_line(f"{setting.name}: {e}", "set a valid value or unset it"))
    for read in (arena_contexts, transport_setting):
        try:
            read()
        except ValueError as e:
            out.append(_line(str(e), "set a valid value or unset it"))
    if not envs.SGLANG_CP_SHARED_KV_PEER_TIMEOUT.get() > 0:
        name = envs.SGLANG_CP_SHARED_KV_PEER_TIMEOUT.name
        out.append(_line(f"{name} must be a positive number of seconds", "set a valid value or unset it"))
    return out


def _plumbing_rejections(cfg: Any) -> list[str]:
    """Features that bypass the widened allocator / rotation-aware radix tree the wiring reuses from SGLang."""
    unsupported = (  # (flag, why); the server args attribute is the flag's name
        ("--speculative-algorithm", "the draft model's KV pool is not sharded"),
        ("--dllm-algorithm", "diffusion admission bypasses the widened allocator"),
        ("--radix-cache-backend", "only the built-in radix tree tracks page-owner rotation"),
        ("--enable-hierarchical-cache", "HiCache host copies of a sharded pool are not wired"),
        ("--enable-lmcache", "LMCache reads whole pages from one rank"),
        ("--enable-hisparse", "HiSparse assumes each rank holds complete pages"),
        ("--enable-flexkv", "FlexKV load-back allocates through the flat allocator"),
        ("--enable-unified-memory", "the unified pool has its own allocator and layout"),
        ("--enable-unified-cache-external-linker", "load-back allocates through the flat allocator"),
        ("--enable-streaming-session", "session nodes carry no page-owner rotation"),
        ("--enable-session-radix-cache", "session nodes carry no page-owner rotation"),
        ("--enable-two-batch-overlap", "the per-batch read plan is one per pool, and TBO builds two"),
        ("--enable-pdmux", "split prefill batches are not planned"),
    )
    chunk, ps = cfg.chunked_prefill_size, cfg.page_size
    checks = [
        (
            getattr(cfg, flag[2:].replace("-", "_"), None) not in (None, False),
            f"{flag} is not supported ({why})",
            f"drop {flag}",
        )
        for flag, why in unsupported
    ]
    checks += [
        (
            chunk is not None and chunk <= 0,
            f"--chunked-prefill-size {chunk} turns chunked prefill off (the view arena and its batch admission are sized from the chunk)",
            "set --chunked-prefill-size to a positive multiple of the page size",
        ),
        (
            chunk is not None and chunk > 0 and _is_pow2(ps) and chunk % ps,
            f"--chunked-prefill-size {chunk} is not a multiple of the page size {ps} (chunks must end on a page: the owner-rotating allocator extends whole pages)",
            f"use a multiple of {ps}",
        ),
    ]
    return _lines(checks) + _staging_buffer_rejections(" sends contiguous slices, not owned pages")


def resolved_rejections(server_args: Any) -> list[str]:
    """Checks on the model and on resolved values (page size, backends, dtype, device)."""
    from sglang.srt.arg_groups.overrides import attention_backends_of, model_config_of, resolved_view, resolving_view
    from sglang.srt.configs.model_config import (
        AttentionArch,
        get_dsa_index_kpool,
        get_dsa_index_kpool_compress,
        is_deepseek_dsa,
    )

    cfg = resolving_view(server_args)
    out = flag_rejections(cfg)
    if cfg.disaggregation_mode == "decode":  # the decode pool, model and kernels stay SGLang's
        return out
    # SGLang sets a DeepSeek model's attention CP size itself (--tp-size / --attn-dp-size unless an
    # interleaved --attn-cp-size N > 1 is given): judged here, on what it resolved to.
    checks = [
        (
            cfg.enable_prefill_cp and (cfg.attn_cp_size or 1) <= 1,
            f"the prefill's attention CP size resolves to {cfg.attn_cp_size or 1} (--tp-size {cfg.tp_size}, "
            f"--attn-dp-size {cfg.attn_dp_size}): nothing to shard over",
            "give it N > 1 CP ranks: --tp-size N with --attn-dp-size 1, or --attn-cp-size N",
        )
    ]
    if str(cfg.model_path).lower() in ("none", "dummy"):
        return out + _lines(checks)
    model_config = model_config_of(server_args)
    hf_config = model_config.hf_config
    arch = (hf_config.architectures or ["?"])[0]
    if model_config.attention_arch != AttentionArch.MLA:
        what = f"{arch} is not an MLA model (attention {model_config.attention_arch.name}); the sharded pool stores MLA latent rows"
        return out + _lines([*checks, (True, what, "serve an MLA model (DeepSeek-V3/V3.2, GLM-5) or drop the flag")])
    checks.append(
        (
            cfg.device != "cuda",
            f"--device {cfg.device}: the read path all-gathers over NCCL and the MLA/DSA kernels are CUDA-only",
            "run on CUDA GPUs",
        )
    )
    prefill_backend, _ = attention_backends_of(resolved_view(server_args))
    if is_deepseek_dsa(hf_config):
        chosen = getattr(cfg, "prefill_attention_backend", None)
        head_dim = getattr(hf_config, "index_head_dim", _INDEX_HEAD_DIM)
        pooled = get_dsa_index_kpool(hf_config) != 1 or get_dsa_index_kpool_compress(hf_config)
        checks += [
            (
                prefill_backend != "dsa",
                f"DSA model {arch} on prefill attention backend {prefill_backend!r}",
                f"drop --prefill-attention-backend {chosen} and use --attention-backend dsa"
                if chosen
                else "use --attention-backend dsa",
            ),
            (
                prefill_backend == "dsa" and cfg.dsa_prefill_backend not in DSA_PREFILL_BACKENDS,
                f"--dsa-prefill-backend {cfg.dsa_prefill_backend} reads the pool outside the sharded read contract",
                f"use --dsa-prefill-backend {' or '.join(DSA_PREFILL_BACKENDS)}",
            ),
            (
                head_dim != _INDEX_HEAD_DIM,
                f"indexer head dim {head_dim} != {_INDEX_HEAD_DIM} (the sharded indexer page layout)",
                "serve a model with 128-dim indexer keys",
            ),
            (  # a pooled indexer sets the page size itself
                cfg.page_size != _DSA_PAGE_SIZE and not pooled,
                f"--page-size {cfg.page_size}: SGLang's DSA pool stores {_DSA_PAGE_SIZE}-token indexer pages",
                f"set --page-size {_DSA_PAGE_SIZE}",
            ),
            (
                pooled,
                "the model pools indexer keys (index_kpool > 1 or compressed), not wired",
                "serve a model with index_kpool = 1",
            ),
        ]
    else:
        # SGLang moves fa3 to triton for an fp8_e5m2 cache (FA3 reads fp8 as e4m3 only): the dtype is the fix.
        e5m2 = cfg.kv_cache_dtype == "fp8_e5m2"
        checks.append(
            (
                prefill_backend not in MLA_PREFILL_BACKENDS,
                f"prefill attention backend {prefill_backend!r} for MLA model {arch} reads the pool outside the sharded read contract"
                + (" (SGLang moves fa3 to triton for --kv-cache-dtype fp8_e5m2)" if e5m2 else ""),
                ("use --kv-cache-dtype fp8_e4m3 or auto with " if e5m2 else "use ")
                + f"--prefill-attention-backend {' or '.join(MLA_PREFILL_BACKENDS)}",
            )
        )
    checks += [
        (
            not _is_pow2(cfg.page_size) or cfg.page_size == 1,
            f"resolved page size {cfg.page_size} must be a power of two greater than 1 (a page is the ownership and transfer unit)",
            "set --page-size 64",
        ),
        (
            model_config.is_encoder_decoder,
            "encoder-decoder models keep a second page table that is not planned",
            "serve a decoder-only MLA model",
        ),
        (
            getattr(model_config, "attention_chunk_size", None) is not None,
            "chunked/local-attention models build metadata the read plan does not cover",
            "serve a full-attention MLA model",
        ),
    ]
    return out + _lines(checks)


def _raise(rejections: list[str]) -> None:
    if rejections:
        raise CPSharedKVStartupError("\n".join(dict.fromkeys(rejections)))


def _disable_prefill_cuda_graph(server_args: Any) -> None:
    """The per-batch read plan is built on the host each forward: prefill runs eagerly (declared, not written)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    graph_config = resolving_view(server_args).cuda_graph_config
    if graph_config.prefill.backend == Backend.DISABLED:
        return
    logger.warning(
        "%s: prefill CUDA graph (%s) disabled: the sharded read plan runs eagerly.", FLAG, graph_config.prefill.backend
    )
    declare_resolution(
        server_args, "cp_shared_kv", cuda_graph_config=with_phase(graph_config, Phase.PREFILL, backend=Backend.DISABLED)
    )


def _tree_core_rejections(cfg: Any) -> list[str]:
    """Make the radix tree core that tracks the allocator's rotation bases (Python's) the default; refuse others."""
    from sglang.srt.environ import envs

    core = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND
    if not core.is_set():
        core.set("python")
    if cfg.disable_radix_cache or core.get() == "python":
        return []
    return [_line(f"{core.name}={core.get()!r} does not track page-owner rotation", "unset it or set it to python")]


def early_check(server_args: Any) -> None:
    """After ``validate_prefill_cp_platform`` (before model resolution), flag on: the flag-only rules."""
    from sglang.srt.arg_groups.overrides import resolving_view

    _raise(flag_rejections(resolving_view(server_args)))


def resolved_check(server_args: Any) -> None:
    """After ``handle_kv_cache_sharding`` (which runs twice; this is idempotent), flag on: the model and
    resolved-value rules."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if cfg.disaggregation_mode == "decode":
        _raise(resolved_rejections(server_args))
        return
    _raise(resolved_rejections(server_args) + _tree_core_rejections(cfg))
    _disable_prefill_cuda_graph(server_args)
