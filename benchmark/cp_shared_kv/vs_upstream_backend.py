"""SGLang's own DSA attention backend (``DeepseekSparseAttnBackend``) for the side-by-side harness,
built without a model runner: SGLang's server arguments for a DeepSeek-V3.2-shaped config are
resolved and published (so the backend reads the prefill impl SGLang picks on H200 for the KV format:
``flashmla_kv`` for fp8, ``flashmla_sparse`` for bf16), and the backend gets a namespace with the
model-runner fields its constructor reads (``device``, ``page_size``, ``model_config``, the pools).

On CPU SGLang's resolution reads the CUDA capability; the harness answers SM90 (the H200 it
stands for) so the same impl is picked there.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

# DeepSeek-V3.2 / GLM-5 shapes the backend reads (heads on one CP rank at attention TP 1).
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_head_dim=128)


def _config(heads: int, topk: int, context_len: int) -> dict:
    """The demo's tiny DeepSeek-V3.2-shaped config with this run's heads, indexer top-k and context."""
    from demo.sglang_parts import MODELS

    return {
        **MODELS["dsa"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "index_n_heads": 64,
        "index_topk": topk,
        "max_position_embeddings": context_len,
    }


def publish_dsa(kv_format: str, heads: int, topk: int, context_len: int, page_size: int, device: torch.device) -> dict:
    """Resolve and publish SGLang's server arguments for a DSA model with this KV format; returns the
    published model config (as a dict) and the impls SGLang picked."""
    from sglang.srt.runtime_context import get_exec, publish
    from sglang.srt.server_args import prepare_server_args

    if device.type != "cuda":
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # the H200 the CPU run stands for
    cfg = _config(heads, topk, context_len)
    model_dir = Path(tempfile.mkdtemp(prefix="dsa_model_"))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    argv = ["--model-path", str(model_dir), "--skip-tokenizer-init", "--page-size", str(page_size)]
    argv += ["--kv-cache-dtype", "fp8_e4m3" if kv_format == "fp8" else "bfloat16"]
    argv += ["--context-length", str(context_len)]
    if device.type != "cuda":
        argv += ["--device", "cpu"]
    server_args = prepare_server_args(argv)
    publish(server_args, role="scheduler")
    kernel = get_exec().kernel
    return {"config": cfg, "prefill_impl": kernel.dsa_prefill_backend, "decode_impl": kernel.dsa_decode_backend}


def make_backend(pool, req_to_token: torch.Tensor, cfg: dict, page_size: int, context_len: int, device):
    """``DeepseekSparseAttnBackend`` over ``pool`` (a namespace stands for the model runner)."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    hf = SimpleNamespace(**cfg)
    model_config = SimpleNamespace(
        hf_config=hf,
        context_len=context_len,
        num_attention_heads=cfg["num_attention_heads"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
    )
    runner = SimpleNamespace(
        device=str(device),
        page_size=page_size,
        model_config=model_config,
        token_to_kv_pool=pool,
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token, size=req_to_token.shape[0]),
        is_draft_worker=False,
        hisparse_coordinator=None,
        kv_cache_dtype=pool.dtype,
        max_running_requests=req_to_token.shape[0],
    )
    return DeepseekSparseAttnBackend(runner)


def make_layers(n: int, heads: int) -> list:
    """SGLang's ``RadixAttention`` per layer as the DSA model builds it (absorbed MLA: 576-wide q/k, 512-wide v)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    d = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    scaling = (MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]) ** -0.5
    return [
        RadixAttention(heads, d, scaling, num_kv_heads=1, layer_id=i, v_head_dim=MLA["kv_lora_rank"]) for i in range(n)
    ]


def forward_batch(req_idx, prefix_lens: list[int], seq_lens: list[int], out_cache_loc, device):
    """The ``ForwardBatch`` fields an EXTEND batch's ``init_forward_metadata`` and ``forward_extend`` read."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    extend = [n - p for p, n in zip(prefix_lens, seq_lens)]
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(seq_lens),
        seq_lens=torch.tensor(seq_lens, device=device),
        seq_lens_cpu=torch.tensor(seq_lens),
        seq_lens_sum=sum(seq_lens),
        req_pool_indices=req_idx,
        extend_seq_lens=torch.tensor(extend, device=device, dtype=torch.int32),
        extend_seq_lens_cpu=extend,
        extend_prefix_lens_cpu=prefix_lens,
        extend_prefix_lens=torch.tensor(prefix_lens, device=device, dtype=torch.int32),
        global_num_tokens_cpu=None,
        attn_cp_metadata=None,
        out_cache_loc=out_cache_loc,
        spec_info=None,
        encoder_out_cache_loc=None,
    )
