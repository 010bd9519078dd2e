"""SGLang's MLA and DSA pools, sharded over the prefill CP ranks: each rank stores the
rows of the pages it owns (``placement.PageOwnership``) and serves the kv-shard read
contract SGLang's backends call from ``read_state.BatchReadState``."""

from __future__ import annotations

import logging
import os
import signal
import time

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
from sglang_cp_shared_kv.srt.utils import check_int

logger = logging.getLogger(__name__)


def stop_server(line: str) -> None:
    """A lost CP peer stops the server as a scheduler crash does (SIGQUIT to the
    parent); until then this rank's stream waits, so the failed batch yields nothing."""
    os.kill(os.getppid(), signal.SIGQUIT)
    time.sleep(5)


def _host_ints(values) -> tuple[int, ...]:
    """SGLang's host lengths (a list or a CPU tensor) as Python ints."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()  # sync-ok: SGLang's *_cpu lengths
    return tuple(map(int, values))


def _unsupported(what: str):
    """A method of SGLang's that moves whole pages, which no rank holds."""

    def method(self, *args, **kwargs):
        raise NotImplementedError(f"{what} of a CP-shared pool is not wired")

    return method


def server_group():
    """``(rank, size, group)`` a server's pool is sharded over: a decode's DCP ranks
    (``--dcp-size``), else the prefill's attention CP ranks; the group (a ``CPGroup``)
    made at first use."""
    from sglang.srt.runtime_context import get_disagg, get_parallel

    p = get_parallel()
    if get_disagg().disaggregation_mode == "decode":
        return p.attn_dcp_rank, p.attn_dcp_size, lambda: CPGroup(get_parallel().dcp_group.device_group)
    return p.attn_cp_rank, p.attn_cp_size, lambda: CPGroup(get_parallel().attn_cp_group.device_group)


class CPSharedKVPoolMixin(PageInterleaveKVPoolMixin):
    """Sharded storage and the kv-shard read contract over an SGLang MLA/DSA pool.
    SGLang's mixin is inherited for its type only (its backends check it)."""

    def __init__(self, *args, cp_rank=None, cp_size=None, cp_group=None, **kwargs):
        """SGLang's pool, then this rank's share: ranks given (a lost peer raises), else
        the server's group (``server_group``; a lost peer stops the server)."""
        super().__init__(*args, **kwargs)
        lost, ps, dsa = None, self.page_size, isinstance(self, DSATokenToKVPool)
        if cp_rank is None or cp_size is None:
            cp_rank, cp_size, server = server_group()
            cp_group, lost = cp_group or server, stop_server
        check_int("cp_size", cp_size, 2)
        if self.use_dsa and not dsa:
            raise ValueError("DSA pools are CPSharedDSATokenToKVPool")
        if dsa and (self.index_kpool != 1 or self.index_buf_size != self.size):
            raise ValueError("a CP-shared DSA pool needs index_kpool 1, no extra keys")
        if self.size % ps:
            raise ValueError(f"pool size {self.size} is not whole {ps}-token pages")
        if isinstance(cp_group, CPGroup) and (cp_group.rank, cp_group.size) != (cp_rank, cp_size):
            raise ValueError(f"cp_group {cp_group} is not rank {cp_rank} of {cp_size}")
        row_bytes, phys = self.kv_buffer[0][0].nbytes, self.size // ps + 1
        self.spec = spec = CPSharedSpec(cp_size, cp_rank, ps, phys, row_bytes, dsa)
        self.ownership = own = spec.ownership()
        self.shard_rank, self.shard_size, self.row_bytes = cp_rank, cp_size, row_bytes
        self.phys_pages, self.trash_page = phys, spec.trash_page
        self.dcp_replicated = True  # rows are physical: never apply SGLang's DCP rule
        pages = [b.view(torch.uint8).view(phys, -1) for b in self.kv_buffer]
        latent, index = PageBuffers(own, cp_rank, row_bytes, pages), None
        if dsa:
            keys = list(self.index_key_cache.buffer)
            index = PageBuffers(own, cp_rank, INDEX_TOKEN_BYTES, keys)
        self.read = BatchReadState(own, cp_rank, spec.logical_pages, latent, index, cp_group, lost)
        # Each loc's physical row here, once per loc tensor (every layer writes it).
        trash = spec.trash_page
        self.store_rows = TensorMemo(lambda loc: own.store_rows(loc.long(), cp_rank, trash, phys)[0])
        self.shared_prefix_hint = None  # the last extend batch's (hint_shared_prefix)
        self.next_batch: tuple = (None, None)  # the next begin's rids, shared pairs
        logger.debug("CP-shared KV pool: %s", spec)

    def attach_view_arena(self, spec, prefetch: bool = False) -> int:
        """Allocate the view arena once, sized by the allocator's ``PageShardSpec``."""
        if (spec.page_size, spec.shard_size) != (self.page_size, self.shard_size):
            raise ValueError(f"arena spec {spec} does not match the pool")
        prefix, chunk = spec.max_prefix_tokens, spec.chunk_tokens
        return self.read.attach_arena(prefix, chunk, prefetch)

    def _stage(self, loc, layer, layer_id: int | None):
        """(local layer, staging rows of ``loc``: None outside an extend batch)."""
        layer_id = layer.layer_id if layer_id is None else layer_id
        staged = self.read.stage_rows(loc) if self.read.mode is not None else None
        return layer_id - self.start_layer, staged

    def _as_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """uint8 ``[rows, row_bytes]`` as the pool's ``[rows, 1, kv_cache_dim]``."""
        return buf.view(self.store_dtype).view(buf.shape[0], 1, self.kv_cache_dim)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        rows, kv = self.store_rows(loc), (cache_k_nope, cache_k_rope)
        local, staged = self._stage(loc, layer, layer_id_override)
        if staged is None:
            return self._write_mla_kv_buffer(self.kv_buffer[local], rows, *kv)
        # Quantized once, into the staging rows the batch reads; the owned ones kept.
        stage = self._as_rows(self.read.stage(local)[0])
        self._write_mla_kv_buffer(stage, staged, *kv)
        self.kv_buffer[local].index_copy_(0, rows, stage.index_select(0, staged))

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, layer_id_override=None):
        if self.dsa_kv_cache_store_fp8:
            raise NotImplementedError("packed DSA latent writes: set_mla_kv_buffer")
        loc, _, _ = unwrap_write_loc(loc_info)
        local, staged = self._stage(loc, layer, layer_id_override)
        cache_k = cache_k.to(self.dtype).view(self.store_dtype)
        if staged is not None:
            self._as_rows(self.read.stage(local)[0])[staged] = cache_k
        self.kv_buffer[local][self.store_rows(loc)] = cache_k

    def name_next_batch(self, request_ids, prefix_lens) -> None:
        """The next begin's request ids, and the hint's pairs if it is its batch."""
        hint = self.shared_prefix_hint
        names = tuple(map(str, request_ids)) if request_ids is not None else None
        self.next_batch = names, hint and hint.for_batch(request_ids, prefix_lens)

    def begin_shard_extend(self, req_to_token, req_pool_indices, prefix_lens_cpu, seq_lens_cpu):
        self.store_rows.clear()  # a kernel may refill a loc tensor, version unbumped
        (names, shared), self.next_batch = self.next_batch, (None, None)
        prefix_lens, seq_lens = _host_ints(prefix_lens_cpu), _host_ints(seq_lens_cpu)
        self.read.begin(BatchInputs(req_to_token, req_pool_indices, prefix_lens, seq_lens, names, shared))

    def end_shard_extend(self) -> None:
        self.store_rows.clear()
        self.read.end()

    def translate_loc_to_scratch(self, loc: torch.Tensor) -> torch.Tensor:
        if self.read.mode is None:
            raise RuntimeError("logical locs read outside a sharded extend batch")
        return self.read.translate(loc)

    def get_key_buffer(self, layer_id: int):
        if self.read.mode is None:
            return super().get_key_buffer(layer_id)
        rows = self.read.latent_rows(layer_id - self.start_layer)
        return self._as_rows(rows).view(self.dtype)

    def get_value_buffer(self, layer_id: int):
        if self.read.mode is None:
            return super().get_value_buffer(layer_id)
        if self.dsa_kv_cache_store_fp8:
            raise NotImplementedError("packed DSA latent reads need a DSA backend")
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer_shape(self):
        k = self.kv_buffer[0]
        return k.shape, k[..., : self.kv_lora_rank].shape

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        """(nope, rope) of logical ``loc``, from this batch's read buffer."""
        rows = self.translate_loc_to_scratch(loc)
        if not self.dsa_kv_cache_store_fp8:
            return super().get_mla_kv_buffer(layer, rows, dst_dtype)
        from sglang.kernels.ops.attention.dsa import dequant_k_cache

        kv = self.get_key_buffer(layer.layer_id)
        kv = dequant_k_cache.dequantize_k_cache_paged_dsa(kv, rows)
        kv = kv.to(dst_dtype) if dst_dtype is not None else kv
        r = self.kv_lora_rank
        return kv[..., :r].contiguous(), kv[..., r:].contiguous()

    move_kv_cache = _unsupported("moving KV")
    get_cpu_copy = load_cpu_copy = _unsupported("CPU offload")


class CPSharedMLATokenToKVPool(CPSharedKVPoolMixin, MLATokenToKVPool):
    """SGLang's MLA latent pool, sharded over the prefill CP ranks."""


class CPSharedIndexKeyCache(IndexKeyCache):
    """A CP-shared DSA pool's indexer pages: masked writes, reads from the batch's."""

    def _read(self, layer_id: int) -> int | None:
        """The local layer if the batch reads its keys from its buffer, else None."""
        local, read = layer_id - self.pool.start_layer, self.pool.read
        return local if read.mode is not None and read.source.has_index[local] else None

    def get_buffer(self, layer_id: int) -> torch.Tensor:
        local = self._read(layer_id)
        if local is None:
            return self.get_local_buffer(layer_id)
        if self.pool.layer_transfer_counter is not None:  # as SGLang's read
            self.pool.layer_transfer_counter.wait_until(local)
        return self._kernel_view(self.pool.read.index_pages(local))

    def get_k_and_scale(self, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len):
        if self._read(layer_id) is None:
            raise RuntimeError(f"layer {layer_id}: no indexer keys outside an extend")
        buf = self.get_buffer(layer_id)
        pages = self.pool.read.translate_pages_once(page_indices)
        get = dsa_index_k_cache.GetKAndS.execute
        return get(self.pool, buf, pages, seq_len_tensor, seq_len_sum, max_seq_len)

    def write_targets(self, layer_id: int, loc: torch.Tensor):
        """(buffer, token slots, None) an indexer writer stores the chunk to: the pool's
        masked rows and, inside an extend batch, the staging pages the batch reads."""
        if loc.numel() == 0:
            return []
        pool, local = self.pool, layer_id - self.pool.start_layer
        if not self.buffer[local].shape[0]:
            raise RuntimeError(f"layer {layer_id} skips top-k: it has no indexer keys")
        targets = [(self._kernel_view(self.buffer[local]), pool.store_rows(loc), None)]
        if pool.read.mode is not None:
            stage = self._kernel_view(pool.read.stage(local)[1])
            targets.append((stage, pool.read.stage_rows(loc), None))
        return targets

    def store_quantized(self, layer_id, loc, index_k, index_k_scale) -> None:
        keys = dict(index_k=index_k, index_k_scale=index_k_scale)
        for buf, slots, _ in self.write_targets(layer_id, loc):
            dsa_index_k_cache.SetKAndS.execute(pool=self.pool, buf=buf, loc=slots, **keys)

    move = _unsupported("moving indexer keys")
    cpu_copy = load_cpu_copy = _unsupported("CPU offload of indexer keys")


class CPSharedDSATokenToKVPool(CPSharedKVPoolMixin, DSATokenToKVPool):
    """SGLang's DSA pool (latent + indexer pages), sharded over the prefill CP ranks or a
    decode's DCP ranks."""

    def __init__(self, size, *args, index_buf_size=None, **kwargs):
        # Indexer rows as the latent's: SGLang's DCP default replicates them (N x size).
        index_buf_size = size if index_buf_size is None else index_buf_size
        super().__init__(size, *args, index_buf_size=index_buf_size, **kwargs)

    def _create_index_key_cache(self) -> IndexKeyCache:
        return CPSharedIndexKeyCache(self, self.index_buf_size)

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_key_cache.get_buffer(layer_id)
