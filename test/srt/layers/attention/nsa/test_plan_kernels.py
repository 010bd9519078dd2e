"""The batch plan's Triton kernel (``plan_batch``) equals its plain-torch references (interpreter on CPU,
or CUDA), over SGLang's token table and over a page table (``build_slot_plan``)."""

import dataclasses

import pytest
import torch
from page_fixtures import build_slot_plan, plan_meta

from sglang_cp_shared_kv.srt.layers.attention.nsa.plan_kernels import (
    PLAN_META_ROWS,
    assign_slots_ref,
    map_batch_pages_ref,
    plan_batch,
    plan_batch_ref,
    plan_positions_ref,
)
from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import plan_meta_rows, slots_per_rank
from sglang_cp_shared_kv.srt.layers.attention.nsa.triton_launch import triton_enabled

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not triton_enabled(DEVICE), reason="Triton kernels need CUDA or TRITON_INTERPRET=1 at import"
)


def _ref_vectors(pages: list[int], max_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions_flat, cu_pages)`` of a batch planned whole, by the references."""
    cu = torch.tensor([0, *torch.tensor(pages, dtype=torch.int64).cumsum(0).tolist()], device=DEVICE)
    return plan_positions_ref(cu, max_pages, sum(pages)), cu


@pytest.mark.parametrize("pages", [[3, 0, 5, 1, 2], [0], [1], [1100, 7], [0, 0, 2]])
def test_reference_positions_and_slot_table(pages):
    max_pages = max(pages) + 2
    positions, cu = _ref_vectors(pages, max_pages)
    assert positions.tolist() == [b * max_pages + j for b, p in enumerate(pages) for j in range(p)]
    page_table = torch.randint(0, 10_000, (len(pages), max_pages), device=DEVICE)
    _, slots, table, _, _ = assign_slots_ref(page_table, positions, 3, slots_per_rank(pages, 3), 777, pad=-1)
    assert table.dtype == torch.int32 and table.shape == page_table.shape
    for b, p in enumerate(pages):
        assert table[b, :p].tolist() == slots[int(cu[b]) : int(cu[b]) + p].tolist()
        assert table[b, p:].tolist() == [-1] * (max_pages - p)


def _batch_table(pages: list[int], width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10_000, (len(pages), width), dtype=dtype, generator=g)


def _assign_case(pages, cp_size, seed, dtype=torch.int64, pad=0, strided=False):
    """The kernel's plan of a page table against the torch reference on one batch (random pages: owner
    blocks may overflow)."""
    width = max(pages) + 1
    table = _batch_table(pages, 2 * width if strided else width, seed, dtype).to(DEVICE)
    if strided:
        table = table[:, ::2]  # a page table whose rows are not contiguous (the reference plans it)
    # Blocks sized for balanced allocation, as the plan sizes them; random pages can overflow them.
    s = slots_per_rank(pages, cp_size)
    positions, _ = _ref_vectors(pages, table.shape[1])
    expected = assign_slots_ref(table, positions, cp_size, s, 777, pad)
    plan = build_slot_plan(table, pages, cp_size, 16, 777, pad=pad, use_triton=True)
    got = (plan.logical, plan.slots, plan.slot_table, plan.slot_phys, plan.status)
    assert torch.equal(plan.positions, positions) and plan.slots_per_rank == s
    for name, a, b in zip(("logical", "slots", "slot_table", "slot_phys", "status"), got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, pages, cp_size)
    # Never past the view, whether or not a block overflowed; the flag says whether one did.
    slots, status = expected[1], expected[4]
    assert bool(((slots >= 0) & (slots < cp_size * s)).all())
    counts = torch.bincount(expected[0] % cp_size, minlength=cp_size)
    assert status.tolist() == [int(counts.max() > s), *counts.tolist()]
    return int(status[0])


@needs_triton
@pytest.mark.parametrize("cp_size", [2, 3, 8])  # one rank: test_slot_plan (shared prefixes)
def test_plan_of_a_page_table_equals_reference(cp_size):
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
    plan = build_slot_plan(table, [6, 2], n, 16, 777, use_triton=use_triton)
    s, positions, logical, slots = plan.slots_per_rank, plan.positions, plan.logical, plan.slots
    slot_phys, slot_table = plan.slot_phys, plan.slot_table
    assert s == slots_per_rank([6, 2], n)
    counts = [sum(1 for lp in logical.tolist() if lp % n == o) for o in range(n)]
    assert plan.status.tolist() == [1, *counts] and counts[1] > s
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
        [1024],  # exactly one 1024-wide block of the kernel's loops
        [1000, 25],  # one past it
        [4096, 4097],  # several blocks per request
        [5000, 1, 7000, 3000, 0, 2047],  # requests straddling blocks
    ],
)
def test_plan_at_block_boundaries(pages):
    for cp_size in (8, 3):
        assert _assign_case(pages, cp_size, seed=sum(pages)) == 1  # random pages overflow a block


def test_build_slot_plan_rejects_meta_of_other_lengths():
    table = torch.zeros((1, 4), dtype=torch.int64)
    with pytest.raises(ValueError, match="meta must be"):
        build_slot_plan(table, [4], 2, 16, 0, meta=plan_meta([4, 4], torch.device("cpu")))


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
        _assert_same_plan(got, ref, got_pos, ref_pos, rotate)
        assert got.wrong.tolist() == [0] * len(pages)  # the hints are right


_PLAN_FIELDS = ("positions", "logical", "slots", "slot_table", "slot_phys", "status", "wrong")


def _assert_same_plan(got, ref, got_pos: torch.Tensor, ref_pos: torch.Tensor, case) -> None:
    """Every output of two plans equal in dtype, shape and value, and their page maps equal."""
    for name in _PLAN_FIELDS:
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, case)
    assert torch.equal(got_pos, ref_pos)


@needs_triton
def test_plan_batch_equals_the_reference_for_batches_of_other_sizes():
    """Batches of other sizes planned one after another give the plan the reference gives; both write the
    flags, then the landed word."""
    cases = [
        ([3, 5, 0], [5, 6, 2], [0, 2, 0], [-1, 0, -1], 4),
        ([1100, 40], [1101, 44], [0, 0], [-1, -1], 2),  # grows the buffers
        ([7, 7, 7, 7], [9, 7, 8, 12], [0, 7, 4, 0], [-1, 0, 1, -1], 16),  # smaller: reuses them
        ([0, 0], [3, 1], [0, 0], [-1, -1], 1),
    ]
    for i, case in enumerate(cases):
        tokens, rows, meta, width, m, s, logical = _plan_case(3, *case, seed=i)
        outs = []
        for use_triton in (False, True):
            page_pos = torch.full((logical,), -3, dtype=torch.int64, device=DEVICE)
            args = (tokens.to(DEVICE), rows.to(DEVICE), case[-1], meta.to(DEVICE), width, m, 3, s, 77, page_pos)
            flags = torch.zeros(3 + 2 + len(case[1]), dtype=torch.int64, device=DEVICE)  # status, wrong, landed
            plan = plan_batch(*args, base=50, fill=99, flags=flags, use_triton=use_triton)
            assert flags.tolist() == plan.status.tolist() + plan.wrong.tolist() + [1]  # the landed word last
            outs.append((plan, page_pos))
        (ref, ref_pos), (got, got_pos) = outs
        _assert_same_plan(got, ref, got_pos, ref_pos, i)


@needs_triton
def test_plan_batch_reads_strided_request_rows_as_the_reference():
    """The launch reads the request rows one after another: rows that are a strided view are made
    contiguous first (they read other requests' pages, or past the table, otherwise)."""
    ps, n = 4, 2
    tokens, rows, meta, width, m, s, logical = _plan_case(n, [3, 5, 0], [5, 6, 2], [0, 2, 0], [-1, 0, -1], ps, n)
    tokens, meta = tokens.to(DEVICE), meta.to(DEVICE)
    strided = torch.stack([rows, (rows + 1) % tokens.shape[0]], 1).to(DEVICE)[:, 0]  # other rows between
    assert not strided.is_contiguous()
    outs = []
    for use_triton, r in ((False, rows.to(DEVICE)), (True, strided)):
        page_pos = torch.full((logical,), -3, dtype=torch.int64, device=DEVICE)
        plan = plan_batch(tokens, r, ps, meta, width, m, n, s, 77, page_pos, 50, 99, pad=-1, use_triton=use_triton)
        outs.append((plan, page_pos))
    (ref, ref_pos), (got, got_pos) = outs
    _assert_same_plan(got, ref, got_pos, ref_pos, "strided rows")


@needs_triton
def test_a_plan_bound_and_queued_later_is_not_changed_by_another_plan():
    """A plan bound with ``queue=False`` over one host buffer (its lengths, read in place, then its flags,
    written by the launch) is its caller's own: another plan, made between a plan's binding and its queueing
    (two pools of one process, each deferring its launch), binds its own, and each plan equals the
    reference, flags included."""
    ps, n = 16, 3
    tokens, rows, _, _, _, _, logical = _plan_case(n, [7, 7, 7, 7], [9, 7, 8, 12], [0, 7, 4, 0], [-1, 0, 1, -1], ps, 5)
    tokens, rows = tokens.to(DEVICE), rows.to(DEVICE)
    pin = DEVICE.type == "cuda"
    page_pos = {name: torch.zeros(logical, dtype=torch.int64, device=DEVICE) for name in ("ours", "theirs")}

    def bind(r, prefix, pages, name):
        b, width = len(pages), max(pages)
        m, s = sum(prefix), slots_per_rank(prefix, n)
        lengths = plan_meta_rows(pages, prefix)
        buf = torch.tensor(lengths + [0] * (n + 2 + b), dtype=torch.int64).pin_memory() if pin else None
        if buf is None:
            buf = torch.tensor(lengths + [0] * (n + 2 + b), dtype=torch.int64)
        args = (tokens, r, ps, buf[: 6 * b], width, m, n, s, 77, page_pos[name], 50, 99)
        plan, queued = plan_batch(*args, flags=buf[6 * b :], queue=False)

        def check():
            ref_pos = torch.full_like(page_pos[name], -3)
            meta = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
            ref = plan_batch_ref(tokens, r, ps, meta, width, m, n, s, 77, ref_pos, 50, 99)
            if pin:
                torch.cuda.synchronize()
            assert buf[6 * b :].tolist() == ref.flags.tolist()  # status, wrong, then the landed word
            _assert_same_plan(dataclasses.replace(plan, flags=plan.flags.to(DEVICE)), ref, page_pos[name], ref_pos, 0)

        return queued, check

    first, check = bind(rows, [7, 7, 7, 7], [9, 7, 8, 12], "ours")
    first()
    check()
    first, check = bind(rows[[3, 2, 1, 0]], [4, 7, 3, 7], [12, 8, 7, 9], "ours")  # other lengths
    theirs_launch, check_theirs = bind(rows[[1, 2]], [3, 5], [7, 8], "theirs")
    assert theirs_launch is not first
    theirs_launch()  # queued before ours, bound after it
    first()
    check_theirs()
    check()


def test_plan_batch_counts_a_wrong_hint_and_rejects_bad_meta():
    tokens, rows, meta, width, m, s, logical = _plan_case(2, [4, 4], [5, 6], [0, 3], [-1, 0], 4, 1)
    tokens[rows[1], 4:8] += 4  # request 1's second shared page is not its source's
    page_pos = torch.zeros(logical, dtype=torch.int64)
    plan = plan_batch_ref(tokens, rows, 4, meta, width, m, 2, s, 0, page_pos, 10, 0)
    assert plan.wrong.tolist() == [0, 1] and len(PLAN_META_ROWS) == meta.shape[0]
    with pytest.raises(ValueError, match="meta must be"):
        plan_batch(tokens, rows, 4, meta[:5], width, m, 2, s, 0, page_pos, 10, 0)
