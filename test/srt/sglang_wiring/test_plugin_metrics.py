"""The plugin's startup line and Prometheus series, read back from prometheus_client's multiprocess registry.

Two gloo CP ranks build SGLang's DSA pool as ``CPSharedDSATokenToKVPool`` with a prefetching view
arena and SGLang's widened ``PageInterleavePoolAllocator``, pass them through the ``_init_pools``
hook (the startup line, logged at INFO), and run extend batches through SGLang's
``prepare_kv_shard_forward`` (``pool_hooks.prepare_forward``, which records the metrics), every layer reading its keys through
the pool contract: a current-only batch, two prefix batches, then a batch whose pages do not rotate
owners (its slot overflow fails the batch after next). SGLang's scratch admission, with ``count_deferral``
after it, holds back one request the arena cannot take. The test process then reads what
SGLang's ``/metrics`` would serve (``MultiProcessCollector`` over ``$PROMETHEUS_MULTIPROC_DIR``) and
checks every series against sizes and byte counts computed here from the batch shapes.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.multirank,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="SGLang's pool writers are Triton kernels: CPU needs TRITON_INTERPRET=1",
    ),
]

PS, LAYERS, SIZE = 64, 2, 16 * 64
PREFIX_TOKENS, CHUNK_TOKENS = 8 * PS, 4 * PS  # the arena's regions (a PageShardSpec)
LABELS = {"model_name": "tiny-dsa", "engine_type": "prefill", "tp_rank": "0"}


def _rank(rank: int, world: int, _cfg: dict) -> dict:
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.kv_cache_configurator import _InitializedPools
    from sglang.srt.mem_cache.page_interleave import PageShardSpec
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.runtime_context import get_parallel

    from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
    from sglang_cp_shared_kv.srt.layers.attention.nsa.slot_plan import SlotOverflowError
    from sglang_cp_shared_kv.srt.sglang_wiring import metrics
    from sglang_cp_shared_kv.srt.sglang_wiring.pool_hooks import prepare_forward
    from sglang_cp_shared_kv.srt.sglang_wiring.sharded_kv_pool import CPSharedDSATokenToKVPool

    kwargs = dict(
        page_size=PS,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=576,
    )
    spec = PageShardSpec(
        shard_rank=rank, shard_size=world, page_size=PS, max_prefix_tokens=PREFIX_TOKENS, chunk_tokens=CHUNK_TOKENS
    )
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False):
        pool = CPSharedDSATokenToKVPool(SIZE, cp_rank=rank, cp_size=world, cp_group=CPGroup(), **kwargs)
    arena = pool.attach_view_arena(spec, prefetch=True)
    allocator = PageInterleavePoolAllocator(
        SIZE, physical_page_size=PS, shard_size=world, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=True
    )
    out = {"arena": arena, "size": pool.size, "logical": allocator.size, "row_bytes": pool.row_bytes}

    metrics.use(metrics.CPSharedKVMetrics({**LABELS, "cp_rank": rank}))
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append((record.levelno, record.getMessage()))
    logging.getLogger(metrics.__name__).addHandler(handler)
    logging.getLogger(metrics.__name__).setLevel(logging.INFO)
    built = _InitializedPools(req_to_token_pool=None, token_to_kv_pool=pool, token_to_kv_pool_allocator=allocator)
    metrics.report_pools(built.token_to_kv_pool, built.token_to_kv_pool_allocator)
    out["logged"] = logged

    req_to_token = torch.zeros((4, 8 * PS), dtype=torch.int32)

    def batch(pages: list[list[int]], prefix_lens: list[int], seq_lens: list[int]) -> None:
        """One extend batch the DSA backend's way: prepare_kv_shard_forward, then every layer's key read."""
        for r, p in enumerate(pages):
            locs = (torch.tensor(p).repeat_interleave(PS) * PS + torch.arange(PS).repeat(len(p)))[: seq_lens[r]]
            req_to_token[r, : seq_lens[r]] = locs.int()
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(pages),
            input_ids=torch.zeros(sum(seq_lens) - sum(prefix_lens), dtype=torch.int64),
            req_pool_indices=torch.arange(len(pages)),
            seq_lens=torch.tensor(seq_lens),
            out_cache_loc=None,
            seq_lens_sum=sum(seq_lens),
            seq_lens_cpu=torch.tensor(seq_lens),
            rids=[f"req-{r}" for r in range(len(pages))],
            extend_prefix_lens_cpu=prefix_lens,
        )
        assert prepare_forward(pool, req_to_token, fb)
        for layer in range(LAYERS):
            pool.get_key_buffer(layer)  # the layer's view, gathered from the owners at its first read

    # Logical pages rotate owners (page p lives on rank p % 2); [0, 2) are reserved.
    batch([[2, 3, 4]], [0], [3 * PS - 5])  # current-only: nothing received
    batch([[2, 3, 4, 5], [6, 7]], [3 * PS, 0], [4 * PS, 2 * PS])  # 3 prefix pages
    batch([[2, 3, 4, 5, 6, 8], [6, 7, 9]], [4 * PS, 2 * PS], [6 * PS, 3 * PS])  # 4 + 2 prefix pages
    batch([[2, 4, 6, 8, 10, 12, 13]], [6 * PS], [7 * PS])  # 6 prefix pages, all on rank 0: overflow
    batch([[2, 3]], [0], [2 * PS])  # its flag is acted on as the batch after this one begins
    try:
        batch([[4, 5]], [0], [2 * PS])
        out["overflow"] = None
    except SlotOverflowError as e:
        out["overflow"] = str(e)

    # SGLang's scratch admission over the arena's spec: the second request's prefix does not fit.
    adder = object.__new__(PrefillAdder)
    adder.token_to_kv_pool_allocator = allocator
    adder.kv_shard_scratch_spec, adder.kv_shard_granule, adder.kv_shard_size = spec, PS, world
    adder.kv_shard_block_bound_pages = adder.kv_shard_chunk_pages = 0
    admitted = []
    for prefix_len in (4 * PS, 6 * PS):
        reserved = PrefillAdder._kv_shard_reserve_scratch(adder, prefix_len, PS)
        if not reserved:
            metrics.count_deferral(adder)
        admitted.append(reserved)
    out["admitted"] = admitted
    return out


def _value(families, name: str, **labels) -> float | None:
    for family in families:
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items()):
                return sample.value
    return None


def test_startup_line_and_metrics_of_two_cp_ranks(tmp_path, monkeypatch):
    from reference.spawn import spawn_ranks

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # as SGLang's launcher sets it
    world = 2
    results = spawn_ranks(_rank, world, {}, timeout_s=300)

    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    families = list(registry.collect())
    page = PS * (results[0]["row_bytes"] + 132)  # a latent + indexer page
    # Pages a rank receives per layer: (N - 1) * sum_i ceil(prefix_pages_i / N).
    received = [LAYERS * (world - 1) * s * page for s in (0, 2, 2 + 1)]
    for rank, res in enumerate(results):
        labels = {**LABELS, "cp_rank": rank}
        (level, line), *_ = res["logged"]
        assert level == logging.INFO, res["logged"]
        assert line.startswith(f"--enable-cp-shared-kv: CP rank {rank} of 2: holds 1/2 of every KV page"), line
        assert f"{res['size']} token slots for {res['logical']} logical tokens" in line, line
        # The arena was charged to the budget: a replicated pool in this memory holds its tokens too.
        replicated = res["size"] + res["arena"] // (LAYERS * page // PS)
        assert f"a replicated pool in this memory: about {replicated} tokens" in line, line
        assert f"view arena {res['arena'] / 2**20:.1f} MiB" in line and line.endswith(
            "prefetch on unless the views go over NCCL"
        ), line
        assert "view transport auto" in line, line

        def value(name, labels=labels, **extra):
            return _value(families, "sglang:cp_shared_kv_" + name, **labels, **extra)

        assert value("held_tokens") == res["size"] == SIZE
        assert value("logical_capacity_tokens") == res["logical"] == world * SIZE
        assert value("view_arena_bytes") == res["arena"]
        # The arena holds 8 + 2 * (4 + 1) = 18 pages. The largest share: batch 2's read buffer (2 * 2 view
        # pages, 3 staged, a trash page: 8) twice, as the 8 pages fit twice (prefetch); batch 3's 10 once.
        assert value("view_arena_peak_used_bytes") == 16 * page
        assert value("view_bytes_received_per_batch_count") == 5, "three before the overflow, it, one after"
        assert value("view_bytes_received_per_batch_sum") == sum(received) + LAYERS * (world - 1) * 3 * page
        assert value("view_bytes_received_per_batch_bucket", le="0.0") == 2  # the current-only batches
        assert value("view_bytes_received_total") == value("view_bytes_received_per_batch_sum")
        assert value("view_transport", transport="gloo") == 1
        assert value("slot_overflows_total") == 1 and "slot overflow" in res["overflow"]
        assert res["admitted"] == [True, False]
        assert value("arena_deferrals_total") == 1
