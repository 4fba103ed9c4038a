"""Describe a site from what transformers passes its attention function (when export cannot show it)."""

from __future__ import annotations

import math

import torch
from torch import nn

from attnopt.hf.interface import CallInfo
from attnopt.ir.calls import SiteCall
from attnopt.ir.masks import ADDITIVE_HIDE_BELOW, keep_mask
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes


def site_from_call(path: str, module: nn.Module, call: SiteCall, info: CallInfo, layer: int) -> AttentionSite:
    """An AttentionSite described from what HF passed to the attention function (fallback detection)."""
    scaling, is_causal, sliding_window = info.scaling, info.is_causal, info.sliding_window
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(D)
    declared_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    causal, window, padding, arbitrary, form = _classify_hf_mask(mask, Nq, Nk, declared_causal)
    if sliding_window is not None and causal and window is None and Nk > sliding_window:
        arbitrary = True  # HF says a window applies but the mask did not show it: be safe
    info_mask = MaskInfo(
        form=form, causal=causal, window=window, padding=padding, arbitrary=arbitrary, node=None,
        keep_when="true" if (mask is not None and mask.dtype == torch.bool) else "zero",
        shape=tuple(mask.shape) if mask is not None else None,
    )
    return AttentionSite(
        id=f"{path}#0", module_path=path, module_type=type(module).__name__, layer=layer, source="hf",
        batch=B, heads=H, kv_heads=Hkv, q_len=Nq, kv_len=Nk, head_dim=D, v_head_dim=Dv, scale=scale,
        causal=causal, mask=info_mask, window=window, dropout_p=0.0, dtype=str(q.dtype).replace("torch.", ""),
        nodes=SiteNodes(query="query", key="key", value="value", output="output", mask="attention_mask" if mask is not None else None),
        spelling=("hf-attention-interface",),
    )


def _classify_hf_mask(mask, Nq, Nk, declared_causal):
    """(causal, window, padding, arbitrary, form) of a mask HF built; HF's own flag proves causality."""
    if mask is None:
        return declared_causal and Nq > 1, None, False, False, "is_causal" if declared_causal else "none"
    form = "bool" if mask.dtype == torch.bool else "additive"
    if mask.dtype != torch.bool:
        vals = mask[mask > ADDITIVE_HIDE_BELOW]
        if vals.numel() and bool((vals != 0).any()):
            return False, None, False, True, form
    keep = keep_mask(mask, "true" if mask.dtype == torch.bool else "zero")
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    keep = keep.expand(keep.shape[0], keep.shape[1], Nq, Nk)
    key_keep = keep.any(dim=-2, keepdim=True)
    i = torch.arange(Nq).unsqueeze(1) + (Nk - Nq)
    j = torch.arange(Nk).unsqueeze(0)
    real = key_keep.expand_as(keep)
    if bool((keep == real).all()):
        return False, None, bool((~key_keep).any()), False, form
    if declared_causal:
        causal_pat = (j <= i)
        if bool((keep == (real & causal_pat)).all()):
            return True, None, bool((~key_keep).any()), False, form
        for w in range(1, Nk + 1):
            pat = causal_pat & (j > i - w)
            if bool((keep == (real & pat)).all()):
                return True, w, bool((~key_keep).any()), False, form
    return False, None, False, True, form
