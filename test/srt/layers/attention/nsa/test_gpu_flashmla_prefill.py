"""FlashMLA's production sparse prefill over our materialized view equals it over a replicated pool.

CP=2 on two GPUs (NCCL): every rank holds its half of a bf16 pool; a mixed batch (requests with and
without prefixes, two of them sharing prefix pages) is planned, gathered and all-gathered into the
dense view, the NSA top-k positions are remapped through the plan, and ``flash_mla_sparse_fwd``
runs on the view. Output and LSE must be bit-identical to the same kernel over the replicated pool.
"""

import pytest
import torch
from page_fixtures import PagePool, RotatingPages, begin_batch

from reference.dsa_reference import positions_to_rows, sparse_mla
from reference.kv_formats import pack_mla_bf16
from reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

PS, HEADS, TOPK = 64, 64, 128
SM_SCALE = 576**-0.5


def flash_mla_kernel(q, kv_rows_u8, rows):
    import flash_mla

    kv = kv_rows_u8.view(torch.bfloat16).view(-1, 1, 576)
    out, _, lse = flash_mla.flash_mla_sparse_fwd(
        q, kv, rows.to(torch.int32).unsqueeze(1), SM_SCALE, 512, use_legacy=True
    )
    return out, lse


def reference_kernel(q, kv_rows_u8, rows):
    return sparse_mla(q, kv_rows_u8, "bf16", rows, SM_SCALE)


def _batch_positions(seq_lens, prefix_lens, device, seed):
    """Per query token (request-major, positions prefix..seq-1), TOPK causal key positions, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    q_req, q_pos, picks = [], [], []
    for b, (n, p) in enumerate(zip(seq_lens, prefix_lens)):
        for pos in range(p, n):
            k = torch.randperm(pos + 1, generator=g)[:TOPK]
            picks.append(torch.cat([k, torch.full((TOPK - len(k),), -1)]))
            q_req.append(b)
            q_pos.append(pos)
    return (
        torch.tensor(q_req, device=device),
        torch.tensor(q_pos, device=device),
        torch.stack(picks).to(device),
    )


def run_rank(rank, world, kernel_name="flash_mla"):
    kernel = flash_mla_kernel if kernel_name == "flash_mla" else reference_kernel
    group = CPGroup()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    own = PageOwnership(world, PS)
    alloc = RotatingPages(own.cp_size, 64)
    repl = PagePool(PageOwnership(1, PS), 0, 64 * world, 1, "bf16", with_indexer=False, device=dev)
    mine = PagePool(own, rank, 64, 1, "bf16", with_indexer=False, device=dev)
    g = torch.Generator().manual_seed(0)  # same data on every rank: the chunk after prefill CP's all-gather

    lens = [11 * PS + 20, 9 * PS + 3, 3 * PS + 40, 2 * PS + 5]
    pages = [alloc.alloc(-(-lens[0] // PS), 0).tolist()]
    shared = 5
    pages.append(
        pages[0][:shared] + alloc.alloc(-(-lens[1] // PS) - shared, alloc.next_owner(pages[0][shared - 1])).tolist()
    )
    pages.append(alloc.alloc(-(-lens[2] // PS), 1).tolist())
    rows_of = {}
    for b, (n, pg) in enumerate(zip(lens, pages)):
        start = shared * PS if b == 1 else 0
        pos = torch.arange(start, n)
        locs = (torch.tensor(pg)[pos // PS] * PS + pos % PS).to(dev)
        rows = pack_mla_bf16(torch.randn(len(pos), 512, generator=g), torch.randn(len(pos), 64, generator=g)).to(dev)
        rows_of[b] = rows
        repl.set_latent(0, locs, rows)
        mine.set_latent(0, locs, rows)

    results = {}
    width = max(map(len, pages))
    for name, reqs, prefix in (
        ("mixed", [0, 1, 2], [lens[0] - 70, lens[1] - 130, 0]),
        ("history", [0, 1], [lens[0] - 30, shared * PS]),
    ):
        table = torch.zeros(len(reqs), width, dtype=torch.int32)
        for i, b in enumerate(reqs):
            table[i, : len(pages[b])] = torch.tensor(pages[b], dtype=torch.int32)
        table = table.to(dev)
        seq_lens = [lens[b] for b in reqs]
        q_req, q_pos, positions = _batch_positions(seq_lens, prefix, dev, seed=len(name))
        q = (torch.randn(len(q_req), HEADS, 576, generator=g) / 4).to(torch.bfloat16).to(dev)
        mat = ViewMaterializer(mine, group)
        counters = begin_batch(mat, table, seq_lens, prefix)
        view = mat.layer_view(0)
        out_v, lse_v = kernel(q, view.kv_rows, positions_to_rows(positions, q_req, view.page_table, PS).int())
        # The replicated pool as it is.
        out_r, lse_r = kernel(q, repl.latent[0], positions_to_rows(positions, q_req, table, PS).int())
        results[name] = (torch.equal(out_v, out_r) and torch.equal(lse_v, lse_r), counters.bytes_materialized)
    return results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_flashmla_sparse_prefill_over_view_equals_replicated_cp2():
    pytest.importorskip("flash_mla")
    for res in spawn_ranks(run_rank, 2, backend="nccl", timeout_s=300):
        assert res["mixed"][0] and res["history"][0], res
        assert res["mixed"][1] > 0 and res["history"][1] > 0
