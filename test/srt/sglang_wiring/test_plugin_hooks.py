"""The plugin's SGLang hooks, installed by SGLang's own ``load_plugins()``, in one worker subprocess.

Hooks cannot be undone, so everything runs in a child process that loads the plugin the way
every SGLang process does. It publishes real resolved server args (a plain MLA config resolves
on CPU; the flag is then set on the record, since resolution with the flag on rejects a CPU
device), and calls SGLang's real KV-cache-configurator builder methods on a configurator
carrying only the attributes those methods read (a full one needs a model runner):

- flag off: the stock ``DSATokenToKVPool`` and ``PagedTokenToKVPoolAllocator``;
- flag on: ``CPSharedDSATokenToKVPool`` (rank/size from SGLang's parallel context) and
  SGLang's ``PageInterleavePoolAllocator`` widened N times, and the process switched to
  SGLang's sharded Mooncake sender path;
- that sender path on two prefill CP ranks: SGLang's ``_prepare_send_indices`` (with our debug
  share check hooked after it) picks each rank's owned pages and their positions, and SGLang's
  ``MooncakeKVManager._send_kvcache_generic`` writes them with the real Mooncake engine over
  TCP on 127.0.0.1 into a stock (non-CP) decode pool: latent rows and DSA indexer pages land
  bit-exact where an unsharded prefill would have put them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from plugin_models import (
    build_pool_and_allocator,
    configurator,
    new_request_locs,
    prefill_cp_argv,
    run_worker,
    stock_dsa_pools,
    write_model_dirs,
)

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

PS = 64
TARGETS = [
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mla_kv_pool",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool_allocator",
    "sglang.srt.disaggregation.common.conn.CommonKVSender._prepare_send_indices",
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools",
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
    "sglang.srt.layers.attention.kv_shard_hooks.prepare_kv_shard_forward",
    "sglang.srt.model_executor.pool_configurator.compute_page_shard_scratch_bytes",
    "sglang.srt.managers.schedule_policy.PrefillAdder._kv_shard_reserve_scratch",
]


def _configurator(model_config):
    return configurator(model_config, PS)


def _sender_side(rank: int, pool, engine):
    """SGLang's Mooncake KV manager and sender for one prefill CP rank, around a real engine."""
    import types

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender

    latent_ptrs, _, latent_lens = pool.get_contiguous_buf_infos()
    mgr = object.__new__(MooncakeKVManager)
    mgr.engine = engine
    mgr.kv_args = types.SimpleNamespace(
        kv_data_ptrs=latent_ptrs,
        kv_item_lens=latent_lens,
        kv_layer_ids=None,
        mla_compression_ratios=None,
        num_draft_entries=0,
    )
    mgr.is_mla_backend, mgr.is_hybrid_mla_backend, mgr.pp_size = True, False, 1
    mgr.enable_custom_mem_pool, mgr.custom_mem_pool_type, mgr.max_transfer_batch_indices = False, None, 0
    mgr.state_strides_validated = set()
    # What CommonKVManager.__init__ derives in sharded mode (the attention-CP group here).
    mgr.kv_shard_rank, mgr.kv_shard_size, mgr.enable_all_cp_ranks_for_transfer = rank, pool.shard_size, True
    mgr.is_dummy_cp_rank = False
    sender = object.__new__(MooncakeKVSender)
    sender.kv_mgr, sender.curr_idx, sender.bootstrap_room = mgr, 0, 1234
    return mgr, sender


def _worker(model_dir: str) -> None:
    import types

    import numpy as np
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine
    from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.srt.sglang_wiring.hooks import missing_hooks

    out: dict = {"patched": sorted(set(TARGETS) & HookRegistry._patched), "missing": missing_hooks()}
    server_args = prepare_server_args(prefill_cp_argv(model_dir, PS))
    server_args.resolve_once()
    dsa_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    sizes = type("Sizes", (), {"max_total_num_tokens": 8 * PS})()
    n = 2
    built = {}
    for flag in (False, True):
        server_args.__dict__["enable_cp_shared_kv"] = flag  # fixture: the record as the launcher would pass it
        publish(server_args, role="scheduler")
        pools = [build_pool_and_allocator(dsa_config, 8 * PS, 4, PS, cp=(rank, n)) for rank in range(n)]
        pool, alloc = pools[1]
        built[flag] = pools
        out[f"flag_{flag}"] = {
            "pool": type(pool).__name__,
            "pool_mro": [c.__name__ for c in type(pool).__mro__[:4]],
            "shard_rank": getattr(pool, "shard_rank", None),
            "allocator": type(alloc).__name__,
            "allocator_size": alloc.size,
            "widening": page_interleave_shard_size(alloc),
            "shard_spec": repr(getattr(alloc, "shard_spec", "absent")),
            "sharded_transfer": bool(get_parallel().enable_kv_cache_sharding),
        }
        # The AFTER hook on SGLang's _init_pools (installed: see "missing"), on the pools built here
        # and on a stock pool in their place.
        from sglang_cp_shared_kv.srt.sglang_wiring.hooks import built_pools

        stock_pool = stock_dsa_pools([8 * PS], PS)[0]
        verdicts = {}
        for name, (p_, a_) in {"built": (pool, alloc), "stock_pool": (stock_pool, alloc)}.items():
            returned = types.SimpleNamespace(token_to_kv_pool=p_, token_to_kv_pool_allocator=a_)
            try:
                kept = built_pools(returned, _configurator(dsa_config), sizes=sizes) is returned
                verdicts[name] = "accepted" if kept else "changed"
            except Exception as e:
                verdicts[name] = f"{type(e).__name__}: {e}"
        out[f"flag_{flag}"]["init_pools"] = verdicts
        # The KV budget's fixed charge (SGLang's sizing calls this before it sizes the pool).
        from sglang.srt.model_executor import pool_configurator

        with get_parallel().override(attn_cp_rank=1, attn_cp_size=n):
            out[f"flag_{flag}"]["charged"] = pool_configurator.compute_page_shard_scratch_bytes(
                _configurator(dsa_config)
            )
        out[f"flag_{flag}"]["context_len"] = dsa_config.context_len
        spec = getattr(alloc, "shard_spec", None)
        if flag:
            # SGLang's own prefill admission against the allocator's spec: requests of a full-context
            # prefix are admitted while the batch's prefix views fit the arena, then deferred.
            import logging

            from sglang.srt.managers.schedule_policy import PrefillAdder

            records = []
            handler = logging.Handler()
            handler.emit = lambda r, records=records: records.append(r.getMessage())
            logging.getLogger("sglang_cp_shared_kv.srt.sglang_wiring.view_arena").addHandler(handler)
            logging.getLogger("sglang_cp_shared_kv.srt.sglang_wiring.view_arena").setLevel(logging.INFO)
            adder = object.__new__(PrefillAdder)
            adder.token_to_kv_pool_allocator = alloc
            adder.kv_shard_scratch_spec = spec
            adder.kv_shard_granule, adder.kv_shard_size = PS, n
            adder.kv_shard_block_bound_pages = adder.kv_shard_chunk_pages = 0
            ctx = dsa_config.context_len // PS * PS
            out["admission"] = [adder._kv_shard_reserve_scratch(prefix_len=ctx, extend_len=PS) for _ in range(3)]
            out["admission_log"] = records
            out["arena_spec"] = [spec.max_prefix_tokens, spec.chunk_tokens, spec.page_size, spec.scratch_rows]
            out["arena_allocated"] = sum(t.numel() * t.element_size() for t in pool.read.arena.values())

    # -- the Mooncake sender path on both prefill ranks, into a stock decode pool --
    class Layer:
        def __init__(self, i):
            self.layer_id = i

    ranks = [p for p, _ in built[True]]
    allocator = built[True][0][1]
    replicated, decode = stock_dsa_pools([n * ranks[0].phys_pages * PS - PS, 12 * PS], PS)
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        seq = 5 * PS + 9
        locs = new_request_locs(allocator, seq)
        g = torch.Generator().manual_seed(3)
        for layer in range(2):
            nope = torch.randn(seq, 1, 512, generator=g).to(torch.bfloat16)
            rope = torch.randn(seq, 1, 64, generator=g).to(torch.bfloat16)
            k = (torch.randn(seq, 128, generator=g) * 4).to(torch.float8_e4m3fn)
            scale = torch.rand(seq, 1, generator=g) + 0.5
            for p in ranks + [replicated]:
                p.set_mla_kv_buffer(Layer(layer), locs, nope, rope)
                p.set_index_k_scale_buffer(layer, locs, k, scale)

    os.environ["MC_FORCE_TCP"] = "1"
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    os.environ["SGLANG_DEBUG_CP_SHARED_KV"] = "1"  # the share check hooked after _prepare_send_indices
    decode_engine = MooncakeTransferEngine("127.0.0.1")
    for buf in list(decode.kv_buffer) + list(decode.index_k_with_scale_buffer):
        decode_engine.register(buf.data_ptr(), buf.nbytes)
    dst_latent, _, _ = decode.get_contiguous_buf_infos()
    dst_index, _, _ = decode.get_state_buf_infos()
    pages = (locs[::PS] // PS).numpy().astype(np.int32)  # the request's logical pages by position
    dst_pages = np.arange(len(pages), dtype=np.int32)[::-1] * 2 + 1  # any decode pages, any order
    sent_positions = []
    for rank, pool in enumerate(ranks):
        engine = MooncakeTransferEngine("127.0.0.1")
        for buf in list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer):
            engine.register(buf.data_ptr(), buf.nbytes)
        mgr, sender = _sender_side(rank, pool, engine)
        sender.num_kv_indices = len(pages)
        positions = []
        for chunk in (pages[:3], pages[3:]):  # two prefill chunks, as SGLang sends them
            local, pos, _, skip = sender._prepare_send_indices(chunk, None)
            if skip:
                continue
            rc = mgr._send_kvcache_generic(
                mooncake_session_id=decode_engine.get_session_id(),
                src_data_ptrs=mgr.kv_args.kv_data_ptrs,
                dst_data_ptrs=dst_latent,
                item_lens=mgr.kv_args.kv_item_lens,
                prefill_data_indices=np.asarray(local, dtype=np.int32),
                dst_data_indices=dst_pages[np.asarray(pos)],
                executor=None,
            )
            assert rc == 0, f"latent transfer rc={rc}"
            positions += np.asarray(pos).tolist()
        # DSA indexer pages: SGLang pairs and narrows them itself in sharded mode.
        src_idx, dst_idx = mgr._prepare_sharded_dsa_indices(pages.tolist(), dst_pages.tolist())
        index_ptrs, _, index_lens = pool.get_state_buf_infos()
        rc = mgr._send_kvcache_generic(
            mooncake_session_id=decode_engine.get_session_id(),
            src_data_ptrs=index_ptrs,
            dst_data_ptrs=dst_index,
            item_lens=index_lens,
            prefill_data_indices=np.asarray(src_idx, dtype=np.int32),
            dst_data_indices=np.asarray(dst_idx, dtype=np.int32),
            executor=None,
            state_type=StateType.DSA,
        )
        assert rc == 0, f"indexer transfer rc={rc}"
        sent_positions.append(positions)

    # The debug share check rejects a selection that is not exactly the rank's owned pages.
    from sglang_cp_shared_kv.srt.sglang_wiring.transfer import SendShareError, check_send_indices

    mgr, sender = _sender_side(0, ranks[0], engine)
    sender.num_kv_indices, sender.curr_idx, sender.bootstrap_room = len(pages), 3, 99
    owned0 = [p for p in range(3) if pages[p] % n == 0]
    forged = np.array([int(pages[owned0[0]]) // n]), np.array([owned0[0] + 1])
    try:
        check_send_indices(sender, pages[:3], *forged)
        out["share_check"] = "missed"
    except SendShareError:
        out["share_check"] = "caught"

    exact = True
    for layer in range(2):
        for p, lp in enumerate(pages):
            d, r = int(dst_pages[p]), int(lp)
            exact &= torch.equal(
                decode.kv_buffer[layer][d * PS : (d + 1) * PS], replicated.kv_buffer[layer][r * PS : (r + 1) * PS]
            )
            exact &= torch.equal(
                decode.index_k_with_scale_buffer[layer][d], replicated.index_k_with_scale_buffer[layer][r]
            )
    out["transfer"] = {
        "positions": sent_positions,
        "owners": [int(lp) % n for lp in pages],
        "exact": bool(exact),
        "nonzero": bool(decode.kv_buffer[0].abs().sum() > 0),
    }
    print("RESULT:" + json.dumps(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    write_model_dirs(root, ["mla", "dsa"])
    env = {**os.environ, "SGLANG_PLUGINS": "cp_shared_kv", "TRITON_INTERPRET": "1", "MC_LOG_LEVEL": "WARNING"}
    return run_worker([__file__, str(root)], env, 300)


def test_every_hook_is_installed(results):
    assert results["patched"] == sorted(TARGETS)
    assert results["missing"] == []


def test_init_pools_refuses_a_pool_that_is_not_ours(results):
    assert results["flag_False"]["init_pools"] == {"built": "accepted", "stock_pool": "accepted"}  # flag off
    on = results["flag_True"]["init_pools"]
    assert on["built"] == "accepted"
    assert on["stock_pool"].startswith("CPSharedKVStartupError: --enable-cp-shared-kv: SGLang built a DSATokenToKVPool")
    assert "\n" not in on["stock_pool"]


def test_flag_off_builds_stock_pool_and_allocator(results):
    off = results["flag_False"]
    assert off["pool"] == "DSATokenToKVPool" and off["shard_rank"] is None
    assert off["allocator"] == "PagedTokenToKVPoolAllocator" and off["allocator_size"] == 8 * PS
    assert off["widening"] == 1 and off["sharded_transfer"] is False


def test_flag_on_builds_cp_shared_pool_and_widened_allocator(results):
    on = results["flag_True"]
    assert on["pool"] == "CPSharedDSATokenToKVPool" and "DSATokenToKVPool" in on["pool_mro"]
    assert on["shard_rank"] == 1
    assert on["allocator"] == "PageInterleavePoolAllocator"
    assert on["allocator_size"] == 2 * 8 * PS and on["widening"] == 2  # the scheduler's widening seam
    # SGLang's scratch admission runs against our view arena's regions (see the arena test below)
    assert on["shard_spec"].startswith("PageShardSpec(shard_rank=1, shard_size=2, page_size=64,")
    assert on["sharded_transfer"] is True


def test_mooncake_sender_moves_owned_pages_to_their_positions(results):
    tr = results["transfer"]
    owners = tr["owners"]
    assert sorted(set(owners)) == [0, 1]
    for rank, positions in enumerate(tr["positions"]):
        assert positions == [p for p, o in enumerate(owners) if o == rank]  # owned pages, by position
    assert sorted(tr["positions"][0] + tr["positions"][1]) == list(range(len(owners)))  # the manifest union
    assert tr["exact"] and tr["nonzero"]


def test_debug_share_check_catches_a_wrong_selection(results):
    assert results["share_check"] == "caught"


def test_view_arena_is_charged_to_the_kv_budget_and_bounds_admission(results):
    from sglang_cp_shared_kv.srt.mem_cache.view_arena_size import ARENA_CONTEXTS

    on, off = results["flag_True"], results["flag_False"]
    assert off["charged"] == 0 and off["shard_spec"] == "'absent'"  # flag off: SGLang's own (no scratch)
    max_prefix, chunk, ps, rows = results["arena_spec"]
    granule = 2 * PS
    assert max_prefix == ARENA_CONTEXTS * -(-on["context_len"] // granule) * granule and ps == PS
    assert rows == max_prefix + chunk + PS
    # One arena of latent rows (bf16 576 values: the configurator's KV dtype) + 132-B indexer records
    # per token (no second chunk: the prefetch is off by default), charged instead of SGLang's
    # 2 x (8 contexts + chunk + page) scratch.
    token_bytes = 576 * 2 + 132
    assert on["charged"] == rows * token_bytes
    upstream = 2 * (8 * -(-on["context_len"] // granule) * granule + chunk + PS) * token_bytes
    assert on["charged"] * 4 <= upstream
    # The pool built by the hook holds that arena, allocated once at build: what was charged.
    assert results["arena_allocated"] == on["charged"]
    # Full-context prefixes: the arena takes ARENA_CONTEXTS of them per batch, the next one waits, and says so.
    assert results["admission"] == [True] * ARENA_CONTEXTS + [False] * (3 - ARENA_CONTEXTS)
    assert len(results["admission_log"]) == 3 - ARENA_CONTEXTS
    assert "waits for a later batch" in results["admission_log"][0]


if __name__ == "__main__":
    _worker(sys.argv[1])
