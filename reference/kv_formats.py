"""Byte formats of one token's KV row, and their quantizers (plain torch).

- MLA fp8 "656 B" row: 512 e4m3 values (4 tiles of 128) | 4 fp32 tile scales | 64 bf16 rope values.
  Tile scale ``s = 2 ** ceil(log2(max(amax / 448, 1e-4)))``.
- MLA bf16 row: 576 bf16 values (latent 512 | rope 64), 1152 B.
- NSA indexer K: 128 e4m3 values and one fp32 scale per token, ``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))``;
  a pool page stores ``ps * 128`` K bytes token-major, then ``ps`` scales (``ps * 132`` B).

Rows are raw ``uint8``: pools, gathers and transfers move bytes. The sizes live in ``kv_layout_constants``.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import (
    FP8_MAX,
    FP8_TILE,
    FP8_TILES,
    INDEX_HEAD_DIM,
    KV_LORA_RANK,
    ROPE_DIM,
    mla_row_bytes,
)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def _to_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_mla_fp8(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``latent [T, 512]``, ``rope [T, 64]`` -> ``uint8 [T, 656]``."""
    if latent.shape[-1] != KV_LORA_RANK or rope.shape[-1] != ROPE_DIM:
        raise ValueError(
            f"latent/rope must end in {KV_LORA_RANK}/{ROPE_DIM}, got {tuple(latent.shape)}/{tuple(rope.shape)}"
        )
    t = latent.shape[0]
    tiles = latent.float().reshape(t, FP8_TILES, FP8_TILE)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    scale = _pow2_ceil(torch.clamp(amax / FP8_MAX, min=1e-4))
    values = _to_e4m3_bytes(tiles / scale).reshape(t, KV_LORA_RANK)
    scale_bytes = scale.reshape(t, FP8_TILES).contiguous().view(torch.uint8)
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([values, scale_bytes, rope_bytes], dim=1)


def dequantize_mla_fp8(rows: torch.Tensor) -> torch.Tensor:
    """``uint8 [T, 656]`` -> ``float32 [T, 576]`` (latent * tile scale | rope)."""
    t = rows.shape[0]
    values = rows[:, :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, KV_LORA_RANK : KV_LORA_RANK + 4 * FP8_TILES].contiguous().view(torch.float32)
    latent = (values.reshape(t, FP8_TILES, FP8_TILE) * scale.unsqueeze(-1)).reshape(t, KV_LORA_RANK)
    rope = rows[:, KV_LORA_RANK + 4 * FP8_TILES :].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=1)


def pack_mla_bf16(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``latent [T, 512]``, ``rope [T, 64]`` -> ``uint8 [T, 1152]`` (bf16 576)."""
    row = torch.cat([latent.to(torch.bfloat16), rope.to(torch.bfloat16)], dim=1).contiguous()
    return row.view(torch.uint8)


def unpack_mla_bf16(rows: torch.Tensor) -> torch.Tensor:
    """``uint8 [T, 1152]`` -> ``float32 [T, 576]``."""
    return rows.contiguous().view(torch.bfloat16).float()


def encode_mla_rows(latent: torch.Tensor, rope: torch.Tensor, kv_format: str) -> torch.Tensor:
    mla_row_bytes(kv_format)
    return quantize_mla_fp8(latent, rope) if kv_format == "fp8" else pack_mla_bf16(latent, rope)


def decode_mla_rows(rows: torch.Tensor, kv_format: str) -> torch.Tensor:
    """Raw rows -> ``float32 [T, 576]`` as the attention kernel sees them."""
    mla_row_bytes(kv_format)
    return dequantize_mla_fp8(rows) if kv_format == "fp8" else unpack_mla_bf16(rows)


def quantize_index_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [T, 128]`` -> (``uint8 [T, 128]`` e4m3 bytes, ``float32 [T]`` scale)."""
    if k.shape[-1] != INDEX_HEAD_DIM:
        raise ValueError(f"index k must end in {INDEX_HEAD_DIM}, got {tuple(k.shape)}")
    kf = k.float()
    amax = kf.abs().amax(dim=-1, keepdim=True)
    scale = _pow2_ceil(torch.clamp(amax, min=1e-4) / FP8_MAX)
    return _to_e4m3_bytes(kf / scale), scale.squeeze(-1)


def dequantize_index_k(k_bytes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return k_bytes.contiguous().view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1)


def index_page_views(index_pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer pages ``uint8 [P, ps * 132]`` -> views (K ``uint8 [P, ps, 128]``, scales ``float32 [P, ps]``)."""
    k_bytes = page_size * INDEX_HEAD_DIM
    return (
        index_pages[:, :k_bytes].unflatten(1, (page_size, INDEX_HEAD_DIM)),
        index_pages[:, k_bytes:].view(torch.float32),
    )
