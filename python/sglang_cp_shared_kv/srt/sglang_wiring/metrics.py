"""A CP rank's startup line and, with ``--enable-metrics``, its series in ``/metrics``:
SGLang's scheduler labels plus ``cp_rank``, values the host already has (no device read).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.sglang_wiring.flag import FLAG, runtime_enabled
from sglang_cp_shared_kv.srt.sglang_wiring.view_arena import serves_arena

logger = logging.getLogger(__name__)

PREFIX = "sglang:cp_shared_kv_"
# Bytes a batch receives: 0 (current-reuse) and powers of 4 from 1 MiB to 64 GiB.
BYTES_BUCKETS = (0.0, *(float(4**k * 2**20) for k in range(9)))
SERIES = {  # name: help; *_total is a counter, *_per_batch a histogram, the rest gauges
    "held_tokens": "KV token slots this CP rank's pool holds (1/N of every page).",
    "logical_capacity_tokens": "Logical KV tokens the CP group's cache holds.",
    "view_arena_bytes": "Bytes of this rank's view arena, allocated once.",
    "view_arena_peak_used_bytes": "The most bytes of the arena one batch has used.",
    "view_transport": "1 on the transport this rank's views are all-gathered with.",
    "view_bytes_received_per_batch": "Bytes one batch's views got from other ranks.",
    "view_bytes_received_total": "Bytes of prefix pages views got from other ranks.",
    "arena_deferrals_total": "Requests held back as their views did not fit the arena.",
    "slot_overflows_total": "Batches failed because their pages did not rotate owners.",
    "manifest_rejections_total": "Requests whose prefill page manifests were refused.",
}


class CPSharedKVMetrics:
    """The series of one process, labelled ``labels``; attributes of their names."""

    def __init__(self, labels: dict[str, Any]):
        from prometheus_client import Counter, Gauge, Histogram

        self.labels = {k: str(v) for k, v in labels.items()}
        for name, doc in SERIES.items():
            extra = ["transport"] if name == "view_transport" else []
            args = (PREFIX + name, doc, [*self.labels, *extra])
            if name.endswith("_total"):
                metric = Counter(*args)
            elif name.endswith("_per_batch"):
                metric = Histogram(*args, buckets=BYTES_BUCKETS)
            else:
                metric = Gauge(*args, multiprocess_mode="mostrecent")
            setattr(self, name.removesuffix("_total"), metric)
        self._peak_used = 0
        self._recorded = None  # the last batch's BatchCounters, recorded once

    def series(self, metric: Any, **extra: str) -> Any:
        return metric.labels(**self.labels, **extra)

    def batch_begun(self, pool: Any) -> None:
        """After ``begin_shard_extend``: its read buffers' arena use, the transport."""
        read = pool.read
        if read.arena is not None and read.stage_latent is not None:
            sets = read.views.view_sets if read.mode == "materialized" else 1
            stages = (read.stage_latent, read.stage_index)
            used = sets * sum(t.nbytes for t in stages if t is not None)
            self._peak_used = max(self._peak_used, used)
            self.series(self.view_arena_peak_used_bytes).set(self._peak_used)
        group = getattr(read.views, "group", None)
        if group is not None:  # copy_engine, nccl or gloo
            self.series(self.view_transport, transport=str(group.backend)).set(1)

    def batch_done(self, counters: Any) -> None:
        """A batch whose layers have all read their views (when the next one begins)."""
        if counters is None or counters is self._recorded:
            return
        self._recorded = counters
        self.series(self.view_bytes_received_per_batch).observe(counters.bytes_received)
        self.series(self.view_bytes_received).inc(counters.bytes_received)


_metrics: CPSharedKVMetrics | None = None
_decided = False


def get() -> CPSharedKVMetrics | None:
    """This process's metrics with the flag and ``--enable-metrics``, else None."""
    global _metrics, _decided
    if not _decided and runtime_enabled():  # not before server args are published
        from sglang.srt import runtime_context as rc
        from sglang.srt.disaggregation.utils import DisaggregationMode as Mode

        _decided, observability = True, rc.get_observability()
        if observability.enable_metrics:  # SGLang's scheduler labels, and cp_rank
            mode = Mode.to_engine_type(rc.get_disagg().disaggregation_mode)
            parallel, serving = rc.get_parallel(), rc.get_serving()
            labels = dict(model_name=serving.served_model_name, engine_type=mode)
            labels.update(tp_rank=parallel.tp_rank, cp_rank=parallel.attn_cp_rank)
            labels.update(observability.extra_metric_labels or {})
            _metrics = CPSharedKVMetrics(labels)
    return _metrics


def use(metrics: CPSharedKVMetrics | None) -> None:
    """Record into ``metrics`` from now on in this process."""
    global _metrics, _decided
    _metrics, _decided = metrics, True


def report_pools(pool: Any, allocator: Any) -> None:
    """A prefill CP rank's pool and allocator built: its INFO line, and its sizes."""
    from sglang_cp_shared_kv.srt.distributed import copy_engine

    spec, n, rank = pool.spec, pool.spec.cp_size, pool.spec.cp_rank
    arena = sum(t.nbytes for t in (pool.read.arena or {}).values())
    row = spec.row_bytes + (INDEX_TOKEN_BYTES if spec.with_indexer else 0)
    replicated = pool.size + arena // (row * len(pool.kv_buffer))  # the arena as tokens
    prefetch = "on unless the views go over NCCL" if pool.read.prefetch else "off"
    transport = f"{copy_engine.transport_setting()} ({copy_engine.TRANSPORT_ENV})"
    logger.info(
        f"{FLAG}: CP rank {rank} of {n}: holds 1/{n} of every KV page, {pool.size} "
        f"token slots for {allocator.size} logical tokens over the CP group (a "
        f"replicated pool in this memory: about {replicated} tokens); view arena "
        f"{arena / 2**20:.1f} MiB; view transport {transport}; prefetch {prefetch}"
    )
    if (metrics := get()) is not None:
        metrics.series(metrics.held_tokens).set(pool.size)
        metrics.series(metrics.logical_capacity_tokens).set(allocator.size)
        metrics.series(metrics.view_arena_bytes).set(arena)


def count_deferral(adder: Any) -> None:
    """Count a request ``PrefillAdder._kv_shard_reserve_scratch`` deferred."""
    _count("arena_deferrals", serves_arena(adder.token_to_kv_pool_allocator))


def count_manifest_rejection() -> None:
    _count("manifest_rejections")


def _count(counter: str, counted: bool = True) -> None:
    if counted and (metrics := get()) is not None:
        metrics.series(getattr(metrics, counter)).inc()
