"""Each Triton kernel of a batch's slot plan equals its plain-torch reference (interpreter on CPU, or CUDA)."""

import pytest
import torch

from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import triton_enabled
from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import (
    BLOCKED_PLAN_BLOCK,
    FUSED_PLAN_MAX_POSITIONS,
    PLAN_META_ROWS,
    assign_slots,
    assign_slots_ref,
    build_slot_table,
    build_slot_table_ref,
    map_batch_pages_ref,
    plan_batch,
    plan_batch_ref,
    plan_positions,
    plan_positions_ref,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import plan_vectors, slots_per_rank

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not triton_enabled(DEVICE), reason="Triton kernels need CUDA or TRITON_INTERPRET=1 at import"
)


@needs_triton
@pytest.mark.parametrize("pad", [0, -1])
def test_build_slot_table_equals_reference(pad):
    pages = [3, 0, 5, 1, 2]
    max_pages = 7
    cu = torch.tensor([0, 3, 3, 8, 9, 11], device=DEVICE)
    slots = torch.randperm(40, device=DEVICE)[:11]
    flat = torch.tensor([b * max_pages + j for b, p in enumerate(pages) for j in range(p)], device=DEVICE)
    expected = build_slot_table_ref(slots, flat, len(pages), max_pages, pad)
    got = build_slot_table(slots, cu, flat, len(pages), max_pages, pad=pad, use_triton=True)
    assert got.dtype == torch.int32 and torch.equal(got, expected)
    for b, p in enumerate(pages):
        assert expected[b, :p].tolist() == slots[int(cu[b]) : int(cu[b]) + p].tolist()
        assert expected[b, p:].tolist() == [pad] * (max_pages - p)


def _batch_table(pages: list[int], width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10_000, (len(pages), width), dtype=dtype, generator=g)


@needs_triton
@pytest.mark.parametrize("pages", [[3, 0, 5, 1, 2], [0], [1], [1100, 7], [0, 0, 2]])
def test_plan_positions_equals_reference(pages):
    max_pages = max(pages) + 2
    cu = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], device=DEVICE)
    expected = plan_positions_ref(cu, max_pages, sum(pages))
    assert expected.tolist() == [b * max_pages + j for b, p in enumerate(pages) for j in range(p)]
    got = plan_positions(cu, max_pages, sum(pages), use_triton=True)
    assert got.dtype == torch.int64 and torch.equal(got, expected)


def _assign_case(pages, cp_size, seed, dtype=torch.int64, pad=0, strided=False):
    """The fused kernel against the torch reference on one batch (random pages: owner blocks may overflow)."""
    width = max(pages) + 1
    table = _batch_table(pages, 2 * width if strided else width, seed, dtype).to(DEVICE)
    if strided:
        table = table[:, ::2]  # a page table whose rows are not contiguous
    # Blocks sized for balanced allocation, as the plan sizes them; random pages can overflow them.
    s = slots_per_rank(pages, cp_size)
    positions, cu = plan_vectors(pages, table.shape[1], DEVICE, use_triton=False)
    args = (table, positions, cu, cp_size, s, 777, pad)
    expected = assign_slots_ref(*args, use_triton=False)
    got = assign_slots(*args, use_triton=True)
    names = ("logical", "slots", "slot_table", "slot_phys", "status")
    assert len(got) == len(expected) == len(names)
    for name, a, b in zip(names, got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, pages, cp_size)
    # Never past the view, whether or not a block overflowed; the flag says whether one did.
    slots, status = expected[1], expected[4]
    assert bool(((slots >= 0) & (slots < cp_size * s)).all())
    counts = torch.bincount(expected[0] % cp_size, minlength=cp_size)
    assert status.tolist() == [int(counts.max() > s), *counts.tolist()]
    return int(status[0])


@needs_triton
@pytest.mark.parametrize("cp_size", [2, 3, 8])  # one rank: test_slot_plan (shared prefixes)
def test_fused_plan_equals_reference(cp_size):
    flags = []
    for seed, pages in enumerate([[5, 3, 7, 1, 4, 9], [1], [12, 0, 12], [2, 40, 3, 1, 0, 17, 8, 8]]):
        flags.append(_assign_case(pages, cp_size, seed, dtype=torch.int32 if seed % 2 else torch.int64, pad=seed - 1))
    flags.append(_assign_case([6, 9, 2], cp_size, 99, strided=True))
    # Random pages do not rotate owners: some batches overflow a block.
    assert any(flags)


@pytest.mark.parametrize("use_triton", [False, True] if triton_enabled(DEVICE) else [False])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_plan_overflow_reads_a_trash_slot_and_raises_the_flag(cp_size, use_triton):
    # Request 0's 6 pages all on owner 1 (no rotation), request 1 balanced: S = ceil(6/N) + ceil(2/N).
    n = cp_size
    table = torch.tensor([[1 + n * i for i in range(6)], [2, 3, 0, 0, 0, 0]], device=DEVICE)
    positions, cu = plan_vectors([6, 2], 6, DEVICE, use_triton=False)
    s = slots_per_rank([6, 2], n)
    logical, slots, slot_table, slot_phys, status = assign_slots(table, positions, cu, n, s, 777, use_triton=use_triton)
    counts = [sum(1 for lp in logical.tolist() if lp % n == o) for o in range(n)]
    assert status.tolist() == [1, *counts] and counts[1] > s
    # Positions past owner 1's block read a slot inside the view whose send entry is the trash page.
    owner1 = [i for i, lp in enumerate(logical.tolist()) if lp % n == 1]
    past = owner1[s:]
    assert past and all(0 <= x < n * s for x in slots.tolist())
    for i in past:
        assert slot_phys[slots[i]].item() == 777  # slot == send entry
        assert slot_table.view(-1)[positions[i]].item() == slots[i].item()
    # Within the block, owner 1's positions keep their own pages.
    assert [slot_phys[slots[i]].item() for i in owner1[:s]] == [logical[i].item() // n for i in owner1[:s]]


@needs_triton
@pytest.mark.parametrize(
    "pages",
    [
        [1024],  # exactly one 1024-wide block
        [1000, 25],  # one past it: the next block size
        [4096, 4096],  # FUSED_PLAN_MAX_POSITIONS exactly: the largest single program
        [4096, 4097],  # one past: the blocked kernel, the last block holding one position
        [5000, 1, 7000, 3000, 0, 2047],  # blocked, requests straddling blocks
    ],
)
def test_fused_plan_at_block_boundaries(pages):
    assert FUSED_PLAN_MAX_POSITIONS == 8192 and FUSED_PLAN_MAX_POSITIONS % BLOCKED_PLAN_BLOCK == 0
    for cp_size in (8, 3):
        assert _assign_case(pages, cp_size, seed=sum(pages)) == 1  # random pages overflow a block


def test_assign_slots_rejects_bad_input():
    table = torch.zeros((1, 4), dtype=torch.int64)
    positions, cu = plan_vectors([4], 4, torch.device("cpu"), use_triton=False)
    with pytest.raises(ValueError, match="slots_per_rank"):
        assign_slots(table, positions, cu, 2, 0, 0)
    with pytest.raises(ValueError, match="cu_pages"):
        assign_slots(table, positions, cu[:1], 2, 4, 0)


def _page_map_by_loops(logical, page_table, plan_table, shared, prefix, pages, base, fill):
    """The batch's page map, one page at a time (an independent statement of ``map_batch_pages_ref``)."""
    out = [fill] * logical
    start = 0
    for b in range(len(pages)):
        for j in range(shared[b], pages[b]):
            lp = int(page_table[b][j])
            out[lp] = int(plan_table[b][j - shared[b]]) if j < prefix[b] else base + start + j - prefix[b]
        start += pages[b] - prefix[b]
    return out


def test_map_batch_pages_maps_prefix_slots_staged_pages_and_fills_the_rest():
    # Three requests over distinct logical pages: request 1 shares its first 2 prefix pages with request 0.
    g = torch.Generator().manual_seed(3)
    logical = 200
    shared, prefix, pages = [0, 2, 0], [3, 4, 0], [5, 6, 2]
    width = 7
    ids = torch.randperm(logical - 4, generator=g)[: sum(pages)] + 4  # pages 0..3 never handed out
    table = torch.zeros((3, width), dtype=torch.int64)
    k = 0
    for b, p in enumerate(pages):
        table[b, :p] = ids[k : k + p]
        k += p
    table[1, :2] = table[0, :2]  # the shared pages are the source's
    plan = torch.randint(0, 50, (3, width), generator=g, dtype=torch.int32)
    starts = [0, 2, 4]
    meta = torch.tensor([shared, prefix, pages, starts], dtype=torch.int64, device=DEVICE)
    page_pos = torch.full((logical,), -5, dtype=torch.int64, device=DEVICE)
    got = map_batch_pages_ref(page_pos, table.to(DEVICE), plan.to(DEVICE), meta, 30, 99)
    expected = _page_map_by_loops(logical, table.tolist(), plan.tolist(), shared, prefix, pages, 30, 99)
    # Request 0 maps the shared pages to its own slots; request 1 leaves them alone.
    assert got is page_pos and page_pos.tolist() == expected


def _plan_case(cp_size, prefix, pages, shared, source, ps, seed, rotate=True, dtype=torch.int32):
    """A batch of requests in a req_to_token table (rows permuted), the plan's host meta and sizes."""
    g = torch.Generator().manual_seed(seed)
    batch, logical = len(pages), 4 * cp_size + 8 * sum(pages)
    width = max(pages) + 1
    free = (torch.randperm(logical - cp_size, generator=g) + cp_size).tolist()  # pages 0..N-1 never handed out
    if rotate:  # balanced: each request's pages rotate over the owners
        free = sorted(free[: sum(pages) + 4 * cp_size])
    tokens = torch.zeros((batch + 2, (width + 2) * ps), dtype=dtype)
    rows = torch.randperm(batch + 2, generator=g)[:batch]
    for b, p in enumerate(pages):
        for j in range(p):
            lp = free.pop(int(torch.randint(len(free), (1,), generator=g))) if not rotate else free.pop(0)
            tokens[rows[b], j * ps : (j + 1) * ps] = lp * ps + torch.arange(ps)
    for b, (src, sh) in enumerate(zip(source, shared)):  # a request's shared pages are its source's
        if sh:
            tokens[rows[b], : sh * ps] = tokens[rows[src], : sh * ps]
    plan_pages = [q - s for q, s in zip(prefix, shared)]
    starts = torch.tensor([0, *[p - q for p, q in zip(pages, prefix)]]).cumsum(0)[:-1].tolist()
    firsts = torch.tensor([0, *plan_pages]).cumsum(0)[:-1].tolist()
    meta = torch.tensor([shared, prefix, pages, starts, source, firsts], dtype=torch.int64)
    s = slots_per_rank(plan_pages, cp_size)
    return tokens, rows, meta, width, sum(plan_pages), s, logical


@needs_triton
@pytest.mark.parametrize("cp_size", [2, 3, 8])
@pytest.mark.parametrize(
    ("prefix", "pages", "shared", "source", "ps"),
    [
        ([3, 5, 0], [5, 6, 2], [0, 2, 0], [-1, 0, -1], 4),  # a hint, a request without a prefix
        ([0, 0], [3, 1], [0, 0], [-1, -1], 1),  # current-reuse: no planned page
        ([7, 7, 7, 7], [9, 7, 8, 12], [0, 7, 4, 0], [-1, 0, 1, -1], 16),  # whole-prefix and nested hints
        ([1100, 40], [1101, 44], [0, 0], [-1, -1], 2),  # past one 1024-wide block
    ],
)
def test_plan_batch_equals_reference(cp_size, prefix, pages, shared, source, ps):
    for rotate in (True, False):  # unbalanced pages overflow an owner's block
        tokens, rows, meta, width, m, s, logical = _plan_case(
            cp_size, prefix, pages, shared, source, ps, cp_size, rotate
        )
        outs = []
        for use_triton in (False, True):
            page_pos = torch.full((logical,), -3, dtype=torch.int64, device=DEVICE)
            args = (tokens.to(DEVICE), rows.to(DEVICE), ps, meta.to(DEVICE), width, m, cp_size, s, 77, page_pos)
            plan = plan_batch(*args, base=50, fill=99, pad=-1, use_triton=use_triton)
            outs.append((plan, page_pos))
        (ref, ref_pos), (got, got_pos) = outs
        for name in ("positions", "logical", "slots", "slot_table", "slot_phys", "status", "wrong"):
            a, b = getattr(got, name), getattr(ref, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, rotate)
        assert torch.equal(got_pos, ref_pos)
        assert got.wrong.tolist() == [0] * len(pages)  # the hints are right


def test_plan_batch_counts_a_wrong_hint_and_rejects_bad_meta():
    tokens, rows, meta, width, m, s, logical = _plan_case(2, [4, 4], [5, 6], [0, 3], [-1, 0], 4, 1)
    tokens[rows[1], 4:8] += 4  # request 1's second shared page is not its source's
    page_pos = torch.zeros(logical, dtype=torch.int64)
    plan = plan_batch_ref(tokens, rows, 4, meta, width, m, 2, s, 0, page_pos, 10, 0)
    assert plan.wrong.tolist() == [0, 1] and len(PLAN_META_ROWS) == meta.shape[0]
    with pytest.raises(ValueError, match="meta must be"):
        plan_batch(tokens, rows, 4, meta[:5], width, m, 2, s, 0, page_pos, 10, 0)
