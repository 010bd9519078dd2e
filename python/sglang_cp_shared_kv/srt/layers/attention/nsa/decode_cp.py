"""Decode context parallel over a sharded DSA cache: the exact global top-k and the LSE merge.

Each of the ``N`` decode ranks holds the indexer keys and latent rows of the token positions it owns.
Per query row, with one total order, score descending then position ascending (the replicated
indexer's, ``reference.dsa_reference.indexer_topk``):

1. each rank scores its own positions and keeps its ``k`` first (``ranked_topk``);
2. the ``N * k`` candidates are all-gathered and ranked again (``global_topk``). Exact: every position
   ranked before a global top-``k`` position on its owner is ranked before it globally too, so it
   already is among its owner's ``k`` first. In SGLang's paged indexer: its keys read through
   ``indexer_pages``, its top-k in SGLang's format from ``owned_topk``;
3. each rank attends over the selected positions it owns (``owned_rows``; in a CP-shared pool a
   position's row is ``position_rows``'s, by the pool's page ownership; from SGLang's token locs,
   ``owned_loc_rows``), giving ``(out_r, lse_r)``,
   ``lse_r = -inf`` where it owns none;
4. ``merge_by_lse``: ``lse = logsumexp_r lse_r``, ``out = sum_r exp(lse_r - lse) * out_r``; in SGLang's
   decode its own DCP merge, fed by ``for_dcp_merge``.

Static shapes and no host sync: sizes come from ``k`` and the batch's rows only.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.mem_cache.placement import TRASH_PAGE, PageOwnership, local_page, page_owner


def ranked_topk(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` first of each row by score descending, position ascending: fp32 and int64 ``[R, k]`` of
    ``scores`` fp32 ``[R, L]`` (``-inf``: not visible) and ``positions`` int64 ``[R, L]`` (-1: none, ranked
    after every position of its score). One ``torch.topk`` over an int64 key that orders as that rule:
    the high 32 bits order as the score, the low 32 bits against the position."""
    rows, width = scores.shape
    if width < k:  # fewer candidates than k: padded with empty ones
        scores = torch.nn.functional.pad(scores, (0, k - width), value=-torch.inf)
        positions = torch.nn.functional.pad(positions, (0, k - width), value=-1)
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 ties with 0.0, as floats compare
    high = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # IEEE order: negatives by magnitude, reversed
    low = torch.where(positions < 0, 0, 0xFFFFFFFF - positions)  # positions < 2**31: low >= 2**31 > empty
    first = torch.topk(high * (1 << 32) + low, k, dim=-1).indices  # sorted: keys are unique but for empties
    values, chosen = scores.gather(-1, first), positions.gather(-1, first)
    return values, torch.where(values == -torch.inf, -1, chosen)


def global_topk(scores: torch.Tensor, positions: torch.Tensor, k: int, group: CPGroup) -> torch.Tensor:
    """int64 ``[R, k]``: the replicated indexer's top-``k`` positions from each rank's own ``[R, L_r]``."""
    values, chosen = ranked_topk(scores, positions, k)
    rows, n = values.shape[0], group.size
    all_values = torch.empty((n * rows, k), dtype=values.dtype, device=values.device)
    all_chosen = torch.empty((n * rows, k), dtype=chosen.dtype, device=chosen.device)
    group.all_gather_into_many([all_values, all_chosen], [values, chosen])

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [N * R, k] rank-major -> [R, N * k]
        return t.view(n, rows, k).transpose(0, 1).reshape(rows, n * k)

    return ranked_topk(per_row(all_values), per_row(all_chosen), k)[1]


def indexer_pages(pages: torch.Tensor, cp_size: int, rank: int) -> torch.Tensor:
    """``pages [B, W]`` logical as the pages of ``rank``'s indexer buffer, where SGLang's paged indexer reads
    a request's keys (``DSAIndexerMetadata.get_page_table_64``); a page another rank owns reads the trash
    page, whose scores ``owned_topk`` drops."""
    owned = page_owner(pages, cp_size) == rank
    return torch.where(owned, local_page(pages, cp_size), TRASH_PAGE).to(pages.dtype)


def owned_scores(
    scores: torch.Tensor, lengths: torch.Tensor, pages: torch.Tensor, page_size: int, cp_size: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 and int64 ``[B, L]``: this rank's ``scores`` (column ``j``: position ``j``, read through
    ``indexer_pages``) and positions where it owns a position in ``[0, length)``, ``-inf`` and -1 elsewhere;
    ``lengths [B]``, the logical ``pages [B, W]``."""
    pos = torch.arange(scores.shape[1], device=scores.device)
    page = pages.long()[:, (pos // page_size).clamp(max=pages.shape[1] - 1)]
    mine = (page_owner(page, cp_size) == rank) & (pos < lengths.unsqueeze(1))
    return torch.where(mine, scores.float(), -torch.inf), torch.where(mine, pos, -1)


def owned_topk(
    scores: torch.Tensor, lengths: torch.Tensor, pages: torch.Tensor, page_size: int, topk: int, group: CPGroup
) -> torch.Tensor:
    """int32 ``[B, topk]``: SGLang's decode top-k of the replicated indexer (positions in ``[0, length)``, -1
    after them) from this rank's ``scores`` fp32 ``[B, L]`` (``owned_scores``)."""
    ranked, positions = owned_scores(scores, lengths, pages, page_size, group.size, group.rank)
    return global_topk(ranked, positions, topk, group).to(torch.int32)


def position_rows(pages: torch.Tensor, page_size: int, cp_size: int, rank: int, width: int) -> torch.Tensor:
    """int64 ``[B, width]``: the row in ``rank``'s CP-shared pool of each of the first ``width`` token positions
    of each request (its logical ``pages [B, W]``; page ``lp`` lives on rank ``lp % N`` as physical page
    ``lp // N``), -1 where another rank owns it."""
    pos = torch.arange(width, device=pages.device)
    logical = pages.long()[:, pos // page_size]
    rows = local_page(logical, cp_size) * page_size + pos % page_size
    return torch.where(page_owner(logical, cp_size) == rank, rows, -1)


def owned_rows(selected: torch.Tensor, row_of_position: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the ``selected`` positions (int64 ``[R, k]``, -1: none) it owns, -1 elsewhere;
    ``row_of_position`` int64 ``[R, P]``: each position's row here, -1 where another rank owns it."""
    rows = row_of_position.gather(-1, selected.clamp(min=0))
    return torch.where(selected < 0, -1, rows)


def owned_loc_rows(locs: torch.Tensor, ownership: PageOwnership, rank: int) -> torch.Tensor:
    """This rank's row of each token loc it owns (SGLang's decode gives the top-k as locs of the
    request's page table, -1: none), -1 elsewhere; ``locs`` int ``[R, k]``, the pool's ``ownership``."""
    some = locs.clamp(min=0)
    mine = (locs >= 0) & (ownership.loc_owner(some) == rank)
    return torch.where(mine, ownership.phys_row(some), -1).to(locs.dtype)


def for_dcp_merge(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``out [R, H, D]`` and natural-log ``lse [R, H]`` (``flash_mla_with_kvcache``'s) as SGLang's
    DCP merge takes a ``dsa`` backend's: the LSE in base 2, and a row this rank attends to nothing (lse
    not finite) ``out = 0``, ``lse = -inf``, so its output weighs nothing whatever the kernel left there."""
    empty = ~torch.isfinite(lse)
    lse2 = torch.where(empty, -torch.inf, lse.float() * 1.4426950408889634)  # log2(e)
    return torch.where(empty.unsqueeze(-1), 0.0, out).to(out.dtype), lse2


def merge_by_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``outs [N, R, H, D]``, natural-log ``lses [N, R, H]`` -> ``out [R, H, D]``, ``lse [R, H]`` (fp32); a row
    no rank attends to keeps ``out = 0``, ``lse = -inf`` (FlashMLA's ``lse = +inf`` for such a row read as -inf)."""
    lses = lses.float()
    lses = torch.where(lses == torch.inf, -torch.inf, lses)
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(lse == -torch.inf, 0.0, lse)).unsqueeze(-1)  # exp(-inf) = 0
    # A rank that attended to nothing contributes nothing, whatever its output holds.
    return (weights * torch.where(weights > 0, outs.float(), 0.0)).sum(dim=0), lse
