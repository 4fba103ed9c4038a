"""Reading a site's runtime mask: the per-key keep pattern the cheap forms honour, and exact fallback.

A mask tensor arrives in the spelling the model used (MaskInfo.keep_when says how to read it):
  "zero"  additive float, 0 keeps and a large negative hides (HF eager, BERT's extended mask);
  "true"  bool, True keeps (SDPA attn_mask, the condition of `torch.where(cond, scores, -inf)`);
  "false" bool, True hides (`scores.masked_fill(mask, -inf)`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# The one definition of "this value masks the key", for an additive entry and for a masked_fill /
# where fill alike (canonicalize, mask_proof and detect import it): at or below it the key is hidden.
# HF uses finfo(dtype).min, old BERT -10000.0, some code -inf; exp(-1000) underflows to 0 even in
# fp64, so no softmax can tell such a key from an absent one.
ADDITIVE_HIDE_BELOW = -1.0e3


def keep_mask(mask: torch.Tensor, keep_when: str) -> torch.Tensor:
    """Bool tensor, same shape as `mask`, True where the key is visible."""
    if keep_when == "zero":
        if mask.dtype == torch.bool:  # HF's sdpa mask function hands bools to the same sites
            return mask
        return mask > ADDITIVE_HIDE_BELOW
    if keep_when == "true":
        return mask.to(torch.bool)
    if keep_when == "false":
        return ~mask.to(torch.bool)
    raise ValueError(f"unknown mask reading {keep_when!r}; expected 'zero', 'true' or 'false'")


def key_keep(mask: Optional[torch.Tensor], keep_when: str, batch: int, kv_len: int, rank: int = 4) -> Optional[torch.Tensor]:
    """The padding pattern [B, Nk] (True = keep) of a mask broadcastable to the scores.

    The scores are [B, H, Nq, Nk] (rank 4) or [B*H, Nq, Nk] (rank 3, where `batch` is B*H). A key
    counts as kept when any query may see it: under a causal or banded mask every real key is seen
    at least by the query at its own position, so this recovers the padding and nothing else.
    """
    if mask is None:
        return None
    keep = keep_mask(mask, keep_when)
    if rank == 3 and keep.dim() == 3:
        keep = keep.unsqueeze(1)  # [B*H, Nq, Nk] -> [B*H, 1, Nq, Nk]
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    keep = keep.any(dim=-2).any(dim=1)  # over queries, then over heads: [b, Nk], b in (1, B)
    return keep.expand(batch, kv_len)


def carries_a_bias(mask: Optional[torch.Tensor], keep_when: str) -> bool:
    """True when an additive float mask without a query axis holds a finite non-zero value: a per-key
    bias passed in at run time, which only exact attention honours (the cheap forms read such a mask
    as key padding). A mask with a query axis was read when the site was detected; an export traces
    no data-dependent check and skips this one."""
    if mask is None or keep_when != "zero" or not mask.dtype.is_floating_point:
        return False
    if (mask.dim() >= 2 and mask.shape[-2] != 1) or torch.compiler.is_exporting():
        return False
    return bool(((mask != 0) & (mask > ADDITIVE_HIDE_BELOW)).any())


def site_key_keep(mask: Optional[torch.Tensor], keep_when: str, q_BHND: torch.Tensor, kv_len: int,
                  folded: bool) -> Optional[torch.Tensor]:
    """[B, Nk] key padding of a site's call, q unfolded to [B, H, N, D]. A call that came folded
    ([B·H, N, D], the bmm spelling) may carry a mask with B·H rows (nn.MultiheadAttention's
    need_weights path) or B rows (DeBERTa's [B, 1, N, N]); either reads as one row per batch item."""
    if mask is None:
        return None
    B, H = q_BHND.shape[0], q_BHND.shape[1]
    if not folded:
        return key_keep(mask, keep_when, B, kv_len)
    rows = mask.shape[0] if mask.dim() >= 3 else 1
    keep = key_keep(mask, keep_when, B * H if rows == B * H else B, kv_len, rank=3 if mask.dim() == 3 else 4)
    return keep.reshape(B, H, kv_len).any(1) if keep.shape[0] == B * H and H > 1 else keep


def sdpa_mask(mask: Optional[torch.Tensor], keep_when: str, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The mask as F.scaled_dot_product_attention takes it (bool keep, or additive float)."""
    if mask is None:
        return None
    if keep_when == "zero" and mask.dtype != torch.bool:
        return mask.to(dtype)
    return keep_mask(mask, keep_when)


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    *,
    keep_when: str,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """softmax(scale·q kᵀ + mask) v with the site's own mask; GQA handled by repeating k and v."""
    groups = q.shape[-3] // k.shape[-3] if q.dim() == 4 else 1
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    attn_mask = sdpa_mask(mask, keep_when, q.dtype)
    if attn_mask is not None and is_causal:
        # The explicit mask already carries causality when the model built it; SDPA refuses both.
        is_causal = False
    nq, nk = q.shape[-2], k.shape[-2]
    if is_causal and nq != nk:
        # SDPA aligns is_causal top-left; queries here are the LAST nq positions (decoding with a cache).
        i = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        attn_mask, is_causal = torch.arange(nk, device=q.device)[None, :] <= i, False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
