"""Current-reuse: a batch that reads no prefix attends over the chunk it just computed.

After prefill CP's all-gather every rank holds the whole current chunk: the latent rows and the
indexer K records it is about to write to the pool. When no request in the batch has a prefix
(decided from host metadata alone), those tensors *are* every key the batch can see, so the
kernels read them directly through a compact table (``req_token_start[b] + position``, page
size 1) and nothing is gathered or all-gathered. Batches with any history use the
materialized view, always.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import copy_to_device
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import INDEX_TOKEN_BYTES

BATCH_KINDS = ("current", "history", "mixed")


def batch_kind(prefix_lens: Sequence[int]) -> str:
    """``current`` (no request has a prefix), ``history`` (all do) or ``mixed``; host ints only."""
    with_prefix = [int(p) > 0 for p in prefix_lens]
    if not any(with_prefix):
        return "current"
    return "history" if all(with_prefix) else "mixed"


def compact_row_table(extend_lens: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 ``[B, max_len]``: row ``req_token_start[b] + j`` of position ``j`` (0 past the request).

    Built on the host from host-known lengths and copied without blocking.
    """
    host_lens = [int(n) for n in extend_lens]
    if any(n < 0 for n in host_lens):
        raise ValueError(f"extend_lens must be >= 0, got {host_lens}")
    lens = np.asarray(host_lens, dtype=np.int64)
    cols = np.arange(lens.max(initial=0), dtype=np.int64)
    starts = np.cumsum(lens) - lens
    table = torch.from_numpy(np.where(cols < lens[:, None], starts[:, None] + cols, 0).astype(np.int32))
    return copy_to_device(table, torch.device(device))


def check_current_chunk(
    kv_rows: torch.Tensor | None,
    index_records: torch.Tensor | None,
    num_tokens: int,
    row_bytes: int,
    with_indexer: bool,
) -> None:
    """Shapes of the current chunk handed to current-reuse (one record per token, request-major)."""
    if kv_rows is None or kv_rows.dtype != torch.uint8 or kv_rows.shape != (num_tokens, row_bytes):
        got = None if kv_rows is None else f"{kv_rows.dtype} {tuple(kv_rows.shape)}"
        raise ValueError(f"current_kv_rows must be uint8 [{num_tokens}, {row_bytes}], got {got}")
    if not with_indexer:
        return
    shape = (num_tokens, INDEX_TOKEN_BYTES)
    if index_records is None or index_records.dtype != torch.uint8 or index_records.shape != shape:
        got = None if index_records is None else f"{index_records.dtype} {tuple(index_records.shape)}"
        raise ValueError(f"current_index_records must be uint8 [{num_tokens}, {INDEX_TOKEN_BYTES}], got {got}")


def pack_index_records(k_u8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``k_u8 [T, 128]`` + ``scale float32 [T]`` -> ``uint8 [T, 132]``: one-token indexer pages (page size 1)."""
    if k_u8.dtype != torch.uint8 or k_u8.dim() != 2 or k_u8.shape[1] != INDEX_TOKEN_BYTES - 4:
        raise ValueError(f"k_u8 must be uint8 [T, {INDEX_TOKEN_BYTES - 4}], got {k_u8.dtype} {tuple(k_u8.shape)}")
    if scale.dtype != torch.float32 or scale.shape != (k_u8.shape[0],):
        raise ValueError(f"scale must be float32 [{k_u8.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    return torch.cat([k_u8, scale.contiguous().view(torch.uint8).view(-1, 4)], dim=1)
