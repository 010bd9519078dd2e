"""A tiny DSA-shaped model and a chunked-prefill driver over a replicated or a CP-sharded KV pool.

The model keeps the byte formats of DeepSeek-V3.2 / GLM-5 and shrinks everything else: per
layer an MLA block in absorbed form (576-dim latent rows stored as the 656-B fp8 or 1152-B bf16
format, ``d_v = 512``) and a lightning indexer (128-dim fp8 K, 132 B per token, top-k by a total
order), with seeded random weights. The plain-torch DSA ops of ``dsa_reference`` stand in for the
GPU kernels.

``run_chunked_prefill`` schedules a request stream (lengths, shared prefixes) into chunked-prefill
batches and runs them either

- over a replicated pool (``group=None``): kernels read the pool through the logical page table; or
- over this rank's share of a sharded pool inside a CP group: every rank computes the whole chunk
  (as it holds it after prefill CP's all-gather), stores only its own pages, and the kernels read
  the materialized view (or, for batches without prefixes, the current chunk).

Top-k positions, attention outputs and LSE of both runs are bit-identical; the sharded run also
reports what its read path moved (``BatchCounters``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_cp_shared_kv.reference.balanced_allocator import BalancedPageAllocator
from sglang_cp_shared_kv.reference.dsa_reference import indexer_topk, sparse_mla
from sglang_cp_shared_kv.reference.read_path import ReadPath, pack_index_records, pool_view
from sglang_cp_shared_kv.reference.sharded_pool import ShardedMLAPool
from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.current_reuse import batch_kind
from sglang_cp_shared_kv.srt.layers.attention.nsa.materialize import BatchCounters, LayerView
from sglang_cp_shared_kv.srt.mem_cache.kv_formats import (
    INDEX_HEAD_DIM,
    KV_LORA_RANK,
    LATENT_DIM,
    ROPE_DIM,
    encode_mla_rows,
    mla_row_bytes,
    quantize_index_k,
)
from sglang_cp_shared_kv.srt.mem_cache.placement import PageOwnership
from sglang_cp_shared_kv.srt.utils import check_int

# ---------------------------------------------------------------------------------------------
# requests and the chunked-prefill schedule
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One prompt of ``length`` tokens; its first ``prefix_len`` tokens (a whole number of pages)
    are those of the earlier request ``prefix_from``, and it reuses that request's cached pages."""

    length: int
    prefix_from: int | None = None
    prefix_len: int = 0


@dataclass(frozen=True)
class ScheduledBatch:
    """One forward batch: which requests, how many tokens each already has cached, how many it computes."""

    requests: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens))

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def kind(self) -> str:
        """``current``, ``history`` or ``mixed`` (see ``current_reuse.batch_kind``)."""
        return batch_kind(self.prefix_lens)


def check_requests(requests: Sequence[RequestSpec], page_size: int) -> None:
    """One clear error for a request stream the driver cannot run."""
    for i, r in enumerate(requests):
        check_int(f"requests[{i}].length", r.length, 1)
        if r.prefix_from is None:
            if r.prefix_len:
                raise ValueError(f"requests[{i}].prefix_len is {r.prefix_len} without a prefix_from")
            continue
        if not 0 <= r.prefix_from < i:
            raise ValueError(f"requests[{i}].prefix_from must name an earlier request, got {r.prefix_from}")
        src = requests[r.prefix_from]
        if not 0 < r.prefix_len < r.length or r.prefix_len > src.length or r.prefix_len % page_size:
            raise ValueError(
                f"requests[{i}].prefix_len must be a positive multiple of page_size ({page_size}), shorter than "
                f"the request and within request {r.prefix_from}'s {src.length} tokens; got {r.prefix_len}"
            )


def schedule_chunked_prefill(requests: Sequence[RequestSpec], chunk_size: int) -> list[ScheduledBatch]:
    """First-come first-served chunked prefill with a budget of ``chunk_size`` new tokens per batch.

    A request starts once the request whose prefix it shares has finished; a request that does
    not fit is split, and its rest leads the next batch.
    """
    check_int("chunk_size", chunk_size, 1)
    done = [None] * len(requests)  # tokens in the cache, None before a request starts
    finished_before: set[int] = set()
    batches = []
    while any(d is None or d < r.length for d, r in zip(done, requests)):
        budget, entries = chunk_size, []
        for i, r in enumerate(requests):
            if done[i] is not None and done[i] == r.length:
                continue
            if done[i] is None:
                if r.prefix_from is not None and r.prefix_from not in finished_before:
                    break  # keep arrival order: nothing behind a waiting request starts
                done[i] = r.prefix_len
            take = min(r.length - done[i], budget)
            entries.append((i, done[i], take))
            budget -= take
            if budget == 0:
                break
        if not entries:
            raise ValueError("requests wait on a prefix that never finishes")
        for i, prefix, take in entries:
            done[i] = prefix + take
        finished_before = {i for i, r in enumerate(requests) if done[i] == r.length}
        batches.append(ScheduledBatch(*(tuple(col) for col in zip(*entries))))
    return batches


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StackConfig:
    """Shapes of the tiny model; the byte formats (576-dim latent, 128-dim indexer) are fixed."""

    num_layers: int = 2
    hidden: int = 64
    heads: int = 16
    index_heads: int = 4
    topk: int = 32
    vocab: int = 512
    seed: int = 0

    def __post_init__(self):
        for name in ("num_layers", "hidden", "heads", "index_heads", "topk", "vocab"):
            check_int(f"StackConfig.{name}", getattr(self, name), 1)


def _rope_angles(pos: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=pos.device) / dim)
    ang = pos.float().unsqueeze(-1) * inv
    return ang.cos(), ang.sin()


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """MLA rope: pairs (0, 1), (2, 3), ... rotate; ``x [T, ..., d]``, ``pos [T]``."""
    cos, sin = _rope_angles(pos, x.shape[-1])
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1] // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def _rope_neox(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Indexer rope (DeepSeek-V3.2): rotate-half over the first ``ROPE_DIM`` dims."""
    half = ROPE_DIM // 2
    cos, sin = _rope_angles(pos, ROPE_DIM)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    a, b, rest = x[..., :half], x[..., half:ROPE_DIM], x[..., ROPE_DIM:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1)


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n**-0.5


@dataclass
class Projections:
    """One layer's per-token tensors for the current chunk (request-major)."""

    q: torch.Tensor  # bf16 [T, H, 576], absorbed-form MLA query
    kv_rows: torch.Tensor  # uint8 [T, row_bytes], what the pool stores
    index_k: torch.Tensor  # uint8 [T, 128] e4m3
    index_scale: torch.Tensor  # float32 [T]
    index_q: torch.Tensor  # uint8 [T, H_idx, 128] e4m3
    index_q_scale: torch.Tensor  # float32 [T, H_idx]
    index_weights: torch.Tensor  # float32 [T, H_idx], already * H_idx^-0.5


class TinyDSAStack:
    """Seeded random weights for ``config.num_layers`` DSA layers (MLA + lightning indexer)."""

    def __init__(self, config: StackConfig, kv_format: str, device: torch.device | str = "cpu"):
        mla_row_bytes(kv_format)
        self.config = config
        self.kv_format = kv_format
        self.device = torch.device(device)
        self.sm_scale = (128 + ROPE_DIM) ** -0.5  # DeepSeek's qk head dim (nope 128 + rope 64)
        c = config
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=g) * shape[0] ** -0.5).to(self.device)

        self.embed = torch.randn((c.vocab, c.hidden), generator=g).to(self.device)
        self.layers = [
            {
                "wq": w(c.hidden, c.heads * LATENT_DIM),
                "wkv": w(c.hidden, KV_LORA_RANK),
                "wkr": w(c.hidden, ROPE_DIM),
                "wiq": w(c.hidden, c.index_heads * INDEX_HEAD_DIM),
                "wik": w(c.hidden, INDEX_HEAD_DIM),
                "wiw": w(c.hidden, c.index_heads),
                "wo": w(c.heads * KV_LORA_RANK, c.hidden),
            }
            for _ in range(c.num_layers)
        ]
        self.hadamard = _hadamard(INDEX_HEAD_DIM).to(self.device)

    def project(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> Projections:
        """Queries, KV rows and indexer tensors of hidden states ``x [T, hidden]`` at positions ``pos``."""
        c, p = self.config, self.layers[layer]
        t = x.shape[0]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = (h @ p["wq"]).view(t, c.heads, LATENT_DIM)
        q = torch.cat([q[..., :KV_LORA_RANK], _rope_interleaved(q[..., KV_LORA_RANK:], pos)], dim=-1)
        kv_rows = encode_mla_rows(h @ p["wkv"], _rope_interleaved(h @ p["wkr"], pos), self.kv_format)
        iq = _rope_neox((h @ p["wiq"]).view(t, c.index_heads, INDEX_HEAD_DIM), pos) @ self.hadamard
        ik = torch.nn.functional.layer_norm(h @ p["wik"], (INDEX_HEAD_DIM,))
        ik = _rope_neox(ik, pos) @ self.hadamard
        k_u8, k_scale = quantize_index_k(ik)
        q_u8, q_scale = quantize_index_k(iq.reshape(t * c.index_heads, INDEX_HEAD_DIM))
        return Projections(
            q=q.to(torch.bfloat16),
            kv_rows=kv_rows,
            index_k=k_u8,
            index_scale=k_scale,
            index_q=q_u8.view(t, c.index_heads, INDEX_HEAD_DIM),
            index_q_scale=q_scale.view(t, c.index_heads),
            index_weights=(h @ p["wiw"]) * c.index_heads**-0.5,
        )

    def finish(self, layer: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual update from the attention output ``[T, H, 512]``."""
        return x + attn_out.reshape(x.shape[0], -1) @ self.layers[layer]["wo"]


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


@dataclass
class LayerOutput:
    """What one layer's kernels returned for the batch's query tokens (on the CPU)."""

    topk: torch.Tensor  # int32 [T, topk], token positions in the request, -1 padded
    out: torch.Tensor  # float32 [T, H, 512]
    lse: torch.Tensor  # float32 [T, H], natural log


@dataclass
class BatchResult:
    batch: ScheduledBatch
    layers: list[LayerOutput]
    counters: BatchCounters


@dataclass
class PrefillRun:
    """All batches of one run, the pool they wrote and each request's logical pages.

    ``arena_bytes``: this rank's view arena (``view_arena``), allocated once; 0 without one."""

    batches: list[BatchResult]
    pool: ShardedMLAPool
    request_pages: list[list[int]] = field(default_factory=list)
    arena_bytes: int = 0


def request_tokens(requests: Sequence[RequestSpec], vocab: int, seed: int) -> list[torch.Tensor]:
    """Seeded token ids; a request with a shared prefix starts with its source's tokens."""
    g = torch.Generator().manual_seed(seed + 1)
    out: list[torch.Tensor] = []
    for r in requests:
        ids = torch.randint(0, vocab, (r.length,), generator=g)
        if r.prefix_from is not None:
            ids[: r.prefix_len] = out[r.prefix_from][: r.prefix_len]
        out.append(ids)
    return out


def page_table_from_pages(pages: Sequence[Sequence[int]], width: int | None = None, pad: int = 0) -> torch.Tensor:
    """int32 ``[B, width]`` page table holding each request's logical pages, ``pad`` after them."""
    width = max((len(p) for p in pages), default=0) if width is None else width
    table = torch.full((len(pages), width), pad, dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, : len(p)] = torch.tensor(list(p), dtype=torch.int32)
    return table


def _pool_pages_per_rank(requests: Sequence[RequestSpec], page_size: int, cp_size: int) -> int:
    """Enough physical pages per rank for the whole stream (no page is freed during a run)."""
    total = sum(-(-r.length // page_size) for r in requests)
    return -(-total // cp_size) + len(requests) + 1  # balanced: at most one extra page per request


def run_chunked_prefill(
    requests: Sequence[RequestSpec],
    *,
    chunk_size: int,
    page_size: int,
    kv_format: str = "fp8",
    group: CPGroup | None = None,
    config: StackConfig = StackConfig(),  # noqa: B008 - frozen dataclass
    device: torch.device | str = "cpu",
    current_reuse: bool = True,
    prefetch: bool = False,
    use_triton: bool | None = None,
    cp_size: int | None = None,
    on_batch: Callable[[int, int, BatchResult], None] | None = None,
    keep_outputs: bool = True,
    stage_current: bool = False,
    view_arena: tuple[int, int] | None = None,
) -> PrefillRun:
    """Run the request stream through the tiny DSA stack, batch by batch, layer by layer.

    ``group=None``: a replicated pool (``PageOwnership(1, ps)``) read through the logical page
    table. With a CP group: this rank's share of a pool sharded over the group, read through
    ``read_path.ReadPath`` (current-reuse for batches without prefixes when ``current_reuse``; the
    next layer's gather started ahead of its pool write when ``prefetch``; the current chunk staged
    past a view of the prefixes when ``stage_current``, as the SGLang path does; every view read from
    one arena of ``view_arena = (prefix_tokens, chunk_tokens)`` allocated once, ``ReadPath.attach_arena``).
    Logical pages come from a balanced allocator over ``cp_size`` owners (default: the
    group's size, or 1), so a replicated run can use the very page ids of a CP run.
    ``on_batch(index, total, result)`` is called after each batch (progress reports). With
    ``keep_outputs=False`` each batch's layer outputs are dropped once ``on_batch`` has seen them
    (``BatchResult.layers`` is then empty), so a long stream holds one batch of outputs at a time.
    """
    check_requests(requests, page_size)
    mla_row_bytes(kv_format)
    device = torch.device(device)
    n = group.size if group is not None else 1
    cp_size = cp_size if cp_size is not None else n
    if group is not None and cp_size != n:
        raise ValueError(f"cp_size must equal the group's size ({n}) for a sharded run, got {cp_size}")
    phys_per_rank = _pool_pages_per_rank(requests, page_size, cp_size)
    allocator = BalancedPageAllocator(PageOwnership(cp_size, page_size), phys_per_rank)
    if group is None:
        pool = ShardedMLAPool(
            PageOwnership(1, page_size), 0, phys_per_rank * cp_size, config.num_layers, kv_format, device=device
        )
        materializer = None
    else:
        pool = ShardedMLAPool(
            PageOwnership(n, page_size), group.rank, phys_per_rank, config.num_layers, kv_format, device=device
        )
        materializer = ReadPath(
            pool,
            group,
            current_reuse=current_reuse,
            prefetch=prefetch,
            use_triton=use_triton,
            stage_current=stage_current,
        )
    arena_bytes = 0
    if view_arena is not None:
        if materializer is None:
            raise ValueError("view_arena needs a CP group: a replicated run reads its pool directly")
        arena_bytes = materializer.attach_arena(*view_arena)

    stack = TinyDSAStack(config, kv_format, device)
    tokens = request_tokens(requests, config.vocab, config.seed)
    pages: list[list[int]] = [[] for _ in requests]
    results = []
    schedule = schedule_chunked_prefill(requests, chunk_size)
    for batch in schedule:
        for i, seq_len in zip(batch.requests, batch.seq_lens):
            _grow_pages(requests, pages, i, seq_len, page_size, allocator)
        table = page_table_from_pages([pages[i] for i in batch.requests])
        q_req = torch.cat([torch.full((e,), b, dtype=torch.int64) for b, e in enumerate(batch.extend_lens)])
        q_pos = torch.cat([torch.arange(p, p + e) for p, e in zip(batch.prefix_lens, batch.extend_lens)])
        ids = torch.cat([tokens[i][p : p + e] for i, p, e in zip(batch.requests, batch.prefix_lens, batch.extend_lens)])
        locs = table.long()[q_req, q_pos // page_size] * page_size + q_pos % page_size
        table, q_req, q_pos, locs = (t.to(device) for t in (table, q_req, q_pos, locs))

        if materializer is not None:
            counters = materializer.begin_batch(table, batch.seq_lens, batch.prefix_lens)
        else:
            counters = BatchCounters(kind=batch.kind)

        def view_of(layer: int, proj: Projections, counters=counters, table=table) -> LayerView:
            if materializer is not None:
                records = pack_index_records(proj.index_k, proj.index_scale)
                return materializer.layer_view(layer, proj.kv_rows, records)
            counters.layers += 1
            return pool_view(pool, layer, table, use_triton=use_triton)

        layers = forward_layers(stack, pool, stack.embed[ids.to(device)], q_req, q_pos, locs, batch.seq_lens, view_of)
        results.append(BatchResult(batch, layers, counters))
        if on_batch is not None:
            on_batch(len(results) - 1, len(schedule), results[-1])
        if not keep_outputs:
            results[-1].layers = []
    return PrefillRun(results, pool, pages, arena_bytes)


def forward_layers(
    stack: TinyDSAStack,
    pool: ShardedMLAPool,
    x: torch.Tensor,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: Sequence[int],
    view_of: Callable[[int, Projections], LayerView],
) -> list[LayerOutput]:
    """Every layer for the tokens ``x`` at ``locs``: project, store in ``pool``, read through
    ``view_of(layer, projections)``, attend, residual. Prefill and decode share it."""
    outputs = []
    for layer in range(stack.config.num_layers):
        proj = stack.project(layer, x, q_pos)
        pool.set_latent(layer, locs, proj.kv_rows)
        pool.set_index(layer, locs, proj.index_k, proj.index_scale)
        out, lse, topk = attend_layer(stack, proj, view_of(layer, proj), q_req, q_pos, list(seq_lens))
        outputs.append(LayerOutput(topk.cpu(), out.cpu(), lse.cpu()))
        x = stack.finish(layer, x, out)
    return outputs


def _grow_pages(requests, pages, i, seq_len, page_size, allocator) -> None:
    """Give request ``i`` the pages ``seq_len`` tokens need: its shared prefix first, then fresh ones."""
    r = requests[i]
    if not pages[i] and r.prefix_from is not None:
        pages[i] = pages[r.prefix_from][: r.prefix_len // page_size]
    need = -(-seq_len // page_size) - len(pages[i])
    if need <= 0:
        return
    first = allocator.next_owner(pages[i][-1]) if pages[i] else i % allocator.ownership.cp_size
    fresh = allocator.alloc(need, first)
    if fresh is None:
        raise RuntimeError(f"out of KV pages for request {i} ({need} more pages)")
    pages[i] = pages[i] + fresh.tolist()


def attend_layer(stack, proj, view: LayerView, q_req, q_pos, seq_lens):
    """One layer's DSA read over ``view``: indexer top-k positions, remapped rows, sparse MLA."""
    topk = indexer_topk(
        proj.index_q,
        proj.index_q_scale,
        proj.index_weights,
        q_req,
        q_pos,
        view.index_pages,
        view.page_table,
        list(seq_lens),
        view.page_size,
        stack.config.topk,
    )
    rows = view.rows(topk, q_req)
    out, lse = sparse_mla(proj.q, view.kv_rows, stack.kv_format, rows, stack.sm_scale)
    return out, lse, topk


def first_mismatch(a: PrefillRun, b: PrefillRun) -> str | None:
    """Where two runs' top-k, outputs or LSE first differ (``torch.equal``), or ``None``."""
    if len(a.batches) != len(b.batches):
        return f"{len(a.batches)} batches vs {len(b.batches)}"
    for i, (ba, bb) in enumerate(zip(a.batches, b.batches)):
        if ba.batch != bb.batch:
            return f"batch {i}: schedules differ ({ba.batch} vs {bb.batch})"
        for layer, (la, lb) in enumerate(zip(ba.layers, bb.layers)):
            for name in ("topk", "out", "lse"):
                x, y = getattr(la, name), getattr(lb, name)
                if not torch.equal(x, y):
                    diff = "" if x.shape != y.shape else f", max |diff| {_max_diff(x, y)}"
                    return f"batch {i} ({ba.batch.kind}) layer {layer}: {name} differs{diff}"
    return None


def _max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    d = (x.double() - y.double()).abs()
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    return float(d.max()) if d.numel() else 0.0
