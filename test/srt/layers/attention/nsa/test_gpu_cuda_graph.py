"""The materialize path (plan + owned-page gather + top-k remap) captured in a CUDA graph.

A batch's plan depends on its lengths (host ints) and its page table (device data); the lengths
fix the shapes, so one capture serves every page table of those lengths. Replayed on new page
tables and new top-k positions, the graph must give what the eager path gives.
"""

import pytest
import torch
from page_fixtures import PagePool, RotatingPages, build_slot_plan, plan_meta

from reference.dsa_reference import positions_to_rows
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import gather_page_buffers
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PS, CP, RANK, PHYS = 64, 4, 1, 96
PAGES = [10, 7, 13, 1]
T, K = 96, 64


def _table(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    alloc = RotatingPages(CP, PHYS)
    alloc.alloc(int(torch.randint(0, 40, (1,), generator=g)), 0)  # shift where the batch's pages start
    table = torch.zeros(len(PAGES), max(PAGES), dtype=torch.int32)
    for b, n in enumerate(PAGES):
        table[b, :n] = alloc.alloc(n, int(torch.randint(0, CP, (1,), generator=g))).to(torch.int32)
    return table


def _topk(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    q_req = torch.randint(0, len(PAGES), (T,), generator=g)
    limit = torch.tensor(PAGES)[q_req] * PS
    pos = (torch.rand(T, K, generator=g) * limit.unsqueeze(1)).long()
    pos[torch.rand(T, K, generator=g) < 0.1] = -1
    return q_req, pos


@pytest.mark.parametrize("kv_format", ["fp8", "bf16"])
def test_materialize_graph_replays_equal_eager(kv_format):
    dev = torch.device("cuda")
    pool = PagePool(PageOwnership(CP, PS), RANK, PHYS, 1, kv_format, device=dev)
    pool.latent[0].random_(0, 256)
    pool.index[0].random_(0, 256)
    srcs = [pool.latent_pages(0), pool.index[0]]

    table = _table(0).to(dev)
    q_req, pos = (t.to(dev) for t in _topk(0))
    meta = plan_meta(PAGES, dev)

    def step(tbl, vecs, outs=None):
        plan = build_slot_plan(tbl, PAGES, CP, PS, pool.trash_page, meta=vecs)
        sent = gather_page_buffers(srcs, plan.send_pages(RANK), outs)
        return plan.slot_table, positions_to_rows(pos, q_req, plan.slot_table, PS), sent

    s = build_slot_plan(table, PAGES, CP, PS, pool.trash_page).slots_per_rank
    assert s == sum(-(-p // CP) for p in PAGES)
    outs = [torch.empty(s, src.shape[1], dtype=torch.uint8, device=dev) for src in srcs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(table, meta, outs)  # warm up (Triton compiles) off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_table, g_rows, _ = step(table, meta, outs)

    for seed in (1, 2, 3):
        table.copy_(_table(seed).to(dev))
        new_req, new_pos = _topk(seed)
        q_req.copy_(new_req)
        pos.copy_(new_pos)
        graph.replay()
        e_table, e_rows, e_sent = step(table.clone(), None)  # eager, meta built afresh
        torch.cuda.synchronize()
        assert torch.equal(g_table, e_table), seed
        assert torch.equal(g_rows, e_rows), seed
        for got, want in zip(outs, e_sent):
            assert torch.equal(got, want), seed
