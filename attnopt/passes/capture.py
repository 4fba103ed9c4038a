"""Capture a model into an ATen-level FX graph that the detector reads and the rewrite edits.

Two routes, one result type:
- `capture_export`: non-strict `torch.export` (dynamic batch and sequence length where the model
  allows; a batch-1 example is exported at batch 2), then `ep.module()` -- the unlifted graph
  whose placeholders are the flat user inputs, so calling it works like the original model, with
  attnopt's `InputGuard` (passes/input_guard.py) checking every call against what was captured.
  Never `run_decompositions()`: that would dissolve `aten.scaled_dot_product_attention` before
  detection sees it.
- `capture_dynamo`: a `torch.compile` backend that keeps every Dynamo graph (graph breaks give
  several) with its example inputs, each re-exported to ATen, because pattern matching on
  Dynamo-level graphs misses spellings that the ATen form unifies.

`record_values` runs a captured graph once and keeps the values of a chosen set of nodes; the
detector uses it for numeric checks and the verifier can reuse it.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export._tree_utils import reorder_kwargs

from attnopt.ir.errors import CaptureError
from attnopt.passes.input_guard import InputContract, contract_of, install_guard
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


def _auto_dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict, batch_only: bool = False) -> Any:
    """Dim.AUTO on every dim (or only dim 0) of every tensor input, keyed like forward()'s
    parameters, so export keeps symbolic whatever the model allows (usually batch and length)."""
    import inspect as pyinspect

    from torch.export import Dim

    def spec_for(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return {i: Dim.AUTO for i in range(1 if batch_only else x.dim())}
        return None

    signature = pyinspect.signature(model.forward)
    star_args = any(p.kind == pyinspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values())
    if not kwargs and not star_args:
        return tuple(pytree.tree_map(spec_for, a) for a in args)
    # keyed by forward()'s parameters: a `forward(*args)` takes its specs as one tuple under `args`
    bound = signature.bind(*args, **kwargs)
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

    With `dynamic`, every input dim the model allows stays symbolic: a batch-1 example is exported
    at batch 2 (torch.export fixes every size-1 dim), checked against the model at batch 1. The
    graph checks every call (`input_guard`): a dim capture fixed, or a non-tensor input, called
    with another size or value raises one line naming it. `retry_hint` ends the error message when
    export fails: what the caller's user can try instead."""
    kwargs = dict(kwargs or {})
    args = tuple(args)
    check_runnable(model, args, kwargs)
    t0 = time.perf_counter()
    exported = _export_with_fallbacks(model, args, kwargs, dynamic, retry_hint)
    ep, gm, notes = exported.program, exported.module, list(exported.notes)
    flat_inputs = _flatten_like(ep, args, kwargs)
    n_ph = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if len(flat_inputs) != n_ph:
        # Non-tensor leaves (None, bools) may be dropped from the graph's inputs; keep the
        # placeholders' own example values instead where export recorded them.
        flat_inputs = _match_placeholders(gm, flat_inputs)
    names = input_names(model, ep.call_spec.in_spec, args, kwargs, [n.target for n in gm.graph.nodes
                                                                     if n.op == "placeholder"])
    contract = contract_of(gm, names, type(model).__name__, dict(ep.range_constraints), exported.why)
    install_guard(gm, contract)
    notes += _input_notes(contract)
    is_dynamic = any(_has_symbolic_shape(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder")
    return CapturedGraph(gm, "export", is_dynamic, list(flat_inputs), in_spec=ep.call_spec.in_spec,
                         out_spec=ep.call_spec.out_spec, exported_program=ep, notes=notes,
                         seconds=time.perf_counter() - t0)


@dataclass
class _Exported:
    program: Any = None  # None: this attempt failed, `error` says why
    module: Optional[fx.GraphModule] = None  # program.module(): the unlifted graph, called like the model
    notes: list = field(default_factory=list)
    why: dict = field(default_factory=dict)  # (input name, dim) -> why capture fixed that dim
    error: str = ""


def _export_with_fallbacks(model, args: tuple, kwargs: dict, dynamic: bool, retry_hint: str) -> _Exported:
    """Every dim dynamic, else only the batch (dim 0), else static shapes; the dynamic attempts at
    batch 2 first when the example has batch 1."""
    if dynamic:
        every = _dynamic_export(model, args, kwargs, "all")
        if every.program is not None:
            return every
        batch = _dynamic_export(model, args, kwargs, "batch")
        if batch.program is not None:
            batch.notes.insert(0, f"dynamic export of every dim failed ({every.error}): captured with only the "
                                  "batch dynamic, every other dim fixed at the example's size")
            return batch
    try:
        ep = _export(model, args, kwargs, dims="none")
    except Exception as exc:
        raise CaptureError(_export_hint(exc, retry_hint)) from exc
    notes = [f"dynamic export failed, captured static shapes instead: {every.error}"] if dynamic else []
    return _Exported(ep, ep.module(), notes)


def _dynamic_export(model, args: tuple, kwargs: dict, dims: str) -> _Exported:
    """Export with `dims` dynamic ("all" or "batch"): at batch 2 for a batch-1 example when the
    graph then computes the model at batch 1, else at the example (its batch fixed at 1)."""
    notes: list[str] = []
    why: dict = {}
    wide = batch_of_two(args, kwargs)
    if wide is not None:
        if any(m.training for m in model.modules()):  # the check below would update its state
            reason = "the model is in training mode, so a graph captured at batch 2 cannot be checked at batch 1"
        else:
            try:
                ep = _export(model, *wide, dims=dims)
            except Exception as exc:
                reason = f"the model does not trace at batch 2: {_first_line(exc)}"
            else:
                gm = ep.module()
                reason = _disagreement(gm, model, args, kwargs)
                if reason is None:
                    return _Exported(ep, gm)
        notes.append(f"the batch size stays fixed at 1, the example's ({reason}); calls with another batch "
                     "raise: compile with a batch of 2 or more to keep it dynamic")
        why = {(name, 0): reason for name in _batch_one_names(model, args, kwargs)}
    try:
        ep = _export(model, args, kwargs, dims=dims)
    except Exception as exc:
        return _Exported(error=_first_line(exc))
    return _Exported(ep, ep.module(), notes, why)


def _export(model, args: tuple, kwargs: dict, dims: str):
    """Non-strict torch.export with Dim.AUTO on `dims` of every tensor input: "all", "batch", "none"."""
    shapes = None if dims == "none" else _auto_dynamic_shapes(model, args, kwargs, batch_only=dims == "batch")
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    before = [set(t.__dict__) for t in tensors]
    try:
        return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes)
    finally:
        # A failed dynamic export leaves Dynamo's dim markings on the input tensors (torch 2.13): the
        # caller's tensors would carry them, and the next attempt would trace them dynamic again.
        for t, had in zip(tensors, before):
            for key in [k for k in t.__dict__ if k not in had and "dynamo" in k]:
                delattr(t, key)


def _first_line(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


def batch_of_two(args: tuple, kwargs: dict) -> Optional[tuple]:
    """(args, kwargs) with every tensor of batch 1 (dim 0) repeated to 2, when some input of 2+ dims
    has batch 1; None otherwise. torch.export fixes a size-1 dim, so a batch-1 example would fix
    the batch."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not any(t.dim() >= 2 and t.shape[0] == 1 for t in leaves):
        return None

    def two(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
            return torch.cat([x, x], dim=0)
        return x

    return pytree.tree_map(two, (tuple(args), dict(kwargs)))


def _batch_one_names(model, args: tuple, kwargs: dict) -> list:
    """Names of the tensor inputs whose dim 0 is 1."""
    names = _leaf_names(model, args, kwargs)
    leaves = pytree.tree_leaves((args, kwargs))
    return [n for n, x in zip(names, leaves) if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1]


# How closely the graph captured at batch 2 must compute the model at the batch-1 example (the same
# ATen ops run, so only reduction order may differ); a model that branches on the batch being 1
# gives another answer there, and the batch is then captured fixed instead.
_AGREEMENT = 1e-4


def _disagreement(gm: fx.GraphModule, model, args: tuple, kwargs: dict) -> Optional[str]:
    """None when the graph exported at batch 2 computes the model at the example; else why not."""
    try:
        with torch.no_grad():
            got = gm(*args, **kwargs)
            want = model(*args, **kwargs)
    except Exception as exc:
        return f"the graph captured at batch 2 does not run at batch 1: {_first_line(exc)}"
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if got_spec != want_spec or len(got_leaves) != len(want_leaves):
        return "the graph captured at batch 2 returns another structure at batch 1"
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            return "the graph captured at batch 2 returns another structure at batch 1"
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return "the graph captured at batch 2 returns other shapes at batch 1"
        if w.is_floating_point() or w.is_complex():
            finite = w[torch.isfinite(w)]
            scale = float(finite.abs().max()) if finite.numel() else 0.0
            ok = torch.allclose(g, w, rtol=0, atol=_AGREEMENT * scale, equal_nan=True)
        else:
            ok = torch.equal(g, w)
        if not ok:
            return "the graph captured at batch 2 computes something else at batch 1: the model's code depends on it"
    return None


def check_runnable(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A model that cannot run on its example gets one line before capture (not export's traceback)."""
    name = type(model).__name__
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    meta = [n for n, t in tensors if t.is_meta]
    if meta:
        raise CaptureError(
            f"{name} has {len(meta)} of its {len(tensors)} parameters/buffers on the meta device (e.g. {meta[0]!r}): "
            "they hold no values to run; load its weights first (from_pretrained without device='meta' / "
            "init_empty_weights, or model.to_empty(device='cpu') then load_state_dict), then compile")
    inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if any(x.is_meta for x in inputs):
        raise CaptureError("the example inputs are on the meta device: they hold no values to run the model on; "
                           "pass real tensors (e.g. torch.randn(...) or a tokenizer's output)")
    devices = {t.device for _, t in tensors}
    if len(devices) == 1:
        (device,) = devices
        other = next((x.device for x in inputs if x.device != device), None)
        if other is not None:
            raise CaptureError(f"{name} is on {device} but an example input is on {other}: move the inputs to the "
                               f"model's device (e.g. x.to('{device}')) before compiling")


def input_names(model: torch.nn.Module, in_spec, args: tuple, kwargs: dict, placeholders: list) -> list:
    """Each graph input as the user passed it ("x", "inputs['ids']"), in placeholder order (the
    placeholders' own names where the example does not flatten to them)."""
    try:
        kwargs = reorder_kwargs(kwargs, in_spec) if kwargs else kwargs
    except ValueError:
        return list(placeholders)
    names = _leaf_names(model, args, kwargs)
    return names if len(names) == len(placeholders) else list(placeholders)


def _leaf_names(model: torch.nn.Module, args: tuple, kwargs: dict) -> list:
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = []
    for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        where, key, rest = path[0].idx, path[1], path[2:]
        if where == 0:
            base = params[key.idx] if key.idx < len(params) else f"args[{key.idx}]"
        else:
            base = str(key.key)
        names.append(base + pytree.keystr(rest))
    return names


def _input_notes(contract: InputContract) -> list[str]:
    """What the report says about the graph's inputs: constants frozen, dims fixed."""
    notes = []
    for r in contract.rules:
        if r.kind == "constant" and r.value is not None:
            keep = (" (pass a 0-dim tensor to keep it a run-time input)"
                    if isinstance(r.value, (int, float)) and not isinstance(r.value, bool) else "")
            notes.append(f"input {r.name!r} is a Python {type(r.value).__name__}: captured as the constant "
                         f"{r.value!r}; a call with another value raises{keep}")
    if contract.fixed_dims():
        notes.append(contract.describe())
    return notes


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
