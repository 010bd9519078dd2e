"""Syncing checks of a decode CP step, on only with ``SGLANG_DEBUG_CP_SHARED_KV=1``: the top-k and the
merged attention against the replicated ones, from the scores and rows gathered from their owners."""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.srt.distributed.cp_group import CPGroup
from sglang_cp_shared_kv.srt.layers.attention.nsa.debug_checks import CPSharedKVDebugError
from sglang_cp_shared_kv.srt.layers.attention.nsa.decode_cp import merge_by_lse


def _gathered(group: CPGroup, local: torch.Tensor) -> torch.Tensor:
    """``[size, n, ...]``: every rank's ``local [n, ...]``."""
    out = torch.empty((group.size, *local.shape), dtype=local.dtype, device=local.device)
    group.all_gather_into(out.view(-1, *local.shape[1:]), local)
    return out


def check_decode_topk(selected: torch.Tensor, owned: torch.Tensor, group: CPGroup) -> None:
    """A decode CP step's top-k is the replicated indexer's: ``selected`` int ``[B, k]`` (-1: none) against
    the scores of every position gathered from its owner (``owned`` fp32 ``[B, L]``, ``-inf`` where another
    rank owns it); tied positions at the k-th score are either's."""
    scores = _gathered(group, owned.float()).amax(dim=0)  # each position finite on its owner only
    k = selected.shape[1]
    valid = torch.isfinite(scores)
    kth = torch.topk(scores, min(k, scores.shape[1]), dim=-1).values[:, -1:]
    for b in range(selected.shape[0]):
        chosen = selected[b][selected[b] >= 0].long()
        must = (valid[b] & (scores[b] > kth[b])).nonzero().flatten()
        may = (valid[b] & (scores[b] >= kth[b])).nonzero().flatten()
        want = min(k, int(valid[b].sum()))
        ok = len(chosen) == want == len(set(chosen.tolist())) and set(must.tolist()) <= set(chosen.tolist())
        if not (ok and set(chosen.tolist()) <= set(may.tolist())):
            raise CPSharedKVDebugError(f"decode CP: row {b}'s top-{k} is not the replicated indexer's")


def check_decode_attention(
    out2: torch.Tensor, lse2: torch.Tensor, kv: torch.Tensor, selected: torch.Tensor, page_size: int, attend, group
) -> None:
    """A decode CP step's partial attention, merged over the ranks, is the attention over the selected
    token locs' rows gathered from their owners: ``out2 [R, H, D]`` and base-2 ``lse2 [R, H]``
    (``for_dcp_merge``'s), this rank's cache ``kv [rows, 1, dim]``, the ``selected`` locs ``[R, k]`` (-1:
    none), ``attend(kv, indices)`` the step's kernel, ``(out, natural lse)``. Each loc's row is found
    here by the ownership rule written out (page ``loc // ps`` on rank ``page % N`` at page ``page // N``)."""
    locs = selected.long().clamp(min=0)
    page = locs // page_size
    mine = ((selected >= 0) & (page % group.size == group.rank)).view(*selected.shape, 1, 1)
    row = (page // group.size) * page_size + locs % page_size
    picked = kv.view(torch.uint8)[row] * mine  # [R, k, 1, bytes]: zero where another rank owns it
    full = _gathered(group, picked).sum(dim=0, dtype=torch.int16).to(torch.uint8)  # one owner per row
    indices = torch.arange(full.shape[0] * full.shape[1], device=selected.device).view(selected.shape)
    indices = torch.where(selected >= 0, indices, -1).to(torch.int32)
    ref_out, ref_lse = attend(full.view(kv.dtype).view(-1, *kv.shape[1:]), indices)
    heads = out2.shape[1]
    outs, lses = _gathered(group, out2.float()), _gathered(group, lse2.float())
    out, lse = merge_by_lse(outs, lses * 0.6931471805599453)  # base 2 -> natural
    ref_out, ref_lse = ref_out[:, :heads].float(), ref_lse[:, :heads].float()
    scale = float(ref_out.abs().max().clamp(min=1.0))
    err = float((out - ref_out).abs().max())
    finite = torch.isfinite(ref_lse) & (ref_lse != torch.inf)
    lse_err = float((lse - ref_lse)[finite].abs().max()) if bool(finite.any()) else 0.0
    if err > 1e-2 * scale or lse_err > 1e-3:
        raise CPSharedKVDebugError(
            f"decode CP: the merged attention is off the replicated one by {err:.3g} (out, of {scale:.3g}), "
            f"{lse_err:.3g} (lse)"
        )
