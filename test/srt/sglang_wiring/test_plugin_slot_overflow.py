"""A batch whose pages do not rotate owners, through SGLang's DSA pool on gloo ranks (debug mode off).

The slot plan sizes each owner's block for balanced allocation. Here request ``req-a``'s prefix
pages all live on owner 1, so owner 1 holds more of the batch's prefix page positions than its
block: those positions must read a slot holding the trash page (never a row past the read
buffer), while the current chunk's pages, staged locally, read their own bytes; and the batch
must fail as the second extend batch after it begins (``prepare_kv_shard_forward``), on every
rank alike, with one line naming the batch's requests (SGLang's rids, handed over by the
``prepare_kv_shard_forward`` hook) and the owners' page counts. The batch between runs normally.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.multirank]
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="SGLang's pool writers are Triton kernels: CPU needs TRITON_INTERPRET=1",
)

PS = 64


def _rank(rank: int, world: int, device: str) -> dict:
    os.environ.pop("SGLANG_DEBUG_CP_SHARED_KV", None)
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel
    from test_plugin_sharded_pool import _chunk, _dsa_kwargs, _Layer

    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import SlotOverflowError
    from sglang_cp_shared_kv.srt.sglang_wiring.pool_hooks import prepare_forward
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    kwargs = {**_dsa_kwargs(1, fp8=False), "device": device}
    group = CPGroup()
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool = CPSharedDSATokenToKVPool(8 * PS, cp_rank=rank, cp_size=world, cp_group=group, **kwargs)
        replicated = DSATokenToKVPool(world * pool.phys_pages * PS - PS, **kwargs)
        replicated.dcp_replicated = True

        def locs(pages: list[int], tokens: int) -> torch.Tensor:
            return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])[:tokens].to(device)

        def write(loc: torch.Tensor, seed: int) -> None:
            nope, rope, k, scale = (t.to(device) for t in _chunk(len(loc), seed))
            for p in (pool, replicated):
                p.set_index_k_scale_buffer(0, loc, k, scale)
                p.set_mla_kv_buffer(_Layer(0), loc, nope, rope)

        def batch(pages: list[list[int]], prefix_lens: list[int], seq_lens: list[int], rids: list[str]):
            req_to_token = torch.zeros((len(pages), 8 * PS), dtype=torch.int32, device=device)
            for r, (p, n) in enumerate(zip(pages, seq_lens)):
                req_to_token[r, :n] = locs(p, n).int()
            fb = SimpleNamespace(
                forward_mode=ForwardMode.EXTEND,
                req_pool_indices=torch.arange(len(pages), device=device),
                extend_prefix_lens_cpu=prefix_lens,
                seq_lens_cpu=seq_lens,
                rids=rids,
            )
            assert prepare_forward(pool, req_to_token, fb) is True
            new = torch.cat([locs(p, n)[q:] for p, q, n in zip(pages, prefix_lens, seq_lens)])
            write(new, seed=7)
            every = [locs(p, n).long() for p, n in zip(pages, seq_lens)]
            rows = [pool.translate_loc_to_scratch(e) for e in every]
            view = pool.get_key_buffer(0)
            table = torch.stack([torch.nn.functional.pad(e[::PS] // PS, (0, 4 - len(e[::PS]))) for e in every])
            lens = torch.tensor(seq_lens, device=device)
            index = pool.get_index_k_scale_buffer(0, lens, table, sum(seq_lens), max(seq_lens))
            return every, rows, view, index

        # Request req-a: 3 prefix pages and 1 new page, all on owner 1 (logical pages 3, 5, 7, 9);
        # req-b: 2 fresh pages on owners 0 and 1. The view covers the prefix only: S = 2 pages per
        # owner, owner 1 holds 3; pages 9, 10, 11 are staged past the view.
        pages = [[3, 5, 7, 9], [10, 11]]
        write(locs(pages[0][:3], 3 * PS), seed=3)  # the cached prefix, written before the batch
        every, rows, view, index = batch(pages, [3 * PS, 0], [3 * PS + 20, PS + 9], ["req-a", "req-b"])
        plan = pool.read.views.plan
        out = {"view_rows": view.shape[0], "slots": plan.view_pages, "S": plan.slots_per_rank}
        out["staged"] = pool.read.counters.pages_staged
        out["max_row"] = max(int(r.max()) for r in rows)
        out["min_row"] = min(int(r.min()) for r in rows)
        # Per position: does the view hold the replicated bytes (within the block) or a trash slot?
        exact, trash = [], []
        for e, r in zip(every, rows):
            got, want = view[r].view(torch.uint8), replicated.get_key_buffer(0)[e].view(torch.uint8)
            for j in range(0, len(e), PS):
                exact.append(bool(torch.equal(got[j : j + PS], want[j : j + PS])))
                page = int(r[j]) // PS
                staged = page >= plan.view_pages
                trash.append(not staged and int(plan.slot_phys[page]) == pool.trash_page)
        out["exact"], out["trash"] = exact, trash
        out["index_shapes"] = [tuple(t.shape) for t in index]
        pool.end_shard_extend()
        # The next batch, balanced and fresh, runs and reads its own bytes; the one after it fails as it
        # begins (SGLang's ``prepare_kv_shard_forward``), on every rank.
        every, rows, view, _ = batch([[12, 13]], [0], [2 * PS], ["req-c"])
        want = replicated.get_key_buffer(0)[every[0]].view(torch.uint8)
        out["after_exact"] = bool(torch.equal(view[rows[0]].view(torch.uint8), want))
        pool.end_shard_extend()
        try:
            batch([[14, 15]], [0], [2 * PS], ["req-d"])
            out["error"] = None
        except SlotOverflowError as err:
            out["error"] = str(err)
    return out


@needs_interpreter
@pytest.mark.parametrize("world", [2])
def test_non_rotating_pages_read_trash_and_fail_the_batch(world):
    from reference.spawn import spawn_ranks

    for res in spawn_ranks(_rank, world, "cpu", timeout_s=300):
        # Never past the buffer: [view | 3 staged pages | trash page], every row inside it.
        assert res["slots"] == world * res["S"] and res["S"] == 2 and res["staged"] == 3, res
        assert res["view_rows"] == (res["slots"] + res["staged"] + 1) * PS, res
        assert 0 <= res["min_row"] and res["max_row"] < res["view_rows"], res
        # req-a: prefix pages 3, 5 in owner 1's block (S = 2), page 7 past it; page 9 and req-b's
        # 10, 11 are the current chunk, staged: exact.
        assert res["exact"] == [True, True, False, True, True, True], res
        assert res["trash"] == [False, False, True, False, False, False], res
        assert res["error"] == (
            "--enable-cp-shared-kv: slot overflow: the batch of requests [req-a, req-b] reads [0, 3] page "
            "positions from owners 0..1, more than the 2 pages of an owner's block (the pages of a request do "
            "not rotate owners); those positions read the trash page, so the batch fails"
        ), res
        assert res["after_exact"], res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_non_rotating_pages_on_gpu_fail_the_batch_without_a_sync():
    """The same batch on CUDA: the flag is read from pinned memory once it has landed. On 2 GPUs the
    ranks all-gather over NCCL; on one GPU both ranks share it and all-gather over gloo."""
    from reference.spawn import spawn_ranks

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    for res in spawn_ranks(_gpu_rank, 2, backend=backend, timeout_s=300):
        assert res["max_row"] < res["view_rows"] and res["error"] is not None, res
        assert "[req-a, req-b]" in res["error"] and "[0, 3]" in res["error"], res


def _gpu_rank(rank: int, world: int) -> dict:
    torch.cuda.synchronize()
    return _rank(rank, world, "cuda")
