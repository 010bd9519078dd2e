"""The layer stand-ins of the overlap benchmark: the attention reference against an independent
dequantize + softmax, FlashMLA against the reference (GPU), and the MoE GEMMs against fp32."""

import math

import numpy as np
import pytest
import torch
from benchmark.cp_shared_kv.layer_compute import (
    AttentionStep,
    MoEConfig,
    MoEStandIn,
    attention_inputs,
    moe_shape,
    sparse_attention_reference,
)

from reference.kv_formats import quantize_mla_fp8


def _e4m3_table() -> np.ndarray:
    """All 256 e4m3fn byte values from their bit fields (sign, 4-bit exponent bias 7, 3-bit mantissa)."""
    table = np.zeros(256)
    for b in range(256):
        sign, exp, man = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 0x7
        if exp == 0xF and man == 0x7:
            table[b] = np.nan
        elif exp == 0:
            table[b] = sign * man / 8 * 2.0**-6
        else:
            table[b] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return table


def _independent_attention(q, rows, indices, scale):
    """float64, one query and head at a time, decoding the 656-B rows from their bytes."""
    table = _e4m3_table()
    raw = rows.numpy()
    latent = table[raw[:, :512]].reshape(-1, 4, 128) * raw[:, 512:528].copy().view(np.float32)[:, :, None]
    rope = (raw[:, 528:].copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    keys = np.concatenate([latent.reshape(-1, 512), rope], axis=1)
    qf = q.float().numpy()
    out = np.zeros((q.shape[0], q.shape[2], 512))
    for t in range(q.shape[0]):
        sel = [int(i) for i in indices[t, 0] if i >= 0]
        for h in range(q.shape[2]):
            s = [scale * float(np.dot(qf[t, 0, h], keys[r])) for r in sel]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            out[t, h] = sum(wi * keys[r, :512] for wi, r in zip(w, sel)) / sum(w)
    return out


def test_attention_reference_matches_independent_dequant_softmax():
    torch.manual_seed(0)
    rows = quantize_mla_fp8(torch.randn(128, 512) * 3, torch.randn(128, 64))  # two pages
    q, idx, seqlens = attention_inputs(5, 128, prefix_tokens=20, heads=4, topk=32, seed=1)
    assert seqlens.tolist() == [21, 22, 23, 24, 25] and (idx[0, 0, 21:] == -1).all() and (idx[0, 0, :21] >= 0).all()
    step = AttentionStep(q, idx, seqlens)
    assert not step.use_kernel  # CPU: the reference
    out = step(rows)
    assert out.shape == (5, 1, 4, 512) and out.dtype == torch.bfloat16
    want = _independent_attention(q, rows, idx, 576**-0.5)
    np.testing.assert_allclose(out[:, 0].float().numpy(), want, rtol=2e-2, atol=2e-2)
    # Blocking queries changes nothing.
    assert torch.equal(sparse_attention_reference(q, rows, idx, 576**-0.5, block=2), out)
    with pytest.raises(ValueError, match="kv_rows must be uint8"):
        step(rows[:, :576])


@pytest.mark.gpu
def test_flashmla_kv_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    step_cls = AttentionStep
    rows = quantize_mla_fp8(torch.randn(4096, 512) * 3, torch.randn(4096, 64)).cuda()
    q, idx, seqlens = attention_inputs(64, 4096, prefix_tokens=1000, seed=2, device="cuda")
    kernel = step_cls(q, idx, seqlens)
    if not kernel.use_kernel:
        pytest.skip("FlashMLA not importable")
    ref = step_cls(q, idx, seqlens, use_kernel=False)
    got, want = kernel(rows).float(), ref(rows).float()
    assert (got - want).abs().max().item() < 2e-2


def test_moe_shape_counts():
    s = moe_shape(4096)
    assert (s["experts_on_rank"], s["rows_per_expert"]) == (32, 1024)
    per_token = 2 * 3 * 7168 * 2048
    assert s["flops"] == 4096 * (8 + 1) * per_token + 2 * 4096 * 7168 * 256
    assert s["weight_bytes"] == 33 * 3 * 7168 * 2048 + 7168 * 256 * 2
    assert moe_shape(4096, MoEConfig(ep_size=2))["flops"] == s["flops"]  # EP moves bytes, not FLOPs
    with pytest.raises(ValueError, match="must divide"):
        moe_shape(16, MoEConfig(ep_size=3))


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_moe_stand_in_matches_fp32(dtype):
    cfg = MoEConfig(hidden=64, moe_intermediate=32, routed_experts=16, top_k=2, ep_size=2, weight_dtype=dtype)
    moe = MoEStandIn(32, cfg, seed=3)
    routed, shared = moe()
    assert routed.shape == (8, 8, 64) and shared.shape == (32, 64)
    want_r, want_s = moe.reference()
    for got, want in ((routed, want_r), (shared, want_s)):
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 0.05, err
