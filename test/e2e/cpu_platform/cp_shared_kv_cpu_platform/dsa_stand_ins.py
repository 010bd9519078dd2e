"""Plain-torch stand-ins for the CUDA-only pieces of SGLang's DSA path (rows of ``platform.STAND_INS``).

Each keeps SGLang's own code around it: the indexer stand-in runs SGLang's q/k projections, rope,
K-cache store (through the pool, so the plugin's masked store) and head gate, reads the indexer keys
through the pool's read contract (``get_index_k_scale_buffer``: the plugin's views) and hands the
logits to SGLang's own masking and torch top-k (a decode batch reads its keys through SGLang's page
table, as SGLang's paged path does); the sparse attention is the project's oracle
``reference.dsa_reference.flash_mla_sparse_fwd_ref`` (SGLang's wrapper over ``sparse_mla``) over the rows
SGLang's DSA backend selected.
"""

from __future__ import annotations

import sys
import types

import torch


def hadamard_transform(x: torch.Tensor, scale: float) -> torch.Tensor:
    """SGLang's ``hadamard_transform`` (a CUDA JIT kernel) in torch: ``x @ H_n * scale``, ``n`` a power of two."""
    n = x.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float32, device=x.device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (x.float() @ h * scale).to(x.dtype)


def deepseek_rope_native(self, positions, query, key, offsets=None):
    """``DeepseekScalingRotaryEmbedding.forward_native`` with one cos/sin row per token for any rank of q/k.

    SGLang's own repeats the neox-style cos/sin to three dims (``cos.repeat(1, 1, 2)``), so a
    ``[T, H, D]`` query comes back ``[1, T, H, D]`` (the DSA indexer's rope then fails to copy it back).
    """
    from sglang.srt.layers.rotary_embedding.rope_variant import rotate_gptj, rotate_neox

    dtype = query.dtype
    cos_sin = self.cos_sin_cache[torch.add(positions, offsets) if offsets is not None else positions]
    cos, sin = cos_sin.chunk(2, dim=-1)
    if self.is_neox_style:
        cos, sin, rotate = cos.repeat(1, 2), sin.repeat(1, 2), rotate_neox
    else:
        cos, sin, rotate = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1), rotate_gptj

    def apply(x: torch.Tensor) -> torch.Tensor:
        shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
        rot = x[..., : self.rotary_dim]
        out = rot * cos.view(shape) + rotate(rot) * sin.view(shape)
        if self.rotary_dim < x.shape[-1]:
            out = torch.cat((out, x[..., self.rotary_dim :]), dim=-1)
        return out.to(dtype)

    return apply(query), apply(key)


def fp8_mqa_logits(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor):
    """DeepGEMM's fp8 MQA logits: ``sum_h relu(q[i, h] . k[j]) * w[i, h] * k_scale[j]``, fp32 ``[T, L]``."""
    logits = torch.einsum("thd,ld->thl", q_fp8.float(), k_fp8.float()).relu_()
    return torch.einsum("thl,th->tl", logits, weights.float()) * k_scale.float()


def indexer_forward(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True, use_cuda_graph=True):
    """SGLang's ``Indexer.forward_cuda`` for an eager extend batch, its DeepGEMM logits in torch."""
    from sglang.kernels.ops.quantization.act_quant_triton import act_quant
    from sglang.srt.layers.attention.dsa.dsa_indexer import get_token_to_kv_pool
    from sglang.srt.model_executor.forward_context import get_attn_backend

    metadata = get_attn_backend().get_indexer_metadata(layer_id, forward_batch)
    if metadata is None:
        return None
    mode = forward_batch.forward_mode
    if not (mode.is_extend_without_speculative() or mode.is_decode()):
        raise NotImplementedError(f"cpu platform: the indexer's top-k for {mode.name} batches has no stand-in")
    query, key, _ = self._get_q_k_bf16(q_lora, x, positions, False, forward_batch=forward_batch)
    q_fp8, q_scale = act_quant(query, self.block_size, self.scale_fmt)
    self._store_index_k_cache(forward_batch=forward_batch, layer_id=layer_id, key=key, act_quant=act_quant)
    weights = self._get_logits_head_gate(x, q_scale).squeeze(-1)
    if mode.is_decode():
        return _topk_paged(self, layer_id, q_fp8, weights, metadata)

    topk = torch.full((q_fp8.shape[0], self.index_topk), -1, dtype=torch.int32, device=q_fp8.device)
    block_tables = metadata.get_logical_page_table()
    if len(block_tables) == 0:
        return topk
    ks, _ke = metadata.get_indexer_kvcache_range()
    lens = metadata.get_indexer_seq_len_cpu()
    k_fp8, k_scale = get_token_to_kv_pool().get_index_k_scale_buffer(
        layer_id, metadata.get_indexer_seq_len(), block_tables, int(lens.sum()), int(lens.max())
    )
    rows = ks.shape[0]
    logits = fp8_mqa_logits(
        q_fp8[:rows], k_fp8.view(torch.float8_e4m3fn), k_scale.view(torch.float32).squeeze(-1), weights[:rows]
    )
    self._mask_init_and_local_tokens(logits, metadata.get_seqlens_expanded(), ks)
    topk[:rows] = metadata.topk_transform(logits, self.index_topk, ks=ks)
    return topk


def _topk_paged(self, layer_id, q_fp8, weights, metadata):
    """SGLang's ``_get_topk_paged`` for a decode batch (one query per request), its paged logits in torch."""
    from sglang.srt.layers.attention.dsa.dsa_indexer import get_token_to_kv_pool

    from reference.dsa_reference import read_index_k

    pool = get_token_to_kv_pool()
    page_size = pool.index_page_size
    block_tables = metadata.get_page_table_64()
    seqlens = metadata.get_seqlens_int32()
    batch = seqlens.shape[0]
    max_len = block_tables.shape[1] * page_size
    pages = self._get_index_k_read_buffer(pool, layer_id)
    pos = torch.arange(max_len, device=q_fp8.device)
    rows = block_tables[:, pos // page_size].long().clamp(min=0) * page_size + pos % page_size  # [B, L]
    k_u8, k_scale = read_index_k(pages, page_size, rows.reshape(-1))
    k = k_u8.view(torch.float8_e4m3fn).float().view(batch, max_len, -1)
    logits = torch.einsum("bhd,bld->bhl", q_fp8[:batch].float(), k).relu_()
    logits = torch.einsum("bhl,bh->bl", logits, weights[:batch].float()) * k_scale.view(batch, max_len)
    logits = torch.where(pos < seqlens.view(-1, 1), logits, torch.full_like(logits, float("-inf")))
    self._mask_init_and_local_tokens(logits, seqlens)
    topk = metadata.topk_transform(logits, self.index_topk)
    if batch < q_fp8.shape[0]:
        pad = torch.full((q_fp8.shape[0] - batch, topk.shape[1]), -1, dtype=topk.dtype, device=topk.device)
        topk = torch.cat([topk, pad])
    return topk


def install_flash_mla() -> None:
    """SGLang's ``flash_mla_interface`` (it imports the ``flash_mla`` CUDA package) as a module of the stand-in."""
    from reference.dsa_reference import flash_mla_sparse_fwd_ref

    name = "sglang.kernels.ops.attention.flash_mla_interface"
    module = types.ModuleType(name)
    module.flash_mla_sparse_fwd = flash_mla_sparse_fwd_ref
    sys.modules[name] = module


def install_ops() -> None:
    from sglang.kernels.fused_op import BaseFusedOp
    from sglang.kernels.ops.quantization import hadamard
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

    hadamard.hadamard_transform = hadamard_transform
    BaseFusedOp.register_oot_forward(Indexer, indexer_forward, "native")
    BaseFusedOp.register_oot_forward(DeepseekScalingRotaryEmbedding, deepseek_rope_native, "native")


def register_cpu_kernels() -> None:
    """A CPU kernel for each SGLang custom op: out of tree SGLang registers them for PrivateUse1 only.

    Each op's Python function is the ``__wrapped__`` of the eager caller SGLang binds in its module.
    """
    from sglang.srt.utils import common

    done = register_cpu_kernels.__dict__.setdefault("done", set())
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("sglang."):
            continue
        for obj in list(vars(module).values()):
            name, fn = getattr(obj, "__name__", None), getattr(obj, "__wrapped__", None)
            if not isinstance(name, str) or fn is None or name in done or not hasattr(torch.ops.sglang, name):
                continue
            try:
                common.sglang_lib.impl(name, fn, "CPU")
            except RuntimeError:
                pass  # already has a CPU kernel
            done.add(name)
