"""Record every attention call of a transformers model through the attention interface (exact run)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from attnopt.hf.interface import ModuleState

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
    """Keep the input of the module's q projection for this call (the x of the reuse residual)."""
    proj = qk_projections(module)
    if proj is None:
        return None
    # The projection holds the state too, so the hook reads it from the module it runs on: a deep
    # copy of the model copies hooks by reference but both attributes into one new state.
    proj[0].__dict__["_attnopt_layer_state"] = module.__dict__.setdefault("_attnopt_state", ModuleState())

    def hook(mod, args):
        mod.__dict__["_attnopt_layer_state"].call.set("x", args[0])

    return proj[0].register_forward_pre_hook(hook)


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
            st.call.set("x", None)
        for h in hooks:
            h.remove()
    return result, outs


def call_model(model: nn.Module, batch) -> Any:
    args, kwargs = batch
    return model(*args, **kwargs)
