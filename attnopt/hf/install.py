"""Install step (transformers path): attach each accepted site module to its attention module.

The registered attention function (`attnopt.hf.interface.attention_forward`) then runs it. A reuse
site reads its anchor's q and k from a cache the anchor fills; both declare that on their state.
Parallel to the graph path's splice (`attnopt.passes.splice`).

Nothing of the model's own is changed: not its layer types, not its sliding window. A layer's type
chooses more than its mask (Gemma3: the RoPE base; Cohere2: RoPE at all), so a model that slides a
window on some layers keeps it on every layer attnopt leaves exact -- its mask, its cache layer and
its numbers, bit for bit. A rewritten site needs none of the model's windowing: its form reads only
the key padding from the mask HF built for its layer (every real key is seen by its own query,
inside any band), and it decodes from a cache layer of its own (attnopt.hf.cache).
"""

from __future__ import annotations

from torch import nn

from attnopt.hf.cache import decoding_modules, set_cache_roles, watch_cache, watch_model_cache
from attnopt.hf.interface import ModuleState, layer_index
from attnopt.hf.routes import keep_routes_of


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
    by_id = {s.id: s for s in sites}
    anchors = 0
    for site_id, module in modules.items():
        target = model.get_submodule(by_id[site_id].module_path)
        target.attnopt_site = module
        state = target.__dict__.setdefault("_attnopt_state", ModuleState())
        if module.uses_anchor_qk:  # the anchor hands its q and k of each call to the sites reusing it
            anchor_mod = model.get_submodule(by_id[module.anchor_id].module_path)
            astate = anchor_mod.__dict__.setdefault("_attnopt_state", ModuleState())
            astate.store_qk, state.anchor = True, astate
            anchors += 1
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
    return {"installed": len(modules), "reuse_anchors": anchors,
            "decode_state_sites": sum(m.__dict__["_attnopt_state"].cache_role == "state" for m in stateful)}
