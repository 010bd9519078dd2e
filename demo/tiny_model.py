"""A tiny DSA model whose layers read and write their KV only through an SGLang pool.

Per layer, in the DSA backend's order: the new tokens' indexer keys are written
(``set_index_k_scale_buffer``) and every visible key read back through the pool
(``get_index_k_scale_buffer``, logical pages); the latent rows are written
(``set_mla_kv_buffer``) and read through the batch's row map (``translate_loc_to_scratch`` +
``get_key_buffer`` on a sharded pool, the logical locs themselves on a stock one). The
indexer's top-k and sparse MLA are the plain-torch operators of ``reference.dsa_reference``;
the attention output feeds the next layer's KV, so a wrong byte read anywhere changes every
later layer. Weights are seeded: two runs over equal bytes give equal bits.
"""

from __future__ import annotations

import torch

from reference.dsa_reference import sparse_mla

LATENT, ROPE, INDEX_DIM = 512, 64, 128  # DeepSeek's fixed row formats (bf16 latent rows: 1152 B)
SM_SCALE = (LATENT + ROPE) ** -0.5


class _Layer:
    """What SGLang's pools read of an attention layer."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id


class TinyDSA:
    """``layers`` DSA layers over a ``hidden``-wide state; ``heads`` attention and indexer heads; top-``topk``."""

    def __init__(self, layers: int, hidden: int = 64, heads: int = 4, topk: int = 64, vocab: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        self.layers, self.heads, self.topk = layers, heads, topk
        self.embed = torch.randn(vocab, hidden, generator=g)
        self.w_kv = [w(hidden, LATENT + ROPE) for _ in range(layers)]
        self.w_ik = [w(hidden, INDEX_DIM) for _ in range(layers)]
        self.w_q = [w(hidden, heads * (LATENT + ROPE)) for _ in range(layers)]
        self.w_qi = [w(hidden, heads * INDEX_DIM) for _ in range(layers)]
        self.w_wi = [w(hidden, heads) for _ in range(layers)]
        self.w_o = [w(heads * LATENT, hidden) for _ in range(layers)]

    @staticmethod
    def _norm(h: torch.Tensor) -> torch.Tensor:
        return h / (h.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)

    def kv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The new tokens' latent (nope ``[T, 1, 512]``, rope ``[T, 1, 64]``, bf16) and indexer key (fp8) + scale."""
        x = self._norm(h)
        kv = (x @ self.w_kv[layer]).to(torch.bfloat16).unsqueeze(1)
        k = ((x @ self.w_ik[layer]) * 4).to(torch.float8_e4m3fn)
        scale = torch.full((h.shape[0], 1), 0.5) + x[:, :1].abs().clamp(max=1.0)
        return kv[..., :LATENT], kv[..., LATENT:], k, scale

    def attend(
        self,
        layer: int,
        h: torch.Tensor,
        q_req: list[int],
        q_pos: list[int],
        keys: tuple[torch.Tensor, torch.Tensor],
        seq_lens: list[int],
        rows: torch.Tensor,
        kv_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's attention for tokens at ``q_pos`` of requests ``q_req``: (next hidden, top-k positions).

        ``keys``: the indexer keys and scales the pool returned for every request's ``seq_lens`` tokens, request
        after request; ``rows[b, p]``: the row of request ``b``'s position ``p`` in ``kv_rows`` (the pool's key
        buffer as raw bytes).
        """
        x = self._norm(h)
        t = h.shape[0]
        q_idx, weights = self._index_query(layer, x)
        k_all = keys[0].view(torch.float8_e4m3fn).reshape(-1, INDEX_DIM).float()
        k_scale = keys[1].contiguous().view(torch.float32).reshape(-1)  # 4 bytes a token: its fp32 scale
        top = torch.full((t, self.topk), -1, dtype=torch.int64)
        starts = [sum(seq_lens[:b]) for b in range(len(seq_lens))]
        req_t, pos_t = torch.tensor(q_req), torch.tensor(q_pos)
        for b, n in enumerate(seq_lens):  # the lightning indexer, one request's queries at a time
            mine = (req_t == b).nonzero().flatten()
            if not len(mine):
                continue
            keys_b = k_all[starts[b] : starts[b] + n]
            scores = _index_scores(q_idx[mine], weights[mine], keys_b, k_scale[starts[b] : starts[b] + n])
            visible = torch.arange(n).unsqueeze(0) <= pos_t[mine].unsqueeze(1)
            scores = torch.where(visible, scores, torch.full_like(scores, -torch.inf))
            order = torch.sort(-scores, dim=-1, stable=True).indices[:, : self.topk]  # score desc, position asc
            width = order.shape[1]
            keep = torch.arange(width).unsqueeze(0) < (pos_t[mine] + 1).unsqueeze(1)
            top[mine, :width] = torch.where(keep, order, torch.full_like(order, -1))
        tok_rows = rows[req_t.unsqueeze(1), top.clamp(min=0)].long()
        tok_rows = torch.where(top >= 0, tok_rows, torch.full_like(tok_rows, -1))
        out, _ = sparse_mla(self._query(layer, x), kv_rows, "bf16", tok_rows, SM_SCALE)
        return h + out.reshape(t, -1) @ self.w_o[layer], top

    def _index_query(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's fp8 queries ``[T, heads, 128]`` (as fp32) and head weights ``[T, heads]``."""
        q_idx = (x @ self.w_qi[layer]).reshape(x.shape[0], self.heads, INDEX_DIM).to(torch.float8_e4m3fn).float()
        return q_idx, (x @ self.w_wi[layer]) * INDEX_DIM**-0.5

    def _query(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w_q[layer]).reshape(x.shape[0], self.heads, LATENT + ROPE).to(torch.bfloat16)

    def decode_layer_cp(self, layer, h, index_pages, page_size, kv_rows, row_of, group):
        """The decode token's ``layer`` on one rank of a decode CP group whose pools hold each page on its
        owner: this rank scores the keys it holds, the group merges the global top-k
        (``decode_cp.global_topk``), each rank attends over the selected rows it holds and the outputs merge
        by their LSE. ``row_of [1, seq_len]``: this rank's row of each position, -1 where another rank holds
        it; ``index_pages`` and ``kv_rows``: this rank's indexer pages and latent rows (raw bytes). Returns
        (next hidden, top-k positions), as ``attend`` does over a whole pool."""
        from reference.dsa_reference import read_index_k
        from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import global_topk, merge_by_lse, owned_rows

        x = self._norm(h)
        q_idx, weights = self._index_query(layer, x)
        k_own, s_own = read_index_k(index_pages, page_size, row_of[0].clamp(min=0))
        scores = _index_scores(q_idx, weights, k_own.view(torch.float8_e4m3fn).float(), s_own.reshape(-1).float())
        mine = row_of >= 0  # every position is visible to the decode token
        positions = torch.where(mine, torch.arange(row_of.shape[1]), -1)
        top = global_topk(torch.where(mine, scores, -torch.inf), positions, self.topk, group)
        out, lse = sparse_mla(self._query(layer, x), kv_rows, "bf16", owned_rows(top, row_of), SM_SCALE)
        outs = torch.empty((group.size, *out.shape))
        lses = torch.empty((group.size, *lse.shape))
        group.all_gather_into_many([outs.view(-1, *out.shape[1:]), lses.view(-1, *lse.shape[1:])], [out, lse])
        merged, _ = merge_by_lse(outs, lses)
        return h + merged.reshape(1, -1) @ self.w_o[layer], top

    def forward(self, pool, tokens: torch.Tensor, batch: list[tuple[int, int]], req_to_token, sharded: bool):
        """One extend batch's layers over ``pool``: ``batch`` is ``(req_to_token row, prefix_len, seq_len)``
        per request (``tokens``: its new tokens' ids, request after request). Returns per layer the indexer
        keys read, the top-k, and the hidden state after the layer (what the replicated run must equal)."""
        reqs = torch.tensor([r for r, _, _ in batch])
        seq_lens = [n for _, _, n in batch]
        new_locs = torch.cat([req_to_token[r, p:n].long() for r, p, n in batch])
        max_seq, ps = max(seq_lens), pool.page_size
        table = req_to_token[reqs, :max_seq].long()
        pages = req_to_token[reqs, :max_seq:ps].long() // ps
        q_req = [b for b, (_, p, n) in enumerate(batch) for _ in range(n - p)]
        q_pos = [p + j for _, p, n in batch for j in range(n - p)]
        h = self.embed[tokens]
        out = []
        for layer in range(self.layers):
            nope, rope, k, scale = self.kv(layer, h)
            pool.set_index_k_scale_buffer(layer, new_locs, k, scale)
            keys = pool.get_index_k_scale_buffer(layer, torch.tensor(seq_lens), pages, sum(seq_lens), max_seq)
            pool.set_mla_kv_buffer(_Layer(layer), new_locs, nope, rope)
            rows = pool.translate_loc_to_scratch(table) if sharded else table
            kv = pool.get_key_buffer(layer)
            h, top = self.attend(
                layer, h, q_req, q_pos, keys, seq_lens, rows, kv.view(torch.uint8).reshape(kv.shape[0], -1)
            )
            out.append((keys[0].clone(), keys[1].clone(), top, h.clone()))
        return out

    def decode_step(self, pool, pages: torch.Tensor, seq_len: int, token: int, trace: list | None = None):
        """One decode token after a prompt of ``seq_len`` tokens on ``pages`` of a stock pool: its hidden state
        after every layer reads the prompt's KV (the new token's own KV is not written: it reads, nothing else).
        ``trace`` receives per layer (hidden in, top-k positions, hidden out)."""
        ps = pool.page_size
        locs = (pages.repeat_interleave(ps) * ps + torch.arange(ps).repeat(len(pages)))[:seq_len]
        h = self.embed[torch.tensor([token])]
        for layer in range(self.layers):
            keys = pool.get_index_k_scale_buffer(layer, torch.tensor([seq_len]), pages.view(1, -1), seq_len, seq_len)
            kv = pool.get_key_buffer(layer)
            rows = locs.view(1, -1)
            h_in = h
            h, top = self.attend(
                layer, h, [0], [seq_len - 1], keys, [seq_len], rows, kv.view(torch.uint8).reshape(kv.shape[0], -1)
            )
            if trace is not None:
                trace.append((h_in, top, h))
        return h


def _index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """The indexer's score (``reference.dsa_reference``) of ``q [T, H, 128]`` against keys ``k [L, 128]`` shared by
    the queries, not copied per query: sum_h relu(q . k) * w, times the key's scale. ``[T, L]``."""
    logits = torch.einsum("thd,ld->thl", q, k).relu()
    return torch.einsum("thl,th->tl", logits, w) * k_scale
