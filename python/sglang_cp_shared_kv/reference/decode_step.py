"""One decode step of the tiny DSA stack over a full (non-CP) pool: what the decode server runs.

Each request gets one new token at position ``lens[b]``. Its KV row and indexer K go into the
request's last page (or a fresh page from ``new_page`` when that page is full), then every layer
runs the indexer top-k and sparse MLA over the pool through the request's page table. Over a
pool rebuilt from the prefill ranks' owned pages and over the replicated pool, the same bytes in
the same order give bit-identical outputs, whatever the physical page ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_cp_shared_kv.reference.dsa_stack import LayerOutput, TinyDSAStack, forward_layers, page_table_from_pages
from sglang_cp_shared_kv.reference.read_path import pool_view
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool


def decode_one_token(
    stack: TinyDSAStack,
    pool: ShardedMLAPool,
    pages: Sequence[Sequence[int]],
    lens: Sequence[int],
    new_ids: torch.Tensor,
    new_page: Callable[[], int],
    use_triton: bool | None = None,
) -> tuple[list[LayerOutput], list[list[int]]]:
    """Run one token per request; returns per-layer outputs and the (possibly grown) page lists.

    ``use_triton`` picks the view's row-remap kernel (Triton, or its torch formulation; ``None``: Triton
    where it can run)."""
    ps = pool.page_size
    pages = [list(p) for p in pages]
    for b, n in enumerate(lens):
        if n % ps == 0 or len(pages[b]) * ps <= n:
            pages[b].append(int(new_page()))
    table = page_table_from_pages(pages).to(pool.device)
    q_req = torch.arange(len(lens), device=pool.device)
    q_pos = torch.tensor(list(lens), dtype=torch.int64, device=pool.device)
    locs = table.long()[q_req, q_pos // ps] * ps + q_pos % ps
    x = stack.embed[new_ids.to(pool.device)]
    seq_lens = [n + 1 for n in lens]
    outputs = forward_layers(
        stack,
        pool,
        x,
        q_req,
        q_pos,
        locs,
        seq_lens,
        lambda layer, _: pool_view(pool, layer, table, use_triton=use_triton),
    )
    return outputs, pages
