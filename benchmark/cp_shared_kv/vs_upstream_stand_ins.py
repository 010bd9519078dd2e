"""Benchmark-only stand-ins for the ops SGLang's DSA backend reaches that cannot run where the
side-by-side harness runs, each with the semantics of the op it replaces, identical for every path,
and timed so the results can report every ratio with and without them.

- ``fp8_mqa_logits`` (DeepGEMM; its extension is built for another torch on the H200 box, and there
  is none on CPU): ``out[m, n] = k_scale[n] * sum_h w[m, h] * relu(q[m, h] . k[n])`` on
  ``ks[m] <= n < ke[m]``; other columns are unspecified, as DeepGEMM leaves them. The per-head dots
  are rounded to bf16 (as SGLang's own torch fallback does). Only each request's own column span is
  computed: the harness hands the request spans (host lists it already has) for the batch.
- ``fast_topk_transform_fused`` (sgl_kernel, built for another torch): per query row the ``topk``
  best key positions of its request (all of them, in order, when it sees at most ``topk``), mapped
  through the batch's ``page_table_1`` to pool (or view) rows, -1 padded.
- On CPU only, the top-k v2 plan (a JIT CUDA kernel whose plan the prefill route never reads), and
  ``sglang.kernels.ops.attention.flash_mla_interface`` (it imports the CUDA-only FlashMLA
  wheel): the schedule call returns placeholders, and ``flash_mla_with_kvcache`` on an fp8 cache with
  sparse indices is the plain-torch sparse MLA reference over the rows the indices select.

The MoE/MLP after attention is ``layer_compute.MoEStandIn`` (``moe_for`` sizes it per batch).

``cost="model"`` (opt-in; the default ``"semantics"`` is the above) swaps the two stand-ins for ones that
cost what the ops they replace cost, the rank model's (``rank_model.py``), instead of computing their
exact semantics: ``fp8_mqa_logits`` becomes one fp8 ``torch._scaled_mm`` per request span and block of
rows, ``[rows, H * 128] x [H * 128, keys]`` into fp32 (the op's FLOPs and output bytes; the score is
``k_scale[n] * sum_h q[m, h] . k[n]``: no relu, no head weights), and the top-k reads the span's logits
twice (a two-pass radix select's reads) and picks the ``topk`` best among the span's first ``4 * topk``
positions (the cost of a select, not its choice). Both stay deterministic functions of the pool's bytes,
so every pool's timed forward is still compared bit for bit. On the rank model's H200 run the logits
GEMM ran at 1200-1480 TFLOP/s (``docs/benchmarks/rank_model.json``); inside the harness it is not timed
apart from the per-stand-in totals below.
"""

from __future__ import annotations

import sys
import time
import types
from contextlib import contextmanager

import torch

TOPK_FUSED = "sgl_kernel.fast_topk_transform_fused"
MQA_LOGITS = "deep_gemm.fp8_mqa_logits"
FLASH_MLA = "flash_mla (CPU: plain-torch sparse MLA reference)"
MOE = "MoE/MLP layer (GEMMs)"


class StandIns:
    """Installs the stand-ins into this process and times each call (CUDA events on GPU).

    ``spans`` is set per batch: ``[(q_start, q_end, k_start, seq_len)]`` per request, the query rows
    and the key columns of that request in the indexer's flattened K (what ``ks``/``ke`` hold on the
    device)."""

    def __init__(self, device: torch.device, logits_budget_bytes: int | None = None, cost: str = "semantics"):
        if cost not in ("semantics", "model"):
            raise ValueError(f"cost must be 'semantics' or 'model', got {cost!r}")
        self.device = device
        self.cost = cost
        self.spans: list[tuple[int, int, int, int]] = []
        self.heads: int | None = None  # the model's heads; the backend pads q to FlashMLA's 64 or 128
        self.budget = logits_budget_bytes or (2 << 30 if device.type == "cuda" else 64 << 20)
        self._events: dict[str, list] = {}
        self._host: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    # -- timing --------------------------------------------------------------------------------

    @contextmanager
    def timed(self, name: str):
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            yield
            e1.record()
            self._events.setdefault(name, []).append((e0, e1))
        else:
            t0 = time.perf_counter()
            yield
            self._host[name] = self._host.get(name, 0.0) + time.perf_counter() - t0

    def take_us(self) -> dict[str, float]:
        """Each stand-in's time since the last call (device time on GPU; call after a sync)."""
        out = {k: v * 1e6 for k, v in self._host.items()}
        for name, pairs in self._events.items():
            out[name] = out.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) * 1e3
        self._events, self._host = {}, {}
        return {k: round(v, 1) for k, v in out.items()}

    # -- the ops -------------------------------------------------------------------------------

    def fp8_mqa_logits(self, q, kv, weights, ks, ke, clean_logits=False):
        """``q [M, H, 128]`` e4m3, ``kv = (k [N, 128] e4m3, k_scale [N] f32)``, ``weights [M, H]`` f32 ->
        f32 ``[M, N]``, filled on each request's rows x its own key columns."""
        if self.cost == "model":
            return self._logits_at_cost(q, kv, weights)
        with self.timed(MQA_LOGITS):
            k, k_scale = kv
            m, h, _ = q.shape
            out = torch.empty(m, k.shape[0], dtype=torch.float32, device=q.device)
            w = weights.to(torch.bfloat16)
            for q0, q1, k0, n in self.spans:
                kb = k[k0 : k0 + n].to(torch.bfloat16)  # e4m3 -> bf16 is exact
                step = max(1, self.budget // max(1, h * n * 2))
                for s in range(q0, q1, step):
                    e = min(s + step, q1)
                    dots = (q[s:e].to(torch.bfloat16).reshape(-1, kb.shape[1]) @ kb.t()).view(e - s, h, n).relu_()
                    out[s:e, k0 : k0 + n] = torch.bmm(w[s:e].unsqueeze(1), dots).squeeze(1).float()
                out[q0:q1, k0 : k0 + n] *= k_scale[k0 : k0 + n]
            return out

    def fast_topk_transform_fused(self, score, lengths, page_table_size_1, cu_seqlens_q, topk, row_starts=None):
        """int32 ``[M, topk]``: request ``b``'s rows pick their ``topk`` best positions ``p < lengths[m]``
        (scored ``score[m, row_starts[m] + p]``; all of them in order when ``lengths[m] <= topk``),
        mapped through ``page_table_size_1[b, p]``; -1 after."""
        with self.timed(TOPK_FUSED):
            out = torch.full((score.shape[0], topk), -1, dtype=torch.int32, device=score.device)
            ar = torch.arange(topk, device=score.device)
            if self.cost == "model":
                return self._topk_at_cost(score, lengths, page_table_size_1, topk, out, ar)
            for b, (q0, q1, k0, n) in enumerate(self.spans):
                lens = lengths[q0:q1].long()
                if n <= topk:
                    pos = ar.expand(q1 - q0, topk)
                else:
                    step = max(1, self.budget // max(1, n * 8))
                    parts = []
                    for s in range(q0, q1, step):
                        e = min(s + step, q1)
                        # The scores are the caller's scratch (the logits, dropped after top-k): masked in place.
                        blk = score[s:e, k0 : k0 + n]
                        blk.masked_fill_(
                            torch.arange(n, device=blk.device) >= lens[s - q0 : e - q0, None], float("-inf")
                        )
                        parts.append(torch.topk(blk, topk, dim=1, sorted=False).indices)
                    pos = torch.where((lens <= topk)[:, None], ar, torch.cat(parts))
                valid = pos < lens[:, None]
                rows = page_table_size_1[b].long()[pos.clamp(max=page_table_size_1.shape[1] - 1)]
                out[q0:q1] = torch.where(valid, rows, -1).to(torch.int32)
            return out

    # -- the cost-realistic pair (cost="model") -------------------------------------------------

    def _logits_at_cost(self, q, kv, weights):
        """``k_scale[n] * sum_h q[m, h] . k[n]`` on each request's rows x its own columns, as one fp8 GEMM of
        the real op's FLOPs per block of rows (bf16 on CPU, where fp8 GEMMs do not run)."""
        with self.timed(MQA_LOGITS):
            k, k_scale = kv
            m, h, d = q.shape
            out = torch.empty(m, k.shape[0], dtype=torch.float32, device=q.device)
            fp8 = q.is_cuda
            qf = q.reshape(m, h * d)
            one = torch.ones((), device=q.device)
            for q0, q1, k0, n in self.spans:
                if n == 0 or q1 == q0:
                    continue
                pad_n = -(-n // 16) * 16
                kb = torch.zeros((pad_n, d), dtype=torch.uint8, device=k.device)
                kb[:n] = k[k0 : k0 + n].view(torch.uint8)
                krep = kb.repeat(1, h).view(k.dtype)  # [keys, H * 128]: key n once per head
                step = max(16, (self.budget // max(1, pad_n * 4)) // 16 * 16)
                for s in range(q0, q1, step):
                    e = min(s + step, q1)
                    rows = -(-(e - s) // 16) * 16
                    a = qf.new_zeros((rows, h * d))
                    a[: e - s] = qf[s:e]
                    if fp8:
                        res = torch._scaled_mm(a, krep.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                    else:
                        res = (a.to(torch.bfloat16) @ krep.to(torch.bfloat16).t()).float()
                    out[s:e, k0 : k0 + n] = res[: e - s, :n] * k_scale[k0 : k0 + n]
            return out

    def _topk_at_cost(self, score, lengths, page_table_size_1, topk, out, ar):
        for b, (q0, q1, k0, n) in enumerate(self.spans):
            lens = lengths[q0:q1].long()
            if n <= topk:
                pos = ar.expand(q1 - q0, topk)
            else:
                blk = score[q0:q1, k0 : k0 + n]
                blk.amax(dim=1)  # the two passes' reads
                blk.sum(dim=1)
                head = score[q0:q1, k0 : k0 + min(n, 4 * topk)].clone()
                head.masked_fill_(torch.arange(head.shape[1], device=head.device) >= lens[:, None], float("-inf"))
                picked = torch.topk(head, topk, dim=1, sorted=False).indices
                pos = torch.where((lens <= topk)[:, None], ar, picked)
            valid = pos < lens[:, None]
            rows = page_table_size_1[b].long()[pos.clamp(max=page_table_size_1.shape[1] - 1)]
            out[q0:q1] = torch.where(valid, rows, -1).to(torch.int32)
        return out

    # -- installation --------------------------------------------------------------------------

    def install(self) -> None:
        """Point SGLang's call sites at the stand-ins (this process only: the harness's rank processes)."""
        sk = sys.modules.get("sgl_kernel")
        if sk is None:
            try:
                import sgl_kernel as sk  # the GPU bundle's shim: every name raises when called
            except ImportError:
                sk = types.ModuleType("sgl_kernel")
                sys.modules["sgl_kernel"] = sk
        sk.fast_topk_transform_fused = self.fast_topk_transform_fused
        if not hasattr(sk, "fast_topk_transform_ragged_fused"):  # imported beside it, used on RAGGED only
            sk.fast_topk_transform_ragged_fused = _not_on_this_route
        if self.device.type != "cuda":
            sys.modules["sglang.kernels.ops.attention.flash_mla_interface"] = _cpu_flash_mla_interface(self)
            from sglang.kernels.ops.attention.dsv4 import topk as topk_v2

            # A JIT CUDA kernel; its plan is built per batch but only read by decode-shaped top-k.
            topk_v2.plan_topk_v2 = lambda seqlens: None

    def describe(self) -> list[dict]:
        """The JSON's ``stand_ins`` list."""
        why_logits = "DeepGEMM's extension does not load (built for another torch; none on CPU)"
        why_topk = "sgl_kernel does not load (built for another torch; none on CPU)"
        if self.cost == "model":
            logits = (
                "cost=model: one fp8 torch._scaled_mm per request span and row block, [rows, H*128] x [H*128, keys] "
                "-> fp32 (the op's FLOPs and output bytes); score k_scale * sum_h q_h . k, no relu or head weights"
            )
            topk = (
                "cost=model: two reads of each span's logits, then torch.topk over its first 4*topk positions, "
                "mapped through page_table_1"
            )
        else:
            logits = "torch bf16 GEMM per request span, relu, head-weighted sum (the op's semantics)"
            topk = "torch.topk per request span, positions mapped through page_table_1"
        items = [
            {"op": MQA_LOGITS, "why": why_logits, "stand_in": logits},
            {"op": TOPK_FUSED, "why": why_topk, "stand_in": topk},
        ]
        items += [
            {
                "op": MOE,
                "why": "the harness has no model: the layer's compute after attention",
                "stand_in": "layer_compute.MoEStandIn: one MoE layer's GEMMs for the rank's tokens (run_environment.moe)",
            },
        ]
        if self.device.type != "cuda":
            items.append(
                {
                    "op": FLASH_MLA,
                    "why": "FlashMLA is CUDA-only",
                    "stand_in": "plain-torch sparse MLA over the fp8 rows the indices select",
                }
            )
        return items


def _not_on_this_route(*args, **kwargs):
    raise NotImplementedError("the harness's extend batches take the PAGED top-k route")


def _cpu_flash_mla_interface(stand_ins: StandIns) -> types.ModuleType:
    """SGLang's FlashMLA wrapper module with the two calls the ``flashmla_kv`` prefill makes, in plain torch."""
    from reference.dsa_reference import sparse_mla

    mod = types.ModuleType("sglang.kernels.ops.attention.flash_mla_interface")

    def get_mla_metadata(
        cache_seqlens=None,
        num_q_tokens_per_head_k=None,
        num_heads_k=None,
        num_heads_q=None,
        is_fp8_kvcache=False,
        topk=None,
    ):
        return torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)

    def flash_mla_with_kvcache(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        tile_scheduler_metadata,
        num_splits=None,
        softmax_scale=None,
        causal=False,
        is_fp8_kvcache=False,
        indices=None,
        kv_format=None,
        **_,
    ):
        with stand_ins.timed(FLASH_MLA):
            t, one, h, d = q.shape
            # Heads past the model's are zero padding whose output the backend drops: left zero here.
            real = min(h, stand_ins.heads or h)
            rows = k_cache.view(torch.uint8).reshape(-1, k_cache.shape[-1])
            idx = indices.reshape(t * one, -1).long()
            valid = idx >= 0
            # Hand the reference only the selected rows (never a buffer's unwritten rows).
            picked = rows[idx.clamp(min=0).reshape(-1)]
            local = torch.arange(picked.shape[0]).view_as(idx)
            q_real = q.reshape(t * one, h, d)[:, :real]
            out, lse = sparse_mla(q_real, picked, "fp8", torch.where(valid, local, -1), softmax_scale)
            full = q.new_zeros(t * one, h, head_dim_v)
            full[:, :real] = out.to(torch.bfloat16)
            return full.view(t, one, h, head_dim_v), None

    mod.get_mla_metadata = get_mla_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    return mod


class MoEForBatch:
    """``layer_compute.MoEStandIn`` for any token count up to ``max_tokens``: the weights are built once
    (random, several GB on GPU), each batch's activations are the first rows of the largest ones."""

    def __init__(self, max_tokens: int, device: torch.device):
        from benchmark.cp_shared_kv.layer_compute import MoEConfig, MoEStandIn

        # The model's sizes on GPU; on CPU a small layer of the same structure (bf16: no fp8 GEMM there).
        cfg = MoEConfig() if device.type == "cuda" else MoEConfig(256, 128, 16, 8, 1, 2, "bf16")
        self.cfg, self.base = cfg, MoEStandIn(max(1, max_tokens), cfg, device)
        self._cache: dict[int, object] = {}

    def __call__(self, tokens: int):
        import copy

        from benchmark.cp_shared_kv.layer_compute import moe_shape

        moe = self._cache.get(tokens)
        if moe is None:
            moe = copy.copy(self.base)
            moe.shape = moe_shape(tokens, self.cfg)
            rows = moe.shape["rows_per_expert"]
            moe.x_routed, moe.x_shared = self.base.x_routed[:, :rows], self.base.x_shared[:tokens]
            if self.cfg.weight_dtype == "fp8":
                moe.sx_routed = self.base.sx_routed[:, :rows]
            self._cache[tokens] = moe
        return moe()
