"""Describe a site from what transformers passes its attention function (when export cannot show it),
and what the model's layer says about it (its layer type, shared caches, learned sinks)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from attnopt.hf.interface import CallInfo, layer_index
from attnopt.ir.calls import SiteCall
from attnopt.ir.masks import ADDITIVE_HIDE_BELOW, keep_mask
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes

# Layer types whose mask a rewritten site reads for key padding (a band hides no key from its own
# query) and whose cache layer holds only keys and values, which the site's own layer replaces.
# Any other type (chunked, compressed, a hybrid that keeps a recurrent state beside its keys) stays
# exact: its mask or its cache means something a form does not reproduce.
REWRITABLE_LAYER_TYPES = ("full_attention", "sliding_attention")


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


def model_keeps_exact(module: nn.Module) -> Optional[tuple]:
    """(run-time inputs, reason) when the model's own layer makes this attention module's exact
    attention the only correct one; None when a form may replace it. Read from the layer, before
    any site is built, so such sites cost compile nothing."""
    config, idx = getattr(module, "config", None), layer_index(module)
    if isinstance(getattr(module, "sinks", None), nn.Parameter):
        # GPT-OSS hands the attention function `s_aux`: a learned logit per head in every softmax.
        return ("s_aux",), "learned attention sinks, one logit per head that every softmax includes"
    if config is None or idx is None:
        return None
    types = getattr(config, "layer_types", None)
    kind = types[idx] if isinstance(types, (list, tuple)) and idx < len(types) else None
    if kind is not None and kind not in REWRITABLE_LAYER_TYPES:
        return ("layer_type",), (f"layer {idx} is a {kind!r} layer, whose mask or cache carries more than causality, "
                                 f"a band and padding; attnopt rewrites {' and '.join(REWRITABLE_LAYER_TYPES)} layers")
    try:
        sharing = getattr(config, "kv_sharing_modes", None)
    except (AttributeError, TypeError, ValueError):
        sharing = None
    mode = sharing[idx] if isinstance(sharing, (list, tuple)) and idx < len(sharing) else None
    if mode is not None:
        return ("shared_kv",), (f"layer {idx} shares its keys and values with other layers (kv sharing {mode!r}); "
                                "a decode state of its own would take them from the layers that read them")
    return None
