"""The two rewrite mechanisms behind one protocol, chosen once per model.

    graph  any module: captured with torch.export, each site replaced in the captured graph;
           the result is a `CompiledModule` called like the original (targets/graph.py)
    hf     a transformers model keeps its class (generate(), caches, any length): its attention
           modules run their site modules through attnopt's registered attention function
           (targets/hf.py)

`attnopt.compile` asks `target_for(model, method)` which mechanism a model takes; everything after
it (save, load, calibrate, export) asks `target_of(compiled)` and never decides again.
"""

from __future__ import annotations

import warnings

from torch import nn

from attnopt.targets.base import LongerBatch, Target
from attnopt.targets.graph import CompiledModule, GraphTarget
from attnopt.targets.hf import HfTarget, is_hf_model

__all__ = ["Target", "LongerBatch", "GraphTarget", "HfTarget", "CompiledModule", "MECHANISMS", "target_for",
           "target_of", "target_class", "check_method"]

MECHANISMS = {"graph": GraphTarget, "hf": HfTarget}
METHODS = ("auto", "hf", "graph")


def check_method(method: str) -> str:
    """`method` as a mechanism name or "auto"; "fx" is the old name of "graph"."""
    if method == "fx":
        warnings.warn("method='fx' is now called method='graph'", DeprecationWarning, stacklevel=3)
        return "graph"
    if method not in METHODS:
        raise ValueError(f"method must be 'auto', 'hf' or 'graph'; got {method!r}")
    return method


def target_for(model: nn.Module, method: str, name: str) -> Target:
    """The mechanism `model` is compiled by (on a copy of it): "hf" for transformers models whose
    attention attnopt can reach in place (attnopt.hf.routes), "graph" for everything else, unless
    `method` names one."""
    method = check_method(method)
    if method == "auto":
        method = "hf" if is_hf_model(model) else "graph"
    if method == "hf" and not is_hf_model(model):
        raise ValueError(f"method='hf' needs a transformers model whose attention modules call the attention interface "
                         f"or that attnopt routes per module (Falcon, BLOOM, GPT-Neo); {name} is neither: use "
                         "method='graph'")
    return MECHANISMS[method].for_compile(model, name)


def target_of(model: nn.Module) -> Target:
    """The mechanism a model returned by `attnopt.compile` (or `attnopt.load`) was compiled by."""
    for cls in MECHANISMS.values():
        if cls.compiled_by(model):
            return cls(model, getattr(model, "attnopt_report", None) and model.attnopt_report.model_name)
    raise ValueError(f"this {type(model).__name__} was not compiled by attnopt.compile (it is neither a "
                     "CompiledModule nor a transformers model with attnopt's report); compile it first")


def target_class(mechanism: str) -> type[Target]:
    """The Target class of a mechanism name ("graph" or "hf"), e.g. read from a saved directory."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"unknown mechanism {mechanism!r}; expected one of {', '.join(MECHANISMS)}")
    return MECHANISMS[mechanism]
