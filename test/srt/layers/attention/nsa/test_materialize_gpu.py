"""On CUDA: the views never synchronize with the host, their compiled kernels equal the CPU
references, and the NCCL-gathered view holds the replicated pages bit for bit. The wired read
state on GPUs: ``test_read_state_ranks.py``."""

import random

import pytest
import torch
from page_fixtures import PagePool, RotatingPages, begin_batch, build_slot_plan, page_table

from reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import (
    gather_page_buffers,
    gather_pages_ref,
    prepare_gather,
    translate_locs,
    translate_locs_ref,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import slots_per_rank
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PS = 64


def _batch(n: int, requests: int, seed: int):
    rng = random.Random(seed)
    alloc = RotatingPages(n, 4096)
    pages = [alloc.alloc(rng.randint(1, 80), rng.randrange(n)).tolist() for _ in range(requests)]
    return pages, page_table(pages), alloc.phys_pages_per_rank


def test_plan_and_gather_do_not_sync_and_equal_cpu():
    n, rank = 8, 3
    pages, table, phys = _batch(n, 48, seed=1)
    lens = [len(p) for p in pages]
    cpu_plan = build_slot_plan(table, lens, n, PS, trash_page=phys, use_triton=False)
    src = torch.randint(0, 256, (phys + 1, PS * 132), dtype=torch.uint8)
    dev = torch.device("cuda")
    table_d, src_d = table.to(dev), src.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        plan = build_slot_plan(table_d, lens, n, PS, trash_page=phys)
        send = gather_page_buffers([src_d], plan.send_pages(rank))[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(plan.slots.cpu(), cpu_plan.slots)
    assert torch.equal(plan.slot_table.cpu(), cpu_plan.slot_table)
    assert torch.equal(plan.slot_phys.cpu(), cpu_plan.slot_phys)
    assert torch.equal(send.cpu(), src[cpu_plan.send_pages(rank)])


def test_materializer_does_not_sync():
    dev = torch.device("cuda")
    pool = PagePool(PageOwnership(1, PS), 0, 64, 2, "fp8", device=dev)
    table = torch.tensor([[5, 9, 2], [7, 1, 0]], dtype=torch.int32, device=dev)
    mat = ViewMaterializer(pool, None)
    ahead = ViewMaterializer(pool, None, prefetch=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        begin_batch(mat, table, [3 * PS, 2 * PS], [PS, 0])
        hist = mat.layer_view(1)
        begin_batch(ahead, table, [3 * PS, 2 * PS], [3 * PS, 2 * PS])  # prefixes only, as the read state plans
        for layer in range(2):
            ahead.layer_view(layer)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert hist.page_table.shape == (2, 3)


def _rank_nccl_views(rank, world_size):
    """Random pages on every rank's share of a pool and on a replicated pool: the view built over NCCL
    (under CUDA sync-debug 'error' mode after a warm-up) holds the replicated page at every position."""
    dev = torch.device("cuda", torch.cuda.current_device())
    group = CPGroup()
    own = PageOwnership(world_size, PS)
    rng = random.Random(5)
    alloc = RotatingPages(world_size, 1800 // world_size + 16)
    pages = [alloc.alloc(rng.randint(1, 300), rng.randrange(world_size)).tolist() for _ in range(6)]
    table = page_table(pages).to(dev)
    lens = [len(p) * PS - rng.randrange(PS) for p in pages]
    phys = alloc.phys_pages_per_rank
    sharded = PagePool(own, rank, phys, 1, "fp8", device=dev)
    replicated = PagePool(PageOwnership(1, PS), 0, phys * world_size, 1, "fp8", device=dev)
    g = torch.Generator().manual_seed(3)  # the same rows on every rank
    locs = torch.arange(phys * world_size * PS)
    rows = torch.randint(0, 256, (len(locs), sharded.row_bytes), dtype=torch.uint8, generator=g).to(dev)
    k_u8 = torch.randint(0, 256, (len(locs), 128), dtype=torch.uint8, generator=g).to(dev)
    scale = torch.rand(len(locs), generator=g).to(dev)
    for pool in (sharded, replicated):
        pool.set_latent(0, locs.to(dev), rows)
        pool.set_index(0, locs.to(dev), k_u8, scale)
    mat = ViewMaterializer(sharded, group)
    prefix = [PS] * len(lens)
    begin_batch(mat, table, lens, prefix)
    mat.layer_view(0)  # warm-up: Triton compiles, NCCL communicators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counters = begin_batch(mat, table, lens, prefix)
        view = mat.layer_view(0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    slots = view.page_table.long()
    mask = (
        torch.arange(table.shape[1], device=dev).unsqueeze(0)
        < torch.tensor([len(p) for p in pages], device=dev)[:, None]
    )
    lp, sl = table.long()[mask], slots[mask]
    latent_ok = torch.equal(
        view.kv_rows.view(-1, PS * sharded.row_bytes)[sl], replicated.latent[0].view(-1, PS * sharded.row_bytes)[lp]
    )
    index_ok = torch.equal(view.index_pages[sl], replicated.index[0][lp])
    expected_pages = world_size * slots_per_rank([len(p) for p in pages], world_size)
    return latent_ok, index_ok, counters.view_pages == expected_pages


@pytest.mark.multirank
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_views_equal_replicated_pages_without_syncing():
    n = min(torch.cuda.device_count(), 8)
    for latent_ok, index_ok, counted in spawn_ranks(_rank_nccl_views, n, backend="nccl", timeout_s=300):
        assert latent_ok and index_ok and counted


def test_prepared_gather_launches_equal_the_reference():
    """A prepared gather queued again and again reads what the pool holds when it runs, with no host sync;
    buffers that are not 16-byte aligned gather right too."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    latent = torch.randint(0, 256, (40, PS * 656), dtype=torch.uint8, generator=gen).to(dev)
    index = torch.randint(0, 256, (40, PS * 132), dtype=torch.uint8, generator=gen).to(dev)
    ids_host = torch.randint(0, 40, (17,), generator=gen)
    ids = ids_host.to(dev)
    outs, launch = prepare_gather([latent, index], ids)
    launch()  # compiled off the sync-debug window
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            for out in outs:
                out.zero_()
            launch()
            latent[int(ids_host[step])] += 1  # queued after the launch: not in what it copied
    finally:
        torch.cuda.set_sync_debug_mode(0)
    latent[int(ids_host[2])] -= 1
    assert torch.equal(outs[0], gather_pages_ref(latent, ids))
    assert torch.equal(outs[1], gather_pages_ref(index, ids))
    few = ids[:5].clamp(max=38)  # pages of the 39-page buffers below
    odd = latent.view(-1)[4 : 4 + 39 * latent.shape[1]].view(39, -1)  # 4-byte, not 16-byte, aligned
    odd_outs, odd_launch = prepare_gather([odd, index[:39]], few)
    odd_launch()
    assert torch.equal(odd_outs[0], gather_pages_ref(odd, few))
    assert torch.equal(odd_outs[1], gather_pages_ref(index[:39], few))


def test_translations_follow_a_rewritten_page_map_without_syncing():
    """Translations over one page map rewritten in place batch after batch equal the reference, with no
    host sync once compiled; locs that are not aligned or not contiguous are right too."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    page_pos = torch.zeros(512, dtype=torch.int64, device=dev)
    pairs = ((torch.int32, None), (torch.int32, torch.int64), (torch.int64, None))
    # Every batch's page map and locs on the device first: only the translations run in sync-debug mode.
    maps = [torch.randperm(512, generator=gen).to(dev) * (batch + 1) for batch in range(4)]
    locs_of = [[torch.randint(0, 512 * PS, (4, 8192), generator=gen).to(d).to(dev) for d, _ in pairs] for _ in maps]
    made = []
    for batch, pos in enumerate(maps):
        if batch == 1:
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if batch else 0)  # compiled in the first batch
        try:
            page_pos.copy_(pos)
            for (_, out_dtype), locs in zip(pairs, locs_of[batch]):
                made.append((pos, locs, out_dtype, translate_locs(page_pos, locs, PS, out_dtype)))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for pos, locs, out_dtype, got in made:
        assert torch.equal(got, translate_locs_ref(pos, locs, PS, out_dtype))
    odd = made[-1][1].view(-1)[1:4097]  # 8 bytes past an aligned address
    assert torch.equal(translate_locs(page_pos, odd, PS), translate_locs_ref(page_pos, odd, PS))
    strided = made[-1][1][:, ::3]
    assert torch.equal(translate_locs(page_pos, strided, PS), translate_locs_ref(page_pos, strided, PS))
