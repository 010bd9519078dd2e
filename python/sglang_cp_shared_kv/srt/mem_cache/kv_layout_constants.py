"""Byte sizes of SGLang's MLA row and DSA indexer page formats (no torch)."""

from __future__ import annotations

KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT_DIM = KV_LORA_RANK + ROPE_DIM  # 576
FP8_TILE = 128
FP8_TILES = KV_LORA_RANK // FP8_TILE  # 4
FP8_MAX = 448.0

MLA_FP8_ROW_BYTES = KV_LORA_RANK + 4 * FP8_TILES + 2 * ROPE_DIM  # 656
MLA_BF16_ROW_BYTES = 2 * LATENT_DIM  # 1152
INDEX_HEAD_DIM = 128
INDEX_SCALE_BYTES = 4  # one fp32 scale per token
INDEX_TOKEN_BYTES = INDEX_HEAD_DIM + INDEX_SCALE_BYTES  # 132

KV_FORMATS = ("fp8", "bf16")


def mla_row_bytes(kv_format: str) -> int:
    """Bytes of one token's MLA latent row in ``kv_format``."""
    if kv_format == "fp8":
        return MLA_FP8_ROW_BYTES
    if kv_format == "bf16":
        return MLA_BF16_ROW_BYTES
    raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
