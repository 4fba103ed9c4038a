"""The attention function attnopt registers with transformers, and the per-module state it reads.

Two implementation names are registered, each with the attention function below AND a mask
function: without a mask function HF hands the attention no mask at all and logits drift silently.
  "attnopt"        masks as for "sdpa" (bool, True keeps; None when HF can prove it unneeded)
  "attnopt_eager"  masks as for "eager" (additive float), for models captured in eager mode
Sites the plan keeps exact call the model's original attention function unchanged.

Nothing one call computes is kept on a module: a compiled model may serve several threads at once.
What one call hands to a later step of the same call lives in the call itself --
  the cache layer of a site     the layer's `update` puts itself into the kwargs dict the module
                                passes on to the attention function (`LAYER_KW`); models whose
                                `update` gets no kwargs hand it over per thread (`hand_over`)
  a reuse anchor's (q, k) and   `ModuleState.call`, a per-thread slot of the anchor's module
  the selections made from them
-- and what a sequence keeps between calls lives in its cache object (attnopt.hf.cache).
"""

from __future__ import annotations

import contextvars
import functools
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from attnopt.ir.calls import SiteCall

IMPL_SDPA = "attnopt"
IMPL_EAGER = "attnopt_eager"
LAYER_KW = "_attnopt_cache_layer"  # the keyword a cache layer hands itself to the attention function under


@dataclass(frozen=True)
class CallInfo:
    """What transformers passed an attention call besides q, k, v and the mask."""

    scaling: Optional[float] = None
    is_causal: Optional[bool] = None
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None
    # A position bias added to the scores (T5's relative bias, ALiBi): "zero" when it is all zeros
    # (T5 cross-attention: no bias at all), "nonzero" otherwise, None when the call has none.
    position_bias: Optional[str] = None

    @classmethod
    def of(cls, scaling, is_causal, kwargs: dict) -> "CallInfo":
        bias = kwargs.get("position_bias")
        kind = None if bias is None else ("nonzero" if has_bias(bias) else "zero")
        return cls(scaling, is_causal, kwargs.get("sliding_window"), kwargs.get("softcap"), kind)


def has_bias(position_bias: Optional[torch.Tensor]) -> bool:
    """Whether a position bias changes the scores (an all-zero one, T5's cross-attention, does not)."""
    return position_bias is not None and bool(position_bias.any())


class PerThread:
    """A module's scratch for the forward call in progress: one per thread; a copy starts empty."""

    __slots__ = ("_local",)

    def __init__(self):
        self._local = threading.local()

    def __deepcopy__(self, memo):
        return PerThread()

    def __reduce__(self):
        return (PerThread, ())

    def get(self, name: str):
        return getattr(self._local, name, None)

    def set(self, name: str, value) -> None:
        setattr(self._local, name, value)


@dataclass
class ModuleState:
    """Per attention module of a compiled copy: its role, recording hook and per-thread scratch."""

    recorder: Optional[list] = None  # when a list: every call appends a SiteCall (exact run, compile time)
    call_info: list = field(default_factory=list)  # a CallInfo per call seen (compile time)
    store_qk: bool = False  # this module is an anchor: its (q, k) of the call go to `call` for the reuse sites
    anchor: Optional["ModuleState"] = None  # reuse site: its anchor module's state (a deep copy maps it along)
    hooks: list = field(default_factory=list)  # forward hooks install() added (removed by uninstall)
    # Which cache layer this module's site keeps (attnopt.hf.cache): "state" (its form's decode
    # state), "reuse" (HF's K/V plus the block selection state) or None (HF's own layer).
    cache_role: Optional[str] = None
    crop_refusal: str = ""  # the one-line error a "state" layer raises when asked to drop tokens
    # The exact attention of a module attnopt routes itself (attnopt.hf.routes), in the attention
    # function's signature; None: the model's own attention function (original_attention).
    original: Optional[Callable] = None
    # An anchor's "qk" of this call and the "selections" its reuse sites made from them.
    call: PerThread = field(default_factory=PerThread)
    # The top-level model, and the first module to decode: the modules whose cache layers it binds.
    stateful: list = field(default_factory=list)


def layer_index(module: nn.Module) -> Optional[int]:
    """The cache index of an attention module: `layer_idx`, or GPT-Neo's / XLM's `layer_id`."""
    for name in ("layer_idx", "layer_id"):
        idx = getattr(module, name, None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            return idx
    return None


_HANDED = threading.local()  # site module id -> (cache layer, the keys its update returned), per thread
# While set (contextvars: per thread and task), a reuse site without a cache gets its anchor's (q, k)
# rather than a selection made before the call: the export's check records site calls this way, so
# that a site exported alone selects inside its op, as it does in the file.
ANCHOR_QK = contextvars.ContextVar("attnopt_anchor_qk", default=False)


def hand_over(layer, kwargs: dict, keys: torch.Tensor) -> None:
    """Called by a cache layer's `update`: make `layer` reach the attention function of this call.

    Most transformers modules pass their own kwargs dict to `update` and then to the attention
    function: the layer rides in it. The others (GPT-NeoX, Falcon, ...) get it per thread, matched
    to the keys `update` returned, so a stale hand-over can never be taken by another call.
    """
    call_kwargs = kwargs.get("kwargs")
    if isinstance(call_kwargs, dict):
        call_kwargs[LAYER_KW] = layer
        return
    table = getattr(_HANDED, "table", None)
    if table is None:
        table = _HANDED.table = {}
    table[id(layer.site_module)] = (layer, keys)


def _taken(site_module: nn.Module, key: torch.Tensor):
    """The layer handed over per thread for this site and these keys (None when there is none)."""
    table = getattr(_HANDED, "table", None)
    entry = None if not table else table.pop(id(site_module), None)
    if entry is None or entry[1] is not key:
        return None
    return entry[0]


def _config_impl(module: nn.Module):
    """The module's config `_attn_implementation`, read from the config's own __dict__ where it can be:
    transformers' config __getattribute__ runs Python on every read, and this runs once per layer and token."""
    cfg = module.__dict__.get("config")
    if cfg is None:
        cfg = getattr(module, "config", None)
    if cfg is None:
        return IMPL_SDPA
    try:
        impl = object.__getattribute__(cfg, "__dict__").get("_attn_implementation_internal", _UNREAD)
    except AttributeError:  # a config object without a __dict__
        impl = _UNREAD
    return getattr(cfg, "_attn_implementation", IMPL_SDPA) if impl is _UNREAD else impl


_UNREAD = object()


def original_attention(module: nn.Module) -> Callable:
    """The function the model would have called: its file's eager function, or sdpa."""
    if _config_impl(module) == IMPL_EAGER:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn
    return _sdpa_forward()


@functools.cache
def _sdpa_forward() -> Callable:
    """transformers' sdpa attention function, imported once (a from-import per call costs microseconds,
    and this runs once per layer and token)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
    layer = kwargs.pop(LAYER_KW, None)  # this call's cache layer of the site, when it keeps one
    state: Optional[ModuleState] = module.__dict__.get("_attnopt_state")
    if layer is not None and layer.decodes and layer.site_module is module._modules.get("attnopt_site") and (
            state is None or (not state.store_qk and state.recorder is None)):
        # The decoding hot path, first (it runs once per layer and token): the site's own state,
        # nothing else asked; inside min_seq_len the layer is a plain KV cache and the model's own
        # attention runs.
        if not layer.exact_now:
            return layer.attend(query, key, value, attention_mask), None
        exact = layer.exact_fn
        if exact is None:
            exact = layer.exact_fn = (state.original if state is not None else None) or original_attention(module)
        return exact(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                     **kwargs)
    site_module = module._modules.get("attnopt_site")
    if layer is not None and layer.steps and attention_mask is None and layer.site_module is site_module and (
            state is not None and state.anchor is not None and not state.store_qk and state.recorder is None
            and not site_module._forward_hooks and not site_module._forward_pre_hooks):
        # A reuse site's decoding token inside a block (its slab, no padding): the same output the
        # path below makes, without the per-call checks that held at the block's first token.
        call = state.anchor.call
        out = layer.step(query, key, value, call.get("qk"), call.get("selections"))
        if out is not None:
            return out.transpose(1, 2), None
    if site_module is None and _planner is not None and state is None:
        site_module = _planner(module, query, key, value, attention_mask, scaling, is_causal, kwargs)
        state = module.__dict__.get("_attnopt_state")
    if state is not None and state.store_qk:
        state.call.set("qk", (query, key))
        state.call.set("selections", {})  # made by the first reuse site of each rule, read by the others
    if state is not None and state.recorder is not None:
        out, weights = _exact_of(module, state)(module, query, key, value, attention_mask, dropout=dropout,
                                                scaling=scaling, is_causal=is_causal, **kwargs)
        state.recorder.append(SiteCall(query, key, value, attention_mask, out.transpose(1, 2), x=state.call.get("x")))
        state.call_info.append(CallInfo.of(scaling, is_causal, kwargs))
        return out, weights
    if site_module is None or kwargs.get("softcap") is not None or has_bias(kwargs.get("position_bias")):
        return _exact_of(module, state)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    if layer is None and state is not None and state.cache_role is not None:
        layer = _taken(site_module, key)
    if layer is not None and layer.site_module is not site_module:
        layer = None  # another site's layer (a cache shared by mistake is refused when it is bound)
    if layer is not None and layer.decodes:  # decode from the site's own state
        if layer.exact_now:  # every column inside min_seq_len: the layer is a plain KV cache
            return _exact_of(module, state)(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, is_causal=is_causal, **kwargs)
        return layer.attend(query, key, value, attention_mask), None
    if layer is None and site_module.runs_exact(query.shape[-2], key.shape[-2]):
        # Below the site's threshold: the model's own attention, with no attnopt step in between (a
        # reuse site too: without a cache layer no selection state is kept, so none is made).
        return _exact_of(module, state)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        is_causal=is_causal, **kwargs)
    if site_module.uses_anchor_qk:
        anchor = _anchor_selection(site_module, state, layer, attention_mask)
        out = site_module(query, key, value, attention_mask, anchor=anchor, slab=getattr(layer, "slab", None))
    else:
        out = site_module(query, key, value, attention_mask)
    return out.transpose(1, 2).contiguous(), None


def _exact_of(module: nn.Module, state: Optional[ModuleState]) -> Callable:
    """The attention the site's module would run without attnopt (looked up only where it runs: a
    decoding step of a rewritten site never needs it)."""
    return (state.original if state is not None else None) or original_attention(module)


def _anchor_selection(site_module: nn.Module, state: Optional[ModuleState], layer, attention_mask):
    """What a reuse site reads of its anchor this call: the block selection made from the anchor's
    q and k, advancing the selection state the site's cache layer keeps (None without a cache: a
    prefill). The first reuse site of an anchor makes it; later ones with the same rule and the same
    state before (decoding advances them alike) read it from the anchor's per-call slot."""
    qk = state.anchor.call.get("qk") if state is not None and state.anchor is not None else None
    if qk is None:
        raise RuntimeError(f"attnopt: reuse site {site_module.geometry.site_id} runs before its anchor in this call; "
                           "call the whole compiled model, not one of its layers")
    if layer is None and (torch.compiler.is_exporting() or ANCHOR_QK.get()):
        return qk  # an exported prefill: the site selects inside its one op (forms/reuse/prefill.py)
    held = getattr(layer, "selection", None)
    made = state.anchor.call.get("selections")
    key = (site_module.rule, site_module.anchor_scale, id(held))
    if key not in made:
        made[key] = site_module.select_for(qk[0], qk[1], attention_mask, held)
    selection, after = made[key]
    if layer is not None:
        layer.selection = after
    return selection


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
