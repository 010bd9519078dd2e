"""Tiny HF ``config.json`` models for the plugin tests that run SGLang's real argument resolution and pools.

Tiny everywhere except where the byte formats are fixed: the MLA latent (``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64) and the DSA indexer head (``index_head_dim`` 128) keep DeepSeek's sizes,
so the pools and transfers under test see the real row and page layouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_MLA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rms_norm_eps": 1e-6,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
_DSA = {
    **_MLA,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_head_dim": 128,
    "index_n_heads": 4,
    "index_topk": 64,
}
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
MODELS = {
    # DeepSeek-V3 (plain MLA): resolves on CPU, builds SGLang's MLA pool.
    "mla": {**_MLA, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
    # DeepSeek-V3.2-shaped (MLA + lightning indexer).
    "dsa": _DSA,
    # The same with a pooled indexer key (``index_kpool``).
    "dsa_kpool": {**_DSA, "index_kpool": 4},
    # A GQA Llama: no MLA latent at all.
    "gqa": LLAMA,
}


def write_model_dirs(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Writes ``root/<name>/config.json`` for each named model (all of ``MODELS`` by default); returns the dirs."""
    names = list(MODELS) if names is None else list(names)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise ValueError(f"names: unknown models {unknown}; known: {sorted(MODELS)}")
    dirs = {}
    for name in names:
        model_dir = Path(root) / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(MODELS[name]))
        dirs[name] = model_dir
    return dirs


def prefill_cp_argv(model_dir: str, page_size: int) -> list[str]:
    """Server argv of the tiny ``mla`` model as a Mooncake prefill server with 2 prefill CP ranks, on CPU.

    It resolves on CPU (``--enable-cp-shared-kv`` would not: the tests set it on the resolved record).
    """
    argv = ["--model-path", str(Path(model_dir) / "mla"), "--device", "cpu", "--skip-tokenizer-init"]
    argv += ["--enable-prefill-cp", "--cp-strategy", "interleave", "--tp-size", "2", "--attn-cp-size", "2"]
    argv += ["--page-size", str(page_size), "--disaggregation-mode", "prefill"]
    return argv + ["--disaggregation-transfer-backend", "mooncake"]


def stock_dsa_pools(token_counts: list[int], page_size: int) -> list:
    """SGLang's stock (non-CP) bf16 ``DSATokenToKVPool`` of the tiny ``dsa`` model on CPU, one per count.

    Built outside decode context parallelism (``dcp_replicated``): the unsharded layout the CP-shared
    pools are compared with, and the pool a non-CP decode server holds. Imports sglang: call it in a worker.
    """
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    dsa = MODELS["dsa"]
    kw = dict(
        page_size=page_size,
        kv_lora_rank=dsa["kv_lora_rank"],
        dtype=torch.bfloat16,
        qk_rope_head_dim=dsa["qk_rope_head_dim"],
        layer_num=dsa["num_hidden_layers"],
        device="cpu",
        index_head_dim=dsa["index_head_dim"],
        enable_memory_saver=False,
        kv_cache_dim=dsa["kv_lora_rank"] + dsa["qk_rope_head_dim"],
    )
    pools = []
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        for tokens in token_counts:
            pool = DSATokenToKVPool(tokens, **kw)
            pool.dcp_replicated = True
            pools.append(pool)
    return pools


def run_worker(argv: list[str], env: dict, timeout: float) -> dict:
    """Run ``python <argv>`` (a test file's worker) and return the JSON it printed after ``RESULT:``; a worker
    that fails or prints none fails the test with its output's tail."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT:")]
    assert proc.returncode == 0 and line, (
        f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(line[-1][len("RESULT:") :])


def configurator(model_config, page_size: int):
    """SGLang's ``KVCacheConfigurator`` with the attributes its pool and allocator builders read (no model runner)."""
    import types

    import torch
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    c = object.__new__(KVCacheConfigurator)
    c.model_config, c.kv_cache_dtype, c.device = model_config, torch.bfloat16, "cpu"
    c.is_draft_worker, c.is_hybrid_swa, c.hybrid_gdn_config = False, False, None
    c.kv_shard_rank, c.kv_shard_size, c.kv_shard_spec = None, 1, None
    c.layer_info = types.SimpleNamespace(num_effective_layers=2, start_layer=0, end_layer=2)
    c.page_size, c.use_mla_backend = page_size, True
    return c


def build_pool_and_allocator(
    model_config, tokens: int, max_running: int, page_size: int, cp: tuple[int, int] | None = None
) -> tuple:
    """SGLang's configurator builds (through the plugin's hooks, when the flag is on) the DSA pool of ``tokens``
    and its allocator; ``cp``: as CP rank ``cp[0]`` of ``cp[1]`` (else in the caller's parallel context)."""
    import contextlib
    import types

    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    ctx = contextlib.nullcontext()
    if cp is not None:
        ctx = get_parallel().override(
            attn_cp_rank=cp[0], attn_cp_size=cp[1], attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False
        )
    with ctx:
        conf = configurator(model_config, page_size)
        pool = conf._build_dsa_kv_pool(
            max_total_num_tokens=tokens, max_running_requests=max_running, dsa_pool_class=DSATokenToKVPool
        )
        alloc = conf._build_token_to_kv_pool_allocator(
            sizes=types.SimpleNamespace(max_total_num_tokens=tokens),
            token_to_kv_pool=pool,
            is_dsv4_model=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
        )
    return pool, alloc
