"""The wired read state (``read_state.BatchReadState``, what SGLang's CP-shared pools answer the
kv-shard contract with) on 2 ranks, over plain page-major buffers written through
``PageOwnership.store_rows`` (no SGLang kernels, so no ``sgl_kernel`` either).

Batches as SGLang's backend drives them (``begin``, the chunk's staged rows, ``translate``,
the per-layer buffers, ``end``): current-reuse, a mixed prefix batch (materialized), a batch whose
requests share prefix pages (read twice, then once through the ``shared_prefix`` hint), and a batch
whose pages do not rotate owners. Every read equals the replicated bytes; the non-rotating batch
reads only inside its view and fails with ``SlotOverflowError`` as the second batch after it begins,
on every rank, and a wrong hint with ``SharedPrefixError``.

On CPU the ranks talk over gloo, with per-batch buffers or from a view arena of two buffers
(one-layer-ahead prefetch: each layer stages into and reads the buffer of its parity, the next
layer's prefix gathered at its read). On GPUs the batches run under
``torch.cuda.set_sync_debug_mode("error")``: any host sync in the wired per-batch path raises; on
2 GPUs over NCCL, and (one GPU is enough) with the arena's views pulled by the copy engines, or read
in line straight from the peers' pools.
"""

from __future__ import annotations

import pytest
import torch

PS, LAYERS, ROW, INDEX_ROW, PHYS = 16, 2, 64, 132, 9


def _rank(rank: int, world: int, device: str, prefetch: bool | None = None) -> dict:
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize_kernels import translate_locs_ref
    from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import BatchInputs, BatchReadState, PageBuffers
    from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import SlotOverflowError
    from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership

    ownership = PageOwnership(world, PS, logical_pages=world * PHYS)
    g = torch.Generator().manual_seed(11)
    logical_rows = world * PHYS * PS
    ref = [torch.randint(0, 256, (logical_rows, ROW), generator=g, dtype=torch.uint8).to(device) for _ in range(LAYERS)]
    ref_index = [
        torch.randint(0, 256, (world * PHYS, PS * INDEX_ROW), generator=g, dtype=torch.uint8).to(device)
        for _ in range(LAYERS)
    ]
    # Each rank stores the logical locs it owns (pages [N, N * PHYS): the allocator reserves [0, N)).
    locs = torch.arange(world * PS, logical_rows, device=device)
    rows, mine = ownership.store_rows(locs, rank, 0)
    pages = torch.arange(world, world * PHYS, device=device)
    latent_bufs, index_bufs = [], []
    for layer in range(LAYERS):
        flat = torch.zeros((PHYS * PS, ROW), dtype=torch.uint8, device=device)
        flat[rows[mine]] = ref[layer][locs[mine]]
        latent_bufs.append(flat.view(PHYS, PS * ROW))
        index = torch.zeros((PHYS, PS * INDEX_ROW), dtype=torch.uint8, device=device)
        owned = pages % world == rank
        index[pages[owned] // world] = ref_index[layer][pages[owned]]
        index_bufs.append(index)

    class CountingGroup(CPGroup):
        """The CP group, recording how many buffers each collective call moves."""

        calls: list[int] = []

        def all_gather_into_many(self, outs, locals_, **kwargs):
            self.calls.append(len(outs))
            return super().all_gather_into_many(outs, locals_, **kwargs)

    group = CountingGroup()
    state = BatchReadState(
        ownership,
        rank,
        world * PHYS,
        PageBuffers(ownership, rank, ROW, latent_bufs),
        PageBuffers(ownership, rank, INDEX_ROW, index_bufs),
        group,
    )
    if prefetch is not None:  # a view arena: 8 pages of prefix, 8 of chunk (twice when prefetching)
        state.attach_arena(8 * PS, 8 * PS, prefetch)

    def count_calls(views) -> None:
        """Record the copy-engine group's calls in ``group.calls`` as the CP group's are."""
        ce = views.group if views is not None else None
        if ce is not None and ce is not group and not getattr(ce, "counted", False):
            call = ce.all_gather_into_many

            def counted(outs, locals_, **kwargs):
                group.calls.append(len(outs))
                return call(outs, locals_, **kwargs)

            ce.all_gather_into_many, ce.counted = counted, True

    def run(batch_pages: list[list[int]], prefix_lens: list[int], seq_lens: list[int], shared=None) -> dict:
        """One batch; returns what the kernels would read, compared later (comparisons sync)."""
        width = max(len(p) for p in batch_pages)
        req_to_token = torch.zeros((len(batch_pages), width * PS), dtype=torch.int32)
        every = []
        for r, p in enumerate(batch_pages):  # built on the host, copied without a blocking call
            loc = (torch.tensor(p).repeat_interleave(PS) * PS + torch.arange(PS).repeat(len(p)))[: seq_lens[r]]
            req_to_token[r, : seq_lens[r]] = loc.int()
            every.append(loc.to(device, non_blocking=True))
        req_to_token = req_to_token.to(device, non_blocking=True)
        names = tuple(f"req-{r}" for r in range(len(batch_pages)))
        rows = torch.arange(len(batch_pages), device=device)
        hint = tuple(shared) if shared is not None else None
        state.begin(BatchInputs(req_to_token, rows, tuple(prefix_lens), tuple(seq_lens), names, hint))
        count_calls(state.views)
        group.calls.clear()
        # SGLang's DSA backend translates its int32 token table first (rows strided by the token table's
        # width), the batch's first device call: after the batch's fence and plan.
        table_1 = req_to_token[:, : max(seq_lens)]
        rows_1 = state.translate(table_1)
        new = torch.cat([e[q:] for e, q in zip(every, prefix_lens)])
        out = {"mode": state.mode, "every": every, "latent": [], "index": [], "counters": state.counters}
        out["view_sets"] = state.views.view_sets if state.mode == "materialized" else 0
        all_locs = torch.cat(every)
        table = all_locs[::PS] // PS
        # The current chunk's pages: whole new pages past each page-aligned prefix.
        new_pages = torch.cat([e[q::PS] // PS for e, q in zip(every, prefix_lens)])
        for layer in range(LAYERS):  # layer by layer: a layer's buffers are reused by the next
            # The pool's write path stages the chunk it stores, in every mode: never gathered.
            stage_latent, stage_index = state.stage(layer)
            stage_latent[state.translate(new)] = ref[layer][new]
            if state.mode != "current":
                stage_index[state.translate_pages(new_pages)] = ref_index[layer][new_pages]
            out["latent"].append((state.latent_rows(layer).clone(), state.translate(all_locs)))
            if state.mode != "current":
                out["index"].append((state.index_pages(layer).clone(), state.translate_pages(table), table))
        out["collectives"] = list(group.calls)
        out["table_1"] = (table_1, rows_1, translate_locs_ref(state.page_pos, table_1, PS))
        return out

    def check(out: dict) -> dict:
        every = torch.cat(out["every"])
        c = out["counters"]
        res = {"mode": out["mode"], "received": c.bytes_received}
        res["staged"], res["view_pages"] = c.pages_staged, c.view_pages
        res["collectives"], res["view_sets"] = out["collectives"], out["view_sets"]
        res["latent_exact"] = [
            bool(torch.equal(buf[r], ref[layer][every])) for layer, (buf, r) in enumerate(out["latent"])
        ]
        res["inside"] = all(int(r.max()) < buf.shape[0] and int(r.min()) >= 0 for buf, r in out["latent"])
        res["index_exact"] = [
            bool(torch.equal(buf[p], ref_index[layer][t])) for layer, (buf, p, t) in enumerate(out["index"])
        ]
        # The token table's translation: the reference's over the batch's page map, and each request's rows
        # those its locs translate to one by one.
        table_1, rows_1, ref_rows = out["table_1"]
        lens = [len(e) for e in out["every"]]
        starts = [sum(lens[:r]) for r in range(len(lens))]
        rows = out["latent"][0][1]
        res["table_exact"] = rows_1.dtype == torch.int32 and bool(torch.equal(rows_1, ref_rows))
        res["table_exact"] &= all(
            bool(torch.equal(rows_1[r, :n].long(), rows[s : s + n].long()))
            for r, (s, n) in enumerate(zip(starts, lens))
        )
        # Page by page (for the overflow batch): which of the batch's pages read their own bytes.
        buf, r = out["latent"][0]
        res["pages_exact"] = [
            bool(torch.equal(buf[r[j : j + PS]], ref[0][every[j : j + PS]])) for j in range(0, len(every), PS)
        ]
        return res

    def end_batch() -> str | None:
        try:
            state.end()
        except SlotOverflowError as err:
            return str(err)
        return None

    batches = [
        ([[2, 3, 4], [5, 6]], [0, 0], [40, 20]),  # current-reuse
        ([[2, 3, 4, 7], [8, 9]], [3 * PS, 0], [3 * PS + 5, 2 * PS]),  # mixed: materialized
        # prefix pages 2 and 4 both on owner 0, whose block holds S = 1
        ([[2, 4, 6, 8], [10, 11]], [2 * PS, 0], [4 * PS, 2 * PS]),
    ]
    # A batch whose second request reads the first one's first 2 prefix pages (one radix node).
    shared_batch = ([[2, 3, 4, 7], [2, 3, 8]], [3 * PS, 2 * PS], [4 * PS, 2 * PS + 10])
    results, errors = [], []
    if device == "cuda":
        for args in batches[:2]:  # warm-up: Triton compiles, communicators, the copy engines' arenas
            run(*args)
            end_batch()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        # The overflowing batch, then two more: its flag is acted on when the second of them begins.
        for args, shared in [(batches[0], None), (batches[1], None)] + [
            (shared_batch, None),  # each request's own slots
            (shared_batch, [(-1, 0), (0, 2)]),  # the shared pages once
            (batches[2], None),
            (batches[0], None),
            (batches[1], None),
        ]:
            try:
                results.append(run(*args, shared=shared))
            except SlotOverflowError as err:
                errors.append(f"begin: {err}")
                break
            errors.append(end_batch())
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    wrong_hint = None
    if device == "cpu":  # a shared_prefix hint that is wrong: debug mode's translation check, then the flag
        import os

        from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import SharedPrefixError

        os.environ["SGLANG_DEBUG_CP_SHARED_KV"] = "1"
        try:
            run([[2, 3, 4, 7], [5, 6, 8]], [3 * PS, 2 * PS], [4 * PS, 2 * PS + 10], shared=[(-1, 0), (0, 2)])
        except AssertionError as err:
            wrong_hint = [str(err)]
        finally:
            os.environ.pop("SGLANG_DEBUG_CP_SHARED_KV")
        try:
            state.check_overflow(wait=True)
        except SharedPrefixError as err:
            wrong_hint.append(str(err))
    fences = getattr(state.views.group, "fences", None) if state.views is not None else None
    return {"batches": [check(o) for o in results], "errors": errors, "wrong_hint": wrong_hint, "fences": fences}


def _check_results(results: list[dict], prefetch: bool = False, pulled: bool = False) -> None:
    for res in results:
        current, mixed, dup, once, skewed, after = res["batches"]
        # Prefetching: every materialized batch here fits the arena twice, its layers alternate sets.
        assert [b["view_sets"] for b in res["batches"]] == [0] + [2 if prefetch else 1] * 4 + [0], res["batches"]
        assert current["mode"] == "current" and all(current["latent_exact"]) and current["inside"], current
        assert mixed["mode"] == "materialized" and all(mixed["latent_exact"]) and all(mixed["index_exact"]), mixed
        assert mixed["inside"], mixed
        # The mixed batch receives its prefix pages only (2, 3, 4: S = 2 per owner, view 4 pages),
        # its 3 current pages (7, 8, 9) are staged; per layer, latent and indexer pages together.
        assert (mixed["view_pages"], mixed["staged"]) == (4, 3), mixed
        assert mixed["received"] == LAYERS * 2 * PS * (ROW + INDEX_ROW), mixed
        # One collective call per layer moves the latent and indexer views together (one NCCL
        # group on GPUs); current-reuse calls none. Views read straight from the peers' mapped pools
        # call none either.
        assert current["collectives"] == [] and mixed["collectives"] == ([] if pulled else [2] * LAYERS), mixed
        # Non-rotating: inside the view; prefix pages 2 and 4 both on owner 0, whose block holds 1:
        # page 4 reads a trash slot. The current pages 6, 8, 10, 11 are staged, never gathered: exact.
        assert skewed["inside"], skewed
        assert skewed["pages_exact"] == [True, False, True, True, True, True], skewed
        # The batch after it runs and reads exact bytes; the one after that fails as it begins, on every
        # rank (no rank left in a collective the others never join).
        assert after["mode"] == "current" and all(after["latent_exact"]) and after["inside"], after
        assert res["errors"][:6] == [None] * 6 and len(res["errors"]) == 7, res["errors"]
        # Every batch's token table, translated first, is exact (the skewed batch's too: its wrong pages
        # read the trash slot through the same page map).
        assert all(b["table_exact"] for b in res["batches"]), res["batches"]
        # Shared prefix read once: the same bytes from a view of 2 slots per owner instead of 3.
        for b in (dup, once):
            assert b["mode"] == "materialized" and all(b["latent_exact"]) and all(b["index_exact"]), b
            assert b["inside"] and b["staged"] == 2, b
        assert (dup["view_pages"], once["view_pages"]) == (6, 4), (dup, once)
        page = PS * (ROW + INDEX_ROW)
        assert (dup["received"], once["received"]) == (LAYERS * 3 * page, LAYERS * 2 * page), (dup, once)
        assert res["errors"][6] == (
            "begin: --enable-cp-shared-kv: slot overflow: the batch of requests [req-0, req-1] reads [2, 0] page "
            "positions from owners 0..1, more than the 1 pages of an owner's block (the pages of a request do "
            "not rotate owners); those positions read the trash page, so the batch fails"
        ), res["errors"]


@pytest.mark.multirank
@pytest.mark.parametrize("prefetch", [None, True], ids=["per-batch-buffers", "arena-prefetch"])
def test_read_state_on_gloo_ranks_is_exact_and_fails_an_overflowing_batch(prefetch):
    from reference.spawn import spawn_ranks

    results = spawn_ranks(_rank, 2, "cpu", prefetch, timeout_s=300)
    _check_results(results, prefetch=bool(prefetch))
    for res in results:
        assert res["wrong_hint"] == [
            "request 1: a page maps outside the read buffer (6 pages)",
            "--enable-cp-shared-kv: wrong shared-prefix hint: in the batch of requests [req-0, req-1], the pages "
            "the hint shares are not the same logical pages for req-1 (its first 2 of 2 prefix pages as req-0's); "
            "they were read from other slots, so the batch fails",
        ], res["wrong_hint"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_read_state_on_gpus_never_syncs_the_host():
    from reference.spawn import spawn_ranks

    _check_results(spawn_ranks(_rank, 2, "cuda", backend="nccl", timeout_s=300))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_state_with_copy_engines_and_prefetch_never_syncs_the_host():
    """Both ranks on one GPU when there is only one: the copy engines pull across processes all the same."""
    from reference.spawn import spawn_ranks

    _check_results(spawn_ranks(_rank, 2, "cuda", True, timeout_s=300), prefetch=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_state_reading_the_peers_pools_in_line_never_syncs_the_host():
    """An arena without prefetch over the copy engines' group: each layer's view is read straight from the
    owners' pools (mapped by CUDA IPC; both ranks on one GPU when there is only one), no all-gather."""
    from reference.spawn import spawn_ranks

    results = spawn_ranks(_rank, 2, "cuda", False, timeout_s=300)
    _check_results(results, pulled=True)
    # Every batch after the first views were built began behind a fence (copy engines reading the peers' pools).
    assert all(res["fences"] >= 4 for res in results), [res["fences"] for res in results]
