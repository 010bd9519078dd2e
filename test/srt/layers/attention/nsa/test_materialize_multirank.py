"""Views on N spawned gloo ranks hold exactly the replicated pool's pages.

Random pool contents are written through the CP-shared pools' masked store on every rank and into a
replicated pool; every page position of a batch's view (shared prefix pages included) must hold
the replicated pool's page, and every token row must map to its row. The whole read contract through
SGLang's pools: ``test_read_state_ranks.py`` and ``sglang_wiring/test_plugin_sharded_pool.py``.
"""

import pytest
import torch
from page_fixtures import PagePool, RotatingPages, begin_batch, page_table

from reference.dsa_reference import positions_to_rows
from reference.spawn import spawn_ranks
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import pages_for_lens, slots_per_rank
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES, mla_row_bytes
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _rank_views(rank, world_size, ps, kv_format):
    """Random pool contents, written through the masked store on every rank and into a replicated pool;
    every page position of a batch's view must hold the replicated pool's page."""
    group = CPGroup()
    g = torch.Generator().manual_seed(7)
    lens = [3 * ps + 5, ps, 6 * ps, ps // 2, 2 * ps + 1]
    own = PageOwnership(world_size, ps)
    alloc = RotatingPages(world_size, 2 + sum(-(-n // ps) for n in lens))
    pages = []
    for i, n in enumerate(lens):
        shared = pages[0][:2] if i == 2 else []  # request 2 shares request 0's first two pages
        first = alloc.next_owner(shared[-1]) if shared else i % world_size
        pages.append(shared + alloc.alloc(-(-n // ps) - len(shared), first).tolist())
    table = page_table(pages)
    phys = alloc.phys_pages_per_rank
    sharded = PagePool(own, rank, phys, 1, kv_format)
    replicated = PagePool(PageOwnership(1, ps), 0, phys * world_size, 1, kv_format)
    locs = torch.arange(phys * world_size * ps)
    rows = torch.randint(0, 256, (len(locs), mla_row_bytes(kv_format)), dtype=torch.uint8, generator=g)
    k_u8 = torch.randint(0, 256, (len(locs), 128), dtype=torch.uint8, generator=g)
    scale = torch.rand(len(locs), generator=g)
    for pool in (sharded, replicated):
        pool.set_latent(0, locs, rows)
        pool.set_index(0, locs, k_u8, scale)
    mat = ViewMaterializer(sharded, group)
    counters = begin_batch(mat, table, lens, [1] * len(lens))
    view = mat.layer_view(0)
    bad = []
    for b, p in enumerate(pages):
        for j, lp in enumerate(p):
            slot = int(view.page_table[b, j])
            latent_ok = torch.equal(
                view.kv_rows[slot * ps : (slot + 1) * ps], replicated.latent[0][lp * ps : (lp + 1) * ps]
            )
            index_ok = torch.equal(view.index_pages[slot], replicated.index[0][lp])
            if not (latent_ok and index_ok):
                bad.append((b, j, lp, slot))
    # Token-level remap: position p of request b is row p of its pages in the view.
    pos = torch.tensor([[0, ps - 1, -1], [ps + 1, 0, 2], [5 * ps, -1, 3]], dtype=torch.int32)
    q_req = torch.tensor([0, 4, 2])
    view_rows = positions_to_rows(pos, q_req, view.page_table, ps)
    row_ok = all(
        torch.equal(view.kv_rows[int(vr)], rows[int(table[int(q), int(x) // ps]) * ps + int(x) % ps])
        for r, vrs, q in zip(pos, view_rows, q_req)
        for x, vr in zip(r, vrs)
        if x >= 0
    ) and bool((view_rows[pos < 0] == -1).all())
    return bad, row_ok, counters.view_pages, counters.bytes_materialized


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("world_size", "ps", "kv_format"),
    [(2, 16, "bf16"), (2, 16, "fp8"), (4, 64, "fp8"), (4, 64, "bf16")],
)
def test_view_pages_equal_replicated_pages(world_size, ps, kv_format):
    lens = [3 * ps + 5, ps, 6 * ps, ps // 2, 2 * ps + 1]
    pages = pages_for_lens(lens, ps)
    view = world_size * slots_per_rank(pages, world_size)
    assert view == world_size * sum(_ceil(p, world_size) for p in pages)
    for bad, row_ok, view_pages, nbytes in spawn_ranks(_rank_views, world_size, ps, kv_format, timeout_s=300):
        assert bad == []
        assert row_ok
        assert view_pages == view
        assert nbytes == view * ps * (mla_row_bytes(kv_format) + INDEX_TOKEN_BYTES)
