"""Install step (transformers path): attach each accepted site module to its attention module.

The registered attention function (`attnopt.hf.interface.attention_forward`) then runs it. A reuse
site reads its anchor's q and k from a cache the anchor fills; both declare that on their state.
Parallel to the graph path's splice (`attnopt.passes.splice`).
"""

from __future__ import annotations

from torch import nn

from attnopt.hf.interface import ModuleState
from attnopt.hf.record import watch_layer_input


def uninstall(model: nn.Module) -> int:
    """Detach every site module and its hooks: the model runs its original attention again."""
    removed = 0
    for m in model.modules():
        if "attnopt_site" in m._modules:
            del m._modules["attnopt_site"]
            removed += 1
        state = m.__dict__.pop("_attnopt_state", None)
        for h in getattr(state, "hooks", ()):
            h.remove()
    return removed


def install(model: nn.Module, sites: list, modules: dict) -> dict:
    """Attach `modules` (site id -> SiteModule) to their attention modules, replacing any earlier
    install; return the counts."""
    uninstall(model)
    reuse_cache: dict = {}
    by_id = {s.id: s for s in sites}
    anchors = watched = 0
    for site_id, module in modules.items():
        target = model.get_submodule(by_id[site_id].module_path)
        target.attnopt_site = module
        state = target.__dict__.setdefault("_attnopt_state", ModuleState())
        state.reuse_cache = reuse_cache
        if module.uses_anchor_qk:
            anchor_mod = model.get_submodule(by_id[module.anchor_id].module_path)
            astate = anchor_mod.__dict__.setdefault("_attnopt_state", ModuleState())
            astate.store_qk, astate.reuse_cache = True, reuse_cache
            state.anchor_key = id(anchor_mod)
            anchors += 1
            if module.needs_layer_input:
                hook = watch_layer_input(target)
                if hook is not None:
                    state.hooks.append(hook)
                    watched += 1
    return {"installed": len(modules), "reuse_anchors": anchors, "layer_inputs_watched": watched}
