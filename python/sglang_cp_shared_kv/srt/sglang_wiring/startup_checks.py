"""Startup checks for ``--enable-cp-shared-kv``, in SGLang's argument resolution.

Every rejection is one line naming the flag and the fix, all raised together (``docs/sglang_plugin.md``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_HEAD_DIM
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG

logger = logging.getLogger(__name__)

# The DSA prefill kernels that read the pool through the kv-shard contract.
DSA_PREFILL_BACKENDS = ("flashmla_sparse", "trtllm")
# Flags a prefill server cannot combine with this one, and why (named as attributes).
_DROP = {
    "--enable-dsa-cache-layer-split": "splits the same DSA cache by layer, not page",
    "--dcp-size": "(decode context parallelism) also widens the allocator",
    "--enable-cp-decode-attn-tp": "is a decode-time CP mode",
    "--pp-size": "is not wired: pipeline-parallel slices of the pool",
    "--speculative-algorithm": "is not wired: the draft model's pool is not sharded",
    "--dllm-algorithm": "is not wired: its admission bypasses the allocator",
    "--radix-cache-backend": "is not wired: only the built-in tree tracks owners",
    "--enable-hierarchical-cache": "is not wired: host copies of a sharded pool",
    "--enable-lmcache": "is not wired: LMCache reads whole pages from one rank",
    "--enable-hisparse": "is not wired: HiSparse needs whole pages on a rank",
    "--enable-flexkv": "is not wired: its load-back bypasses the allocator",
    "--enable-unified-memory": "is not wired: the unified pool has its own layout",
    "--enable-unified-cache-external-linker": "is not wired: it bypasses the allocator",
    "--enable-streaming-session": "is not wired: sessions do not track page owners",
    "--enable-session-radix-cache": "is not wired: sessions do not track page owners",
    "--enable-two-batch-overlap": "is not wired: one read plan per pool",
    "--enable-pdmux": "is not wired: split prefill batches are not planned",
}
_DECODE_CP = ("--enable-prefill-cp", "--enable-cp-decode-attn-tp", "--attn-cp-size")
# Flags a decode CP server (--dcp-size > 1) cannot combine with this one, and why.
_DROP_DECODE_CP = {
    "--speculative-algorithm": "is not wired on a decode CP server: the draft model's pool is not sharded",
    "--enable-hierarchical-cache": "is not wired on a decode CP server: host copies of a sharded pool",
    "--enable-hisparse": "is not wired on a decode CP server: HiSparse needs whole pages on a rank",
    "--enable-lmcache": "is not wired on a decode CP server: LMCache reads whole pages from one rank",
    "--enable-dsa-cache-layer-split": "splits the same DSA cache by layer, not page",
    "--enable-two-batch-overlap": "is not wired on a decode CP server",
    "--pp-size": "is not wired on a decode CP server: pipeline-parallel slices of the pool",
}


class CPSharedKVStartupError(ValueError):
    """A configuration ``--enable-cp-shared-kv`` cannot run: one line per problem."""


def _lines(*rejections: Any) -> list[str]:
    """The lines of the rejections given as ``"what; fix"`` (falsy ones pass)."""
    return [f"{FLAG}: {r}." for r in rejections if r]


def _raise(rejections: list[str]) -> None:
    if rejections:
        raise CPSharedKVStartupError("\n".join(rejections))


def _given(cfg: Any, flag: str) -> str | None:
    """The flag with its value if on (not unset, False or a size <= 1), else None."""
    value = getattr(cfg, flag[2:].replace("-", "_"), None)
    if value in (None, False) or (type(value) is int and value <= 1):
        return None
    return flag if value is True else f"{flag} {value}"


def _not_wired(flag: str, value: Any) -> str:
    if value in (None, "null", ""):
        return f"{flag} is not set"
    return f"{flag} {value} is not wired"


def _is_pow2(n: Any) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def model_config_rejections(path: str, revision: str | None = None) -> list[str]:
    """The model config must be readable here, offline: a local or cached model."""
    if path.lower() in ("none", "dummy"):
        return _lines(f"--model-path {path} carries no model config to check for MLA; pass a real MLA checkpoint")
    if os.path.isdir(path):
        found = os.path.isfile(os.path.join(path, "config.json"))
        return _lines(not found and f"--model-path {path} has no config.json; pass a Hugging Face checkpoint directory")
    if os.path.exists(path):
        return []  # a single-file checkpoint: SGLang reads its config locally
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json", revision=revision)
    except Exception:  # not a valid repo id either
        cached = None
    return _lines(
        not isinstance(cached, str)
        and f"--model-path {path} is neither a local directory nor a model in the "
        "Hugging Face cache (the model config is checked before anything goes to the "
        f"network); download it first (huggingface-cli download {path}) or pass its "
        "local directory"
    )


def flag_rejections(cfg: Any, decode_cp: bool = False) -> list[str]:
    """The rules on the flags alone (the record or a resolving view of it); ``decode_cp``: a decode may
    shard its pool over ``--dcp-size`` ranks (its hooks are installed)."""
    from sglang.srt.environ import envs

    backend, mode = cfg.disaggregation_transfer_backend, cfg.disaggregation_mode
    both = [  # a decode server's rules too
        backend != "mooncake"
        and f"{_not_wired('--disaggregation-transfer-backend', backend)}: it has no "
        "owned-page sender; use --disaggregation-transfer-backend mooncake",
        cfg.enable_kv_cache_sharding
        and "--enable-kv-cache-sharding is SGLang's own page sharding of the same pool; pass only one of the two flags",
        envs.SGLANG_DISAGG_STAGING_BUFFER.get()
        and "SGLANG_DISAGG_STAGING_BUFFER: staged transfers send no owned pages or manifests; unset it",
    ]
    if mode == "decode":
        on = [f for f in _DECODE_CP + (() if decode_cp else ("--dcp-size",)) if _given(cfg, f)]
        shown = ", ".join(_given(cfg, f) for f in on)
        dcp = decode_cp and (cfg.dcp_size or 1) > 1
        kept = "shards its KV over --dcp-size ranks, or holds it whole" if decode_cp else "holds the KV whole"
        return _lines(
            *both,
            on
            and f"{shown} on the decode server: prefill CP runs on the --disaggregation-mode prefill "
            f"server (a decode {kept}); drop {', '.join(on)} here",
            *(dcp and f"{g} {w}; drop {f}" for f, w in _DROP_DECODE_CP.items() if (g := _given(cfg, f))),
        )
    chunk, ps = cfg.chunked_prefill_size, cfg.page_size
    out = model_config_rejections(str(cfg.model_path), getattr(cfg, "revision", None))
    out += _setting_rejections()
    return out + _lines(
        *both,
        not cfg.enable_prefill_cp
        and "prefill CP is off, and the KV is sharded over its ranks; add --enable-prefill-cp",
        cfg.cp_strategy != "interleave"
        and f"{_not_wired('--cp-strategy', cfg.cp_strategy)} (the write path needs "
        "the whole chunk on every rank); use --cp-strategy interleave",
        mode != "prefill"
        and f"{_not_wired('--disaggregation-mode', mode)} (the sharded pool has no "
        "decode allocation); use --disaggregation-mode prefill (or decode, to "
        "check the manifests)",
        ps is not None
        and not _is_pow2(ps)
        and f"--page-size {ps} is not a power of two (page ownership is shift/mask "
        "arithmetic); use e.g. --page-size 64",
        chunk is not None
        and chunk <= 0
        and f"--chunked-prefill-size {chunk} turns chunked prefill off (the view "
        "arena is sized from the chunk); set a positive multiple of the page size",
        chunk is not None
        and chunk > 0
        and _is_pow2(ps)
        and chunk % ps
        and f"--chunked-prefill-size {chunk} is not a multiple of the page size {ps}; use a multiple of {ps}",
        *(f"{g} {w}; drop {f}" for f, w in _DROP.items() if (g := _given(cfg, f))),
    )


def _setting_rejections() -> list[str]:
    """The feature's settings, read now: a bad value stops the server at startup."""
    from sglang_cp_shared_kv.srt.distributed.copy_engine import transport_setting
    from sglang_cp_shared_kv.srt.environ import envs
    from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import arena_contexts

    def problem(read: Any, *args: Any, name: str = "") -> str | None:
        try:
            read(*args)
        except ValueError as e:
            return f"{name}{e}; set a valid value or unset it"
        return None

    names = [n for n in dir(envs) if "CP_SHARED_KV" in n and getattr(envs, n).is_set()]
    peer = envs.SGLANG_CP_SHARED_KV_PEER_TIMEOUT
    return _lines(
        # a value that does not parse would read as the default
        *(problem(getattr(envs, n).parse, os.environ[n], name=f"{n}: ") for n in names),
        problem(arena_contexts),
        problem(transport_setting),
        not peer.get() > 0 and f"{peer.name} must be a positive number of seconds; set a valid value or unset it",
    )


def resolved_rejections(server_args: Any, decode_cp_rules=None) -> list[str]:
    """The flag rules, then those on the model and the resolved values; ``decode_cp_rules(server_args)``:
    a decode CP server's lines, None where a decode may not shard its pool."""
    from sglang.srt.arg_groups import overrides
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_dsa

    cfg = overrides.resolving_view(server_args)
    out = flag_rejections(cfg, decode_cp_rules is not None)
    if cfg.disaggregation_mode == "decode":
        # A decode CP server's pool is sharded; a non-CP decode's pool, model and kernels are SGLang's.
        sharded = decode_cp_rules is not None and (cfg.dcp_size or 1) > 1
        return out + (decode_cp_rules(server_args) if sharded else [])
    cp = cfg.attn_cp_size or 1  # SGLang sets a DeepSeek model's CP size itself
    out += _lines(
        cfg.enable_prefill_cp
        and cp <= 1
        and f"the prefill's attention CP size resolves to {cp} (--tp-size "
        f"{cfg.tp_size}, --attn-dp-size {cfg.attn_dp_size}): nothing to shard over; "
        "give it N > 1 CP ranks (--tp-size N with --attn-dp-size 1, or --attn-cp-size "
        "N)"
    )
    if str(cfg.model_path).lower() in ("none", "dummy"):
        return out
    model = overrides.model_config_of(server_args)
    hf_config = model.hf_config
    arch = (hf_config.architectures or ["?"])[0]
    if model.attention_arch != AttentionArch.MLA:
        return out + _lines(
            f"{arch} is not an MLA model (attention {model.attention_arch.name}); "
            "serve an MLA model (DeepSeek-V3/V3.2, GLM-5) or drop the flag"
        )
    backend, _ = overrides.attention_backends_of(overrides.resolved_view(server_args))
    if is_deepseek_dsa(hf_config):
        out += _dsa_rejections(cfg, hf_config, backend, arch)
    elif backend != "fa3":
        e5m2 = cfg.kv_cache_dtype == "fp8_e5m2"  # SGLang moves fa3 to triton for it
        why = " (SGLang moves fa3 to triton for fp8_e5m2)" if e5m2 else ""
        fix = "--kv-cache-dtype fp8_e4m3 or auto with " if e5m2 else ""
        out += _lines(
            f"prefill attention backend {backend!r} for MLA model {arch} reads the "
            f"pool outside the sharded read contract{why}; use "
            f"{fix}--prefill-attention-backend fa3"
        )
    return out + _lines(
        cfg.device != "cuda"
        and f"--device {cfg.device}: the read path all-gathers over NCCL and the "
        "kernels are CUDA-only; run on CUDA GPUs",
        cfg.page_size in (None, 1)  # the flag rules refuse sizes not powers of two
        and f"resolved page size {cfg.page_size or 1} must be a power of two greater than 1; set --page-size 64",
        model.is_encoder_decoder
        and "encoder-decoder models keep a second page table, not planned; serve a decoder-only MLA model",
        getattr(model, "attention_chunk_size", None) is not None
        and "chunked/local attention is not covered by the read plan; serve a full-attention MLA model",
    )


def _dsa_rejections(cfg: Any, hf: Any, backend: str, arch: str) -> list[str]:
    """A DSA model's rules: its prefill kernel, and the sharded indexer page layout."""
    from sglang.srt.configs import model_config as mc

    chosen = cfg.prefill_attention_backend
    head_dim = getattr(hf, "index_head_dim", INDEX_HEAD_DIM)
    pooled = mc.get_dsa_index_kpool(hf) != 1 or mc.get_dsa_index_kpool_compress(hf)
    drop = f"drop --prefill-attention-backend {chosen} and " if chosen else ""
    return _lines(
        backend != "dsa"
        and f"DSA model {arch} on prefill attention backend {backend!r}; {drop}use --attention-backend dsa",
        backend == "dsa"
        and cfg.dsa_prefill_backend not in DSA_PREFILL_BACKENDS
        and f"--dsa-prefill-backend {cfg.dsa_prefill_backend} reads the pool outside "
        "the sharded read contract; use --dsa-prefill-backend "
        f"{' or '.join(DSA_PREFILL_BACKENDS)}",
        head_dim != INDEX_HEAD_DIM
        and f"indexer head dim {head_dim} is not the sharded layout's "
        f"{INDEX_HEAD_DIM}; serve a model with 128-dim indexer keys",
        pooled and "the model pools indexer keys (index_kpool > 1 or compressed); serve a model with index_kpool = 1",
        cfg.page_size != 64  # a pooled indexer sets the page size itself
        and not pooled
        and f"--page-size {cfg.page_size}: SGLang's DSA pool stores 64-token indexer pages; set --page-size 64",
    )


def early_check(server_args: Any, decode_cp: bool = False) -> None:
    """After ``validate_prefill_cp_platform`` (model unresolved): the flag rules."""
    from sglang.srt.arg_groups.overrides import resolving_view

    _raise(flag_rejections(resolving_view(server_args), decode_cp))


def resolved_check(server_args: Any, decode_cp_rules=None) -> None:
    """After ``handle_kv_cache_sharding`` (twice; idempotent): every rule, then on a
    prefill server Python's radix tree core by default and an eager prefill."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.environ import envs
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    cfg = resolving_view(server_args)
    if cfg.disaggregation_mode == "decode":
        return _raise(resolved_rejections(server_args, decode_cp_rules))
    core = envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND  # Python's tracks page owners
    if not core.is_set():
        core.set("python")
    other = not cfg.disable_radix_cache and core.get() != "python"
    tree = other and f"{core.name}={core.get()!r} does not track page owners; unset it"
    _raise(resolved_rejections(server_args, decode_cp_rules) + _lines(tree))
    graph = cfg.cuda_graph_config
    if graph.prefill.backend != Backend.DISABLED:  # the read plan is made per batch
        logger.warning("%s: prefill CUDA graph (%s) off: the read plan runs eagerly", FLAG, graph.prefill.backend)
        graph = with_phase(graph, Phase.PREFILL, backend=Backend.DISABLED)
        declare_resolution(server_args, "cp_shared_kv", cuda_graph_config=graph)
