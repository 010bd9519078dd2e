"""A plain-torch twin of SGLang's indexer-key writer, for CPU tests that run many ranks.

SGLang's DSA pool writes the indexer keys with ``_set_k_and_s_triton``: one Triton program per token,
which the CPU interpreter runs one by one. A multi-rank read test writes thousands of tokens per rank
through it and spends most of its time there, not in what it checks. ``use_torch_index_k_writer()`` swaps in
the twin (same arguments, same bytes: ``test_sglang_writers.py`` compares it with the kernel); the pools
and the code around them run unchanged.

The fp8 latent quantizer keeps its kernel: the interpreter's fp32 -> e4m3 cast rounds on the cut-off
bit alone and ORs a mantissa carry into the exponent instead of adding it, so no torch cast writes its
bytes.
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


def use_torch_index_k_writer() -> None:
    """Make SGLang's DSA pools write indexer keys through the twin in this process."""
    from sglang.kernels.ops.kvcache import dsa_index_k_cache

    dsa_index_k_cache._set_k_and_s_triton = set_k_and_s
