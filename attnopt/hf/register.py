"""`attnopt.hf.register`: `attn_implementation="attnopt"` applying a policy per layer, unverified.

    attnopt.hf.register("window:64+sinks:4")
    model = AutoModel.from_pretrained(path, attn_implementation="attnopt")
"""

from __future__ import annotations

import functools
import warnings

from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.forms.common.mixed_heads import build_site
from attnopt.hf.cache import refusal_line, watch_cache
from attnopt.hf.interface import CallInfo, ModuleState, layer_index, register_names
from attnopt.hf.sites import site_from_call
from attnopt.ir.calls import SiteCall
from attnopt.policy import Policy


def register(policy="exact") -> None:
    """Register `attn_implementation="attnopt"` (and its mask function) applying `policy` per layer.

    Each attention module is planned on its first call from what HF passes (layer_idx, heads,
    scaling, causality, sliding window). No verification happens here: use `attnopt.compile`
    to measure drift and revert sites. Calling `register` again replaces the policy.
    """
    policy = Policy.parse(policy)
    if getattr(policy, "auto", False):
        raise ValueError(
            "policy 'auto' picks forms by measuring drift on example inputs; register() has none. "
            "Use attnopt.compile(model, 'auto', example_inputs=...) instead."
        )
    if any(r.params.get("keep") for r in policy.rules):
        raise ValueError("policy 'keep:recall' chooses the exact heads by measuring the model's retrieval on probes; "
                         "register() measures nothing. Use attnopt.compile(model, policy, example_inputs=...), or name "
                         "the heads yourself with '+exact_heads:0,3'")
    if any(r.form == "reuse" for r in policy.rules):
        warnings.warn("attnopt.hf.register: reuse needs each site's anchor wired in by attnopt.compile; "
                      "register() keeps reuse sites exact. Use attnopt.compile(model, policy, example_inputs=...)",
                      stacklevel=2)
    register_names(functools.partial(plan_on_first_call, policy=policy))


def plan_on_first_call(module, query, key, value, attention_mask, scaling, is_causal, kwargs, *, policy):
    """register() mode: describe the site from this call, plan it with the policy, attach its module."""
    layer = int(layer_index(module) or 0)
    call = SiteCall(query, key, value, attention_mask, query)
    info = CallInfo.of(scaling, is_causal, kwargs)
    site = site_from_call(type(module).__name__, module, call, info, layer)
    n_layers = int(getattr(getattr(module, "config", None), "num_hidden_layers", layer + 1) or layer + 1)
    rule, _ = policy.choose(site, n_layers)
    site_module = None
    if rule is not None and rule.form not in ("exact", "reuse"):
        form = forms.get(rule.form)
        if form.why_not(site, rule.params, [site]) is None:
            site_module = build_site(form, site, rule.params, BuildContext(sites=[site])).to(query.device)
            module.attnopt_site = site_module
    state = module.__dict__["_attnopt_state"] = ModuleState()
    if site_module is not None and site_module.decodes and layer_index(module) is not None and _self_attention_call(call) \
            and info.position_bias != "nonzero":
        # From the next cache on, this site decodes from its own state; the cache of the call that
        # planned it already holds the prompt's keys, so that generation recomputes over them.
        state.cache_role = "state"
        state.crop_refusal = refusal_line([(layer_index(module), site_module.form)])
        state.hooks.append(watch_cache(module))
    return site_module


def _self_attention_call(call: SiteCall) -> bool:
    """Self-attention over the call's own tokens (a first call without a cache): cross-attention never decodes."""
    return call.q.shape[-2] == call.k.shape[-2]
