"""What ``--enable-cp-shared-kv`` does, per CP rank: one startup line, and metrics in SGLang's ``/metrics``.

Metrics exist only with ``--enable-metrics`` (``docs/usage.md`` lists them), made as SGLang's scheduler
metrics plus ``cp_rank``: every CP rank reports its own shard. Every value is one the host already has:
nothing reads the device.
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


class CPSharedKVMetrics:
    """The flag's Prometheus series for one process, under ``labels`` (SGLang's scheduler labels + ``cp_rank``)."""

    def __init__(self, labels: dict[str, Any]):
        from prometheus_client import Counter, Gauge, Histogram

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Gauge(PREFIX + name, doc, [*names, *extra], multiprocess_mode="mostrecent")

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, names)

        self.held_tokens = gauge("held_tokens", "KV token slots this CP rank's pool holds (1/N of every page).")
        self.logical_capacity_tokens = gauge(
            "logical_capacity_tokens",
            "Logical KV tokens the CP group caches with the sharding (the widened allocator).",
        )
        self.view_arena_bytes = gauge("view_arena_bytes", "Bytes of this rank's view arena, allocated once.")
        self.view_arena_peak_used_bytes = gauge(
            "view_arena_peak_used_bytes", "The most bytes of the view arena one batch's read buffers have used."
        )
        self.view_transport = gauge(
            "view_transport", "1 on the transport this rank's views are all-gathered with.", ("transport",)
        )
        self.view_bytes_received_per_batch = Histogram(
            PREFIX + "view_bytes_received_per_batch",
            "Bytes of prefix pages one batch's views received from the other CP ranks, all layers.",
            names,
            buckets=BYTES_BUCKETS,
        )
        self.view_bytes_received_total = counter(
            "view_bytes_received_total", "Bytes of prefix pages the views received from other CP ranks."
        )
        self.arena_deferrals = counter(
            "arena_deferrals_total",
            "Times SGLang's admission held a request back because the batch's views would not fit the view arena.",
        )
        self.slot_overflows = counter(
            "slot_overflows_total", "Batches failed because their pages did not rotate owners."
        )
        self.manifest_rejections = counter(
            "manifest_rejections_total", "Requests whose prefill page manifests the decode server refused."
        )
        self._peak_used = 0
        self._recorded = None  # the last BatchCounters recorded (a batch is recorded once)
        self._transport: str | None = None

    def series(self, metric: Any) -> Any:
        return metric.labels(**self.labels)

    def pools_built(self, pool: Any, allocator: Any) -> None:
        self.series(self.held_tokens).set(pool.size)
        self.series(self.logical_capacity_tokens).set(allocator.size)
        self.series(self.view_arena_bytes).set(arena_bytes(pool))

    def batch_begun(self, pool: Any) -> None:
        """After ``begin_shard_extend``: the arena share of this batch's read buffers, the transport once chosen."""
        read = pool.read
        if read.arena is not None and read.stage_latent is not None:
            sets = read.views.view_sets if read.mode == "materialized" else 1
            used = sets * sum(t.nbytes for t in (read.stage_latent, read.stage_index) if t is not None)
            if used > self._peak_used:
                self._peak_used = used
                self.series(self.view_arena_peak_used_bytes).set(used)
        if self._transport is None and read.views is not None and read.views.group is not None:
            self._transport = str(read.views.group.backend)  # copy_engine, nccl or gloo
            self.view_transport.labels(**self.labels, transport=self._transport).set(1)

    def batch_done(self, counters: Any) -> None:
        """A batch whose layers have all read their views (recorded when the next batch begins)."""
        if counters is None or counters is self._recorded:
            return
        self._recorded = counters
        self.series(self.view_bytes_received_per_batch).observe(counters.bytes_received)
        if counters.bytes_received:
            self.series(self.view_bytes_received_total).inc(counters.bytes_received)


def arena_bytes(pool: Any) -> int:
    """Bytes of a CP-shared pool's view arena (0 without one)."""
    arena = pool.read.arena
    return sum(t.nbytes for t in arena.values()) if arena is not None else 0


def sglang_labels() -> dict[str, Any]:
    """SGLang's scheduler metric labels for this process (with its extra labels), and ``cp_rank``."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg, get_observability, get_parallel, get_serving

    parallel = get_parallel()
    labels = {
        "model_name": get_serving().served_model_name,
        "engine_type": DisaggregationMode.to_engine_type(get_disagg().disaggregation_mode),
        "tp_rank": parallel.tp_rank,
        "cp_rank": parallel.attn_cp_rank,
    }
    labels.update(get_observability().extra_metric_labels or {})
    return labels


_metrics: CPSharedKVMetrics | None = None
_decided = False


def get() -> CPSharedKVMetrics | None:
    """This process's metrics when the flag and ``--enable-metrics`` are on (built at the first call), else None."""
    global _metrics, _decided
    if not _decided:
        from sglang.srt.runtime_context import get_observability

        if not runtime_enabled():
            return None  # no server args published yet: decide later
        _decided = True
        if get_observability().enable_metrics:
            _metrics = CPSharedKVMetrics(sglang_labels())
    return _metrics


def use(metrics: CPSharedKVMetrics | None) -> None:
    """Record into ``metrics`` from now on in this process."""
    global _metrics, _decided
    _metrics, _decided = metrics, True


def startup_line(pool: Any, allocator: Any) -> str:
    """The one INFO line a prefill CP rank logs once its pool and allocator are built."""
    from sglang_cp_shared_kv.srt.distributed.copy_engine import TRANSPORT_ENV, transport_setting

    spec = pool.spec
    n = spec.cp_size
    arena = arena_bytes(pool)
    # The arena was charged to the KV budget: a replicated pool would hold those bytes as tokens.
    token_bytes = (spec.row_bytes + (INDEX_TOKEN_BYTES if spec.with_indexer else 0)) * len(pool.kv_buffer)
    replicated = pool.size + arena // token_bytes
    return (
        f"{FLAG}: CP rank {spec.cp_rank} of {n}: holds 1/{n} of every KV page, {pool.size} token slots for "
        f"{allocator.size} logical tokens over the CP group (a replicated pool in this memory: about {replicated} "
        f"tokens); view arena {arena / 2**20:.1f} MiB; view transport {transport_setting()} ({TRANSPORT_ENV}); "
        f"prefetch {'on unless the views go over NCCL' if pool.read.prefetch else 'off'}"
    )


# -- at SGLang's call sites --


def report_pools(pool, allocator) -> None:
    logger.info(startup_line(pool, allocator))
    metrics = get()
    if metrics is not None:
        metrics.pools_built(pool, allocator)


def count_deferral(adder) -> None:
    """Count a request ``PrefillAdder._kv_shard_reserve_scratch`` deferred for the view arena."""
    if serves_arena(adder.token_to_kv_pool_allocator):
        _count("arena_deferrals")


def count_manifest_rejection() -> None:
    _count("manifest_rejections")


def _count(counter: str) -> None:
    metrics = get()
    if metrics is not None:
        metrics.series(getattr(metrics, counter)).inc()
