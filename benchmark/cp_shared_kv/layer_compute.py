"""One DSA layer's compute on a prefill rank, as the stand-in a view is timed behind.

Two parts, each with a plain-torch reference of the same semantics (for CPU and for tests):

- **Attention** (``AttentionStep``): the sparse MLA step SGLang's DSA backend runs on H200 with an
  fp8 KV cache (``flashmla_kv``, both SM90 defaults for a ``fp8_e4m3`` pool): FlashMLA's paged
  fp8 kernel ``flash_mla_with_kvcache`` over the 656-B rows viewed ``(-1, 64, 1, 656)``, top-k
  indices ``[T, 1, 2048]`` of token rows, and the split-KV schedule precomputed from
  ``cache_seqlens = min(seq_len, topk)`` as the backend's ``_compute_flashmla_metadata`` does. The
  call goes through SGLang's own wrapper (``sglang.kernels.ops.attention.flash_mla_interface``)
  where SGLang imports, else straight to the ``flash_mla`` wheel with the same arguments.
- **MoE** (``MoEStandIn``): the GEMMs of one DeepSeek-V3.2 / GLM-5 MoE layer for this rank's tokens:
  routed experts (top-8 of 256, SwiGLU, ``moe_intermediate`` 2048) and the shared expert, hidden
  7168, fp8 e4m3 weights with per-channel scales (the checkpoints ship fp8) and per-token
  activation scales. ``moe_shape`` returns the FLOPs, bytes and assumptions as a dict.

Assumptions of the MoE stand-in (``moe_shape``): a CP-8 prefill node runs the experts with expert
parallelism over its 8 GPUs (SGLang's DeepSeek-V3.2 / GLM-5 prefill recipes: DeepEP dispatch,
``--ep-size 8``): a rank holds ``256 / 8 = 32`` experts, and with balanced routing receives
``top_k * T`` token rows for them, ``T * top_k * ep / 256`` per expert, so its routed FLOPs are those
of its own ``T`` tokens' top-8 experts whatever ``ep``; ``ep`` sets the weight bytes (32 experts'
worth, 1.41 GB at fp8). Not modelled: the dispatch/combine all-to-all (network, and on DeepEP some
SMs), routing imbalance, the indexer (its logits grow with the prefix and would lengthen the layer at
long contexts), the q/kv/o projections and norms. So the layer here is shorter than a real one: a
view hidden behind it hides behind the real one too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reference.kv_formats import dequantize_mla_fp8
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import FP8_MAX, KV_LORA_RANK, MLA_FP8_ROW_BYTES, ROPE_DIM

PAGE_SIZE = 64
INDEX_TOPK = 2048
QK_DIM = KV_LORA_RANK + ROPE_DIM  # 576: absorbed q and the cache's latent + rope
HEADS = 128  # DeepSeek-V3.2 / GLM-5 attention heads on one CP rank (attention TP 1)
KV_FORMAT = "V32"  # the backend's ``flashmla_kv_format`` for the 656-B rows


# -- attention: flashmla_kv ----------------------------------------------------------------------------------------


def _flash_mla_api():
    """SGLang's wrapper module (what the DSA backend imports), else the ``flash_mla`` wheel, else None."""
    try:
        from sglang.kernels.ops.attention import flash_mla_interface

        return "sglang", flash_mla_interface
    except Exception:  # noqa: BLE001 - SGLang absent or its wrapper's imports fail: try the wheel
        pass
    try:
        import flash_mla

        return "flash_mla", flash_mla
    except ImportError:
        return None, None


def sparse_attention_reference(
    q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, sm_scale: float, block: int = 64
) -> torch.Tensor:
    """Plain torch: ``q`` bf16 ``[T, 1, H, 576]``, ``kv_rows`` uint8 ``[R, 656]``, ``indices`` int32
    ``[T, 1, K]`` (rows, -1 skipped) -> bf16 ``[T, 1, H, 512]``: softmax over the selected rows of
    ``sm_scale * q . k`` (k = dequantized latent | rope), times their latent. A query with no valid
    row gets zeros. Blocks of ``block`` queries bound the memory."""
    t, _, h, _ = q.shape
    out = torch.empty(t, 1, h, KV_LORA_RANK, dtype=torch.bfloat16, device=q.device)
    for s in range(0, t, block):
        idx = indices[s : s + block, 0].long()  # [b, K]
        valid = idx >= 0
        k = dequantize_mla_fp8(kv_rows[idx.clamp(min=0).reshape(-1)]).view(*idx.shape, QK_DIM)  # [b, K, 576]
        scores = torch.einsum("bhd,bkd->bhk", q[s : s + block, 0].float(), k) * sm_scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-invalid row: zeros
        out[s : s + block, 0] = torch.einsum("bhk,bkd->bhd", probs, k[..., :KV_LORA_RANK]).to(torch.bfloat16)
    return out


class AttentionStep:
    """The ``flashmla_kv`` attention of one layer for ``num_tokens`` query tokens over a cache of rows.

    ``cache_seqlens`` int32 ``[T]`` is the backend's ``dsa_cache_seqlens_int32`` (each query's
    ``min(seq_len, topk)``); ``indices`` int32 ``[T, 1, topk]`` the cache rows top-k picked (-1 past
    ``cache_seqlens``). ``use_kernel``: None picks FlashMLA on CUDA when it imports, else the
    reference. The schedule is computed once here, as the backend does once per batch.
    """

    def __init__(
        self,
        q: torch.Tensor,
        indices: torch.Tensor,
        cache_seqlens: torch.Tensor,
        sm_scale: float | None = None,
        use_kernel: bool | None = None,
    ):
        t, one, h, d = q.shape
        if one != 1 or d != QK_DIM or q.dtype != torch.bfloat16:
            raise ValueError(f"q must be bf16 [T, 1, H, {QK_DIM}], got {q.dtype} {tuple(q.shape)}")
        if indices.shape[:2] != (t, 1) or indices.dtype != torch.int32:
            raise ValueError(f"indices must be int32 [{t}, 1, topk], got {indices.dtype} {tuple(indices.shape)}")
        self.q, self.indices, self.cache_seqlens = q, indices, cache_seqlens
        self.sm_scale = QK_DIM**-0.5 if sm_scale is None else sm_scale
        self.entry, self._api = _flash_mla_api() if q.is_cuda else (None, None)
        if use_kernel is None:
            use_kernel = self._api is not None
        if use_kernel and self._api is None:
            raise RuntimeError("FlashMLA is not importable (neither SGLang's wrapper nor the flash_mla wheel)")
        self.use_kernel = use_kernel
        self._sched = self._schedule() if use_kernel else None
        self._block_table = torch.empty((t, 0), dtype=torch.int32, device=q.device)  # ignored by the kernel

    def _schedule(self):
        """The split-KV schedule, as ``DeepseekSparseAttnBackend._compute_flashmla_metadata`` makes it."""
        heads, topk = self.q.shape[2], self.indices.shape[-1]
        if self.entry == "sglang":
            return self._api.get_mla_metadata(
                cache_seqlens=self.cache_seqlens,
                num_q_tokens_per_head_k=heads,
                num_heads_k=1,
                num_heads_q=heads,
                is_fp8_kvcache=True,
                topk=topk,
            )
        return self._api.get_mla_decoding_metadata(self.cache_seqlens, heads, 1, heads, True, topk, use_legacy=True)

    def __call__(self, kv_rows: torch.Tensor) -> torch.Tensor:
        """``kv_rows`` uint8 ``[R, 656]`` (R a multiple of 64) -> bf16 ``[T, 1, H, 512]``."""
        if kv_rows.dtype != torch.uint8 or kv_rows.dim() != 2 or kv_rows.shape[1] != MLA_FP8_ROW_BYTES:
            raise ValueError(
                f"kv_rows must be uint8 [R, {MLA_FP8_ROW_BYTES}], got {kv_rows.dtype} {tuple(kv_rows.shape)}"
            )
        if not self.use_kernel:
            return sparse_attention_reference(self.q, kv_rows, self.indices, self.sm_scale)
        cache = kv_rows.view(torch.float8_e4m3fn).view(-1, PAGE_SIZE, 1, MLA_FP8_ROW_BYTES)
        sched, splits = self._sched
        if self.entry == "sglang":
            out, _ = self._api.flash_mla_with_kvcache(
                q=self.q,
                k_cache=cache,
                block_table=self._block_table,
                cache_seqlens=self.cache_seqlens,
                head_dim_v=KV_LORA_RANK,
                tile_scheduler_metadata=sched,
                num_splits=splits,
                softmax_scale=self.sm_scale,
                indices=self.indices,
                is_fp8_kvcache=True,
                kv_format=KV_FORMAT,
            )
            return out
        from flash_mla.flash_mla_interface import FlashMLASchedMeta

        meta = FlashMLASchedMeta()
        meta.tile_scheduler_metadata, meta.num_splits = sched, splits
        out, _ = self._api.flash_mla_with_kvcache(
            self.q,
            cache,
            self._block_table,
            self.cache_seqlens,
            KV_LORA_RANK,
            meta,
            softmax_scale=self.sm_scale,
            is_fp8_kvcache=True,
            indices=self.indices,
            use_legacy=True,
            kv_format=KV_FORMAT,
        )
        return out

    def describe(self) -> dict:
        t, _, h, _ = self.q.shape
        return {
            "kernel": f"flash_mla_with_kvcache via {self.entry}" if self.use_kernel else "plain-torch reference",
            "shape": f"q {t}x1x{h}x{QK_DIM} bf16, fp8 cache (-1,{PAGE_SIZE},1,{MLA_FP8_ROW_BYTES}), "
            f"indices {t}x1x{self.indices.shape[-1]}",
            "kv_format": KV_FORMAT,
            "schedule": "precomputed (get_mla_metadata on cache_seqlens = min(seq_len, topk))",
        }


def attention_inputs(
    num_tokens: int,
    cache_rows: int,
    prefix_tokens: int,
    heads: int = HEADS,
    topk: int = INDEX_TOPK,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, indices, cache_seqlens)`` of a chunk of ``num_tokens`` queries appended to ``prefix_tokens``:
    query ``t`` sees ``prefix_tokens + t + 1`` keys, keeps ``min(that, topk)`` of them, spread uniformly
    over ``cache_rows`` rows (a long prefix's top-k scatters; rows may repeat), -1 after."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(num_tokens, 1, heads, QK_DIM, generator=g) / 8).to(torch.bfloat16)
    seqlens = torch.clamp(prefix_tokens + torch.arange(1, num_tokens + 1), max=topk).to(torch.int32)
    idx = torch.randint(0, cache_rows, (num_tokens, 1, topk), generator=g, dtype=torch.int32)
    idx[torch.arange(topk).expand(num_tokens, 1, topk) >= seqlens.view(-1, 1, 1)] = -1
    return q.to(device), idx.to(device), seqlens.to(device)


# -- MoE stand-in ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    """One DeepSeek-V3.2 MoE layer (GLM-5's routed/shared layout is the same: 256 routed, top-8, 1 shared)."""

    hidden: int = 7168
    moe_intermediate: int = 2048
    routed_experts: int = 256
    top_k: int = 8
    shared_experts: int = 1
    ep_size: int = 8  # expert parallelism over a CP-8 prefill node's GPUs
    weight_dtype: str = "fp8"  # or "bf16"


def moe_shape(tokens: int, cfg: MoEConfig = MoEConfig()) -> dict:
    """FLOPs and bytes of one layer's MoE GEMMs on one rank holding ``tokens`` tokens (a dict for the JSON)."""
    if cfg.routed_experts % cfg.ep_size:
        raise ValueError(f"ep_size {cfg.ep_size} must divide routed_experts {cfg.routed_experts}")
    h, i = cfg.hidden, cfg.moe_intermediate
    local = cfg.routed_experts // cfg.ep_size
    rows = math.ceil(tokens * cfg.top_k * cfg.ep_size / cfg.routed_experts)  # per local expert, balanced
    wbytes = 1 if cfg.weight_dtype == "fp8" else 2
    per_row = 2 * 3 * h * i  # gate + up (h -> 2i) and down (i -> h), 2 FLOPs per MAC
    routed = local * rows * per_row
    shared = cfg.shared_experts * tokens * per_row
    router = 2 * tokens * h * cfg.routed_experts
    weights = (local + cfg.shared_experts) * 3 * h * i * wbytes + h * cfg.routed_experts * 2
    act_rows = local * rows + cfg.shared_experts * tokens
    # GEMM operands: inputs (weight dtype), gate/up out (bf16), its SwiGLU (weight dtype), down out (bf16).
    activations = act_rows * (h * wbytes + 2 * i * 2 + i * wbytes + h * 2) + tokens * (h * 2 + cfg.routed_experts * 4)
    return {
        "model": "DeepSeek-V3.2 / GLM-5 MoE layer",
        "hidden": h,
        "moe_intermediate": i,
        "routed_experts": cfg.routed_experts,
        "top_k": cfg.top_k,
        "shared_experts": cfg.shared_experts,
        "ep_size": cfg.ep_size,
        "weight_dtype": cfg.weight_dtype,
        "tokens_on_rank": tokens,
        "experts_on_rank": local,
        "rows_per_expert": rows,
        "flops": routed + shared + router,
        "flops_formula": "2*3*hidden*inter*(experts_on_rank*rows_per_expert + shared*tokens) + 2*tokens*hidden*256, "
        "rows_per_expert = ceil(tokens*top_k*ep/256)",
        "weight_bytes": weights,
        "activation_bytes": activations,
        "why_ep": "a CP-8 prefill node serves DeepSeek-V3.2 / GLM-5 with DeepEP expert parallelism over its 8 GPUs: "
        "32 experts per rank, each GEMM with ~tokens rows; routed FLOPs per rank equal its own tokens' top-8 "
        "experts under balanced routing, ep sets the weight bytes",
        "not_modelled": "dispatch/combine all-to-all, routing imbalance, indexer, q/kv/o projections, norms",
    }


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (e4m3 ``[..., K]``, fp32 scale ``[..., 1]``), one scale per row (amax / 448)."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _mm_fp8(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """``a`` e4m3 ``[M, K]`` (row scales ``[M, 1]``) x ``w`` e4m3 ``[N, K]`` (channel scales ``[1, N]``) -> bf16 ``[M, N]``."""
    return torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)


class MoEStandIn:
    """The MoE GEMMs of ``moe_shape(tokens, cfg)`` on random weights: router, ``experts_on_rank`` routed
    experts of ``rows_per_expert`` rows each, the shared expert over all ``tokens``; SwiGLU between.

    fp8: one ``torch._scaled_mm`` per expert and projection (row-scaled activations, channel-scaled
    weights); bf16: one batched ``bmm`` per projection. ``reference()`` computes the same in fp32 from
    the same quantized operands."""

    def __init__(self, tokens: int, cfg: MoEConfig = MoEConfig(), device: str | torch.device = "cpu", seed: int = 0):
        self.cfg, self.shape = cfg, moe_shape(tokens, cfg)
        g = torch.Generator(device=device).manual_seed(seed)
        h, i = cfg.hidden, cfg.moe_intermediate
        e, m = self.shape["experts_on_rank"], self.shape["rows_per_expert"]

        def rand(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device=device) * scale

        self.x_shared = rand(tokens, h).to(torch.bfloat16)
        self.router = rand(cfg.routed_experts, h, scale=h**-0.5).to(torch.bfloat16)
        x_routed = rand(e, m, h)
        # Routed experts first, the shared experts after them: [E + S, ...].
        w13 = rand(e + cfg.shared_experts, 2 * i, h, scale=h**-0.5)
        w2 = rand(e + cfg.shared_experts, h, i, scale=i**-0.5)
        if cfg.weight_dtype == "fp8":
            self.x_routed, self.sx_routed = quantize_rows(x_routed)
            self.w13, self.s13 = quantize_rows(w13)
            self.w2, self.s2 = quantize_rows(w2)
            self.s13, self.s2 = self.s13.transpose(1, 2).contiguous(), self.s2.transpose(1, 2).contiguous()
        elif cfg.weight_dtype == "bf16":
            self.x_routed, self.w13, self.w2 = (t.to(torch.bfloat16) for t in (x_routed, w13, w2))
        else:
            raise ValueError(f"weight_dtype must be 'fp8' or 'bf16', got {cfg.weight_dtype!r}")
        del x_routed, w13, w2

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed out bf16 ``[E, M, hidden]``, shared out bf16 ``[T, hidden]``); the router logits are computed and dropped."""
        _ = self.x_shared @ self.router.t()
        return self.routed(0, self.shape["experts_on_rank"]), self.shared()

    def steps(self, k: int) -> list:
        """The layer's MoE as ``k`` callables run in turn (router and routed experts in ``k`` groups, the
        shared expert with the last): for a caller that interleaves other work between them."""
        e = self.shape["experts_on_rank"]
        bounds = [round(j * e / k) for j in range(k + 1)]
        out = []
        for j in range(k):
            lo, hi, last = bounds[j], bounds[j + 1], j == k - 1

            def step(lo=lo, hi=hi, first=j == 0, last=last):
                if first:
                    _ = self.x_shared @ self.router.t()
                self.routed(lo, hi)
                if last:
                    self.shared()

            out.append(step)
        return out

    def routed(self, lo: int, hi: int) -> torch.Tensor:
        """Local experts ``[lo, hi)``: bf16 ``[hi - lo, M, hidden]``."""
        i = self.cfg.moe_intermediate
        if self.cfg.weight_dtype == "bf16":
            gu = torch.bmm(self.x_routed[lo:hi], self.w13[lo:hi].transpose(1, 2))
            return torch.bmm(_swiglu(gu, i), self.w2[lo:hi].transpose(1, 2))
        outs = []
        for k in range(lo, hi):
            act, sa = quantize_rows(_swiglu(_mm_fp8(self.x_routed[k], self.sx_routed[k], self.w13[k], self.s13[k]), i))
            outs.append(_mm_fp8(act, sa, self.w2[k], self.s2[k]))
        return torch.stack(outs) if outs else self.x_shared.new_empty(0)

    def shared(self) -> torch.Tensor:
        """The shared expert over every token: bf16 ``[T, hidden]``."""
        e, i = self.shape["experts_on_rank"], self.cfg.moe_intermediate
        if self.cfg.weight_dtype == "bf16":
            return _swiglu(self.x_shared @ self.w13[e].t(), i) @ self.w2[e].t()
        xs, sxs = quantize_rows(self.x_shared)
        act, sa = quantize_rows(_swiglu(_mm_fp8(xs, sxs, self.w13[e], self.s13[e]), i))
        return _mm_fp8(act, sa, self.w2[e], self.s2[e])

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same outputs in fp32 from the dequantized operands (activations requantized like ``__call__``)."""
        cfg, e, i = self.cfg, self.shape["experts_on_rank"], self.cfg.moe_intermediate

        def deq(x, s=None):
            return x.float() if s is None else x.float() * s

        fp8 = cfg.weight_dtype == "fp8"
        w13 = deq(self.w13, self.s13.transpose(1, 2) if fp8 else None)
        w2 = deq(self.w2, self.s2.transpose(1, 2) if fp8 else None)
        xr = deq(self.x_routed, self.sx_routed if fp8 else None)

        def expert(x, k):
            a = _swiglu((x @ w13[k].t()).to(torch.bfloat16), i)
            if fp8:
                a = deq(*quantize_rows(a))
            return a.float() @ w2[k].t()

        routed = torch.stack([expert(xr[k], k) for k in range(e)])
        xs = deq(*quantize_rows(self.x_shared)) if fp8 else self.x_shared.float()
        return routed, expert(xs, e)


def _swiglu(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    return torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
