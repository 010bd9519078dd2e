"""SGLang's own MLA / DSA pool classes, sharded over CP ranks, on CPU (no hooks involved).

- Write path: N rank pools and one replicated stock pool receive the same chunks through
  SGLang's write entry points (its quantizers and Triton scatter, interpreted on CPU). Every
  rank's storage, trash page aside, is bit-exact with the stock bytes of the locs it owns placed at
  their physical rows (``PageOwnership.phys_row``) and zeros elsewhere, so exactly the owned rows
  were written.
- Read path on N spawned gloo ranks (SGLang's two per-token writers replaced by
  ``reference.sglang_writers``' twins): the kv-shard contract SGLang's DSA backend and indexer call
  (``begin_shard_extend``, ``translate_loc_to_scratch``, ``get_key_buffer``,
  ``get_index_k_scale_buffer`` with logical pages; ``get_mla_kv_buffer`` for plain MLA's
  chunked-prefix read) returns exactly the replicated pool's bytes,
  for a current-only batch (current-reuse: nothing moved) and a mixed prefix batch
  (materialized: pages gathered from their owners), with pages drawn by SGLang's own
  owner-rotating allocator.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="SGLang's pool writers are Triton kernels: CPU needs TRITON_INTERPRET=1",
    ),
]

PS = 64  # SGLang's DSA pool requires 64-token pages


class _Layer:
    def __init__(self, layer_id: int):
        self.layer_id = layer_id


def _dsa_kwargs(layers: int, fp8: bool = True) -> dict:
    """fp8: the packed 656-byte rows (SGLang's quantizer); else bf16 576-value rows."""
    return dict(
        page_size=PS,
        kv_lora_rank=512,
        dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=656 if fp8 else 576,
    )


def _mla_kwargs(layers: int) -> dict:
    return dict(
        page_size=PS,
        dtype=torch.bfloat16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def _no_dcp():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)


def _chunk(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    nope = torch.randn(t, 1, 512, generator=g).to(torch.bfloat16)
    rope = torch.randn(t, 1, 64, generator=g).to(torch.bfloat16)
    k = (torch.randn(t, 128, generator=g) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(t, 1, generator=g) + 0.5
    return nope, rope, k, scale


def _index_bytes(pool, layer: int, locs: torch.Tensor):
    """(k uint8 [T, 128], scale float32 [T]) of ``locs`` in a stock pool's page-major indexer buffer."""
    buf = pool.index_k_with_scale_buffer[layer]
    page, off = locs // PS, locs % PS
    k = buf[:, : PS * 128].reshape(-1, PS, 128)[page, off]
    scale = buf[:, PS * 128 :].reshape(-1, PS, 4)[page, off].contiguous().view(torch.float32).reshape(-1)
    return k, scale


@pytest.mark.parametrize("kind", ["dsa_fp8", "mla_bf16"])
def test_sglang_pools_store_exactly_the_owned_rows(kind):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool

    from reference.kv_formats import index_page_views
    from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import (
        CPSharedDSATokenToKVPool,
        CPSharedMLATokenToKVPool,
    )

    n, size, layers = 3, 6 * PS, 1
    dsa = kind == "dsa_fp8"
    stock_cls, ours_cls = (
        (DSATokenToKVPool, CPSharedDSATokenToKVPool) if dsa else (MLATokenToKVPool, CPSharedMLATokenToKVPool)
    )
    kwargs = _dsa_kwargs(layers) if dsa else _mla_kwargs(layers)
    with _no_dcp():
        pools = [ours_cls(size, cp_rank=r, cp_size=n, **kwargs) for r in range(n)]
        phys = pools[0].phys_pages
        replicated = stock_cls(n * phys * PS - PS, **kwargs)  # the same logical space, unsharded
        if not dsa:
            replicated.dcp_replicated = True
        assert all(isinstance(p, stock_cls) for p in pools)
        # Two requests' worth of logical pages past the reserved [0, n), ragged last pages.
        locs = torch.cat([torch.arange(4 * PS, 5 * PS + 21), torch.arange(12 * PS, 12 * PS + 40)])
        nope, rope, k, scale = _chunk(len(locs), seed=1)
        for pool in pools + [replicated]:
            pool.set_mla_kv_buffer(_Layer(0), locs, nope, rope)
            if dsa:
                pool.set_index_k_scale_buffer(0, locs, k, scale)

    ownership = PageOwnership(n, PS)
    row_bytes = 656 if dsa else 1152
    stock_rows = replicated.kv_buffer[0][locs].view(torch.uint8).reshape(len(locs), row_bytes)
    for rank, pool in enumerate(pools):
        assert isinstance(pool, stock_cls) and pool.kv_buffer[0].shape[0] == size + PS  # stock shape per rank
        owned = ownership.loc_owner(locs) == rank
        assert 0 < int(owned.sum()) < len(locs)
        at = ownership.phys_row(locs[owned])
        expected = torch.zeros(phys * PS, row_bytes, dtype=torch.uint8)
        expected[at] = stock_rows[owned]
        ours = pool.kv_buffer[0].view(torch.uint8).reshape(-1, row_bytes)
        # Page 0 is the trash page: it holds whichever foreign row landed last.
        assert torch.equal(ours[PS:], expected[PS:]), f"rank {rank} latent"
        if dsa:
            expected_index = torch.zeros(phys, PS * 132, dtype=torch.uint8)
            k_part, scale_part = index_page_views(expected_index, PS)
            k_bytes, scales = _index_bytes(replicated, 0, locs[owned])
            k_part[at // PS, at % PS], scale_part[at // PS, at % PS] = k_bytes, scales
            assert torch.equal(pool.index_k_with_scale_buffer[0][1:], expected_index[1:]), f"rank {rank} index"


def test_trash_page_and_bad_configuration():
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedMLATokenToKVPool

    with _no_dcp():
        pool = CPSharedMLATokenToKVPool(4 * PS, cp_rank=1, cp_size=2, **_mla_kwargs(1))
        locs = torch.tensor([2 * PS + 5, 3 * PS + 5, 5 * PS + 63])  # owners 0, 1, 1
        assert pool.store_rows(locs).tolist() == [5, 1 * PS + 5, 2 * PS + 63]
        for bad in (dict(cp_rank=2, cp_size=2), dict(cp_rank=0, cp_size=1)):
            with pytest.raises(ValueError, match="cp_"):
                CPSharedMLATokenToKVPool(4 * PS, **bad, **_mla_kwargs(1))
    with pytest.raises(RuntimeError, match="outside a sharded extend"):
        pool.translate_loc_to_scratch(locs)


# ---------------------------------------------------------------------------------------------
# read path on spawned gloo ranks
# ---------------------------------------------------------------------------------------------


def _alloc(allocator, prefix_len: int, seq_len: int, last_loc: int, base):
    t = torch.tensor
    bases = [base]
    out = allocator.alloc_extend(
        t([prefix_len]),
        t([prefix_len]),
        t([seq_len]),
        t([seq_len]),
        t([last_loc]),
        seq_len - prefix_len,
        rotation_bases=bases,
    )
    assert out is not None
    return out, bases[0]


def _rank_read_path(rank: int, world: int, cfg: dict) -> dict:
    """The three batch kinds through both sharded pools and their stock twins, on one CP rank.

    ``cfg``: ``debug`` (the syncing plan / translation / stored-row checks on every call), ``fp8``
    (the DSA pool's packed 656-byte rows, else bf16 576-value rows), ``mla_ps`` (the plain MLA
    pool's page size; SGLang's DSA pool needs 64) and ``arena`` (the pools read from a view arena
    allocated once, as a server builds them).
    """
    if cfg["debug"]:
        os.environ["SGLANG_DEBUG_CP_SHARED_KV"] = "1"
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool

    from reference.sglang_writers import use_torch_writers
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool, CPSharedMLATokenToKVPool

    use_torch_writers()  # the write path's test runs SGLang's kernels; here they would be most of the run
    size, layers, mla_ps = 12 * PS, 2, cfg["mla_ps"]
    kwargs = _dsa_kwargs(layers, fp8=cfg["fp8"])
    mla_kwargs = dict(_mla_kwargs(layers), page_size=mla_ps)
    group = CPGroup()
    with _no_dcp():
        pool = CPSharedDSATokenToKVPool(size, cp_rank=rank, cp_size=world, cp_group=group, **kwargs)
        replicated = DSATokenToKVPool(world * pool.phys_pages * PS - PS, **kwargs)
        # Plain MLA (no indexer) follows the same batches: the FA3 side of the contract. Its pages
        # may be smaller than the allocator's 64: a 64-token page's sub-pages still rotate owners.
        mla = CPSharedMLATokenToKVPool(size + PS, cp_rank=rank, cp_size=world, cp_group=group, **mla_kwargs)
        mla_replicated = MLATokenToKVPool(world * (size + 2 * PS), **mla_kwargs)
        for p in (replicated, mla_replicated):
            p.dcp_replicated = True
    arenas = {}
    if cfg.get("arena"):
        # Room for the history batch: N * S <= N * (2 + 2 + 1) prefix pages, 5 staged pages, a trash page.
        for p in (pool, mla):
            p.attach_view_arena(_arena_spec(rank, world, p.page_size, prefix=5 * world * PS, chunk=6 * PS))
            arenas[id(p)] = [t.data_ptr() for t in p.read.arena.values()]
    allocator = PageInterleavePoolAllocator(
        size, physical_page_size=PS, shard_size=world, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=True
    )
    req_to_token = torch.zeros((8, 8 * PS), dtype=torch.int32)
    out: dict = {"checks": 0, "row_bytes": pool.row_bytes, "mla_row_bytes": mla.row_bytes}

    def run_batch(reqs, prefix_lens, seq_lens, seed):
        """One extend batch the way SGLang's DSA backend drives the pool, both pools side by side."""
        req_idx = torch.tensor(reqs)
        with _no_dcp():
            pool.begin_shard_extend(req_to_token, req_idx, prefix_lens, seq_lens)
            mla.begin_shard_extend(req_to_token, req_idx, prefix_lens, seq_lens)
            new = torch.cat([req_to_token[r, p:s].long() for r, p, s in zip(reqs, prefix_lens, seq_lens)])
            every = torch.cat([req_to_token[r, :s].long() for r, s in zip(reqs, seq_lens)])
            for layer in range(layers):
                nope, rope, k, scale = _chunk(len(new), seed=seed + layer)
                for p in (pool, replicated):  # the indexer writes and reads first, then the latent
                    p.set_index_k_scale_buffer(layer, new, k, scale)
                pages = req_to_token[req_idx, : max(seq_lens) : PS].long() // PS
                lens = torch.tensor(seq_lens)
                got = pool.get_index_k_scale_buffer(layer, lens, pages, sum(seq_lens), max(seq_lens))
                want = replicated.get_index_k_scale_buffer(layer, lens, pages, sum(seq_lens), max(seq_lens))
                assert all(torch.equal(a, b) for a, b in zip(got, want)), f"rank {rank} layer {layer} indexer keys"
                for p in (pool, replicated, mla, mla_replicated):
                    p.set_mla_kv_buffer(_Layer(layer), new, nope, rope)
                mla_rows = mla.translate_loc_to_scratch(every)
                assert torch.equal(mla.get_key_buffer(layer)[mla_rows], mla_replicated.get_key_buffer(layer)[every])
                got_mla = mla.get_mla_kv_buffer(_Layer(layer), every)  # the chunked-prefix MHA read
                want_mla = mla_replicated.get_mla_kv_buffer(_Layer(layer), every)
                assert all(torch.equal(a, b) for a, b in zip(got_mla, want_mla)), f"rank {rank} MLA rows"
                rows = pool.translate_loc_to_scratch(every)
                got_rows = pool.get_key_buffer(layer)[rows].view(torch.uint8)  # fp8 view: compare bytes (NaN codes)
                want_rows = replicated.get_key_buffer(layer)[every].view(torch.uint8)
                assert torch.equal(got_rows, want_rows), f"rank {rank} layer {layer} latent rows"
                table = req_to_token[req_idx, : max(seq_lens)]
                assert pool.translate_loc_to_scratch(table).dtype == table.dtype
                out["checks"] += 2
            mode, counters, mla_counters = pool.read.mode, pool.read.counters, mla.read.counters
            assert mla.read.mode == mode
            for p in (pool, mla) if arenas else ():  # every buffer read is the arena, allocated once
                bufs = [p.read.stage_latent] + ([p.read.stage_index] if p is pool else [])
                assert [t.data_ptr() for t in bufs] == arenas[id(p)], f"rank {rank}: a read buffer outside the arena"
                assert p.read.latent_rows(0).data_ptr() == arenas[id(p)][0]
            pool.end_shard_extend()
            mla.end_shard_extend()
        return mode, counters, mla_counters

    def record(name, mode, counters, mla_counters):
        keep = ("kind", "view_pages", "pages_staged", "bytes_received")
        out[name] = (mode, {k: getattr(counters, k) for k in keep}, {k: getattr(mla_counters, k) for k in keep})

    def fill(row, locs, start=0):
        req_to_token[row, start : start + len(locs)] = locs.int()

    # Batch 1 (current): two fresh requests, no prefix -> current-reuse.
    loc_a, base_a = _alloc(allocator, 0, 3 * PS + 10, 0, None)
    loc_b, base_b = _alloc(allocator, 0, 2 * PS, 0, None)
    fill(0, loc_a)
    fill(1, loc_b)
    record("current", *run_batch([0, 1], [0, 0], [len(loc_a), len(loc_b)], seed=10))

    # Batch 2 (mixed): request 2 reuses request 0's first 3 pages as a cached prefix; request 3 is fresh.
    prefix = 3 * PS
    req_to_token[2, :prefix] = req_to_token[0, :prefix]
    loc_c, _ = _alloc(allocator, prefix, prefix + PS + 7, int(req_to_token[0, prefix - 1]), base_a)
    fill(2, loc_c, prefix)
    loc_d, _ = _alloc(allocator, 0, PS + 1, 0, None)
    fill(3, loc_d)
    record("mixed", *run_batch([2, 3], [prefix, 0], [prefix + len(loc_c), len(loc_d)], seed=20))

    # Batch 3 (history): requests 4 and 5 both read request 0's 3 pages (one radix node), request 6
    # request 1's 2 pages; each computes a chunk of new pages.
    lens = []
    for row, (src, pre, base, new_len) in enumerate(
        [(0, 3 * PS, base_a, PS + 3), (0, 3 * PS, base_a, 20), (1, 2 * PS, base_b, 2 * PS)], start=4
    ):
        req_to_token[row, :pre] = req_to_token[src, :pre]
        loc, _ = _alloc(allocator, pre, pre + new_len, int(req_to_token[src, pre - 1]), base)
        fill(row, loc, pre)
        lens.append((pre, pre + new_len))
    record("history", *run_batch([4, 5, 6], [p for p, _ in lens], [n for _, n in lens], seed=30))
    out["history_lens"] = lens
    owners = {int(p) % world for p in torch.cat([loc_a, loc_b, loc_c, loc_d]) // PS}
    out["owners"] = sorted(owners)
    return out


def _arena_spec(rank: int, world: int, ps: int, prefix: int, chunk: int):
    from sglang.srt.mem_cache.page_interleave import PageShardSpec

    return PageShardSpec(shard_rank=rank, shard_size=world, page_size=ps, max_prefix_tokens=prefix, chunk_tokens=chunk)


def _expected_received(world: int, prefix_pages: list[int], page_bytes: int, layers: int = 2) -> int:
    """Bytes a rank receives for a view of exactly these prefixes: ``(N - 1) * S`` pages per layer."""
    s = sum(-(-p // world) for p in prefix_pages)
    return layers * (world - 1) * s * page_bytes


@pytest.mark.multirank
@pytest.mark.parametrize(
    "world,fp8,mla_ps,debug,arena",
    [
        (2, False, 64, False, False),
        (2, True, 16, False, False),
        (3, False, 16, True, False),
        (3, True, 64, False, False),
        (4, False, 16, False, False),
        (2, False, 16, False, True),
    ],
    ids=["N2-bf16", "N2-fp8-mla16", "N3-bf16-mla16-debug", "N3-fp8", "N4-bf16-mla16", "N2-bf16-mla16-arena"],
)
def test_read_contract_matches_replicated_pool(world, fp8, mla_ps, debug, arena):
    """Current, mixed and history batches read the stock pool's bytes, the current chunk staged
    locally: a batch receives exactly its prefix pages (latent and indexer), nothing of its chunk."""
    from reference.spawn import spawn_ranks

    cfg = dict(fp8=fp8, mla_ps=mla_ps, debug=debug, arena=arena)
    results = spawn_ranks(_rank_read_path, world, cfg, timeout_s=480)
    for res in results:
        assert res["checks"] == 12, res
        dsa_page = PS * (res["row_bytes"] + 132)
        mla_page = mla_ps * res["mla_row_bytes"]
        sub = PS // mla_ps  # MLA pages per 64-token page
        mode, dsa, plain = res["current"]
        assert mode == "current" and dsa["kind"] == "current" and dsa["bytes_received"] == 0, res
        mode, dsa, plain = res["mixed"]
        assert (mode, dsa["kind"], plain["kind"]) == ("materialized", "mixed", "mixed"), res
        # Prefix: request 2's 3 pages; staged: its 2 new pages and request 3's 2.
        assert dsa["view_pages"] == world * -(-3 // world) and dsa["pages_staged"] == 4, res
        assert dsa["bytes_received"] == _expected_received(world, [3], dsa_page), res
        assert plain["pages_staged"] == -(-(PS + 7) // mla_ps) + -(-(PS + 1) // mla_ps), res
        assert plain["bytes_received"] == _expected_received(world, [3 * sub], mla_page), res
        mode, dsa, plain = res["history"]
        assert (mode, dsa["kind"]) == ("materialized", "history"), res
        # Exactly the prefix pages (3 + 3 + 2, the shared prefix once per request), nothing else.
        assert dsa["bytes_received"] == _expected_received(world, [3, 3, 2], dsa_page), res
        assert plain["bytes_received"] == _expected_received(world, [3 * sub, 3 * sub, 2 * sub], mla_page), res
        assert dsa["pages_staged"] == sum(-(-(n - p) // PS) for p, n in res["history_lens"]), res
        assert res["owners"] == list(range(world)), res  # every rank owned some of the pages read


def test_view_arena_is_allocated_once_and_refuses_a_batch_past_it():
    """The arena is the read buffer of every batch; a batch that would not fit raises before anything
    is allocated or written (SGLang's admission, sized by the same spec, never lets one through)."""
    from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import ViewArenaError
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    with _no_dcp():
        pool = CPSharedDSATokenToKVPool(8 * PS, cp_rank=0, cp_size=2, **_dsa_kwargs(1, fp8=False))
    nbytes = pool.attach_view_arena(_arena_spec(0, 2, PS, prefix=2 * PS, chunk=2 * PS))
    assert nbytes == (2 * PS + 2 * PS + PS) * (pool.row_bytes + 132)  # SGLang's scratch_rows x token bytes
    ptrs = [t.data_ptr() for t in pool.read.arena.values()]
    req_to_token = torch.arange(8 * PS, dtype=torch.int32).reshape(2, 4 * PS) + 2 * PS
    with _no_dcp():
        pool.begin_shard_extend(req_to_token, torch.tensor([0]), [0], [2 * PS - 3])  # 2 pages + trash: fits
        assert [pool.read.stage_latent.data_ptr(), pool.read.stage_index.data_ptr()] == ptrs
        pool.end_shard_extend()
        with pytest.raises(ViewArenaError, match="needs 6 pages, more than the view arena's 5"):
            pool.begin_shard_extend(req_to_token, torch.tensor([0, 1]), [0, 0], [3 * PS, 2 * PS])
    assert pool.read.mode is None and pool.read.stage_latent is None  # nothing staged for the refused batch
    with pytest.raises(ValueError, match="does not match the pool"):
        pool.attach_view_arena(_arena_spec(0, 2, 16, prefix=2 * PS, chunk=2 * PS))


def test_shared_prefix_from_radix_paths():
    """Which requests of a batch share prefix pages, from their radix paths (host only)."""
    from sglang_cp_shared_kv.srt.sglang_wiring.pool_hooks import shared_prefix_from_paths

    # A tree: a (a cached system prompt, 2 pages) with two continuations b (1 page) and c (2 pages),
    # and d (another conversation, 3 pages). Per node on a path: its identity and its depth in tokens.
    a, b, c, d = ("a", 2 * PS), ("b", 3 * PS), ("c", 4 * PS), ("d", 3 * PS)
    paths = [[a, b], [a, c], [a], [], [d], [a, c]]
    got = shared_prefix_from_paths(paths, [3 * PS, 4 * PS, 2 * PS, 0, 3 * PS, 3 * PS], PS)
    # c shares a's 2 pages with b; a (alone) too; root: no prefix; d: nothing; the second c shares
    # all of its 3-page prefix with the first c (its prefix ends inside c).
    assert got == [(-1, 0), (0, 2), (0, 2), (-1, 0), (-1, 0), (1, 3)]
