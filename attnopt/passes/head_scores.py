"""Cheap per-KV-head signals of retrieval, read from a site's recorded exact calls: which heads to try
keeping exact first (attnopt.selection confirms by measuring).

    induction_targets(ids_BN)   per row, the key each query copies from when it continues a repeat
    retrieval_scores(...)       per KV head: attention mass on those keys beyond the cheap form's reach
    transfer_loss(...)          per KV head: the form's attention-transfer error (LoLCATs' per-layer
                                loss, per head here), what the cheap form loses where it is wrong

An induction (copy) head at query t looks at the token after the earlier occurrence of the bigram
ending at t (RazorAttention's induction score; Wu et al.'s retrieval heads copy the same way from a
needle). Only targets farther back than the form reaches (a window's W keys) count: a window keeps
the nearer ones by itself.

Letters: B batch, H query heads, Hkv KV heads, G = H / Hkv, N tokens, D head dim, R scored queries.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.ir.calls import SiteCall
from attnopt.ir.masks import key_keep

ROWS_PER_CALL = 256  # queries scored per batch row (evenly spaced among those with a target)


def induction_targets(ids_BN: Tensor, reach: int) -> list:
    """Per row, (query positions [R], target key positions [R]) where the query continues a bigram seen
    more than `reach` tokens before: its target is the token after the latest such earlier occurrence."""
    out = []
    for row in ids_BN.tolist():
        last: dict = {}
        queries, targets = [], []
        for t in range(1, len(row)):
            pair = (row[t - 1], row[t])
            seen = last.get(pair)
            if seen is not None and t - (seen + 1) > reach and seen + 1 < t:
                queries.append(t)
                targets.append(seen + 1)
            last[pair] = t
        out.append((torch.tensor(queries, dtype=torch.long), torch.tensor(targets, dtype=torch.long)))
    return out


def _rows(n: int, most: int) -> Tensor:
    return torch.arange(n) if n <= most else torch.linspace(0, n - 1, most).round().long()


def retrieval_scores(call: SiteCall, targets: list, scale: float, keep_when: str, kv_heads: int) -> Optional[Tensor]:
    """[Hkv] float64: per KV head, the largest over its query heads of the mean attention mass the
    exact softmax puts on each scored query's target (rows of `targets`, from `induction_targets`);
    None when no row has a target."""
    q, k = call.q, call.k
    if q.dim() != 4:
        return None
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    keep = key_keep(call.mask, keep_when, B, Nk) if call.mask is not None else None
    G = H // kv_heads
    total, count = torch.zeros(H, dtype=torch.float64), 0
    for b, (queries, keys) in enumerate(targets):
        if queries.numel() == 0:
            continue
        pick = _rows(queries.numel(), ROWS_PER_CALL)
        queries, keys = queries[pick], keys[pick]
        col = queries + (Nk - Nq)  # the query's key column (bottom-right aligned)
        k_b = k[b].double().repeat_interleave(G, dim=0)  # [H, Nk, D]
        logits = scale * torch.einsum("hrd,hnd->hrn", q[b][:, queries].double(), k_b)  # [H, R, Nk]
        visible = torch.arange(Nk)[None, :] <= col[:, None]
        if keep is not None:
            visible = visible & keep[b][None, :]
        p = torch.softmax(logits.masked_fill(~visible[None], float("-inf")), dim=-1)
        total += p.gather(2, keys[None, :, None].expand(H, -1, 1))[..., 0].sum(-1)
        count += queries.numel()
    if count == 0:
        return None
    per_query = total / count
    return per_query.reshape(kv_heads, G).max(dim=1).values


def transfer_loss(out: Tensor, ref: Tensor, kv_heads: int) -> Tensor:
    """[Hkv] float64: per KV head, the relative MSE ‖o − o*‖² / ‖o*‖² of the form's output against the
    exact one over its query heads (out, ref [B, H, N, Dv])."""
    H = out.shape[1]
    err = ((out.double() - ref.double()) ** 2).sum(dim=(0, 2, 3))
    norm = (ref.double() ** 2).sum(dim=(0, 2, 3)).clamp_min(1e-30)
    return (err.reshape(kv_heads, H // kv_heads).sum(1) / norm.reshape(kv_heads, H // kv_heads).sum(1))
