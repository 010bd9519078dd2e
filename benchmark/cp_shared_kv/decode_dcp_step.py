"""One decode step's sparse attention on one rank of a decode CP group, modeled on one GPU, against the
replicated decode: what sharding the latent rows and the indexer keys over N ranks costs a step.

Per layer, for B requests of L context tokens (DeepSeek-V3.2: 64 index heads of 128 fp8, top-2048,
128 attention heads of 576, fp8 656-byte latent rows):

- **replicated** (a GPU holds every token): the indexer's logits over each request's L keys, their
  top-2048, FlashMLA's sparse fp8 decode (``flashmla_kv``, ``layer_compute.AttentionStep``) over the
  selected rows;
- **sharded** (rank 0 holds the pages ``lp % N == 0``: L / N keys and rows of each request): the logits
  over its own keys, their top-2048, the all-gather of every rank's candidates (``N x B x 2048`` scores
  and positions), the global top-2048 (``decode_cp.ranked_topk`` over the gathered candidates, as
  ``global_topk`` merges them), FlashMLA over the 2048 selected positions with the ones it does not hold
  as -1, the all-gather of the partial outputs and their LSE, the merge (``decode_cp.merge_by_lse``).

The peers' candidates come from their own keys (computed once, untimed), so the merged top-k is checked
against the replicated top-k as a set (``topk_equal``). The all-gathers are emulated: the N - 1 peers'
blocks lie on this GPU and are copied in, paced to the link (``rank_model_pacing.PacedLink``: its speed
and a fixed latency per collective, ``--latency-us``, an assumption). Stand-ins, the same on both sides:
the logits are a Triton kernel of the indexer's math (fp8 queries and keys, relu, head weights, key
scale) over contiguous keys, in place of DeepGEMM's paged kernel, which cannot load on the box (its speed
against DeepGEMM's is not known); the top-k is ``torch.topk``. FlashMLA reads the selected rows whatever
their values: its row indices are fixed per run. Everything else in a step (projections, MoE, norms) is
the same on both sides and left out, so ``overhead_pct`` is of the attention part of a layer, an upper
bound on the step's.
"""

from __future__ import annotations

import argparse

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None

from benchmark.cp_shared_kv import rank_model_pacing as pacing
from benchmark.cp_shared_kv.layer_compute import HEADS, INDEX_TOPK, PAGE_SIZE, QK_DIM, AttentionStep
from reference.dsa_reference import ranked_topk_ref
from reference.kv_formats import quantize_mla_fp8
from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import merge_by_lse, ranked_topk
from sglang_cp_shared_kv.srt.mem_cache.kv_layout_constants import KV_LORA_RANK, ROPE_DIM

INDEX_HEADS, INDEX_DIM = 64, 128
BLOCK_L = 64


if triton is not None:

    @triton.jit
    def _logits_kernel(q_ptr, w_ptr, k_ptr, s_ptr, out_ptr, L, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        # q fp8 [B, H, D], w fp32 [B, H], k fp8 [B, L, D], s fp32 [B, L] -> out fp32 [B, L]
        b, blk = tl.program_id(0), tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        live = offs < L
        h, d = tl.arange(0, H), tl.arange(0, D)
        q = tl.load(q_ptr + b * H * D + h[:, None] * D + d[None, :]).to(tl.float32)
        k = tl.load(k_ptr + (b * L + offs[:, None]) * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        dots = tl.dot(q, tl.trans(k))  # [H, BLOCK]; fp8 values are exact in tf32
        w = tl.load(w_ptr + b * H + h)
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)  # relu, weighted over heads
        scale = tl.load(s_ptr + b * L + offs, mask=live, other=0.0)
        tl.store(out_ptr + b * L + offs, score * scale, mask=live)


def index_logits_ref(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """The indexer's logits: ``q`` fp8 ``[B, H, 128]``, ``w`` fp32 ``[B, H]``, ``k`` fp8 ``[B, L, 128]``,
    ``k_scale`` fp32 ``[B, L]`` -> fp32 ``[B, L]``: ``sum_h relu(q[h] . k) * w[h]``, times the key's scale."""
    dots = torch.einsum("bhd,bld->bhl", q.float(), k.float())
    return torch.einsum("bhl,bh->bl", dots.relu(), w) * k_scale


def index_logits(q, w, k, k_scale, out: torch.Tensor) -> torch.Tensor:
    """``index_logits_ref`` into ``out`` in one Triton launch (the interpreter on CPU)."""
    b, length = k_scale.shape
    _logits_kernel[(b, triton.cdiv(length, BLOCK_L))](
        q, w, k, k_scale, out, length, H=q.shape[1], D=q.shape[2], BLOCK=BLOCK_L
    )
    return out


def _rows(count: int, device, g: torch.Generator) -> torch.Tensor:
    """``count`` fp8 656-byte latent rows: a block of quantized random rows, repeated."""
    block = min(count, 1 << 14)
    latent = torch.randn(block, KV_LORA_RANK, generator=g) / 4
    rope = torch.randn(block, ROPE_DIM, generator=g) / 4
    rows = quantize_mla_fp8(latent, rope).to(device)
    return rows.repeat(-(-count // block), 1)[:count].contiguous()


class DecodeData:
    """A batch's indexer inputs and keys (replicated), its attention queries, and the page owners."""

    def __init__(self, batch: int, context: int, cp_size: int, device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.batch, self.context, self.cp_size, self.device = batch, context, cp_size, device
        self.q = (torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=g) * 2).to(torch.float8_e4m3fn).to(device)
        self.w = torch.randn(batch, INDEX_HEADS, generator=g).to(device)
        self.k = (torch.randn(batch, context, INDEX_DIM, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
        self.k_scale = (torch.rand(batch, context, generator=g) + 0.5).to(device)
        self.q_attn = (torch.randn(batch, 1, HEADS, QK_DIM, generator=g) / 8).to(torch.bfloat16).to(device)
        pos = torch.arange(context, device=device)
        self.owner = (pos // PAGE_SIZE) % cp_size  # the request's pages rotate over the owners from rank 0
        self.g = g


class ReplicatedStep:
    """The replicated decode's attention part of a layer (``__call__``, timed)."""

    def __init__(self, data: DecodeData):
        d, b, n = data, data.batch, data.context
        self.d = d
        self.logits = torch.empty(b, n, device=d.device)
        self.kv_rows = _rows(b * n, d.device, d.g)
        rows = torch.arange(b, device=d.device).view(b, 1) * n + torch.randint(0, n, (b, INDEX_TOPK), generator=d.g).to(
            d.device
        )
        seqlens = torch.full((b,), min(n, INDEX_TOPK), dtype=torch.int32, device=d.device)
        self.attn = AttentionStep(d.q_attn, rows.view(b, 1, -1).int(), seqlens)

    def __call__(self) -> torch.Tensor:
        d = self.d
        index_logits(d.q, d.w, d.k, d.k_scale, self.logits)
        self.top = torch.topk(self.logits, min(INDEX_TOPK, d.context), dim=-1).indices
        return self.attn(self.kv_rows)


class ShardedStep:
    """Rank 0's attention part of a layer in a decode CP group (``__call__``, timed); its peers' candidates
    and partial outputs computed once and copied in through ``link``."""

    def __init__(self, data: DecodeData, link: pacing.PacedLink):
        d, b, n, k = data, data.batch, data.context, INDEX_TOPK
        self.d, self.link = d, link
        mine = d.owner == 0
        self.positions = torch.nonzero(mine).flatten()  # the global positions rank 0 holds, ascending
        self.k, self.k_scale = d.k[:, mine].contiguous(), d.k_scale[:, mine].contiguous()
        self.logits = torch.empty(b, self.positions.numel(), device=d.device)
        width = min(k, self.positions.numel())
        self.vals = torch.full((d.cp_size, b, k), -torch.inf, device=d.device)
        self.pos = torch.full((d.cp_size, b, k), -1, dtype=torch.int64, device=d.device)
        for r in range(1, d.cp_size):  # the peers' candidates from their own keys (untimed)
            theirs = torch.nonzero(d.owner == r).flatten()
            logits = index_logits(d.q, d.w, d.k[:, theirs].contiguous(), d.k_scale[:, theirs].contiguous(),
                                  torch.empty(b, theirs.numel(), device=d.device))  # fmt: skip
            top = torch.topk(logits, min(k, theirs.numel()), dim=-1)
            self.vals[r, :, : top.values.shape[1]] = top.values
            self.pos[r, :, : top.values.shape[1]] = theirs[top.indices]
        self.peer_vals, self.peer_pos = self.vals[1:].clone(), self.pos[1:].clone()  # where the peers hold them
        self.width = width
        # FlashMLA over 2048 positions, the ones rank 0 does not hold as -1.
        self.kv_rows = _rows(b * self.positions.numel(), d.device, d.g)
        pick = torch.randint(0, n, (b, k), generator=d.g).to(d.device)
        local = torch.searchsorted(self.positions, pick)
        held = mine[pick]
        rows = torch.arange(b, device=d.device).view(b, 1) * self.positions.numel() + local
        seqlens = torch.full((b,), min(n, k), dtype=torch.int32, device=d.device)
        self.attn = AttentionStep(d.q_attn, torch.where(held, rows, -1).view(b, 1, k).int(), seqlens)
        self.outs = torch.zeros((d.cp_size, b, HEADS, KV_LORA_RANK), dtype=torch.bfloat16, device=d.device)
        self.lses = torch.zeros((d.cp_size, b, HEADS), device=d.device)
        self.peer_outs, self.peer_lses = self.outs[1:].clone(), self.lses[1:].clone()

    def _gather(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.link.copy_pull([(src.view(torch.uint8).view(-1), dst.view(torch.uint8).view(-1)) for src, dst in pairs])

    def merge(self, rank=ranked_topk) -> torch.Tensor:
        """The global top-k of the gathered candidates by ``rank``: ``[N, B, k]`` -> ``[B, k]``."""
        per_row = lambda t: t.transpose(0, 1).reshape(self.d.batch, -1)  # noqa: E731 - [N, B, k] -> [B, N * k]
        return rank(per_row(self.vals), per_row(self.pos), INDEX_TOPK)[1]

    def __call__(self, rank=ranked_topk) -> torch.Tensor:
        d = self.d
        index_logits(d.q, d.w, self.k, self.k_scale, self.logits)
        top = torch.topk(self.logits, self.width, dim=-1)
        self.vals[0, :, : self.width] = top.values
        self.pos[0, :, : self.width] = self.positions[top.indices]
        self._gather([(self.peer_vals, self.vals[1:]), (self.peer_pos, self.pos[1:])])
        self.top = self.merge(rank)
        self.outs[0] = self.attn(self.kv_rows)[:, 0]
        self._gather([(self.peer_outs, self.outs[1:]), (self.peer_lses, self.lses[1:])])
        return merge_by_lse(self.outs, self.lses)[0]


def owned_first(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` int32 ``[B, 1, k]`` (-1: another rank's) -> the same rows, this rank's first in their order,
    and their count int32 ``[B]``: FlashMLA's ``cache_seqlens`` for a sparse decode over only those."""
    own = rows >= 0
    count = own.sum(-1, dtype=torch.int32)
    dst = torch.where(own, own.cumsum(-1) - 1, count.unsqueeze(-1) + (~own).cumsum(-1) - 1)
    return torch.empty_like(rows).scatter_(-1, dst, rows), count.view(-1)


def attend_owned_first(shard: ShardedStep) -> torch.Tensor:
    """Rank 0's attention with its rows first and ``cache_seqlens`` their count (schedule made from the
    counts in the step): FlashMLA then walks ~k / N rows, not k with the others skipped as -1."""
    rows, count = owned_first(shard.attn.indices)
    return AttentionStep(shard.d.q_attn, rows, count)(shard.kv_rows)


def measure_owned_first(shard: ShardedStep, time_us) -> dict:
    """An experiment: the attention over this rank's rows only (``attend_owned_first``) against over all k
    (-1 for the others'), timed alone; ``owned_first_max_diff``: their outputs' largest difference."""
    try:
        attn_us = time_us(lambda: shard.attn(shard.kv_rows))
        first_us = time_us(lambda: attend_owned_first(shard))
        diff = (attend_owned_first(shard).float() - shard.attn(shard.kv_rows).float()).abs().max().item()
    except Exception as e:  # noqa: BLE001 - recorded: the kernel may not take a schedule made in a graph
        return {"owned_first_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"attn_us": round(attn_us, 1), "attn_owned_first_us": round(first_us, 1),
            "owned_first_max_diff": diff}  # fmt: skip


def measure(batch: int, context: int, cp_size: int, link: pacing.PacedLink, device, time_us) -> dict:
    """Both steps of one cell, timed by ``time_us(fn)``; the merged top-k against the replicated one."""
    data = DecodeData(batch, context, cp_size, device)
    rep, shard = ReplicatedStep(data), ShardedStep(data, link)
    rep_us, shard_us = time_us(rep), time_us(shard)
    shard_sorting_us = time_us(lambda: shard(ranked_topk_ref))
    merge_us, merge_sorting_us = time_us(shard.merge), time_us(lambda: shard.merge(ranked_topk_ref))
    rep(), shard()
    same = all(set(rep.top[i].tolist()) == set(t for t in shard.top[i].tolist() if t >= 0) for i in range(batch))
    same_merge = torch.equal(shard.merge(), shard.merge(ranked_topk_ref))
    return {
        "batch": batch,
        "context": context,
        "cp_size": cp_size,
        "replicated_us": round(rep_us, 1),
        "sharded_us": round(shard_us, 1),
        "overhead_pct": round((shard_us / rep_us - 1) * 100, 2),
        "topk_equal": same,
        # The global merge alone and the step with it, by one top-k over a composite key (the product's
        # ranked_topk) and by two stable sorts (ranked_topk_ref); merge_equal: the same top-k both ways.
        "merge_us": round(merge_us, 1),
        "merge_sorting_us": round(merge_sorting_us, 1),
        "sharded_sorting_merge_us": round(shard_sorting_us, 1),
        "merge_equal": same_merge,
        "candidate_bytes_per_peer": batch * INDEX_TOPK * 12,
        "output_bytes_per_peer": batch * HEADS * (KV_LORA_RANK * 2 + 4),
        "kv_bytes_per_rank": {
            "replicated": rep.kv_rows.nbytes + data.k.nbytes,
            "sharded": shard.kv_rows.nbytes + shard.k.nbytes,
        },
    }


def main(argv: list[str] | None = None) -> int:
    from benchmark.cp_shared_kv.bench_common import cuda_time_us, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp-size", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--link-gbps", type=float, default=370.0, help="one-way NVLink per H200")
    ap.add_argument("--latency-us", type=float, default=20.0, help="per all-gather (an assumption)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_dcp_step times FlashMLA and paced copies: it needs a GPU")
    device = torch.device("cuda")
    spinner = pacing.Spinner(device)
    local = pacing.measure_local_copy_gbps(device)
    link = pacing.PacedLink(args.link_gbps, args.latency_us, local, spinner)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            row = measure(batch, context, args.cp_size, link, device, lambda fn: cuda_time_us(fn, graph=True))
            print(row, flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    summary = _summary(rows, args, link)
    write_result("decode_dcp_step", rows, summary)
    print(summary)
    # The experiment last, the results above already written: a kernel fault here cannot lose them.
    for row in rows:
        data = DecodeData(row["batch"], row["context"], args.cp_size, device)
        row.update(measure_owned_first(ShardedStep(data, link), lambda fn: cuda_time_us(fn, graph=True)))
        print(row, flush=True)
        del data
        torch.cuda.empty_cache()
    write_result("decode_dcp_step", rows, summary)
    return 0 if summary["topk_equal"] and summary["merge_equal"] else 1


def _summary(rows: list[dict], args, link: pacing.PacedLink) -> dict:
    cell = next((r for r in rows if r["batch"] == 32 and r["context"] == 131072), None)
    return {
        "step_overhead_b32_128k": None if cell is None else cell["overhead_pct"],
        "what": "attention part of a decode layer, sharded over cp_size ranks vs replicated (percent)",
        "topk_equal": all(r["topk_equal"] for r in rows),
        "merge_equal": all(r["merge_equal"] for r in rows),
        "cp_size": args.cp_size,
        "link": link.describe(),
        "stand_ins": [
            "indexer logits: a Triton kernel over contiguous fp8 keys (DeepGEMM's paged kernel cannot load)",
            "top-k: torch.topk (sgl_kernel's fused top-k cannot load)",
        ],  # fmt: skip
    }


if __name__ == "__main__":
    raise SystemExit(main())
