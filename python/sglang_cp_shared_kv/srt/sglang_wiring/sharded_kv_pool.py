"""SGLang's MLA and DSA token pools, sharded over the prefill CP ranks.

The pools subclass SGLang's own, so every ``isinstance`` check and byte format stays SGLang's. Storage is
SGLang's per-rank buffers, paged by ``placement.PageOwnership``; every rank receives the whole current chunk,
which SGLang's writers quantize to ``store_rows(locs)`` (a masked store: no host sync); reads go through the
kv-shard contract SGLang's backends already call, served by ``read_state.BatchReadState``."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import torch
from sglang.kernels.ops.kvcache import dsa_index_k_cache
from sglang.srt.mem_cache.index_key_cache import IndexKeyCache
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool, unwrap_write_loc
from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.read_state import (
    BatchInputs,
    BatchReadState,
    PageBuffers,
    TensorMemo,
)
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import INDEX_TOKEN_BYTES
from sglang_cp_shared_kv.srt.mem_cache.placement import CPSharedSpec

logger = logging.getLogger(__name__)


def stop_server(line: str) -> None:
    """A lost CP peer stops the server as a scheduler's crash does: SIGQUIT to the parent, which kills the
    process tree. The grace keeps this rank's stream waiting until then, so the failed batch yields nothing."""
    os.kill(os.getppid(), signal.SIGQUIT)
    time.sleep(5)


def _host_ints(values) -> tuple[int, ...]:
    """SGLang's host lengths (a list or a CPU tensor) as Python ints, a tensor through one ``tolist``."""
    if isinstance(values, torch.Tensor):
        return tuple(values.tolist())  # sync-ok: SGLang's *_cpu lengths
    return tuple(int(v) for v in values)


class CPSharedKVPoolMixin(PageInterleaveKVPoolMixin):
    """Sharded storage + the kv-shard read contract over an SGLang MLA/DSA pool's buffers. SGLang's mixin is
    inherited for the type only (its backends detect a sharded pool by it); every method it calls is here."""

    def _init_cp_shared(
        self, cp_rank: int | None, cp_size: int | None, cp_group: CPGroup | Callable[[], CPGroup] | None
    ) -> None:
        """Build the pool's ``CPSharedSpec``: ranks from the arguments, else from SGLang's parallel context,
        whose CP device group is then looked up at first use."""
        on_peer_lost = None  # ranks handed in (tests, benchmarks): a lost peer raises at the next call
        if cp_rank is None or cp_size is None:
            from sglang.srt.runtime_context import get_parallel

            parallel = get_parallel()
            cp_rank, cp_size = parallel.attn_cp_rank, parallel.attn_cp_size
            cp_group = cp_group or (lambda: CPGroup(get_parallel().attn_cp_group.device_group))
            on_peer_lost = stop_server
        if not isinstance(cp_size, int) or cp_size < 2:
            raise ValueError(f"cp_size must be an int > 1 for a sharded pool, got {cp_size!r}")
        ps = self.page_size
        spec = CPSharedSpec(
            cp_size=cp_size,
            cp_rank=cp_rank,
            page_size=ps,
            phys_pages=self.size // ps + 1,  # page 0, the trash page, included
            row_bytes=self.kv_buffer[0][0].nbytes,
            with_indexer=isinstance(self, DSATokenToKVPool),
        )
        if isinstance(cp_group, CPGroup) and (cp_group.rank != cp_rank or cp_group.size != cp_size):
            raise ValueError(f"cp_group ({cp_group}) does not match cp_rank {cp_rank} / cp_size {cp_size}")
        if self.size % ps:
            raise ValueError(f"pool size {self.size} must be a multiple of page_size {ps}")
        self.spec = spec
        self.dcp_replicated = True  # rows are physical: never apply SGLang's DCP owner rule (DCP is rejected)
        self.shard_rank, self.shard_size = spec.cp_rank, spec.cp_size
        self.phys_pages = spec.phys_pages
        self.ownership = spec.ownership()
        self.trash_page = spec.trash_page
        self.row_bytes = spec.row_bytes
        latent = PageBuffers(
            self.ownership,
            spec.cp_rank,
            spec.row_bytes,
            [buf.view(torch.uint8).view(spec.phys_pages, ps * spec.row_bytes) for buf in self.kv_buffer],
        )
        index = None
        if spec.with_indexer:
            index = PageBuffers(self.ownership, spec.cp_rank, INDEX_TOKEN_BYTES, list(self.index_key_cache.buffer))
        self.read = BatchReadState(
            self.ownership, spec.cp_rank, spec.logical_pages, latent, index, cp_group, on_peer_lost
        )
        # The same out_cache_loc reaches every layer's latent and indexer writes: its rows once.
        self._store_rows = TensorMemo(
            lambda locs: self.ownership.store_rows(locs.long(), spec.cp_rank, spec.trash_page, spec.phys_pages)[0]
        )
        # The last extend batch's shared-prefix hint (``pool_hooks.hint_shared_prefix``), or None.
        self.shared_prefix_hint = None
        # The request ids and shared-prefix pairs the next ``begin_shard_extend`` takes (``name_next_batch``).
        self.next_batch: tuple[tuple[str, ...] | None, tuple | None] = (None, None)
        self._shard_extend_active = False
        logger.debug("CP-shared KV pool: %s", spec)  # the rank's one INFO line: metrics.startup_line

    def attach_view_arena(self, spec, prefetch: bool = False) -> int:
        """Allocate the view arena once, sized by the allocator's ``PageShardSpec``. Returns its bytes."""
        if spec.page_size != self.page_size or spec.shard_size != self.spec.cp_size:
            raise ValueError(
                f"arena spec (page size {spec.page_size}, {spec.shard_size} ranks) does not match the pool "
                f"(page size {self.page_size}, {self.spec.cp_size} ranks)"
            )
        return self.read.attach_arena(spec.max_prefix_tokens, spec.chunk_tokens, prefetch)

    # -- write path --
    def store_rows(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical row (int64) of every loc on this rank (``PageOwnership.store_rows``), once per loc tensor."""
        return self._store_rows(locs)

    def _local_layer(self, layer, layer_id_override) -> int:
        return (layer_id_override if layer_id_override is not None else layer.layer_id) - self.start_layer

    def _stage_rows(self, locs: torch.Tensor) -> torch.Tensor | None:
        """Rows of the batch's staging pages for ``locs``, or None outside a sharded extend batch."""
        return self.read.stage_rows(locs) if self._shard_extend_active and self.read.mode is not None else None

    def _as_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """A uint8 ``[rows, row_bytes]`` buffer as the pool's ``[rows, 1, kv_cache_dim]`` store dtype."""
        return buf.view(self.store_dtype).view(buf.shape[0], 1, self.kv_cache_dim)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        local = self._local_layer(layer, layer_id_override)
        rows = self.store_rows(loc)
        stage_rows = self._stage_rows(loc)
        if stage_rows is None:
            self._write_mla_kv_buffer(self.kv_buffer[local], rows, cache_k_nope, cache_k_rope)
            return
        # Quantize once into the staging rows the batch reads, then keep the owned ones.
        stage = self._as_rows(self.read.stage(local)[0])
        self._write_mla_kv_buffer(stage, stage_rows, cache_k_nope, cache_k_rope)
        self.kv_buffer[local].index_copy_(0, rows, stage.index_select(0, stage_rows))

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, layer_id_override=None):
        if self.dsa_kv_cache_store_fp8:
            raise NotImplementedError("packed DSA latent writes go through set_mla_kv_buffer")
        loc, _, _ = unwrap_write_loc(loc_info)
        local = self._local_layer(layer, layer_id_override)
        if cache_k.dtype != self.dtype:
            cache_k = cache_k.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k = cache_k.view(self.store_dtype)
        stage_rows = self._stage_rows(loc)
        if stage_rows is not None:
            self._as_rows(self.read.stage(local)[0])[stage_rows] = cache_k
        self.kv_buffer[local][self.store_rows(loc)] = cache_k

    # -- what the scheduler knows of the next batch --
    def name_next_batch(self, request_ids, prefix_lens) -> None:
        """The request ids of the batch the next ``begin_shard_extend`` begins (for errors), and the hint's
        pairs where the hint is that batch's (``SharedPrefixHint.for_batch``)."""
        hint = self.shared_prefix_hint
        shared = hint.for_batch(request_ids, prefix_lens) if hint is not None else None
        names = tuple(str(r) for r in request_ids) if request_ids is not None else None
        self.next_batch = (names, tuple(shared) if shared is not None else None)

    # -- the kv-shard read contract --
    def begin_shard_extend(self, req_to_token, req_pool_indices, prefix_lens_cpu, seq_lens_cpu) -> None:
        self._store_rows.clear()  # per batch: a kernel may refill a loc buffer without a version bump
        (names, shared), self.next_batch = self.next_batch, (None, None)  # that batch's only
        inputs = BatchInputs(
            req_to_token, req_pool_indices, _host_ints(prefix_lens_cpu), _host_ints(seq_lens_cpu), names, shared
        )
        self.read.begin(inputs)
        self._shard_extend_active = True

    def end_shard_extend(self) -> None:
        self._store_rows.clear()
        self.read.end()
        self._shard_extend_active = False

    def translate_loc_to_scratch(self, loc: torch.Tensor) -> torch.Tensor:
        if not self._shard_extend_active:
            raise RuntimeError(
                "translate_loc_to_scratch outside a sharded extend batch (begin_shard_extend not called)"
            )
        return self.read.translate(loc)

    def _read_rows(self, layer_id: int) -> torch.Tensor:
        """The kernels' view of the layer's read buffer (the pool's store dtype, as ``kv_buffer``)."""
        rows = self._as_rows(self.read.latent_rows(layer_id - self.start_layer))
        return rows.view(self.dtype) if self.store_dtype != self.dtype else rows

    def get_key_buffer(self, layer_id: int):
        if self._shard_extend_active:
            return self._read_rows(layer_id)
        return super().get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int):
        if self._shard_extend_active:
            if self.dsa_kv_cache_store_fp8:
                raise NotImplementedError("packed DSA latent reads need the raw key buffer and a DSA backend")
            return self._read_rows(layer_id)[..., : self.kv_lora_rank]
        return super().get_value_buffer(layer_id)

    def get_kv_buffer_shape(self):
        k = self.kv_buffer[0]
        return k.shape, k[..., : self.kv_lora_rank].shape

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        """Latent rows of logical ``loc`` as separate nope / rope tensors, from this batch's read buffer."""
        if not self._shard_extend_active:
            raise RuntimeError("a sharded pool reads logical locs only inside a sharded extend batch")
        rows = self.read.translate(loc)
        kv = self._read_rows(layer.layer_id)
        if self.dsa_kv_cache_store_fp8:
            from sglang.kernels.ops.attention.dsa.dequant_k_cache import dequantize_k_cache_paged_dsa

            out = dequantize_k_cache_paged_dsa(kv, rows)
            if dst_dtype is not None:
                out = out.to(dst_dtype)
            return out[..., : self.kv_lora_rank].contiguous(), out[..., self.kv_lora_rank :].contiguous()
        from sglang.srt.mem_cache.utils import get_mla_kv_buffer_triton

        dst_dtype = dst_dtype or self.dtype
        nope = torch.empty((loc.shape[0], 1, self.kv_lora_rank), dtype=dst_dtype, device=kv.device)
        rope = torch.empty((loc.shape[0], 1, self.qk_rope_head_dim), dtype=dst_dtype, device=kv.device)
        get_mla_kv_buffer_triton(kv, rows, nope, rope)
        return nope, rope

    # -- SGLang's operations that assume whole pages on every rank --
    def move_kv_cache(self, tgt_loc, src_loc):
        raise NotImplementedError("moving KV between logical locs crosses page owners on a CP-shared pool")

    def get_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("CPU offload of a CP-shared pool is not wired (each rank holds 1/N of a page set)")

    def load_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("CPU restore of a CP-shared pool is not wired (each rank holds 1/N of a page set)")


class CPSharedMLATokenToKVPool(CPSharedKVPoolMixin, MLATokenToKVPool):
    """SGLang's MLA latent pool, sharded over the prefill CP ranks."""

    def __init__(self, *args, cp_rank=None, cp_size=None, cp_group=None, **kwargs):
        MLATokenToKVPool.__init__(self, *args, **kwargs)
        if self.use_dsa:
            raise ValueError("DSA pools are CPSharedDSATokenToKVPool")
        self._init_cp_shared(cp_rank, cp_size, cp_group)


class CPSharedIndexKeyCache(IndexKeyCache):
    """The DSA indexer K + scale pages of a CP-shared pool: masked writes, reads from the batch's buffer."""

    def _has_keys(self, local: int) -> bool:
        """Whether local layer ``local`` holds indexer keys (``PageBuffers.has_index``)."""
        return self.pool.read.source.has_index[local]

    def get_buffer(self, layer_id: int) -> torch.Tensor:
        pool = self.pool
        if not pool._shard_extend_active or not self._has_keys(layer_id - pool.start_layer):
            return self.get_local_buffer(layer_id)
        counter = pool.layer_transfer_counter  # as SGLang's read: the layer's pages loaded first
        if counter is not None:
            counter.wait_until(layer_id - pool.start_layer)
        return self._kernel_view(pool.read.index_pages(layer_id - pool.start_layer))

    def get_k_and_scale(self, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len):
        pool = self.pool
        if not pool._shard_extend_active:
            raise RuntimeError("indexer pages of a CP-shared pool are read only inside a sharded extend batch")
        if not self._has_keys(layer_id - pool.start_layer):
            raise RuntimeError(f"layer {layer_id} skips top-k and holds no indexer keys")
        return dsa_index_k_cache.GetKAndS.execute(
            pool,
            self.get_buffer(layer_id),
            page_indices=pool.read.translate_pages_once(page_indices),
            seq_len_tensor=seq_len_tensor,
            seq_len_sum=seq_len_sum,
            max_seq_len=max_seq_len,
        )

    def write_targets(self, layer_id: int, loc: torch.Tensor):
        """(buffer, token slots, None) pairs an indexer writer stores the whole chunk to: the pool at its masked
        rows and, inside an extend batch, the staging page the batch reads."""
        if loc.numel() == 0:
            return []
        pool = self.pool
        local = self.buffer[layer_id - pool.start_layer]
        if not local.shape[0]:
            raise RuntimeError(f"layer {layer_id} skips top-k and holds no indexer keys")
        targets = [(self._kernel_view(local), pool.store_rows(loc), None)]
        stage_rows = pool._stage_rows(loc)
        if stage_rows is not None:
            targets.append((self._kernel_view(pool.read.stage(layer_id - pool.start_layer)[1]), stage_rows, None))
        return targets

    def store_quantized(self, layer_id, loc, index_k, index_k_scale) -> None:
        for buf, slots, _ in self.write_targets(layer_id, loc):
            dsa_index_k_cache.SetKAndS.execute(
                pool=self.pool, buf=buf, loc=slots, index_k=index_k, index_k_scale=index_k_scale
            )

    def move(self, tgt_loc, src_loc) -> None:
        raise NotImplementedError("moving indexer keys between logical locs crosses page owners")

    def cpu_copy(self, indices):
        raise NotImplementedError("CPU offload of a CP-shared indexer cache is not wired")

    def load_cpu_copy(self, index_k_cpu, indices) -> None:
        raise NotImplementedError("CPU restore of a CP-shared indexer cache is not wired")


class CPSharedDSATokenToKVPool(CPSharedKVPoolMixin, DSATokenToKVPool):
    """SGLang's DSA pool (MLA latent + lightning-indexer K/scale pages), sharded over the prefill CP ranks."""

    def __init__(self, *args, cp_rank=None, cp_size=None, cp_group=None, **kwargs):
        DSATokenToKVPool.__init__(self, *args, **kwargs)
        if self.index_kpool != 1 or self.index_buf_size != self.size:
            raise ValueError(
                f"a CP-shared DSA pool needs index_kpool 1 and equal latent/indexer capacity, got "
                f"index_kpool={self.index_kpool}, index_buf_size={self.index_buf_size}, size={self.size}"
            )
        self._init_cp_shared(cp_rank, cp_size, cp_group)

    def _create_index_key_cache(self) -> IndexKeyCache:
        return CPSharedIndexKeyCache(self, self.index_buf_size)

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_key_cache.get_buffer(layer_id)
