"""The decode CP server's step (``decode_server``) over SGLang's DSA pool and DCP allocator, on 2-4 gloo ranks.

Each rank builds the CP-shared pool of a decode CP server (its ranks, group and indexer rows as the server
reads them: ``server_group``, ``dcp_group``) under SGLang's own DCP allocator, ``PagedTokenToKVPoolAllocator``
of ``64 * N``-token pages, and ``check_built_pools`` accepts the pair (and refuses SGLang's allocator at
the prefill's page size). Requests get their slots from that allocator; SGLang's writers fill the pool and
a replicated ``DSATokenToKVPool``. Per layer, as the decode's indexer reads it (``indexer_page_table``),
the top-k (``indexer_topk``) selects what SGLang's torch top-k selects over the replicated scores, and
``forward_decode`` (FlashMLA's sparse kernel stood in by the project's oracle) gives each rank's
``(out, lse)``, which SGLang's DCP merge kernel (2 and 4 ranks; 3: the LSE merge in plain torch) turns
into sparse MLA over the replicated rows. Debug mode is on: the step's own checks (``decode_cp_checks``)
pass, and fail on a top-k or an output that is not the replicated one.
"""

from __future__ import annotations

import functools
import os
import sys
import types

import pytest
import torch
from test_plugin_decode_cp import HEADS, INDEX_HEADS, LAYERS, LENS, PS, SM_SCALE, TOPK, needs_interpreter

pytestmark = [pytest.mark.sglang, pytest.mark.multirank]
SLOTS = 1024  # rows per rank


def _rank(rank: int, world: int, seed: int, model_dir: str) -> dict:
    from types import SimpleNamespace

    from sglang.kernels.ops.attention.dcp_kernels import correct_attn_out
    from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    # The plugin as SGLang loads it, and a decode server's arguments with the flag, as its scheduler publishes them.
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_disagg, get_parallel, publish
    from sglang.srt.server_args import prepare_server_args
    from test_plugin_decode_cp import _same_selection
    from test_plugin_sharded_pool import _chunk, _dsa_kwargs, _Layer

    from demo.sglang_parts import decode_argv
    from reference.dsa_reference import flash_mla_sparse_fwd_ref, indexer_scores, read_index_k, sparse_mla
    from sglang_cp_shared_kv.srt.layers.attention.nsa import decode_cp_checks
    from sglang_cp_shared_kv.srt.layers.attention.nsa.debug_checks import CPSharedKVDebugError
    from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import (
        for_dcp_merge,
        merge_by_lse,
        owned_loc_rows,
        owned_scores,
    )
    from sglang_cp_shared_kv.srt.sglang_wiring import decode_server
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool, server_group
    from sglang_cp_shared_kv.srt.sglang_wiring.startup_checks import CPSharedKVStartupError

    os.environ["SGLANG_PLUGINS"] = "cp_shared_kv"
    load_plugins()
    server_args = prepare_server_args(decode_argv(model_dir, PS) + ["--enable-cp-shared-kv"])
    server_args.resolve_once()
    publish(server_args, role="scheduler")
    assert get_disagg().disaggregation_mode == "decode"
    module = types.ModuleType("sglang.kernels.ops.attention.flash_mla_interface")
    module.flash_mla_sparse_fwd = flash_mla_sparse_fwd_ref
    sys.modules[module.__name__] = module
    g = torch.Generator().manual_seed(seed)
    kwargs = _dsa_kwargs(LAYERS, fp8=False)
    dcp = dict(attn_dcp_size=world, attn_dcp_rank=rank, dcp_enabled=True, dcp_group=SimpleNamespace(device_group=None))
    out: dict = {}
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        replicated = DSATokenToKVPool(SLOTS * world, **kwargs)
        replicated.dcp_replicated = True

    get_parallel().override_permanently(**dcp)  # this rank: a decode CP server's
    cp_rank, cp_size, _ = server_group()
    pool = CPSharedDSATokenToKVPool(SLOTS, **kwargs)  # the ranks and group a decode server reads
    out["server_group"] = [cp_rank, cp_size, pool.shard_rank, pool.shard_size]
    out["index_rows"] = pool.index_buf_size
    out["is_decode_pool"] = decode_server.is_decode_pool(pool)
    group = decode_server.dcp_group()
    allocator = PagedTokenToKVPoolAllocator(
        SLOTS * world, page_size=PS * world, dtype=kwargs["dtype"], device="cpu", kvcache=pool, need_sort=True
    )
    out["log"] = decode_server.check_built_pools(pool, allocator)
    narrow = PagedTokenToKVPoolAllocator(SLOTS, page_size=PS, dtype=kwargs["dtype"], device="cpu", kvcache=pool,
                                         need_sort=True)  # fmt: skip
    try:
        decode_server.check_built_pools(pool, narrow)
        out["narrow_refused"] = False
    except CPSharedKVStartupError:
        out["narrow_refused"] = True
    # Each request's slots from SGLang's DCP allocator (whole widened pages), as a decode server's.
    slots = [allocator.alloc(-(-n // (PS * world)) * PS * world)[:n] for n in LENS]
    width = max(-(-n // PS) for n in LENS) * PS
    table = torch.zeros(len(LENS), width, dtype=torch.int32)  # req_to_token: each request's token locs
    for i, s in enumerate(slots):
        table[i, : len(s)] = s.int()
    locs = torch.cat(slots)
    logical_pages = table[:, ::PS] // PS  # SGLang's page table of 64-token pages (real_page_table)
    lengths = torch.tensor(LENS, dtype=torch.int32)
    visible = torch.arange(width) < lengths.unsqueeze(1)
    backend = SimpleNamespace(
        token_to_kv_pool=pool,
        forward_metadata=SimpleNamespace(page_table_1=table),
        dsa_decode_impl="flashmla_sparse",
        device_sm_major=9,
        _pad_topk_indices=lambda t, n: t,
    )
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE)
    out.update(topk_equal=[], merge_err=[], checks_pass=[], bad_topk_caught=[], bad_out_caught=[])
    for layer in range(LAYERS):
        nope, rope, k, scale = _chunk(len(locs), seed + layer)
        for p in (pool, replicated):
            p.set_index_k_scale_buffer(layer, locs, k, scale)
            p.set_mla_kv_buffer(_Layer(layer), locs, nope, rope)
        q_index = torch.randn(len(LENS), INDEX_HEADS, 128, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
        q_scale = torch.rand(len(LENS), INDEX_HEADS, generator=g) + 0.5
        weights = torch.randn(len(LENS), INDEX_HEADS, generator=g)
        q = torch.randn(len(LENS), HEADS, 576, generator=g).to(torch.bfloat16)

        # The replicated pool: every position's key, SGLang's torch top-k, sparse MLA over the rows.
        k_all, s_all = read_index_k(replicated.index_k_with_scale_buffer[layer], PS, table.long())
        scores = torch.where(visible, indexer_scores(q_index, q_scale, weights, k_all, s_all), -torch.inf)
        want = DSATopKBackend.TORCH.topk_func(scores.clone(), lengths, TOPK)
        kv = replicated.get_key_buffer(layer)

        # This rank, as the decode server runs it (debug mode: each call checks itself).
        pages = decode_server.indexer_page_table(pool, logical_pages)
        paged = pages.long()[:, torch.arange(width) // PS] * PS + torch.arange(width) % PS
        k_read, s_read = read_index_k(pool.index_k_with_scale_buffer[layer], PS, paged)
        logits = indexer_scores(q_index, q_scale, weights, k_read, s_read)
        top = decode_server.indexer_topk(pool, logits, lengths, logical_pages, TOPK)
        out["topk_equal"].append(_same_selection(top, want, scores, TOPK))
        # Sparse MLA over the replicated rows of that selection (tied positions at the k-th score: its own).
        top_locs = transform_index_page_table_decode(page_table=table, topk_indices=top, page_size=1)
        want_out, _ = sparse_mla(q.float(), kv.view(torch.uint8).reshape(kv.shape[0], -1), "bf16",
                                 top_locs.long(), SM_SCALE)  # fmt: skip
        lay = SimpleNamespace(layer_id=layer, tp_q_head_num=HEADS, head_dim=576, v_head_dim=512, scaling=SM_SCALE)
        # q as the model hands it over: the absorbed nope part and the rope part apart
        o2, lse2 = decode_server.forward_decode(backend, q[..., :512], None, lay, batch, False, q[..., 512:], None, top)
        out["checks_pass"].append(True)  # forward_decode and indexer_topk ran their checks

        # SGLang's DCP merge kernel over the ranks' (out, base-2 lse); the sum stands in for its reduce-scatter.
        every_lse = torch.empty((world * lse2.shape[0], *lse2.shape[1:]))
        group.all_gather_into(every_lse, lse2.contiguous())
        if world & (world - 1) == 0:  # SGLang's merge kernel takes 2^k ranks
            heads_first = torch.empty((o2.shape[1], o2.shape[0], o2.shape[2]))
            merged, _ = correct_attn_out(o2.float().contiguous(), every_lse.view(world, *lse2.shape), rank, None,
                                         heads_first, is_lse_base_on_e=False)  # fmt: skip
            torch.distributed.all_reduce(merged)
            merged = merged.transpose(0, 1)
        else:  # the LSE merge in plain torch
            every_out = torch.empty((world * o2.shape[0], *o2.shape[1:]))
            group.all_gather_into(every_out, o2.float().contiguous())
            natural = every_lse.view(world, *lse2.shape) * 0.6931471805599453
            merged, _ = merge_by_lse(every_out.view(world, *o2.shape), natural)
        out["merge_err"].append(float((merged - want_out).abs().max()))

        # The checks fail on a top-k missing a position, and on an output that dropped a row.
        bad_top = top.clone()
        bad_top[0, 0] = -1
        owned, _ = owned_scores(logits, lengths, logical_pages, PS, world, rank)
        out["bad_topk_caught"].append(_raises(CPSharedKVDebugError, decode_cp_checks.check_decode_topk, bad_top,
                                              owned, group))  # fmt: skip
        sel = top_locs
        bad_sel = sel.clone()
        bad_sel[:, 1] = -1  # the output attended without it; the check's reference with it
        attend = functools.partial(_attend, q)
        bad_rows = owned_loc_rows(bad_sel, pool.ownership, rank)
        o_bad, lse_bad = for_dcp_merge(*attend(pool.get_key_buffer(layer), bad_rows))
        check = decode_cp_checks.check_decode_attention
        out["bad_out_caught"].append(_raises(CPSharedKVDebugError, check, o_bad, lse_bad, pool.get_key_buffer(layer),
                                             sel, PS, attend, group))  # fmt: skip
    return out


def _attend(q, kv, indices):
    """The step's kernel as the check calls it: ``(out, natural lse)`` over ``indices [R, k]``."""
    from reference.dsa_reference import flash_mla_sparse_fwd_ref

    out, _, lse2 = flash_mla_sparse_fwd_ref(q, kv, indices.unsqueeze(1), SM_SCALE)
    return out, lse2 * 0.6931471805599453  # ln(2)


def _raises(error: type, fn, *args) -> bool:
    try:
        fn(*args)
    except error:
        return True
    return False


@needs_interpreter
@pytest.mark.parametrize("world", [2, 3, 4])
def test_decode_cp_server_step_equals_the_replicated_decode(tmp_path, world):
    from plugin_models import write_model_dirs

    from reference.spawn import spawn_ranks

    write_model_dirs(tmp_path, ["mla"])
    os.environ["SGLANG_DEBUG_CP_SHARED_KV"] = "1"  # the ranks inherit it: the step checks itself
    try:
        results = spawn_ranks(_rank, world, 11, str(tmp_path), timeout_s=300)
    finally:
        os.environ.pop("SGLANG_DEBUG_CP_SHARED_KV")
    for rank, res in enumerate(results):
        assert res["server_group"] == [rank, world, rank, world] and res["index_rows"] == SLOTS, res
        assert f"decode CP pool, rank {rank} of {world}: {SLOTS} latent and indexer rows here" in res["log"], res
        assert res["narrow_refused"] and res["is_decode_pool"], res
        assert all(res["topk_equal"]) and len(res["topk_equal"]) == LAYERS, (rank, res)
        assert max(res["merge_err"]) < 4e-3, (rank, res["merge_err"])  # the partials are bf16, as the server's
        assert all(res["checks_pass"]) and all(res["bad_topk_caught"]) and all(res["bad_out_caught"]), (rank, res)
