"""The attention function attnopt registers with transformers, and the per-module state it reads.

Two implementation names are registered, each with the attention function below AND a mask
function: without a mask function HF hands the attention no mask at all and logits drift silently.
  "attnopt"        masks as for "sdpa" (bool, True keeps; None when HF can prove it unneeded)
  "attnopt_eager"  masks as for "eager" (additive float), for models captured in eager mode
Sites the plan keeps exact call the model's original attention function unchanged.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from attnopt.ir.calls import SiteCall

IMPL_SDPA = "attnopt"
IMPL_EAGER = "attnopt_eager"


@dataclass(frozen=True)
class CallInfo:
    """What transformers passed an attention call besides q, k, v and the mask."""

    scaling: Optional[float] = None
    is_causal: Optional[bool] = None
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None

    @classmethod
    def of(cls, scaling, is_causal, kwargs: dict) -> "CallInfo":
        return cls(scaling, is_causal, kwargs.get("sliding_window"), kwargs.get("softcap"))


@dataclass
class ModuleState:
    """Per attention module of a compiled copy: recording hook and reuse cache (no globals)."""

    recorder: Optional[list] = None  # when a list: every call appends a SiteCall (exact run)
    reuse_cache: Optional[dict] = None  # shared by an anchor and the sites reusing its q, k
    store_qk: bool = False  # this module is an anchor: put (q, k) into reuse_cache
    call_info: list = field(default_factory=list)  # a CallInfo per call seen
    anchor_key: Optional[str] = None  # reuse site: the reuse_cache key of its anchor (the anchor's qk_key)
    qk_key: Optional[str] = None  # anchor: the key it files its (q, k) under (its module path; survives a deep copy)
    last_x: Optional[torch.Tensor] = None  # this forward's input to the q projection (reuse residual)
    x_cache: Optional[torch.Tensor] = None  # layer inputs of every token so far, when decoding with reuse
    hooks: list = field(default_factory=list)  # forward hooks install() added (removed by uninstall)
    cache_layer: Optional[object] = None  # this call's SiteCacheLayer (attnopt.hf.cache), when decoding from a state


def original_attention(module: nn.Module) -> Callable:
    """The function the model would have called: its file's eager function, or sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    impl = getattr(getattr(module, "config", None), "_attn_implementation", IMPL_SDPA)
    if impl == IMPL_EAGER:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn
    return sdpa_attention_forward


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    *,
    _planner: Optional[Callable] = None,
    **kwargs,
):
    """HF attention function: q [B, H, Nq, D], k/v [B, Hkv, Nk, D]; returns ([B, Nq, H, Dv], None)."""
    state: Optional[ModuleState] = module.__dict__.get("_attnopt_state")
    site_module = getattr(module, "attnopt_site", None)
    if site_module is None and _planner is not None and state is None:
        site_module = _planner(module, query, key, value, attention_mask, scaling, is_causal, kwargs)
    if state is not None and state.recorder is not None:
        out, weights = original_attention(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
        state.recorder.append(SiteCall(query, key, value, attention_mask, out.transpose(1, 2), x=state.last_x))
        state.call_info.append(CallInfo.of(scaling, is_causal, kwargs))
        if state.store_qk and state.reuse_cache is not None:
            state.reuse_cache[state.qk_key] = (query, key)
        return out, weights
    if state is not None and state.store_qk and state.reuse_cache is not None:
        state.reuse_cache[state.qk_key] = (query, key)
    if site_module is None or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return original_attention(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    layer = state.cache_layer if state is not None else None
    if layer is not None and layer.site_module is site_module:  # decode from the site's own state
        return layer.attend(query, key, value, attention_mask).transpose(1, 2).contiguous(), None
    x = None
    if site_module.uses_anchor_qk:
        query, key = state.reuse_cache[state.anchor_key]
        if site_module.needs_layer_input:
            x = _layer_input_for_keys(state, query.shape[-2], key.shape[-2])
    out = site_module(query, key, value, attention_mask, x=x)
    return out.transpose(1, 2).contiguous(), None


def _layer_input_for_keys(state: ModuleState, nq: int, nk: int) -> torch.Tensor:
    """The layer input x for every key: a prefill sees all of it; decoding appends to a cache of x.

    Caching x of earlier tokens is what replaces this layer's K cache (x·B is r wide per head).
    """
    x = state.last_x
    if nq == nk:
        state.x_cache = x
        return x
    prev = state.x_cache
    if prev is None or prev.shape[0] != x.shape[0] or prev.shape[1] + x.shape[1] != nk:
        raise RuntimeError(
            "reuse residual: the cached layer inputs do not match the key cache (was the KV cache built "
            "by another model or edited?); run the prompt through this compiled model first"
        )
    state.x_cache = torch.cat([prev, x], dim=1)
    return state.x_cache


def register_names(planner: Optional[Callable] = None) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    """Register both attnopt implementation names; `planner` (register() mode) plans a module on its first call."""
    fn = attention_forward
    if planner is not None:
        def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
            return attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, _planner=planner, **kwargs
            )
    AttentionInterface.register(IMPL_SDPA, fn)
    AttentionInterface.register(IMPL_EAGER, fn)
    AttentionMaskInterface.register(IMPL_SDPA, sdpa_mask)
    AttentionMaskInterface.register(IMPL_EAGER, eager_mask)


def implementation_for(model: nn.Module) -> str:
    """The attnopt implementation name matching the model's current mask flavour."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    return IMPL_EAGER if impl == "eager" else IMPL_SDPA


def switch(model: nn.Module, impl: str) -> None:
    """Point a transformers model (and its sub-models) at an attention implementation."""
    register_names()
    model.set_attn_implementation(impl)
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
            cfg._attn_implementation_internal = impl


def is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and bool(getattr(model, "_supports_attention_backend", False))
