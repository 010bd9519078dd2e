"""FlashMLA's production fp8 sparse decode reads the pool rebuilt from per-rank owned pages.

The decode side of PD rebuilds a full-layout pool from the pages every CP rank owns (each tagged with
its logical page position). Here the rebuild is done with device copies (the Mooncake transfer moves the
same bytes, see the mooncake tests); FlashMLA's fp8 sparse decode kernel over the rebuilt pool must give
output bit-identical to the same kernel over the replicated fp8 pool, and both must match our plain-torch
dequantized reference: the kernel reads our 656-B rows and page layout as we write them.
"""

import pytest
import torch
from page_fixtures import PagePool, RotatingPages

from reference.dsa_reference import sparse_mla
from reference.kv_formats import quantize_mla_fp8
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PS = 64  # FlashMLA's page block size


def _flash_mla():
    return pytest.importorskip("flash_mla")


def _decode(flash_mla, q, cache_u8, rows, sm_scale):
    cache = cache_u8.view(-1, PS, 1, cache_u8.shape[-1]).view(torch.float8_e4m3fn)
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, cache, None, None, 512, meta, None, sm_scale, False, True, rows, use_legacy=True
    )
    return out, lse


def _rows_through(positions: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """int32 ``[B, k]``: each request's token positions (-1: none) as rows of a pool through its page table."""
    return torch.stack(
        [torch.where(p >= 0, t[p.clamp(min=0) // PS] * PS + p.clamp(min=0) % PS, -1) for p, t in zip(positions, tables)]
    ).to(torch.int32)


def _pools(cp_size: int, lens: list[int], seed: int, kv_format: str = "fp8"):
    """Random fp8 (or bf16) rows for requests of ``lens`` tokens on rotating pages, stored in a replicated
    pool and in every rank's sharded pool: ``(ownership, pages per request, replicated pool, rank pools)``."""
    torch.manual_seed(seed)
    own = PageOwnership(cp_size, PS)
    alloc = RotatingPages(own.cp_size, 16)
    replicated = PagePool(PageOwnership(1, PS), 0, 16 * cp_size, 1, kv_format, with_indexer=False, device="cuda")
    ranks = [PagePool(own, r, 16, 1, kv_format, with_indexer=False, device="cuda") for r in range(cp_size)]
    req_pages = []
    for n in lens:
        pages = alloc.alloc(-(-n // PS), 0).to("cuda")
        req_pages.append(pages)
        pos = torch.arange(n, device="cuda")
        locs = pages[pos // PS] * PS + pos % PS
        nope, rope = torch.randn(n, 512, device="cuda") * 3, torch.randn(n, 64, device="cuda")
        if kv_format == "fp8":
            rows = quantize_mla_fp8(nope, rope)
        else:
            rows = torch.cat([nope, rope], dim=1).to(torch.bfloat16).view(torch.uint8)
        replicated.set_latent(0, locs, rows)
        for pool in ranks:
            pool.set_latent(0, locs, rows)
    return own, req_pages, replicated, ranks


@pytest.mark.parametrize("cp_size", [2, 4])
def test_fp8_sparse_decode_over_rebuilt_pool_equals_replicated(cp_size):
    flash_mla = _flash_mla()
    dev = "cuda"
    lens = [9 * PS + 17, 4 * PS + 1, 13 * PS]
    own, req_pages, replicated, ranks = _pools(cp_size, lens, seed=0)

    # Decode-side rebuild: page position p of a request lands in destination page dst[p].
    total_pages = sum(len(p) for p in req_pages)
    decode = PagePool(PageOwnership(1, PS), 0, total_pages, 1, "fp8", with_indexer=False, device=dev)
    dst_of_req, next_dst = [], 0
    dst_view = decode.latent_pages(0)
    for pages in req_pages:
        dst = torch.arange(next_dst, next_dst + len(pages), device=dev)
        next_dst += len(pages)
        dst_of_req.append(dst)
        for r, pool in enumerate(ranks):
            mine = own.owner(pages) == r
            dst_view[dst[mine]] = pool.latent_pages(0)[own.phys_page(pages[mine])]

    topk, h_q, b = 128, 64, len(lens)
    q = (torch.randn(b, 1, h_q, 576, device=dev) / 4).to(torch.bfloat16)
    sm_scale = 576**-0.5
    # Each request's query picks topk of its positions (some -1).
    pos = torch.stack([torch.randperm(n, device=dev)[:topk] for n in lens])
    pos[:, -5:] = -1

    rows_repl = _rows_through(pos, req_pages).unsqueeze(1)
    rows_dec = _rows_through(pos, dst_of_req).unsqueeze(1)
    out_r, lse_r = _decode(flash_mla, q, replicated.latent[0], rows_repl, sm_scale)
    out_d, lse_d = _decode(flash_mla, q, decode.latent[0], rows_dec, sm_scale)
    assert torch.equal(out_r, out_d) and torch.equal(lse_r, lse_d)

    for i in range(b):
        ref_out, ref_lse = sparse_mla(q[i, :, :, :], replicated.latent[0], "fp8", rows_repl[i, :, :].long(), sm_scale)
        assert torch.allclose(out_r[i, 0].float(), ref_out[0], atol=2e-2, rtol=2e-2)
        assert torch.allclose(lse_r[i, :, 0].float(), ref_lse[0], atol=1e-3)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_decode_cp_each_rank_attends_over_its_own_rows_and_the_lse_merge_equals_replicated(cp_size):
    """Decode CP's attention (``decode_cp``): each rank runs FlashMLA's fp8 sparse decode over the selected
    positions it owns, in its own sharded pool; merged by LSE, the outputs equal the same kernel over the
    replicated pool within its bf16 output's rounding. Request 0 selects positions of its first page only,
    so every other rank attends to nothing for it (its LSE must drop out of the merge)."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import merge_by_lse, owned_rows, position_rows

    flash_mla = _flash_mla()
    dev = "cuda"
    lens = [3 * PS + 5, 9 * PS + 17, 13 * PS]
    _, req_pages, replicated, ranks = _pools(cp_size, lens, seed=1)
    topk, h_q, b = 128, 64, len(lens)
    q = (torch.randn(b, 1, h_q, 576, device=dev) / 4).to(torch.bfloat16)
    sm_scale = 576**-0.5
    selected = torch.stack([torch.randperm(n, device=dev)[:topk] for n in lens])
    selected[0] = torch.cat([torch.randperm(PS, device=dev)[:40], torch.full((topk - 40,), -1, device=dev)])
    selected[1:, -5:] = -1
    rows_repl = _rows_through(selected, req_pages)
    out_repl, lse_repl = _decode(flash_mla, q, replicated.latent[0], rows_repl.unsqueeze(1), sm_scale)
    width = max(lens)
    outs, lses, attended = [], [], []
    for r, pool in enumerate(ranks):
        row_of_position = torch.stack(
            [
                torch.nn.functional.pad(position_rows(p.view(1, -1), PS, cp_size, r, n)[0], (0, width - n), value=-1)
                for p, n in zip(req_pages, lens)
            ]
        )
        mine = owned_rows(selected, row_of_position).to(torch.int32)
        attended.append((mine >= 0).any(dim=1).tolist())
        out, lse = _decode(flash_mla, q, pool.latent[0], mine.unsqueeze(1), sm_scale)
        outs.append(out[:, 0])
        lses.append(lse[:, :, 0])
    out, lse = merge_by_lse(torch.stack(outs), torch.stack(lses))
    assert sum(a[0] for a in attended) == 1, attended  # request 0: one rank attends, the others to nothing
    assert torch.allclose(lse, lse_repl[:, :, 0].float(), atol=1e-4), (lse - lse_repl[:, :, 0]).abs().max()
    assert torch.allclose(out, out_repl[:, 0].float(), atol=1e-2, rtol=1e-2), (out - out_repl[:, 0]).abs().max()

    # SGLang's own DCP merge kernel, fed as a `dsa` backend's output (base-2 LSE, empty rows zeroed); the
    # sum over ranks stands in for its reduce-scatter.
    dcp_kernels = pytest.importorskip("sglang.kernels.ops.attention.dcp_kernels")
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import for_dcp_merge

    fed = [for_dcp_merge(o.float(), lse_r) for o, lse_r in zip(outs, lses)]
    all_lses = torch.stack([lse_r for _, lse_r in fed])
    merged = sum(
        dcp_kernels.correct_attn_out(o, all_lses, r, None, torch.empty_like(o.transpose(0, 1)))[0]
        for r, (o, _) in enumerate(fed)
    ).transpose(0, 1)
    assert torch.allclose(merged, out_repl[:, 0].float(), atol=1e-2, rtol=1e-2), (merged - out_repl[:, 0]).abs().max()


@pytest.mark.parametrize("kernel", ["flashmla_kv", "flashmla_sparse"])
def test_decode_server_flashmla_call_merges_to_the_replicated_decode(kernel):
    """The decode CP server's FlashMLA calls through SGLang's ``flash_mla_interface``: ``flashmla_kv`` over
    the fp8 cache (the DSA backend's legacy schedule for the padded head count over the full lengths) and
    ``flashmla_sparse`` over a bf16 cache (the legacy kernel's base-2 LSE, read as such), 16 heads padded
    to 64: each of 2 ranks over the selected rows it owns; merged by LSE (``merge_by_lse``, and SGLang's
    ``correct_attn_out`` over ``for_dcp_merge``'s base-2 LSE), the outputs equal the same call over the
    replicated pool within its bf16 output's rounding (and its natural LSE the plain-torch reference's),
    a rank that attends to nothing included."""
    from types import SimpleNamespace

    interface = pytest.importorskip("sglang.kernels.ops.attention.flash_mla_interface")
    dcp_kernels = pytest.importorskip("sglang.kernels.ops.attention.dcp_kernels")
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import (
        for_dcp_merge,
        merge_by_lse,
        owned_rows,
        position_rows,
    )
    from sglang_cp_shared_kv.srt.sglang_wiring import decode_server

    cp_size, dev, topk, heads = 2, "cuda", 128, 16
    lens = [3 * PS + 5, 9 * PS + 17, 13 * PS]
    kv_format = "fp8" if kernel == "flashmla_kv" else "bf16"
    _, req_pages, replicated, ranks = _pools(cp_size, lens, seed=3, kv_format=kv_format)
    b, width = len(lens), max(lens)
    q = (torch.randn(b, heads, 576, device=dev) / 4).to(torch.bfloat16)
    selected = torch.stack([torch.randperm(n, device=dev)[:topk] for n in lens])
    selected[0] = torch.cat([torch.randperm(PS, device=dev)[:40], torch.full((topk - 40,), -1, device=dev)])
    padded = decode_server.flashmla_kv_heads(heads)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=dev).clamp(max=topk)  # dsa_cache_seqlens
    meta, splits = interface.get_mla_metadata(
        cache_seqlens=cache_seqlens,
        num_q_tokens_per_head_k=padded,
        num_heads_k=1,
        num_heads_q=padded,
        is_fp8_kvcache=True,
        topk=topk,
    )
    backend = SimpleNamespace(flashmla_kv_num_q_heads=padded, physical_page_size=PS, kv_cache_dim=656,
                              flashmla_kv_format="V32", device_sm_major=9)  # fmt: skip
    flashmla = SimpleNamespace(flashmla_metadata=meta, num_splits=splits)
    metadata = SimpleNamespace(dsa_cache_seqlens_int32=cache_seqlens, flashmla_metadata=flashmla)
    layer = SimpleNamespace(v_head_dim=512, scaling=576**-0.5)

    def attend(latent, rows):
        if kernel == "flashmla_kv":
            kv = latent.view(torch.float8_e4m3fn).view(-1, 1, 656)
            out, lse = decode_server._flashmla_kv(backend, q, kv, rows, layer=layer, metadata=metadata)
        else:
            kv = latent.view(torch.bfloat16).view(-1, 1, 576)
            out, lse = decode_server._flashmla_sparse(backend, q, kv, rows, layer=layer)
        return out[:, :heads].float(), lse[:, :heads]

    rows_repl = _rows_through(selected, req_pages)
    want, want_lse = attend(replicated.latent[0], rows_repl)
    for i in range(b):  # the natural LSE against the plain-torch reference
        _, ref_lse = sparse_mla(q[i : i + 1].float(), replicated.latent[0], kv_format, rows_repl[i : i + 1].long(),
                                layer.scaling)  # fmt: skip
        assert torch.allclose(want_lse[i].float(), ref_lse[0], atol=1e-3), (
            kernel,
            (want_lse[i] - ref_lse[0]).abs().max(),
        )
    outs, lses = [], []
    for r, pool in enumerate(ranks):
        row_of = torch.stack(
            [
                torch.nn.functional.pad(position_rows(p.view(1, -1), PS, cp_size, r, n)[0], (0, width - n), value=-1)
                for p, n in zip(req_pages, lens)
            ]
        )
        out, lse = attend(pool.latent[0], owned_rows(selected, row_of).to(torch.int32))
        outs.append(out)
        lses.append(lse)
    out, lse = merge_by_lse(torch.stack(outs), torch.stack(lses))
    assert torch.allclose(lse, want_lse.float(), atol=1e-4), (lse - want_lse).abs().max()
    assert torch.allclose(out, want, atol=1e-2, rtol=1e-2), (out - want).abs().max()
    fed = [for_dcp_merge(o, lse_r) for o, lse_r in zip(outs, lses)]
    all_lses = torch.stack([lse_r for _, lse_r in fed])
    merged = sum(
        dcp_kernels.correct_attn_out(o, all_lses, r, None, torch.empty_like(o.transpose(0, 1)))[0]
        for r, (o, _) in enumerate(fed)
    ).transpose(0, 1)
    assert torch.allclose(merged, want, atol=1e-2, rtol=1e-2), (merged - want).abs().max()


def test_decode_cp_step_makes_no_host_sync_and_replays_in_a_cuda_graph():
    """A whole decode CP step for every rank of a group of 4 (``decode_cp``), on one GPU: each rank's
    own top-k over the index scores of the positions it owns, the global top-k over every rank's
    candidates, FlashMLA over the selected rows each rank owns, the LSE merge. The candidates' and
    outputs' all-gathers are stood in for by stacking the ranks' tensors (the CP group's collectives
    have their own tests). The step runs with torch's sync check set to raise, then is captured in a CUDA
    graph whose replay must equal the eager step bit for bit; the selection equals the top-k over all
    positions (scores drawn from 40 values, so ties decide the edge) and the merged output FlashMLA over
    the replicated pool."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import (
        merge_by_lse,
        owned_rows,
        position_rows,
        ranked_topk,
    )

    flash_mla = _flash_mla()
    dev, cp_size, topk, h_q = "cuda", 4, 128, 64
    lens = [PS + 5, 9 * PS + 17, 13 * PS]
    _, req_pages, replicated, ranks = _pools(cp_size, lens, seed=2)
    b, width = len(lens), max(lens)
    g = torch.Generator(device=dev).manual_seed(3)
    scores = torch.randint(0, 40, (b, width), device=dev, generator=g).float()
    positions = torch.arange(width, device=dev).expand(b, width)
    visible = positions < torch.tensor(lens, device=dev).view(b, 1)
    scores, positions = torch.where(visible, scores, -torch.inf), torch.where(visible, positions, -1)
    row_of_position = []
    for r in range(cp_size):
        rows = [position_rows(p.view(1, -1), PS, cp_size, r, n)[0] for p, n in zip(req_pages, lens)]
        row_of_position.append(torch.stack([torch.nn.functional.pad(x, (0, width - len(x)), value=-1) for x in rows]))
    q = (torch.randn(b, 1, h_q, 576, device=dev) / 4).to(torch.bfloat16)
    sm_scale = 576**-0.5
    metas = [flash_mla.get_mla_metadata()[0] for _ in range(cp_size)]  # once per batch, as the backend does

    def step():
        local = []
        for r in range(cp_size):  # each rank: its own positions' scores only
            mine = row_of_position[r] >= 0
            local.append(ranked_topk(torch.where(mine, scores, -torch.inf), torch.where(mine, positions, -1), topk))
        per_row = lambda ts: torch.stack(ts, dim=1).reshape(b, cp_size * topk)  # noqa: E731 - the all-gather
        selected = ranked_topk(per_row([v for v, _ in local]), per_row([p for _, p in local]), topk)[1]
        outs, lses = [], []
        for r, pool in enumerate(ranks):
            rows = owned_rows(selected, row_of_position[r]).to(torch.int32).unsqueeze(1)
            cache = pool.latent[0].view(-1, PS, 1, pool.latent[0].shape[-1]).view(torch.float8_e4m3fn)
            out, lse = flash_mla.flash_mla_with_kvcache(
                q, cache, None, None, 512, metas[r], None, sm_scale, False, True, rows, use_legacy=True
            )
            outs.append(out[:, 0])
            lses.append(lse[:, :, 0])
        out, lse = merge_by_lse(torch.stack(outs), torch.stack(lses))
        return selected, out, lse

    step()  # FlashMLA fills each rank's schedule on its first call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        selected, out, lse = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            captured = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(captured, (selected, out, lse)))

    assert torch.equal(selected, ranked_topk(scores, positions, topk)[1])
    assert (selected[0] >= 0).sum() == lens[0] and (selected[1:] >= 0).all()
    rows_repl = _rows_through(selected, req_pages)
    out_repl, lse_repl = _decode(flash_mla, q, replicated.latent[0], rows_repl.unsqueeze(1), sm_scale)
    assert torch.allclose(lse, lse_repl[:, :, 0].float(), atol=1e-4), (lse - lse_repl[:, :, 0]).abs().max()
    assert torch.allclose(out, out_repl[:, 0].float(), atol=1e-2, rtol=1e-2), (out - out_repl[:, 0]).abs().max()
