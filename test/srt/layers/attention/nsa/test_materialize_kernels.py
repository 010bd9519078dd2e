"""Each Triton kernel of the read path equals its plain-torch reference (interpreter on CPU, or CUDA)."""

import pytest
import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import (
    gather_launch,
    gather_page_buffers,
    gather_pages_ref,
    pull_launch,
    pull_pages_ref,
    translate_locs,
    translate_locs_ref,
    word_pair,
    word_view,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.triton_launch import interpreting, triton_enabled
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import (
    INDEX_TOKEN_BYTES,
    MLA_BF16_ROW_BYTES,
    MLA_FP8_ROW_BYTES,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not triton_enabled(DEVICE), reason="Triton kernels need CUDA or TRITON_INTERPRET=1 at import"
)


def gather_pages(src, page_ids, out=None, use_triton=None):
    """``gather_page_buffers`` for a single buffer."""
    return gather_page_buffers([src], page_ids, None if out is None else [out], use_triton)[0]


@needs_triton
@pytest.mark.parametrize(
    ("page_bytes", "index_dtype"),
    [
        (16 * MLA_FP8_ROW_BYTES, torch.int64),
        (16 * MLA_BF16_ROW_BYTES, torch.int32),
        (16 * INDEX_TOKEN_BYTES, torch.int32),
        (64 * INDEX_TOKEN_BYTES, torch.int64),
        (2 * INDEX_TOKEN_BYTES, torch.int64),  # page bytes not a multiple of 16
        (7, torch.int64),  # not even word-sized: the kernel copies bytes
    ],
)
def test_gather_pages_equals_reference(page_bytes, index_dtype):
    g = torch.Generator().manual_seed(page_bytes)
    src = torch.randint(0, 256, (9, page_bytes), dtype=torch.uint8, generator=g).to(DEVICE)
    ids = torch.tensor([8, 0, 3, 3, 8, 5], dtype=index_dtype, device=DEVICE)  # repeats and the last (trash) page
    expected = gather_pages_ref(src, ids)
    assert torch.equal(expected.cpu(), src.cpu()[ids.cpu()])
    assert torch.equal(gather_pages(src, ids, use_triton=True), expected)
    # Into rows of a larger buffer, as the send block is; neighbours stay untouched.
    big = torch.full((len(ids) + 2, page_bytes), 17, dtype=torch.uint8, device=DEVICE)
    gather_pages(src, ids, out=big[1:-1], use_triton=True)
    assert torch.equal(big[1:-1], expected)
    assert bool((big[0] == 17).all()) and bool((big[-1] == 17).all())


@needs_triton
def test_gather_pages_from_a_page_view_of_a_row_buffer():
    """The pool's latent buffer is row-major; its page view is what the gather reads."""
    ps, rb = 16, MLA_FP8_ROW_BYTES
    rows = torch.randint(0, 256, (5 * ps, rb), dtype=torch.uint8, device=DEVICE)
    pages = rows.view(5, ps * rb)
    ids = torch.tensor([4, 2, 1], device=DEVICE)
    out = gather_pages(pages, ids, use_triton=True)
    assert torch.equal(out.view(3 * ps, rb), torch.cat([rows[p * ps : (p + 1) * ps] for p in (4, 2, 1)]))


def test_wrappers_fall_back_to_reference_without_triton():
    src = torch.arange(60, dtype=torch.uint8).view(6, 10)
    ids = torch.tensor([5, 1])
    assert torch.equal(gather_pages(src, ids, use_triton=False), src[ids])


@pytest.mark.skipif(torch.cuda.is_available() or interpreting(), reason="Triton can run here")
def test_forcing_triton_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(ValueError, match="use_triton=True"):
        gather_pages(torch.zeros((2, 4), dtype=torch.uint8), torch.tensor([0]), use_triton=True)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gather_pages(torch.zeros(4, dtype=torch.uint8), torch.tensor([0])), "src"),
        (lambda: gather_pages(torch.zeros((2, 4), dtype=torch.uint8), torch.tensor([0.0])), "page_ids"),
        (
            lambda: gather_pages(
                torch.zeros((2, 4), dtype=torch.uint8), torch.tensor([0]), out=torch.zeros((2, 4), dtype=torch.uint8)
            ),
            "out",
        ),
    ],
)
def test_bad_input_is_rejected(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@needs_triton
@pytest.mark.parametrize(("ps", "row_bytes"), [(16, MLA_FP8_ROW_BYTES), (64, MLA_BF16_ROW_BYTES)])
def test_gather_page_buffers_gathers_latent_and_index_pages_together(ps, row_bytes):
    g = torch.Generator().manual_seed(ps)
    latent = torch.randint(0, 256, (6, ps * row_bytes), dtype=torch.uint8, generator=g).to(DEVICE)
    index = torch.randint(0, 256, (6, ps * INDEX_TOKEN_BYTES), dtype=torch.uint8, generator=g).to(DEVICE)
    ids = torch.tensor([5, 2, 2, 0], device=DEVICE)
    expected = [gather_pages_ref(latent, ids), gather_pages_ref(index, ids)]
    got = gather_page_buffers([latent, index], ids, use_triton=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    outs = [torch.zeros_like(e) for e in expected]
    assert gather_page_buffers([latent, index], ids, outs, use_triton=True) == outs
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    # Fewer programs than slots: each loops over every programs-th slot.
    for programs in (1, 3):
        outs = [torch.zeros_like(e) for e in expected]
        gather_launch([word_pair(s, o) for s, o in zip((latent, index), outs)], ids, programs=programs)()
        assert all(torch.equal(a, b) for a, b in zip(outs, expected)), programs


@needs_triton
@pytest.mark.parametrize("cp_size", [2, 3])
def test_pull_pages_reads_each_block_from_its_owners_pool(cp_size):
    """The in-line view over peer-mapped pools: every owner's block read from that owner's pages, two
    layers, a layer without indexer pages in one column."""
    ps, row_bytes, layers, pages, s = 4, MLA_FP8_ROW_BYTES, 2, 7, 3
    g = torch.Generator().manual_seed(cp_size)

    def pool(width: int) -> list[torch.Tensor]:
        return [torch.randint(0, 256, (pages, width), dtype=torch.uint8, generator=g).to(DEVICE) for _ in range(layers)]

    # Each owner's buffers (here this process's tensors; on a server the peers' pools, mapped in).
    latent = [pool(ps * row_bytes) for _ in range(cp_size)]
    index = [pool(ps * INDEX_TOKEN_BYTES) for _ in range(cp_size)]
    table = torch.tensor(
        [
            [[latent[o][i].data_ptr() for o in range(cp_size)], [index[o][i].data_ptr() for o in range(cp_size)]]
            for i in range(layers)
        ],
        dtype=torch.int64,
        device=DEVICE,
    )
    slot_phys = torch.randint(0, pages, (cp_size * s,), generator=g).to(DEVICE)
    outs = [
        torch.zeros((cp_size * s, w), dtype=torch.uint8, device=DEVICE)
        for w in (ps * row_bytes, ps * INDEX_TOKEN_BYTES)
    ]
    words = [word_view(o) for o in outs]
    strides = [ps * row_bytes // 4, ps * INDEX_TOKEN_BYTES // 4]
    for layer in range(layers):
        pull_launch(table, slot_phys, s, words, strides, layer)()
        assert torch.equal(outs[0], pull_pages_ref([latent[o][layer] for o in range(cp_size)], slot_phys, s)), layer
        assert torch.equal(outs[1], pull_pages_ref([index[o][layer] for o in range(cp_size)], slot_phys, s)), layer
    # The reference against plain indexing: slot x from owner x // S.
    expected = torch.stack([latent[x // s][1][slot_phys[x]] for x in range(cp_size * s)])
    assert torch.equal(pull_pages_ref([latent[o][1] for o in range(cp_size)], slot_phys, s), expected)
    # The entries inside a larger buffer (a plan's words, from its send_start): a later batch's entries in
    # the same buffer are one int away.
    other = torch.randint(0, pages, (cp_size * s,), generator=g).to(DEVICE)
    buf = torch.cat([other, slot_phys, torch.zeros(3, dtype=torch.int64, device=DEVICE)])
    pull_launch(table, buf, s, words, strides, layer=1, start=cp_size * s, slots=cp_size * s)()
    assert torch.equal(outs[0], pull_pages_ref([latent[o][1] for o in range(cp_size)], slot_phys, s))
    pull_launch(table, buf, s, words, strides, layer=1, start=0, slots=cp_size * s)()
    assert torch.equal(outs[0], pull_pages_ref([latent[o][1] for o in range(cp_size)], other, s))
    assert torch.equal(outs[1], pull_pages_ref([index[o][1] for o in range(cp_size)], other, s))
    with pytest.raises(ValueError, match="past slot_phys"):
        pull_launch(table, buf, s, words, strides, start=cp_size * s + 4, slots=cp_size * s)
    # A latent-only layer: one column, the indexer view untouched.
    outs[1].zero_()
    pull_launch(table, slot_phys, s, words[:1], strides[:1], layer=0)()
    assert torch.equal(outs[0], pull_pages_ref([latent[o][0] for o in range(cp_size)], slot_phys, s))
    assert not bool(outs[1].any())
    # A table of latent addresses alone would be read at the wrong layer's entries: refused.
    with pytest.raises(ValueError, match=r"\[layers, 2, cp_size\]"):
        pull_launch(table[:, :1].contiguous(), slot_phys, s, words[:1], strides[:1], layer=1)


def test_gather_page_buffers_rejects_bad_buffer_lists():
    src = torch.zeros((3, 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="srcs"):
        gather_page_buffers([src, src, src], torch.tensor([0]))
    with pytest.raises(ValueError, match="outs"):
        gather_page_buffers([src, src], torch.tensor([0]), [torch.zeros((1, 8), dtype=torch.uint8)])


@pytest.mark.parametrize("use_triton", [False, True] if triton_enabled(DEVICE) else [False])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_translate_locs_equals_torch_indexing(use_triton, dtype):
    g = torch.Generator().manual_seed(5)
    page_pos = torch.randint(0, 1000, (40,), generator=g, dtype=torch.int64).to(DEVICE)
    locs = torch.randint(0, 40 * 16, (3, 37), generator=g).to(dtype).to(DEVICE)
    locs[0, 0] = -1  # torch's negative index: the last page, row 15
    got = translate_locs(page_pos, locs, 16, use_triton=use_triton)
    pp = page_pos.tolist()
    expected = [[pp[x // 16] * 16 + x % 16 for x in row] for row in locs.tolist()]
    assert got.dtype == dtype and got.shape == locs.shape and got.tolist() == expected
    assert torch.equal(translate_locs_ref(page_pos, locs, 16), got)
    # Page ids (page size 1), a non-contiguous input, another output dtype.
    pages = locs[:, ::2] // 16
    assert translate_locs(page_pos, pages, 1, torch.int64, use_triton=use_triton).tolist() == [
        [pp[x] for x in row] for row in pages.tolist()
    ]


def test_a_translation_follows_its_page_map_as_it_is_rewritten():
    """``translate_locs`` equals ``translate_locs_ref`` over one map, batch after batch as the map is
    rewritten in place, for either locs dtype, another output dtype, and locs neither contiguous nor aligned."""
    g = torch.Generator().manual_seed(8)
    page_pos = torch.zeros(40, dtype=torch.int64, device=DEVICE)

    def locs_of(locs, dtype=None):
        return translate_locs(page_pos, locs, 16, dtype)

    def pages_of(pages):
        return translate_locs(page_pos, pages, 1)

    for batch in range(3):
        page_pos.copy_(torch.randperm(40, generator=g).to(DEVICE) * (batch + 1))
        for dtype in (torch.int32, torch.int64):
            locs = torch.randint(0, 40 * 16, (3, 37), generator=g).to(dtype).to(DEVICE)
            assert torch.equal(locs_of(locs), translate_locs_ref(page_pos, locs, 16))
            assert torch.equal(locs_of(locs, torch.int64), translate_locs_ref(page_pos, locs, 16, torch.int64))
            odd = locs.view(-1)[1:].view(2, 55)  # 4 or 8 bytes past an aligned address
            assert torch.equal(locs_of(odd), translate_locs_ref(page_pos, odd, 16))
            assert torch.equal(pages_of(locs[:, ::2] // 16), translate_locs_ref(page_pos, locs[:, ::2] // 16, 1))
    with pytest.raises(ValueError, match="translate on one device"):  # never an address of another device
        locs_of(torch.zeros(4, dtype=torch.int32, device="meta"))
