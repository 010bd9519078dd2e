"""Every CP size the flag allows: SGLang's scheduler-side allocation keeps each request's pages rotating
owners, so every batch fits the slot plan's blocks and reads exact views.

The workload runs SGLang's own scheduler objects over the pool and allocator that SGLang's KV cache
configurator builds through the plugin's hooks (flag on): a ``UnifiedRadixCache``, ``Req`` s and
``ScheduleBatch.prepare_for_extend`` (``alloc_for_extend`` -> ``alloc_paged_token_slots_extend``, which
hands the allocator each request's rotation base), ``checkpoint_kv_cache`` between the chunks of a
request and ``release_kv_cache`` when it ends. Seeded at random: requests that share system prompts
(radix matches, split nodes), unaligned lengths, chunk budgets that are and are not multiples of
``cp_size`` pages, a pool small enough that the tree evicts and freed pages are drawn again.

- **Allocation, CP 2..8** (one process): in every batch, request ``i`` 's k-th page is on owner
  ``(b_i + k) % cp_size`` (checked against the locs in ``req_to_token``, not the allocator's
  bookkeeping), so no owner holds more than ``S = Σ ceil(pages_i / cp_size)`` of the batch's page
  positions: the slot plan's block.
- **Views, CP 3, 5 and 8** (gloo ranks, each running the same workload as a server's ranks do): each
  batch goes through ``prepare_kv_shard_forward`` and the DSA backend's pool calls; the indexer keys
  and the latent rows read equal a stock replicated pool's, bit for bit (both pools write their
  indexer keys through ``reference.sglang_writers``' twin of SGLang's writer), and no batch raises a slot
  overflow (at the second batch after it, or for the last batches once the run ends).
"""

from __future__ import annotations

import os
import random
from array import array

import pytest
import torch

pytestmark = [pytest.mark.sglang]
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="SGLang's pool writers are Triton kernels: CPU needs TRITON_INTERPRET=1",
)

PS = 64
ENV = {"SGLANG_PLUGINS": "cp_shared_kv", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}


def _scheduler(model_root: str, cp_rank: int, cp_size: int, pages_per_rank: int):
    """SGLang's pool, allocator and radix cache for one CP rank, built as a prefill server with the flag builds them."""
    from plugin_models import build_pool_and_allocator, prefill_cp_argv, radix_cache
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    server_args = prepare_server_args(prefill_cp_argv(model_root, PS, cp_size))
    server_args.resolve_once()
    server_args.__dict__["enable_cp_shared_kv"] = True  # the record as the launcher passes it
    publish(server_args, role="scheduler")
    config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_root, "dsa")]))
    pool, allocator = build_pool_and_allocator(config, pages_per_rank * PS, 8, PS, cp=(cp_rank, cp_size))
    req_to_token, tree = radix_cache(allocator, 8, 8 * PS)
    return config, pool, allocator, req_to_token, tree


def _batches(cp_size: int, seed: int, steps: int, config, allocator, req_to_token, tree):
    """Run the seeded workload through SGLang's scheduler objects; yield each prepared ``ScheduleBatch``
    (its KV allocated, before its forward) and the scenario counts so far."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    rng = random.Random(seed)
    # Three system prompts of 1-3 pages plus a partial page: requests take a prefix of one.
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(1, 4) * PS + rng.randrange(PS))] for _ in range(3)]
    seen = {"matched": 0, "chunk_multiple": 0, "chunk_other": 0, "unaligned": 0, "reused": 0, "split": 0}
    drawn: set[int] = set()
    freed: set[int] = set()
    live: list = []
    made = 0
    for _ in range(steps):
        while len(live) < 3:
            ids = rng.choice(systems)[: rng.randrange(PS, 4 * PS)]
            ids = ids + [1000 + rng.randrange(20) for _ in range(rng.randrange(1, 3 * PS))]
            live.append(Req(f"r{made}", "", array("q", ids), SamplingParams(max_new_tokens=1)))
            made += 1
        for req in live:  # the waiting ones match the tree again each round, as SGLang's scheduler does
            if not req.kv.holds_kv:
                req.init_next_round_input(tree)
        pages_budget = rng.choice([1, 2, 3, cp_size, cp_size + 1, 2 * cp_size])
        seen["chunk_multiple" if pages_budget % cp_size == 0 else "chunk_other"] += 1
        budget, reqs = pages_budget * PS, []
        for req in live:  # chunked prefill: whole pages unless the chunk ends the request
            total = len(req.full_untruncated_fill_ids)
            end = min(req.prefix_len + budget, total)
            if end < total:
                end -= end % PS
            if end <= req.prefix_len:
                break
            if not req.kv.holds_kv and req.prefix_len > 0:
                seen["matched"] += 1
            req.extend_end = end
            budget -= end - req.prefix_len
            reqs.append(req)
        batch = ScheduleBatch.init_new(reqs, req_to_token, allocator, tree, config, False, SpeculativeAlgorithm.NONE)
        batch.prepare_for_extend()
        rows = req_to_token.req_to_token
        new_pages = set()
        for req in reqs:
            new_pages |= set((rows[req.kv.req_pool_idx, req.prefix_len : req.extend_end].long() // PS).tolist())
            seen["unaligned"] += req.extend_end % PS != 0
            seen["split"] += req.prefix_len % (cp_size * PS) != 0
        seen["reused"] += len(new_pages & freed)
        yield batch, seen
        for req in reqs:
            if req.extend_end == len(req.full_untruncated_fill_ids):
                req.finished_reason = True  # SGLang's finish marker: the release inserts the whole prompt
                release_kv_cache(req, tree, checkpoint=True)
                live.remove(req)
            else:
                checkpoint_kv_cache(req, tree)
                req.init_next_round_input()
        drawn |= new_pages
        freed = drawn & set(allocator.get_all_free_pages().tolist())  # drawn before, free again now


def _owners(batch, cp_size: int) -> tuple[list[list[int]], list[int], int]:
    """Each request's page owners, the batch's page positions per owner, and the plan's block ``S``."""
    rows = batch.req_to_token_pool.req_to_token
    owners = [
        ((rows[req.kv.req_pool_idx, : req.extend_end : PS].long() // PS) % cp_size).tolist() for req in batch.reqs
    ]
    per_owner = [sum(o.count(r) for o in owners) for r in range(cp_size)]
    block = sum(-(-len(o) // cp_size) for o in owners)
    return owners, per_owner, block


def _allocation_worker(model_root: str, seeds: list[int], steps: int) -> dict:
    out = {}
    for cp_size in range(2, 9):
        for seed in seeds:
            config, _pool, allocator, req_to_token, tree = _scheduler(model_root, 0, cp_size, 12)
            stray, over, batches = [], [], 0
            for batch, seen in _batches(cp_size, seed, steps, config, allocator, req_to_token, tree):  # noqa: B007
                owners, per_owner, block = _owners(batch, cp_size)
                batches += 1
                for req, o in zip(batch.reqs, owners):
                    if o != [(o[0] + k) % cp_size for k in range(len(o))]:
                        stray.append([req.rid, o])
                if max(per_owner) > block:
                    over.append([per_owner, block])
            out[f"{cp_size}/{seed}"] = {"batches": batches, "stray": stray, "over": over, "seen": dict(seen)}
    return out


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> str:
    from plugin_models import write_model_dirs

    root = tmp_path_factory.mktemp("models")
    write_model_dirs(root, ["mla", "dsa"])
    return str(root)


@pytest.fixture
def plugin_env(monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)


def test_every_request_rotates_owners_at_every_cp_size(model_root, plugin_env):
    from reference.spawn import spawn_ranks

    # One spawned process (the plugin loads there, as in a server's scheduler), every CP size in it.
    (res,) = spawn_ranks(_allocation_rank, 1, model_root, timeout_s=600)
    assert sorted(res) == [f"{n}/{s}" for n in range(2, 9) for s in (11, 12)]
    for key, run in res.items():
        assert run["batches"] == 60, key
        assert run["stray"] == [] and run["over"] == [], (key, run["stray"][:3], run["over"][:3])
        # The workload reached every case it is meant to: radix matches, split prefixes, unaligned
        # ends, both kinds of chunk budget, pages freed by the tree and drawn again.
        assert all(count > 0 for count in run["seen"].values()), (key, run["seen"])


def _allocation_rank(_rank: int, _world: int, model_root: str) -> dict:
    return _allocation_worker(model_root, [11, 12], 60)


def _views_rank(rank: int, cp_size: int, model_root: str, seed: int, steps: int) -> dict:
    """One CP rank: the workload's batches through the pool and a stock replicated pool, compared."""
    from types import SimpleNamespace

    from plugin_models import stock_dsa_pools
    from sglang.srt.layers.attention.kv_shard_hooks import prepare_kv_shard_forward
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from test_plugin_sharded_pool import _chunk, _Layer, _no_dcp

    from reference.sglang_writers import use_torch_writers
    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup

    use_torch_writers()  # SGLang's per-token Triton writer, interpreted, would be most of the run
    config, pool, allocator, req_to_token, tree = _scheduler(model_root, rank, cp_size, 12)
    pool.read.group = CPGroup()
    (stock,) = stock_dsa_pools([cp_size * pool.phys_pages * PS - PS], PS)
    out = {"batches": 0, "views": 0, "mismatch": [], "reads": set()}
    with _no_dcp():
        for bi, (batch, _) in enumerate(_batches(cp_size, seed, steps, config, allocator, req_to_token, tree)):
            table = req_to_token.req_to_token
            idx = batch.req_pool_indices
            prefix, seq = list(batch.prefix_lens), batch.seq_lens_cpu.tolist()
            fb = SimpleNamespace(
                forward_mode=ForwardMode.EXTEND,
                req_pool_indices=idx,
                extend_prefix_lens_cpu=prefix,
                seq_lens_cpu=seq,
                rids=[r.rid for r in batch.reqs],
            )
            prepare_kv_shard_forward(pool, table, fb)
            mode = pool.read.mode
            out["reads"].add(mode)
            new = batch.out_cache_loc.long()
            every = torch.cat([table[r, :s].long() for r, s in zip(idx.tolist(), seq)])
            pages = table[idx, : max(seq) : PS].long() // PS
            lens = torch.tensor(seq)
            for layer in range(2):
                nope, rope, k, scale = _chunk(len(new), seed=1000 * bi + layer)
                for p in (pool, stock):
                    p.set_index_k_scale_buffer(layer, new, k, scale)
                got = pool.get_index_k_scale_buffer(layer, lens, pages, sum(seq), max(seq))
                want = stock.get_index_k_scale_buffer(layer, lens, pages, sum(seq), max(seq))
                for p in (pool, stock):
                    p.set_mla_kv_buffer(_Layer(layer), new, nope, rope)
                rows = pool.translate_loc_to_scratch(every)
                same = all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(
                    pool.get_key_buffer(layer)[rows].view(torch.uint8),
                    stock.get_key_buffer(layer)[every].view(torch.uint8),
                )
                if not same:
                    out["mismatch"].append([bi, layer])
            pool.end_shard_extend()
            out["batches"] += 1
            out["views"] += mode == "materialized"
    pool.read.check_overflow(wait=True)  # the last batches' flags: a slot overflow raises, failing the rank
    out["reads"] = sorted(out["reads"])
    return out


@needs_interpreter
@pytest.mark.multirank
@pytest.mark.parametrize("cp_size", [3, 5, 8])
def test_every_batch_reads_exact_views_on_cp_ranks(cp_size, model_root, plugin_env):
    from reference.spawn import spawn_ranks

    for rank, res in enumerate(spawn_ranks(_views_rank, cp_size, model_root, 21, 16, timeout_s=900)):
        assert res["batches"] == 16 and res["mismatch"] == [], (rank, res)
        # Most batches read a prefix view across the ranks; the first reads its chunk only.
        assert res["reads"] == ["current", "materialized"] and res["views"] >= 10, (rank, res)
