"""The overlap proxy's wired pipeline builds the views it times: every layer's view, in line or
prefetched (gather on the side or the compute stream), holds this rank's pool pages in plan order
and the emulated peer's part of its arena, byte for byte (one GPU, the copy-engine transport's
driver calls against a local peer)."""

import pytest
import torch
from benchmark.cp_shared_kv.bench_overlap import CP, INDEX_PAGE, LATENT_PAGE, PS, local_copy_engine_group
from page_fixtures import begin_batch

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewMaterializer, allocate_arena
from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import PageBuffers
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import MLA_FP8_ROW_BYTES
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("prefetch", "gather"), [(False, "side"), (True, "side"), (True, "compute")], ids=["inline", "side", "compute"]
)
def test_views_hold_own_pages_and_peer_part(prefetch, gather):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, layers, tokens = torch.device("cuda"), 3, 4096
    pages = tokens // PS
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=g)

    logical = 2 * pages + 1
    pool = PageBuffers(
        PageOwnership(CP, PS),
        0,
        MLA_FP8_ROW_BYTES,
        [rand(logical, LATENT_PAGE) for _ in range(layers)],
        [rand(logical, INDEX_PAGE) for _ in range(layers)],
    )
    # Position i holds a page of owner i % 2 (pages rotate owners, as SGLang's allocator places them).
    table = torch.empty(pages, dtype=torch.int64)
    table[0::2] = torch.randperm(pages, generator=torch.Generator().manual_seed(1))[: pages // 2] * 2 + 2
    table[1::2] = torch.randperm(pages, generator=torch.Generator().manual_seed(2))[: pages // 2] * 2 + 1
    table = table.to(dev, torch.int32).unsqueeze(0)
    arena = allocate_arena(2 * tokens, 0, PS, MLA_FP8_ROW_BYTES, True, dev, prefetch=True)
    peer = [rand(*b.shape) for b in arena.values()]
    mat = ViewMaterializer(
        pool,
        local_copy_engine_group(list(arena.values()), peer),
        prefetch=prefetch,
        arena=arena,
        prefetch_gather=gather,
    )
    for _ in range(2):  # a second batch reuses the buffers and the transport's counters
        begin_batch(mat, table, [tokens], [tokens], extra_pages=1)
        s, set_pages = mat.plan.slots_per_rank, mat.plan.view_pages + 1
        assert s == pages // 2 and mat.view_sets == (2 if prefetch else 1)
        send = mat.plan.send_pages(0).long()
        for layer in range(layers):
            view = mat.layer_view(layer)
            part = layer % mat.view_sets
            latent = view.kv_rows.view(-1, LATENT_PAGE)
            base = part * set_pages
            assert torch.equal(latent[:s], pool.buffers[layer][send])
            assert torch.equal(view.index_pages[:s], pool.index[layer][send])
            assert torch.equal(latent[s : 2 * s], peer[0][base + s : base + 2 * s])
            assert torch.equal(view.index_pages[s : 2 * s], peer[1][base + s : base + 2 * s])
        mat.drain()
    assert mat.group.calls == 2 * layers
