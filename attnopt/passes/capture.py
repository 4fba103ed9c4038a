"""Capture a model into an ATen-level FX graph that the detector reads and the rewrite edits.

Two routes, one result type:
- `capture_export`: non-strict `torch.export` (dynamic sequence length where the model allows),
  then `ep.module()` -- the unlifted graph whose placeholders are the flat user inputs, so calling
  it works like the original model. Never `run_decompositions()`: that would dissolve
  `aten.scaled_dot_product_attention` before detection sees it.
- `capture_dynamo`: a `torch.compile` backend that keeps every Dynamo graph (graph breaks give
  several) with its example inputs, each re-exported to ATen, because pattern matching on
  Dynamo-level graphs misses spellings that the ATen form unifies.

`record_values` runs a captured graph once and keeps the values of a chosen set of nodes; the
detector uses it for numeric checks and the verifier can reuse it.
"""

from __future__ import annotations

import inspect
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from attnopt.ir.errors import CaptureError, SpecializedInputError
from attnopt.passes.record import ValueRecorder


@dataclass
class CapturedGraph:
    """One ATen graph plus the example values of its placeholders, in placeholder order."""

    graph_module: fx.GraphModule
    method: str  # "export" | "dynamo"
    dynamic: bool  # True when some input dims stayed symbolic
    flat_inputs: list  # example values, one per placeholder
    in_spec: Any = None  # pytree spec of (args, kwargs) for export captures
    out_spec: Any = None
    exported_program: Any = None
    notes: list = field(default_factory=list)  # e.g. why dynamic export fell back to static
    seconds: float = 0.0

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.op == "placeholder"]


def _auto_dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """Dim.AUTO on every dim of every tensor input, keyed like forward()'s parameters, so export
    keeps symbolic whatever the model allows (usually batch and sequence length)."""
    import inspect as pyinspect

    from torch.export import Dim

    def spec_for(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return {i: Dim.AUTO for i in range(x.dim())}
        return None

    if not kwargs:
        return tuple(pytree.tree_map(spec_for, a) for a in args)
    bound = pyinspect.signature(model.forward).bind(*args, **kwargs)
    specs = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind == pyinspect.Parameter.VAR_POSITIONAL:
            specs[name] = tuple(pytree.tree_map(spec_for, a) for a in value)
        elif kind == pyinspect.Parameter.VAR_KEYWORD:
            specs[name] = {k: pytree.tree_map(spec_for, v) for k, v in value.items()}
        else:
            specs[name] = pytree.tree_map(spec_for, value)
    return specs


# What a caller of capture_export can try instead; each caller knows its own options (inspect takes
# method="dynamo", attnopt.compile does not), so the default names only what works everywhere.
DEFAULT_RETRY_HINT = "or run attnopt.inspect(model, ..., method='dynamo') to see where the graph breaks"


def _export_hint(exc: BaseException, retry_hint: str = DEFAULT_RETRY_HINT) -> str:
    data_dependent = "DataDependent" in type(exc).__name__ or "data-dependent" in str(exc)
    retry = f", {retry_hint}" if retry_hint else ""
    specific = (
        "The model branches on the VALUES of a tensor (data-dependent control flow, e.g. "
        "nn.Transformer comparing tgt_mask with a causal mask when tgt_is_causal is left None): make "
        f"that decision static (pass the flag explicitly){retry}." if data_dependent else
        "Check that the example inputs match forward() (positional args and keyword args), "
        f"that outputs are tensors / tuples / dicts (e.g. pass use_cache=False to Hugging Face models){retry}."
    )
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"torch.export could not trace the model: {type(exc).__name__}: {first}. {specific}"


def capture_export(model: torch.nn.Module, args: tuple = (), kwargs: Optional[dict] = None,
                   dynamic: bool = True, retry_hint: str = DEFAULT_RETRY_HINT) -> CapturedGraph:
    """Non-strict export of `model(*args, **kwargs)` to an unlifted ATen graph module.

    `retry_hint` ends the error message when export fails: what the caller's user can try instead."""
    kwargs = dict(kwargs or {})
    args = tuple(args)
    notes: list[str] = []
    t0 = time.perf_counter()
    ep = None
    is_dynamic = False
    if dynamic:
        try:
            ep = torch.export.export(model, args, kwargs, strict=False,
                                     dynamic_shapes=_auto_dynamic_shapes(model, args, kwargs))
            is_dynamic = True
        except Exception as exc:  # fall back to static shapes, but say so
            notes.append(f"dynamic export failed, captured static shapes instead: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if ep is None:
        try:
            ep = torch.export.export(model, args, kwargs, strict=False)
        except Exception as exc:
            raise CaptureError(_export_hint(exc, retry_hint)) from exc
    gm = ep.module()
    notes += _name_scalar_guards(gm)
    flat_inputs = _flatten_like(ep, args, kwargs)
    n_ph = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if len(flat_inputs) != n_ph:
        # Non-tensor leaves (None, bools) may be dropped from the graph's inputs; keep the
        # placeholders' own example values instead where export recorded them.
        flat_inputs = _match_placeholders(gm, flat_inputs)
    if is_dynamic:
        is_dynamic = any(_has_symbolic_shape(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder")
    return CapturedGraph(gm, "export", is_dynamic, list(flat_inputs), in_spec=ep.call_spec.in_spec,
                         out_spec=ep.call_spec.out_spec, exported_program=ep, notes=notes,
                         seconds=time.perf_counter() - t0)


class _NamedGuards(torch.nn.Module):
    """Wraps export's `_guards_fn` so a failed guard on a Python-number input names the argument."""

    def __init__(self, guards: torch.nn.Module, scalars: dict):
        super().__init__()
        self.guards = guards
        self.scalars = scalars  # placeholder name -> the value it was captured with

    def forward(self, *args):
        try:
            return self.guards(*args)
        except AssertionError as exc:
            text = str(exc)
            named = [n for n in self.scalars if re.search(rf"\b{re.escape(n)}\b", text)]
            if not named:  # a guard on something else (a tensor's shape): export's message stands
                raise
            which = ", ".join(f"{n}={self.scalars[n]!r}" for n in named)
            raise SpecializedInputError(
                f"the captured graph holds {which} as a constant: torch.export specialises Python numbers, "
                f"so the graph is valid only for that value, and this call passed another ({text}). Pass "
                f"{named[0]!r} as a 0-dim tensor to keep it a run-time input, or capture again with the new "
                "value.") from exc


def _name_scalar_guards(gm: fx.GraphModule) -> list[str]:
    """Python-number inputs become constants guarded by `_guards_fn`: make that guard's failure a clear
    error naming the argument, and say at capture that the value was frozen."""
    scalars = {n.target: n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), (bool, int, float)) and not isinstance(n.meta.get("val"), torch.SymInt)}
    guards = getattr(gm, "_guards_fn", None)
    if not scalars or not isinstance(guards, torch.nn.Module):
        return []
    gm._guards_fn = _NamedGuards(guards, scalars)
    return [f"input {name!r} is a Python {type(value).__name__}: captured as the constant {value!r} "
            "(pass a 0-dim tensor to keep it a run-time input)" for name, value in scalars.items()]


def _flatten_like(ep, args: tuple, kwargs: dict) -> list:
    """Example inputs flattened in the order of the graph's placeholders (the export's in_spec)."""
    from torch.fx._pytree import tree_flatten_spec

    try:
        return list(tree_flatten_spec((args, kwargs), ep.call_spec.in_spec))
    except Exception:  # an unusual spec: fall back to plain pytree order
        return pytree.tree_flatten((args, kwargs))[0]


def _has_symbolic_shape(val) -> bool:
    return isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape)


def _match_placeholders(gm: fx.GraphModule, flat_inputs: list) -> list:
    tensors = [x for x in flat_inputs if isinstance(x, torch.Tensor)]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(tensors) == len(phs):
        return tensors
    raise CaptureError(
        f"the exported graph has {len(phs)} inputs but the example inputs flatten to {len(flat_inputs)} "
        "values; pass only tensors (and plain Python constants) as example inputs")


def capture_dynamo(model: torch.nn.Module, args: tuple = (), kwargs: Optional[dict] = None) -> list[CapturedGraph]:
    """Run `torch.compile(model)` once with a backend that keeps each graph, then export each to ATen."""
    import torch._dynamo

    kwargs = dict(kwargs or {})
    grabbed: list[tuple[fx.GraphModule, list]] = []

    def grab_backend(gm: fx.GraphModule, example_inputs):
        grabbed.append((gm, list(example_inputs)))
        return gm.forward

    t0 = time.perf_counter()
    for attempt in range(2):
        try:
            compiled = torch.compile(model, backend=grab_backend, dynamic=False, fullgraph=False)
            with torch.no_grad():
                compiled(*args, **kwargs)
        except Exception as exc:
            raise CaptureError(
                f"torch.compile could not trace the model: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}. Check the example inputs, or try method='export'."
            ) from exc
        if grabbed or attempt:
            break
        # Dynamo reused graphs it had compiled for this model earlier: clear its cache once and retry
        torch._dynamo.reset()
    if not grabbed:
        raise CaptureError("torch.compile produced no graph (the whole forward ran eagerly); try method='export'")
    out = []
    for dyn_gm, example_inputs in grabbed:
        ex = [x for x in example_inputs]
        try:
            ep = torch.export.export(dyn_gm, tuple(ex), strict=False)
        except Exception as exc:  # already the dynamo route: nothing else to suggest
            raise CaptureError(_export_hint(exc, retry_hint="")) from exc
        gm = ep.module()
        _copy_module_stacks(dyn_gm, gm, type(model))
        out.append(CapturedGraph(gm, "dynamo", False, ex, in_spec=ep.call_spec.in_spec,
                                 out_spec=ep.call_spec.out_spec, exported_program=ep,
                                 notes=[f"dynamo graph {len(out)} of {len(grabbed)}"],
                                 seconds=time.perf_counter() - t0))
    return out


def _copy_module_stacks(dyn_gm: fx.GraphModule, aten_gm: fx.GraphModule, root_type: type) -> None:
    """Re-exporting a Dynamo graph loses the user's module hierarchy; recover it via `from_node`."""
    by_name = {n.name: n for n in dyn_gm.graph.nodes}
    for node in aten_gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = {"": ("", root_type)}
        for src in node.meta.get("from_node", None) or []:
            name = getattr(src, "name", None)
            while src is not None and name not in by_name:
                parents = getattr(src, "from_node", None) or []
                src = parents[0] if parents else None
                name = getattr(src, "name", None)
            if name in by_name and by_name[name].meta.get("nn_module_stack"):
                stack.update(by_name[name].meta["nn_module_stack"])
                break
        node.meta["nn_module_stack"] = stack


def record_values(captured: CapturedGraph, node_names: Iterable[str]) -> dict[str, Any]:
    """Run the captured graph on its example inputs (no grad) and return {node name: value}."""
    wanted = set(node_names)
    if not wanted:
        return {}
    return ValueRecorder(captured.graph_module, wanted, stop_early=True).record(*captured.flat_inputs)


def without_cache(model: torch.nn.Module, kwargs: dict) -> dict:
    """use_cache=False unless the caller set it: a Hugging Face model returns a DynamicCache object
    otherwise, which export cannot flatten."""
    if "use_cache" in kwargs:
        return kwargs
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return kwargs
    return {**kwargs, "use_cache": False} if "use_cache" in params else kwargs
