"""Plain-torch twins of SGLang's two per-token KV writers, for CPU tests that run many ranks.

SGLang's DSA pool writes the indexer keys with ``_set_k_and_s_triton`` and quantizes the fp8 latent with
``_quantize_k_cache_fast_separate``: one Triton program per token (and tile), which the CPU interpreter
runs one by one. A multi-rank read test writes thousands of tokens per rank through them and spends most
of its time there, not in what it checks. ``use_torch_writers()`` swaps in the twins (same arguments;
``test_sglang_writers.py`` compares their bytes with the kernels'); the pools and the code around them
run unchanged, and every side of a comparison writes through the same twins.

The quantizer's e4m3 cast is torch's, round to nearest even as the GPU's ``cvt.rn``; the interpreter's
own cast rounds on the cut-off bit alone and ORs a mantissa carry into the exponent, so the twin writes
the kernel's bytes wherever the cast is exact and the GPU's elsewhere. An all-zero tile (scale 0, values
0 / 0) is not written by the tests: torch casts its NaNs to 0xFF, the interpreter to 0xFE.
"""

from __future__ import annotations

import torch


def set_k_and_s(
    buf: torch.Tensor, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale: torch.Tensor, page_size: int
):
    """Scatter index K + scale into page-major rows: K at ``off * 128``, the scale at ``page_size * 128 + off * 4``.

    buf: [num_pages, page_size * 132] uint8; loc: [T] int64; index_k: [T, 128] e4m3; index_k_scale: [T] or [T, 1] fp32.
    """
    assert buf.dtype == torch.uint8 and buf.shape[1] == page_size * 132 and index_k.shape[1] == 128
    flat = buf.view(-1)
    base = loc // page_size * buf.shape[1]
    off = loc % page_size
    flat[(base + off * 128)[:, None] + torch.arange(128)] = index_k.view(torch.uint8)
    scale = index_k_scale.reshape(-1).contiguous().view(torch.uint8).view(-1, 4)
    flat[(base + page_size * 128 + off * 4)[:, None] + torch.arange(4)] = scale


def quantize_separate(k_nope: torch.Tensor, k_rope: torch.Tensor, group_size: int = 128):
    """Per-tile e4m3 quantization, the kernel's scale ``amax / 448`` (no floor), the rope bytes copied.

    k_nope: [T, D] bf16 with D % group_size == 0; k_rope: [T, R] bf16 (R may be 0).
    Returns ([T, 1, D + 4 * D / group_size] uint8, [T, 1, 2 * R] uint8): values, then the fp32 scales.
    """
    t, d = k_nope.shape
    fmax = torch.finfo(torch.float8_e4m3fn).max
    y = k_nope.float().view(t, d // group_size, group_size)
    scale = y.abs().amax(-1, keepdim=True) / fmax
    q = (y * (1.0 / scale)).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
    nope = torch.cat([q.view(t, d).view(torch.uint8), scale.view(t, -1).view(torch.uint8)], dim=1)
    rope = k_rope.contiguous().view(torch.uint8).view(t, -1)
    return nope.unsqueeze(1), rope.unsqueeze(1)


def use_torch_writers() -> None:
    """Make SGLang's DSA pools write through the twins in this process."""
    from sglang.kernels.ops.kvcache import dsa_index_k_cache
    from sglang.kernels.ops.quantization import dsa_quant_k_cache

    dsa_index_k_cache._set_k_and_s_triton = set_k_and_s
    dsa_quant_k_cache._quantize_k_cache_fast_separate = quantize_separate
