"""Install step (transformers path): attach each accepted site module to its attention module.

The registered attention function (`attnopt.hf.interface.attention_forward`) then runs it. A reuse
site reads its anchor's q and k from a cache the anchor fills; both declare that on their state.
Parallel to the graph path's splice (`attnopt.passes.splice`).
"""

from __future__ import annotations

from torch import nn

from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.hf.cache import decoding_modules, set_cache_roles, watch_cache, watch_model_cache
from attnopt.hf.interface import ModuleState, layer_index
from attnopt.hf.recording import watch_layer_input
from attnopt.hf.routes import keep_routes_of

# What HF's sliding-window masks and caches are given instead of the model's window: wider than any
# input, so they hide nothing (models that always build a sliding mask need a number, not None).
NO_WINDOW = 2**31 - 1


def take_over_model_windows(model: nn.Module, sites: list, modules: dict) -> int:
    """Make prefill and decoding agree on a model that slides its own attention window (Mistral).

    HF applies the window twice: in the prefill mask, and in decoding by a cache that drops keys
    older than the window. A form that reads every key (linear, ssm, linear+window) would see them
    all in prefill and only the window when decoding. So on such a model attnopt takes the window
    over: HF's windowing is switched off on this copy (full causal masks and caches), every exact
    site runs the same band as a window site (the same numbers as before), window sites keep the
    narrower of their band and the model's, and the other forms replace the model's window, in
    prefill and decoding alike. Returns the number of sites now run under attnopt's own band (0 when
    no site needs it, or some windowed site must keep HF's own attention, e.g. a softcap).
    """
    windowed = [s for s in sites if s.window is not None]
    window = forms.get("window")
    # Needed only when some site reads outside the model's band (or keeps sinks the band drops),
    # and possible only when every windowed site may run as a plain band (no softcap, no bias, ...).
    needed = any(s.id in modules and not (modules[s.id].form == "window" and modules[s.id].params["sinks"] == 0)
                 for s in windowed)
    if not needed or any(window.why_not(s, window.validate({"window": s.window}), sites) for s in windowed):
        return 0
    for site in windowed:
        if site.id not in modules:
            modules[site.id] = window.build(site, window.validate({"window": site.window}), BuildContext())
    for m in model.modules():
        cfg = getattr(m, "config", None)
        for c in {id(x): x for x in (cfg, getattr(cfg, "get_text_config", lambda **k: None)())}.values():
            if c is None:
                continue
            if getattr(c, "sliding_window", None) is not None:
                c.sliding_window = NO_WINDOW
            types = getattr(c, "layer_types", None)
            if isinstance(types, (list, tuple)):
                c.layer_types = ["full_attention" if t == "sliding_attention" else t for t in types]
        if isinstance(getattr(m, "sliding_window", None), int) and not isinstance(m.sliding_window, bool):
            m.sliding_window = NO_WINDOW
        if getattr(m, "layer_type", None) == "sliding_attention":
            m.layer_type = "full_attention"
        if getattr(m, "attention_type", None) == "sliding_attention":
            m.attention_type = "full_attention"
    return len(windowed)


def uninstall(model: nn.Module) -> int:
    """Detach every site module and its hooks: the model runs its original attention again (the
    route, attnopt.hf.routes, stays: exact sites run the module's own attention through it)."""
    removed = 0
    for m in model.modules():
        if "attnopt_site" in m._modules:
            del m._modules["attnopt_site"]
            removed += 1
        m.__dict__.pop("_attnopt_layer_state", None)
        state = m.__dict__.get("_attnopt_state")
        if state is None:
            continue
        for h in state.hooks:
            h.remove()
        state.hooks, state.store_qk, state.anchor, state.cache_role, state.stateful = [], False, None, None, []
    return removed


def install(model: nn.Module, sites: list, modules: dict) -> dict:
    """Attach `modules` (site id -> SiteModule) to their attention modules, replacing any earlier
    install; return the counts."""
    uninstall(model)
    modules = dict(modules)
    banded = take_over_model_windows(model, sites, modules)
    by_id = {s.id: s for s in sites}
    anchors = watched = 0
    for site_id, module in modules.items():
        target = model.get_submodule(by_id[site_id].module_path)
        target.attnopt_site = module
        state = target.__dict__.setdefault("_attnopt_state", ModuleState())
        if module.uses_anchor_qk:
            anchor_mod = model.get_submodule(by_id[module.anchor_id].module_path)
            astate = anchor_mod.__dict__.setdefault("_attnopt_state", ModuleState())
            astate.store_qk, state.anchor = True, astate
            anchors += 1
            if module.needs_layer_input:
                hook = watch_layer_input(target)
                if hook is not None:
                    state.hooks.append(hook)
                    watched += 1
    keep_routes_of(model, {by_id[i].module_path for i in modules}
                   | {by_id[m.anchor_id].module_path for m in modules.values() if m.uses_anchor_qk})
    set_cache_roles(model, sites)  # after the loop above: anchors are known by now
    stateful = decoding_modules(model)
    if stateful:  # a cache made inside the forward: the first module to decode binds every layer
        first = min(stateful, key=layer_index)
        fstate = first.__dict__["_attnopt_state"]
        fstate.stateful = stateful
        fstate.hooks.append(watch_cache(first))
        top = model.__dict__.setdefault("_attnopt_state", ModuleState())
        top.stateful = stateful  # a deep copy of the model maps these to its own modules
        top.hooks.append(watch_model_cache(model))
    return {"installed": len(modules), "reuse_anchors": anchors, "layer_inputs_watched": watched,
            "model_window_taken_over": banded,
            "decode_state_sites": sum(m.__dict__["_attnopt_state"].cache_role == "state" for m in stateful)}
