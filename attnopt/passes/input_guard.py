"""What a captured graph accepts, checked on every call: `InputContract` and the `InputGuard` module.

torch.export holds every non-tensor input (bool, int, float, str, None) as the constant it was
captured with, and may fix tensor dims at their example size (a size-1 dim always, others when
the model's code needs it). Called with anything else the graph would compute something else or
fail deep inside (a reshape baked with the example's sizes). The guard checks, per graph input:

- a non-tensor input equals its captured value (same type, same value);
- a tensor input has the captured rank, its fixed dims their captured size, and dims that are one
  symbol in the graph (e.g. q's and k's batch) equal sizes, within the capture's range;

and raises one line naming the input and the size or value the graph was captured for. The
contract is plain data (`contract_to_dict` / `contract_from_dict` write it as JSON, which is how
`attnopt.save` keeps it) and the guard a plain module. torch.export's own guard function is Python
source that export execs; `InputGuard` runs it where compile made it, and never keeps it on disk.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
from torch import nn

from attnopt.ir.errors import SpecializedInputError, SpecializedShapeError

GUARD_NAME = "_guards_fn"  # the submodule torch.export calls with every placeholder, first thing
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")


@dataclass(frozen=True)
class InputRule:
    """One graph input: a tensor (`sizes`: int = fixed, str = a symbol of the graph) or a constant."""

    name: str  # as the user wrote it: "x", "inputs['ids']"
    kind: str  # "tensor", "constant", or "any" (an int export kept symbolic)
    sizes: tuple = ()  # per dim, for tensors
    value: Any = None  # the captured value, for constants
    why: dict = field(default_factory=dict)  # dim -> why capture fixed it, where known


@dataclass(frozen=True)
class InputContract:
    """Every graph input's rule, in placeholder order, and each symbol's (min, max) size."""

    model_name: str
    rules: tuple
    ranges: dict = field(default_factory=dict)  # symbol -> (min, max or None)

    def fixed_dims(self) -> list[tuple[str, int, int]]:
        """(input, dim, size) of every tensor dim the graph fixes."""
        return [(r.name, d, s) for r in self.rules if r.kind == "tensor" for d, s in enumerate(r.sizes)
                if isinstance(s, int)]

    def describe(self) -> str:
        """One line: every tensor input's accepted shape (`*` any size)."""
        parts = [f"{r.name} {_shape_text(r)}" for r in self.rules if r.kind == "tensor"]
        return ("the captured graph takes " + "; ".join(parts) + " (* = any size; a call with another size in a "
                "fixed dim raises)")


# ---------------------------------------------------------------- as JSON (attnopt.save keeps the contract as data)

# The constant types torch.export keeps as graph inputs, by the name JSON records them under.
_CONSTANT_TYPES = {"none": type(None), "bool": bool, "int": int, "float": float, "str": str}


def contract_to_dict(contract: InputContract) -> dict:
    """The contract as JSON-able data; ValueError naming the input when a constant is of no JSON type."""
    return {"model_name": contract.model_name,
            "rules": [{"name": r.name, "kind": r.kind, "sizes": list(r.sizes), "value": _constant_to_json(r),
                       "why": {str(d): w for d, w in r.why.items()}} for r in contract.rules],
            "ranges": {sym: [lo, hi] for sym, (lo, hi) in contract.ranges.items()}}


def contract_from_dict(d: Any) -> InputContract:
    """The contract `contract_to_dict` wrote; ValueError naming the first field of the wrong type."""
    if not isinstance(d, dict) or not isinstance(d.get("model_name"), str) or not isinstance(d.get("rules"), list) \
            or not isinstance(d.get("ranges"), dict):
        raise ValueError("the input contract is not an object with model_name, rules and ranges")
    rules = []
    for i, r in enumerate(d["rules"]):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str) \
                or r.get("kind") not in ("tensor", "constant", "any") \
                or not isinstance(r.get("sizes"), list) or not isinstance(r.get("why"), dict):
            raise ValueError(f"input rule {i} is damaged")
        if not all(isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool)) for s in r["sizes"]):
            raise ValueError(f"input rule {i} ({r['name']!r}) has sizes that are neither ints nor symbols")
        try:
            why = {int(k): str(v) for k, v in r["why"].items()}
        except ValueError:
            raise ValueError(f"input rule {i} ({r['name']!r}) has a non-integer dim in 'why'") from None
        value = _constant_from_json(r.get("value"), i) if r["kind"] == "constant" else None
        rules.append(InputRule(r["name"], r["kind"], tuple(r["sizes"]), value, why))
    ranges = {}
    for sym, bounds in d["ranges"].items():
        ints = all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in bounds or ())
        if not (isinstance(bounds, list) and len(bounds) == 2 and ints and bounds[0] is not None):
            raise ValueError(f"the range of {sym!r} is not [int, int or null]")
        ranges[sym] = (bounds[0], bounds[1])
    return InputContract(d["model_name"], tuple(rules), ranges)


def _constant_to_json(rule: InputRule) -> Optional[dict]:
    if rule.kind != "constant":
        return None
    value = rule.value
    kind = next((k for k, t in _CONSTANT_TYPES.items() if type(value) is t), None)
    if kind is None:
        raise ValueError(f"input {rule.name!r} was captured as the constant {_show(value)} of type "
                         f"{type(value).__name__}, which has no JSON form; pass it as a tensor or a bool/int/float/str")
    # float.hex: exact, and spells nan and inf, which JSON has no numbers for.
    return {"type": kind, "value": value.hex() if kind == "float" else value}


def _constant_from_json(d: Any, i: int) -> Any:
    if not isinstance(d, dict) or d.get("type") not in _CONSTANT_TYPES:
        raise ValueError(f"input rule {i} has no typed constant value")
    kind, value = d["type"], d.get("value")
    if kind == "float":
        try:
            return float.fromhex(value)
        except (TypeError, ValueError):
            raise ValueError(f"input rule {i} has a float constant that is not a hex float") from None
    if type(value) is not _CONSTANT_TYPES[kind]:
        raise ValueError(f"input rule {i} has a {kind} constant holding {type(value).__name__}")
    return value


def contract_of(gm: fx.GraphModule, names: list, model_name: str, ranges: dict,
                why: Optional[dict] = None) -> InputContract:
    """The contract of an exported graph module: its placeholders' captured values and shapes."""
    why = why or {}
    rules = []
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            sizes = tuple(_size(s) for s in val.shape)
            rules.append(InputRule(name, "tensor", sizes, why={d: w for (n, d), w in why.items() if n == name}))
        elif isinstance(val, torch.SymInt):
            rules.append(InputRule(name, "any"))
        else:
            rules.append(InputRule(name, "constant", value=val))
    bounds = {}
    for sym, vr in ranges.items():
        lo = int(vr.lower) if _finite(vr.lower) else 0
        hi = int(vr.upper) if _finite(vr.upper) else None
        bounds[str(sym)] = (lo, hi)
    return InputContract(model_name, tuple(rules), bounds)


def _size(s) -> "int | str":
    """A captured dim: its int size when fixed (a SymInt whose expression is a number is), else the
    printed symbol or expression."""
    if isinstance(s, int):
        return int(s)
    expr = s.node.expr
    return int(expr) if getattr(expr, "is_number", False) else str(expr)


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError, OverflowError):
        return False


class InputGuard(nn.Module):
    """Called by the graph with every placeholder before anything else: checks the contract, then
    torch.export's own guard function where it is still held (not after pickling)."""

    _is_impure = True  # a call with no users: dead-code elimination must keep it

    def __init__(self, contract: InputContract, export_guard: Optional[nn.Module] = None):
        super().__init__()
        self.contract = contract
        self._export_guard = [export_guard] if export_guard is not None else []  # a list: not a submodule

    def forward(self, *flat):
        check_inputs(self.contract, flat)
        for guard in self._export_guard:
            try:
                guard(*flat)
            except AssertionError as exc:
                raise SpecializedShapeError(
                    f"this compiled {self.contract.model_name} was captured under the condition "
                    f"{_guard_text(exc)} (the model's code depends on it) and this call breaks it; call it with "
                    "inputs that meet it, or compile again with example_inputs like this call's") from None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_export_guard"] = []  # export's guard is a function made by exec: it cannot be pickled
        return state

    def __deepcopy__(self, memo) -> "InputGuard":
        # A copy (compile splices a copy of the captured graph) keeps export's guard: it holds no state.
        new = InputGuard(copy.deepcopy(self.contract, memo), *self._export_guard)
        memo[id(self)] = new
        return new.train(self.training)


def _guard_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[len("Guard failed: "):] if text.startswith("Guard failed: ") else text


def install_guard(gm: fx.GraphModule, contract: InputContract) -> None:
    """Make `contract` the first thing `gm` checks: in place of export's guard call (which it then
    runs itself), or as a new call after the placeholders."""
    export_guard = gm._modules.get(GUARD_NAME)
    gm._modules.pop(GUARD_NAME, None)
    gm.add_submodule(GUARD_NAME, InputGuard(contract, export_guard))
    if not any(n.op == "call_module" and n.target == GUARD_NAME for n in gm.graph.nodes):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if not placeholders:
            return
        with gm.graph.inserting_after(placeholders[-1]):
            gm.graph.call_module(GUARD_NAME, tuple(placeholders))
    gm.recompile()


def guard_of(gm: nn.Module) -> Optional[InputGuard]:
    guard = getattr(gm, "_modules", {}).get(GUARD_NAME)
    return guard if isinstance(guard, InputGuard) else None


# ---------------------------------------------------------------- the checks


def check_inputs(contract: InputContract, flat: tuple) -> None:
    """Raise one line naming the first input that the captured graph was not captured for."""
    seen: dict = {}  # symbol -> (size, input, dim) of its first occurrence
    for rule, value in zip(contract.rules, flat):
        if rule.kind == "constant":
            if not _same_value(value, rule.value):
                raise SpecializedInputError(_value_message(contract.model_name, rule, value))
            continue
        if rule.kind != "tensor":
            continue
        if not isinstance(value, torch.Tensor):
            raise SpecializedShapeError(
                f"this compiled {contract.model_name} was captured with input {rule.name!r} a tensor, and this call "
                f"passes {type(value).__name__}; pass a tensor of shape {_shape_text(rule)}")
        if value.dim() != len(rule.sizes):
            raise SpecializedShapeError(
                f"this compiled {contract.model_name} was captured with input {rule.name!r} of {len(rule.sizes)} dims "
                f"{_shape_text(rule)}, and this call passes {value.dim()} dims {tuple(value.shape)}; pass "
                f"{len(rule.sizes)} dims")
        for d, want in enumerate(rule.sizes):
            _check_dim(contract, rule, d, want, value.shape[d], seen)


def _check_dim(contract: InputContract, rule: InputRule, d: int, want, got, seen: dict) -> None:
    name = contract.model_name
    if isinstance(want, int):
        if got != want:
            why = f" ({rule.why[d]})" if d in rule.why else ""
            raise SpecializedShapeError(
                f"this compiled {name} was captured with input {rule.name!r} dim {d}{_dim_role(rule, d)} fixed at "
                f"{want}{why}, and this call has {got} there; call it with {want} there, or compile again with "
                "example_inputs of this size")
        return
    if not _SYMBOL.match(want):
        return  # a size derived from others (e.g. 2*s0): the graph's own ops check it
    if want in seen:
        size, other, od = seen[want]
        if got != size:
            raise SpecializedShapeError(
                f"this compiled {name} was captured with input {rule.name!r} dim {d} equal to input {other!r} dim "
                f"{od} (one size in the graph), and this call has {got} and {size}; pass equal sizes there")
        return
    seen[want] = (got, rule.name, d)
    lo, hi = contract.ranges.get(want, (0, None))
    # torch.export traces every dynamic dim as >= 2 and runs at 1 as well; a higher bound comes from the model
    if (lo > 2 and got < lo) or (hi is not None and got > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise SpecializedShapeError(
            f"this compiled {name} was captured for input {rule.name!r} dim {d} of size {span} (the model's code "
            f"depends on it), and this call has {got} there; call it within that range, or compile again with "
            "example_inputs of this size")


def _dim_role(rule: InputRule, d: int) -> str:
    """The batch-1 dims capture tried to keep dynamic (the only dims it knows to be the batch)."""
    return " (the batch size)" if d == 0 and d in rule.why else ""


def _shape_text(rule: InputRule) -> str:
    return "(" + ", ".join("*" if isinstance(s, str) else str(s) for s in rule.sizes) + ")"


def _same_value(got: Any, want: Any) -> bool:
    if type(got) is not type(want):
        return False
    if isinstance(want, float) and math.isnan(want):
        return math.isnan(got)
    return got == want


def _value_message(model_name: str, rule: InputRule, value: Any) -> str:
    want = rule.value
    kind = "" if want is None else f" (a Python {type(want).__name__})"
    number = isinstance(want, (int, float)) and not isinstance(want, bool)
    fix = (f"pass {rule.name!r} as a 0-dim tensor to keep it a run-time input, or compile again with the new value"
           if number else f"compile again with example_inputs that pass {rule.name}={_show(value)} (the graph holds "
                          "one value)")
    return (f"this compiled {model_name} was captured with {rule.name}={_show(want)}{kind}: torch.export holds a "
            f"non-tensor input as a constant, so the graph is valid only for that value, and this call passes "
            f"{rule.name}={_show(value)}; {fix}")


def _show(value: Any) -> str:
    """A value on one short line (a tensor by its dtype and shape)."""
    if isinstance(value, torch.Tensor):
        return f"<{str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}>"
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."
