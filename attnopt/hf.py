"""Hugging Face transformers integration through `AttentionInterface` and `AttentionMaskInterface`.

Two implementation names are registered, each with the attention function below AND a mask
function: without a mask function HF hands the attention no mask at all and logits drift silently.
  "attnopt"        masks as for "sdpa" (bool, True keeps; None when HF can prove it unneeded)
  "attnopt_eager"  masks as for "eager" (additive float), for models captured in eager mode
Sites the plan keeps exact call the model's original attention function unchanged.

    attnopt.hf.register("window:64+sinks:4")
    model = AutoModel.from_pretrained(path, attn_implementation="attnopt")
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from attnopt.passes.masks import keep_mask
from attnopt.passes.site import AttentionSite, MaskInfo, SiteNodes
from attnopt.passes.verify import SiteCall

IMPL_SDPA = "attnopt"
IMPL_EAGER = "attnopt_eager"


@dataclass
class ModuleState:
    """Per attention module of a compiled copy: recording hook and reuse cache (no globals)."""

    recorder: Optional[list] = None  # when a list: every call appends a SiteCall (exact run)
    reuse_cache: Optional[dict] = None  # shared by an anchor and the sites reusing its q, k
    store_qk: bool = False  # this module is an anchor: put (q, k) into reuse_cache
    call_info: list = field(default_factory=list)  # (scaling, is_causal, sliding_window, softcap) seen
    last_x: Optional[torch.Tensor] = None  # this forward's input to the q projection (reuse residual)
    x_cache: Optional[torch.Tensor] = None  # layer inputs of every token so far, when decoding with reuse


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
    _policy=None,
    **kwargs,
):
    """HF attention function: q [B, H, Nq, D], k/v [B, Hkv, Nk, D]; returns ([B, Nq, H, Dv], None)."""
    state: Optional[ModuleState] = module.__dict__.get("_attnopt_state")
    site_module = getattr(module, "attnopt_site", None)
    if site_module is None and _policy is not None and state is None:
        site_module = _plan_on_first_call(module, query, key, value, attention_mask, scaling, is_causal, kwargs, _policy)
    if state is not None and state.recorder is not None:
        out, weights = original_attention(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
        state.recorder.append(SiteCall(query, key, value, attention_mask, out.transpose(1, 2), x=state.last_x))
        state.call_info.append((scaling, is_causal, kwargs.get("sliding_window"), kwargs.get("softcap")))
        if state.store_qk and state.reuse_cache is not None:
            state.reuse_cache[id(module)] = (query, key)
        return out, weights
    if state is not None and state.store_qk and state.reuse_cache is not None:
        state.reuse_cache[id(module)] = (query, key)
    if site_module is None or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return original_attention(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    x = None
    if site_module.form == "reuse":
        query, key = state.reuse_cache[site_module.anchor_key]
        if site_module.residual_A is not None:
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


def _register_names(policy=None) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    fn = attention_forward
    if policy is not None:
        def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
            return attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, _policy=policy, **kwargs
            )
    AttentionInterface.register(IMPL_SDPA, fn)
    AttentionInterface.register(IMPL_EAGER, fn)
    AttentionMaskInterface.register(IMPL_SDPA, sdpa_mask)
    AttentionMaskInterface.register(IMPL_EAGER, eager_mask)


def register(policy="exact") -> None:
    """Register `attn_implementation="attnopt"` (and its mask function) applying `policy` per layer.

    Each attention module is planned on its first call from what HF passes (layer_idx, heads,
    scaling, causality, sliding window). No verification happens here: use `attnopt.compile`
    to measure drift and revert sites. Calling `register` again replaces the policy.
    """
    from attnopt.policy import Policy

    policy = Policy.parse(policy)
    if getattr(policy, "auto", False):
        raise ValueError(
            "policy 'auto' picks forms by measuring drift on example inputs; register() has none. "
            "Use attnopt.compile(model, 'auto', example_inputs=...) instead."
        )
    _register_names(policy)


def implementation_for(model: nn.Module) -> str:
    """The attnopt implementation name matching the model's current mask flavour."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    return IMPL_EAGER if impl == "eager" else IMPL_SDPA


def switch(model: nn.Module, impl: str) -> None:
    """Point a transformers model (and its sub-models) at an attention implementation."""
    _register_names()
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


# Names transformers models give their separate query and key projections.
_QK_NAMES = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"))


def qk_projections(module: nn.Module) -> Optional[tuple[nn.Linear, nn.Linear]]:
    """The attention module's own q and k nn.Linear projections, when it has separate ones."""
    for qn, kn in _QK_NAMES:
        q, k = getattr(module, qn, None), getattr(module, kn, None)
        if isinstance(q, nn.Linear) and isinstance(k, nn.Linear):
            return q, k
    return None


def watch_layer_input(module: nn.Module):
    """Keep the input of the module's q projection in its state (the x of the reuse residual)."""
    proj = qk_projections(module)
    if proj is None:
        return None
    state = module.__dict__.setdefault("_attnopt_state", ModuleState())

    def hook(_mod, args):
        state.last_x = args[0]

    return proj[0].register_forward_pre_hook(hook)


def residual_factors(model: nn.Module, site: AttentionSite, anchor: AttentionSite, rank: int,
                     calls: list, anchor_calls: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Reuse residual (A, B) for `site` from both layers' q/k weights, fitted on the recorded inputs."""
    from attnopt.kernels.reuse import init_reuse_factors
    from attnopt.passes.rewrite import SiteUnsupported

    mine, theirs = (qk_projections(model.get_submodule(s.module_path)) for s in (site, anchor))
    if mine is None or theirs is None:
        raise SiteUnsupported("reuse with rank > 0 needs separate q and k nn.Linear projections in both layers")
    x_l, x_a = calls[0].x, anchor_calls[0].x
    calibration = None
    if x_l is not None and x_a is not None and x_l.shape == x_a.shape:
        calibration = (x_a.reshape(-1, x_a.shape[-1]), x_l.reshape(-1, x_l.shape[-1]))
    (q_l, k_l), (q_a, k_a) = mine, theirs
    with torch.no_grad():
        return init_reuse_factors(q_l.weight, q_l.bias, k_l.weight, k_l.bias, q_a.weight, q_a.bias, k_a.weight,
                                  k_a.bias, site.heads, rank, calibration=calibration)


def record_calls(model: nn.Module, batches: list) -> tuple[dict[str, list], list]:
    """Run the model (already switched to attnopt) with every attention module recording its calls.

    Returns ({module path: [(SiteCall, call_info), ...] over all batches, in call order}, outputs).
    """
    paths = {id(m): name for name, m in model.named_modules()}
    states: dict[int, ModuleState] = {}

    # Attach recorders to every module that may be passed to the attention function.
    for m in model.modules():
        st = m.__dict__.get("_attnopt_state")
        if st is None:
            st = ModuleState()
            m.__dict__["_attnopt_state"] = st
        st.recorder = []
        st.call_info = []
        states[id(m)] = st
    hooks = [h for h in (watch_layer_input(m) for m in model.modules()) if h is not None]
    try:
        with torch.no_grad():
            outs = [call_model(model, b) for b in batches]
    finally:
        result = {}
        for m in model.modules():
            st = states[id(m)]
            if st.recorder:
                result[paths[id(m)]] = list(zip(st.recorder, st.call_info))
            st.recorder = None
            st.last_x = None
        for h in hooks:
            h.remove()
    return result, outs


def call_model(model: nn.Module, batch) -> Any:
    args, kwargs = batch
    return model(*args, **kwargs)


def site_from_call(path: str, module: nn.Module, call: SiteCall, info: tuple, layer: int) -> AttentionSite:
    """An AttentionSite described from what HF passed to the attention function (fallback detection)."""
    scaling, is_causal, sliding_window, _softcap = info
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
        vals = mask[mask > -1e3]
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


def _plan_on_first_call(module, query, key, value, attention_mask, scaling, is_causal, kwargs, policy):
    """register() mode: describe the site from this call, plan it with the policy, attach its module."""
    from attnopt.passes.plan import why_not
    from attnopt.passes.rewrite import RewrittenSite

    layer = int(getattr(module, "layer_idx", 0) or 0)
    call = SiteCall(query, key, value, attention_mask, query)
    info = (scaling, is_causal, kwargs.get("sliding_window"), kwargs.get("softcap"))
    site = site_from_call(type(module).__name__, module, call, info, layer)
    n_layers = int(getattr(getattr(module, "config", None), "num_hidden_layers", layer + 1) or layer + 1)
    rule, _ = policy.choose(site, n_layers)
    site_module = None
    if rule is not None and rule.form not in ("exact", "reuse") and why_not(site, rule.form, rule.params, [site]) is None:
        site_module = RewrittenSite(site, rule.form, rule.params).to(query.device)
        module.attnopt_site = site_module
    module.__dict__["_attnopt_state"] = ModuleState()
    return site_module
