"""Shared prefixes read once on the SGLang-wired path: the hint from the scheduler's radix tree to the pool.

- **The hook route, with SGLang's own scheduler objects** (one worker subprocess that loads the
  plugin as SGLang does, flag on): a ``UnifiedRadixCache`` (the Python tree core the flag selects)
  over the CP-shared DSA pool and SGLang's widened allocator; a first request's prompt is
  prefilled (``ScheduleBatch.prepare_for_extend``) and checkpointed into the tree; a second batch
  of requests matches it (``Req.init_next_round_input``) and is prepared. The AFTER hook on
  ``ForwardBatch.init_new`` computes the hint from their ``last_node`` s and hands it to the pool;
  the hook on ``prepare_kv_shard_forward`` hands its pairs to the pool's next begin for that batch
  (also for the dataclass copy SGLang's eager runner makes, and past DP padding), and for no other.
  ``ForwardBatch.init_new`` itself imports SGLang's model runner, which needs the HTTP server stack
  this environment does not install: the worker builds the ``ForwardBatch`` it would (the fields the
  hooks read, from the same ``ScheduleBatch``) and calls the hook on it.
- **The pool with the hint, on gloo ranks**: the same batch read with and without the hint gives
  bit-identical latent rows (equal to a replicated stock pool) and indexer reads, and receives
  fewer bytes (the shared pages once).
- **A wrong hint** (pages a request does not share with its source) fails as the second batch
  after it begins (``begin_shard_extend``), with one line naming the requests; the batch between
  reads its own bytes, and the batch after the failure runs normally.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from plugin_models import build_pool_and_allocator, prefill_cp_argv, radix_cache, run_worker, write_model_dirs

pytestmark = [pytest.mark.sglang]
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="SGLang's pool writers are Triton kernels: CPU needs TRITON_INTERPRET=1",
)

PS = 64
INIT_NEW = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


# ---------------------------------------------------------------------------------------------
# The hook route with SGLang's scheduler objects (worker subprocess)
# ---------------------------------------------------------------------------------------------


def _worker(model_dir: str) -> None:
    import dataclasses
    from array import array
    from types import SimpleNamespace

    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_cp_shared_kv.srt.sglang_wiring.hooks import hint_shared_prefix, missing_hooks

    out: dict = {"patched": INIT_NEW in HookRegistry._patched, "missing": missing_hooks()}
    out["still_classmethod"] = isinstance(ForwardBatch.__dict__["init_new"], classmethod)
    server_args = prepare_server_args(prefill_cp_argv(model_dir, PS))
    server_args.resolve_once()
    server_args.__dict__["enable_cp_shared_kv"] = True  # fixture: the record as the launcher would pass it
    publish(server_args, role="scheduler")
    dsa_config = model_config_of(prepare_server_args(["--model-path", os.path.join(model_dir, "dsa")]))
    pool, allocator = build_pool_and_allocator(dsa_config, 16 * PS, 8, PS, cp=(0, 2))
    req_to_token, tree = radix_cache(allocator, 8, 16 * PS)
    out["tree_core"] = type(tree.tree_core).__name__

    def request(rid: str, ids: list[int]) -> Req:
        req = Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=1))
        req.init_next_round_input(tree)  # SGLang's prefix match: prefix_len and last_node
        req.extend_end = len(req.full_untruncated_fill_ids)  # admitted whole, as SGLang's PrefillAdder does
        return req

    def prepared(reqs: list[Req]) -> ScheduleBatch:
        batch = ScheduleBatch.init_new(
            reqs, req_to_token, allocator, tree, dsa_config, False, SpeculativeAlgorithm.NONE
        )
        batch.prepare_for_extend()
        return batch

    def forward_batch(batch: ScheduleBatch) -> ForwardBatch:
        """The ForwardBatch ``ForwardBatch.init_new(batch, ...)`` builds, in the fields the hooks read."""
        return ForwardBatch(
            forward_mode=batch.forward_mode,
            batch_size=len(batch.reqs),
            input_ids=batch.input_ids,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            out_cache_loc=batch.out_cache_loc,
            seq_lens_sum=int(batch.seq_lens_cpu.sum()),
            seq_lens_cpu=batch.seq_lens_cpu,
            rids=[req.rid for req in batch.reqs],
            extend_prefix_lens_cpu=list(batch.prefix_lens),
        )

    runner = SimpleNamespace(token_to_kv_pool=pool)  # what the hook reads of SGLang's model runner

    def handed(fb) -> tuple:
        """What prepare_kv_shard_forward hands the pool's next begin for ``fb``."""
        pool.name_next_batch(fb.rids, fb.extend_prefix_lens_cpu)
        rids, pairs = pool.next_batch
        return [list(p) for p in pairs] if pairs is not None else None, list(rids) if rids is not None else None

    # A conversation's system prompt (3 pages) plus its first turn, prefilled and kept in the tree.
    system = list(range(3 * PS))
    first = prepared([request("a", system + [500] * 20)])
    tree.checkpoint(first.reqs[0], up_to=first.reqs[0].extend_end)
    # The next batch: a fresh prompt, two more turns on the whole system prompt, one on its first 2 pages.
    reqs = [
        request("fresh", [800] * 100),
        request("turn-b", system + [600] * 30),
        request("turn-c", system[: 2 * PS] + [700] * 70),
        request("turn-d", system + [900] * 5),
    ]
    batch = prepared(reqs)
    out["prefix_lens"] = list(batch.prefix_lens)
    rows = req_to_token.req_to_token
    # The radix tree's claim checked on the rows SGLang wrote: turn-c and turn-d start with turn-b's pages.
    b_row, c_row, d_row = (rows[r.kv.req_pool_idx] for r in reqs[1:])
    out["rows_agree"] = bool(
        torch.equal(b_row[: 2 * PS], c_row[: 2 * PS]) and torch.equal(b_row[: 3 * PS], d_row[: 3 * PS])
    )

    fb = forward_batch(batch)
    assert hint_shared_prefix(fb, ForwardBatch, batch, runner) is fb
    hint = pool.shared_prefix_hint
    out["hint"] = [list(p) for p in hint.pairs] if hint is not None else None
    out["handed"] = handed(fb)
    # SGLang's eager runner rebuilds the ForwardBatch from its dataclass fields before the backend begins it.
    out["handed_copy"] = handed(dataclasses.replace(fb))[0]
    # DP padding appends prefix-free entries past the requests.
    out["handed_padded"] = handed(dataclasses.replace(fb, extend_prefix_lens_cpu=fb.extend_prefix_lens_cpu + [0]))[0]
    # Any other batch reads without it: other requests, other prefix lens, a decode batch.
    out["handed_other_rids"] = handed(dataclasses.replace(fb, rids=["x", "y", "z", "w"]))[0]
    other_lens = [0, 3 * PS, PS, 3 * PS]
    out["handed_other_lens"] = handed(dataclasses.replace(fb, extend_prefix_lens_cpu=other_lens))[0]
    decode = dataclasses.replace(fb, forward_mode=ForwardMode.DECODE, extend_prefix_lens_cpu=None)
    hint_shared_prefix(decode, ForwardBatch, batch, runner)
    out["kept_after_decode"] = pool.shared_prefix_hint is hint
    out["handed_decode"] = handed(decode)[0]
    # The next extend batch replaces the hint: no two of its requests share a page.
    lone = prepared([request("lone", system + [400] * 10)])
    hint_shared_prefix(forward_batch(lone), ForwardBatch, lone, runner)
    out["after_lone"] = pool.shared_prefix_hint
    # Flag off: the hook passes through (the lone batch would have replaced the hint).
    pool.shared_prefix_hint = hint
    server_args.__dict__["enable_cp_shared_kv"] = False
    publish(server_args, role="scheduler")
    hint_shared_prefix(forward_batch(lone), ForwardBatch, lone, runner)
    out["flag_off_kept"] = pool.shared_prefix_hint is hint
    print("RESULT:" + json.dumps(out))


@pytest.fixture(scope="module")
def route(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    write_model_dirs(root, ["mla", "dsa"])
    env = {
        **os.environ,
        "SGLANG_PLUGINS": "cp_shared_kv",
        "TRITON_INTERPRET": "1",
        "MC_LOG_LEVEL": "WARNING",
        "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",  # what the flag's resolution selects
    }
    return run_worker([__file__, str(root)], env, 300)


def test_init_new_hook_is_installed(route):
    assert route["patched"] and route["missing"] == [] and route["still_classmethod"]


def test_radix_paths_become_the_batch_hint_and_reach_the_read_state(route):
    assert route["tree_core"] == "UnifiedTreeCore"
    assert route["prefix_lens"] == [0, 3 * PS, 2 * PS, 3 * PS] and route["rows_agree"]
    # turn-c shares 2 pages with turn-b (their paths meet where turn-c's match split the node);
    # turn-d all 3 of turn-b's: the first request through the deepest shared node is the source.
    pairs = [[-1, 0], [-1, 0], [1, 2], [1, 3]]
    assert route["hint"] == pairs
    assert route["handed"] == [pairs, ["fresh", "turn-b", "turn-c", "turn-d"]]
    assert route["handed_copy"] == pairs
    assert route["handed_padded"] == [*pairs, [-1, 0]]


def test_no_other_batch_gets_the_hint(route):
    assert route["handed_other_rids"] is None and route["handed_other_lens"] is None
    assert route["kept_after_decode"] and route["handed_decode"] is None
    assert route["after_lone"] is None  # the next extend batch replaced it
    assert route["flag_off_kept"]  # flag off: the hook left the pool alone


# ---------------------------------------------------------------------------------------------
# The pool with the hint, on gloo ranks
# ---------------------------------------------------------------------------------------------


def _rank(rank: int, world: int) -> dict:
    os.environ.pop("SGLANG_DEBUG_CP_SHARED_KV", None)
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel
    from test_plugin_sharded_pool import _chunk, _dsa_kwargs, _Layer

    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import SharedPrefixError
    from sglang_cp_shared_kv.srt.sglang_wiring.pool_hooks import SharedPrefixHint, prepare_forward
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    kwargs = _dsa_kwargs(1, fp8=False)
    group = CPGroup()
    out: dict = {}
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool = CPSharedDSATokenToKVPool(12 * PS, cp_rank=rank, cp_size=world, cp_group=group, **kwargs)
        replicated = DSATokenToKVPool(world * pool.phys_pages * PS - PS, **kwargs)
        replicated.dcp_replicated = True

        def locs(pages: list[int], tokens: int) -> torch.Tensor:
            return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])[:tokens]

        def write(loc: torch.Tensor, seed: int) -> None:
            nope, rope, k, scale = _chunk(len(loc), seed)
            for p in (pool, replicated):
                p.set_index_k_scale_buffer(0, loc, k, scale)
                p.set_mla_kv_buffer(_Layer(0), loc, nope, rope)

        def batch(pages, prefix_lens, seq_lens, rids, pairs=None, end=True):
            """One extend batch through the prepare_kv_shard_forward hook; what its layer reads."""
            req_to_token = torch.zeros((len(pages), 8 * PS), dtype=torch.int32)
            for r, (p, n) in enumerate(zip(pages, seq_lens)):
                req_to_token[r, :n] = locs(p, n).int()
            pool.shared_prefix_hint = SharedPrefixHint(tuple(rids), tuple(prefix_lens), tuple(pairs)) if pairs else None
            fb = SimpleNamespace(
                forward_mode=ForwardMode.EXTEND,
                req_pool_indices=torch.arange(len(pages)),
                extend_prefix_lens_cpu=prefix_lens,
                seq_lens_cpu=seq_lens,
                rids=rids,
            )
            assert prepare_forward(pool, req_to_token, fb) is True
            write(torch.cat([locs(p, n)[q:] for p, q, n in zip(pages, prefix_lens, seq_lens)]), seed=7)
            every = [locs(p, n).long() for p, n in zip(pages, seq_lens)]
            view = pool.get_key_buffer(0)
            latent = [view[pool.translate_loc_to_scratch(e)].view(torch.uint8).clone() for e in every]
            exact = [
                bool(torch.equal(got, replicated.get_key_buffer(0)[e].view(torch.uint8)))
                for got, e in zip(latent, every)
            ]
            width = max(len(p) for p in pages)
            table = torch.stack([torch.nn.functional.pad(e[::PS] // PS, (0, width - len(e[::PS]))) for e in every])
            index = pool.get_index_k_scale_buffer(0, torch.tensor(seq_lens), table, sum(seq_lens), max(seq_lens))
            index = [t.clone() for t in index]
            c = pool.read.counters
            res = {"exact": exact, "view_pages": c.view_pages, "received": c.bytes_received, "latent": latent}
            res["index"] = index
            if end:
                try:
                    pool.end_shard_extend()
                    res["error"] = None
                except SharedPrefixError as err:
                    res["error"] = str(err)
            return res

        # The cached pages, owners rotating: a system prompt (2, 3, 4, 5) and another prompt (6, 7, 8).
        write(locs([2, 3, 4, 5], 4 * PS), seed=3)
        write(locs([6, 7, 8], 3 * PS), seed=5)
        rids = ["req-a", "req-b", "req-c"]
        # req-b reads req-a's first 3 prefix pages (one radix node); req-c is a fresh prompt.
        pages = [[2, 3, 4, 5, 10], [2, 3, 4, 11], [12, 13]]
        lens = ([4 * PS, 3 * PS, 0], [4 * PS + 20, 3 * PS + 9, 2 * PS])
        hinted = [(-1, 0), (0, 3), (-1, 0)]
        plain, once = batch(pages, *lens, rids), batch(pages, *lens, rids, hinted)
        out["plain"] = {k: plain[k] for k in ("exact", "view_pages", "received", "error")}
        out["once"] = {k: once[k] for k in ("exact", "view_pages", "received", "error")}
        out["same_latent"] = all(torch.equal(a, b) for a, b in zip(plain["latent"], once["latent"]))
        out["same_index"] = all(torch.equal(a, b) for a, b in zip(plain["index"], once["index"]))
        out["row_bytes"] = pool.row_bytes

        def verdict() -> tuple[bool, str | None]:
            """Two fresh batches: the first reads its own bytes; the second's begin acts on the flags of the
            batch before them (``SharedPrefixError``)."""
            between = batch([[14, 15]], [0], [2 * PS], ["req-d"])
            try:
                batch([[14, 15]], [0], [2 * PS], ["req-e"])
            except SharedPrefixError as err:
                return all(between["exact"]) and between["error"] is None, str(err)
            return all(between["exact"]) and between["error"] is None, None

        # A wrong hint: req-b's prefix is another prompt's pages.
        wrong = batch([[2, 3, 4, 5, 10], [6, 7, 8, 11], [12, 13]], *lens, rids, hinted)
        out["wrong"] = {k: wrong[k] for k in ("exact", "error")}
        out["wrong"]["between_exact"], out["wrong"]["verdict"] = verdict()
        # One page off (req-b's third page is another prompt's), the batch not ended.
        batch([[2, 3, 4, 5, 10], [2, 3, 8, 11], [12, 13]], *lens, rids, hinted, end=False)
        out["one_off"] = verdict()
        # The batch after them runs normally.
        after = batch(pages, *lens, rids, hinted)
        out["after"] = {k: after[k] for k in ("exact", "error")}
    return out


@needs_interpreter
@pytest.mark.multirank
def test_hint_reads_the_same_bytes_once_and_a_wrong_hint_fails_the_batch():
    from reference.spawn import spawn_ranks

    for res in spawn_ranks(_rank, 2, timeout_s=600):
        plain, once = res["plain"], res["once"]
        assert all(plain["exact"]) and all(once["exact"]), res
        assert res["same_latent"] and res["same_index"], res
        assert plain["error"] is None and once["error"] is None, res
        # S = ceil(4/2) + ceil(3/2) = 4 pages per owner without the hint, ceil(4/2) = 2 with it.
        assert (plain["view_pages"], once["view_pages"]) == (8, 4), res
        page = PS * (res["row_bytes"] + 132)
        assert (plain["received"], once["received"]) == (4 * page, 2 * page), res
        # The wrong hint read req-b's prefix from other slots; its pages are named once the flag is read.
        assert res["wrong"]["exact"][0] and not res["wrong"]["exact"][1] and res["wrong"]["exact"][2], res
        # Its flag is acted on as the second batch after it begins; the batch between reads its own bytes.
        assert res["wrong"]["error"] is None and res["wrong"]["between_exact"], res
        assert res["wrong"]["verdict"] == (
            "--enable-cp-shared-kv: wrong shared-prefix hint: in the batch of requests [req-a, req-b, req-c], "
            "the pages the hint shares are not the same logical pages for req-b (its first 3 of 3 prefix pages "
            "as req-a's); they were read from other slots, so the batch fails"
        ), res
        between_exact, one_off = res["one_off"]
        assert between_exact and one_off is not None and "for req-b (its first 3 of 3" in one_off, res
        assert all(res["after"]["exact"]) and res["after"]["error"] is None, res


if __name__ == "__main__":
    _worker(sys.argv[1])
