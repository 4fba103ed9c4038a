"""`attnopt.export_onnx`: a compiled model to one ONNX file, each site lowered by its form, checked.

    check inputs → (compile, if given an original model and a policy) → torch.export with dynamic
    batch and length → torch.onnx.export twice: every site exact (the "before" histogram) and every
    site lowered by its form for the target → checks (checks.py) → write → report

A site keeps its exact attention in the file when the policy kept it exact (it calls no attnopt
op, so it exports as it would without attnopt). Sites with `min_seq_len` are refused: their
run-time switch to exact attention below a length would need an If on the sequence length in the
graph, and a file that silently dropped the switch would compute something else at short lengths.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from attnopt import forms
from attnopt.backends.export_inputs import (
    TensorForward,
    compiled_for_export,
    dynamic_shapes,
    example_args,
)
from attnopt.backends.onnx import checks
from attnopt.forms.common.base import SiteModule
from attnopt.ir.errors import SpecializedInputError
from attnopt.kernels.onnx.lowering import TARGETS, OpLowering

# torch.onnx's dynamo exporter writes opset 18 and up (its default, 20 with torch 2.13, when
# opset=None); other versions are a version conversion of that graph. ORT 1.32 runs them all on CPU.
SUPPORTED_OPSETS = range(18, 24)
PARITY_TOLERANCE = 1e-4  # relative RMS of every output, fp32
PLUGIN_VERSION = "1"


@dataclass
class OnnxExport:
    """What export_onnx wrote and measured: per-site lowerings, op histograms, parity figures."""

    path: str
    target: str
    opset: int
    sites: list = field(default_factory=list)  # {"site", "form", "lowering"} per lowered call, graph order
    ops_before: dict = field(default_factory=dict)  # op histogram of the all-exact export
    ops_after: dict = field(default_factory=dict)
    parity: list = field(default_factory=list)  # {"batch", "length", "rel_rms", "runtime"} per check
    seconds: float = 0.0
    dispatch_dropped: dict = field(default_factory=dict)  # site id -> the measured min_seq_len the file omits

    def to_dict(self) -> dict:
        return {"path": self.path, "target": self.target, "opset": self.opset, "sites": list(self.sites),
                "ops_before": dict(self.ops_before), "ops_after": dict(self.ops_after),
                "parity": list(self.parity), "seconds": self.seconds, "dispatch_dropped": dict(self.dispatch_dropped)}


def export_onnx(model: nn.Module, path, example_inputs: Any = None, *, target: str = "ort",
                opset: Optional[int] = None, dynamic: bool = True, policy: Any = None,
                check_lengths: Optional[Sequence[int]] = None, baseline: bool = True) -> OnnxExport:
    """Export a compiled model (HF or graph path; or an original one plus `policy=`) to `path`.

    `target`: "ort" (ONNX Runtime contrib kernels where exact), "onnx-std" (standard ops only) or
    "custom" (each site one `attnopt`-domain node with a model-local function: a runtime with a
    kernel or plugin of that name uses it, any other inlines the function). The file is checked
    (onnx.checker; ORT CPU parity with torch at the export length and one other, relative RMS ≤
    1e-4; ReferenceEvaluator on a short input for onnx-std and custom) before it is returned, and
    the result is appended to `model.attnopt_report.exports`. `check_lengths` overrides the two
    parity lengths; `baseline=False` skips the all-exact export behind `ops_before` (a second
    export, about as long as the first). Thresholds the automatic dispatch measured are left out of
    the file (its sites run their form at every length; `dispatch_dropped` lists them); a
    min_seq_len the policy gave is refused.
    """
    started = time.perf_counter()
    target, opset = check_target(target, opset)
    _require_packages()
    out_path = writable_file(path)
    opt = compiled_for_export(model, policy, example_inputs)
    dropped = _run_time_switches(opt.attnopt_report)
    with _dispatch_dropped(opt, dropped):
        result = _export(opt, out_path, example_inputs, target, opset, dynamic, check_lengths, baseline)
    result.dispatch_dropped = dropped
    result.seconds = time.perf_counter() - started
    opt.attnopt_report.exports.append(result.to_dict())
    return result


def _export(opt, out_path, example_inputs, target, opset, dynamic, check_lengths, baseline) -> "OnnxExport":
    args, kwargs = example_args(opt, example_inputs)
    wrapper = TensorForward(opt, kwargs)
    flat = tuple(args) + tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))
    export_args = _export_args(wrapper, flat) if dynamic else flat
    shapes = dynamic_shapes(export_args) if dynamic else None

    before = None
    if baseline:
        with _all_sites_exact(opt):
            before = _to_onnx(wrapper, export_args, shapes, {}, opset)
    calls: list = []
    table = _translation_table(target, calls)
    after = _to_onnx(wrapper, export_args, shapes, table, opset)
    _add_functions(after.model, [c.pop("function") for c in calls if "function" in c])
    result = OnnxExport(path=str(out_path), target=target, opset=after.model.opset_imports[""],
                        sites=_name_sites(calls, _site_calls(opt, wrapper, flat)),
                        ops_before=histogram(before.model) if before else {}, ops_after=histogram(after.model))

    proto = after.model_proto
    checks.check_model(proto)
    # The other lengths run at the batch the file was exported at (2 for a batch-1 example, unless
    # the compiled model fixes its batch).
    other_batch = int(export_args[0].shape[0]) if export_args and export_args[0].dim() else 1
    lengths = check_lengths or _default_lengths(opt, wrapper, flat, dynamic, other_batch)
    result.parity = checks.ort_parity(proto, wrapper, flat, lengths, PARITY_TOLERANCE,
                                      on_failure=lambda msg: _localise(opt, wrapper, flat, table, msg, opset),
                                      other_batch=other_batch)
    if target in ("onnx-std", "custom"):
        result.parity.append(checks.reference_parity(proto, wrapper, flat, PARITY_TOLERANCE))
    after.save(str(out_path))
    return result


def _default_lengths(opt, wrapper: nn.Module, flat: tuple, dynamic: bool, batch: int) -> list:
    """The export length, and for a dynamic export one other that the compiled model itself runs at
    (a static export, or a graph-path model captured at a fixed length, runs at its own only)."""
    if not dynamic:
        return [checks.sequence_length(flat)]
    first, *others = checks.default_lengths(flat, opt)
    return [first] + [n for n in others if _accepts(wrapper, checks.at_length(flat, int(n), batch))]


def histogram(model) -> dict:
    """Op counts of an onnx_ir model, "domain.op" for non-default domains, functions' bodies excluded."""
    counts = Counter((f"{n.domain}.{n.op_type}" if n.domain else n.op_type) for n in model.graph)
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------- argument checks


def check_target(target: str, opset: Optional[int]) -> tuple[str, Optional[int]]:
    if target not in TARGETS:
        raise ValueError(f"unknown ONNX target {target!r}; choose one of: {', '.join(TARGETS)}")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset not in SUPPORTED_OPSETS):
        raise ValueError(f"opset {opset!r} is not supported; use {SUPPORTED_OPSETS.start}.."
                         f"{SUPPORTED_OPSETS.stop - 1}, or None for torch.onnx's default")
    return target, opset


def _require_packages() -> None:
    for module, why in (("onnx", "to write the file"), ("onnxscript", "for the lowerings"),
                        ("onnxruntime", "to check every export against torch")):
        try:
            __import__(module)
        except ImportError:
            raise ImportError(f"attnopt.export_onnx needs {module} ({why}); install it with "
                              f"pip install 'attnopt[onnx]'") from None


def writable_file(path) -> Path:
    p = Path(os.fspath(path)).expanduser()
    if p.is_dir():
        raise ValueError(f"cannot write the ONNX file to {str(p)!r}: it is a directory; give a file path such as "
                         f"{str(p / 'model.onnx')!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"cannot write the ONNX file to {str(p)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise PermissionError(f"cannot write the ONNX file to {str(p)!r}: permission denied; choose a writable path")
    return p


def _run_time_switches(report) -> dict:
    """Site id -> min_seq_len of the thresholds the automatic dispatch measured: the file runs those
    sites' forms at every length (a torch-side speed switch; ONNX Runtime's own crossover differs).
    A min_seq_len the policy itself gave changes the model's results, so it is refused instead."""
    dropped = {}
    for record in report.sites:
        params = record.outcome.params or {}
        T = int(params.get("min_seq_len", 0) or 0)
        if record.outcome.status.value != "rewritten" or T == 0:
            continue
        source = getattr(getattr(record, "threshold", None), "source", "given")
        if source in ("measured", "cached"):
            dropped[record.site.id] = T
            continue
        raise ValueError(
            f"site {record.site.id} ({record.outcome.final_form}) switches to exact attention below "
            f"min_seq_len={T} at run time, as its policy rule asks; ONNX export does not carry that switch: "
            "drop min_seq_len from the rule to export")
    return dropped


@contextlib.contextmanager
def _dispatch_dropped(model: nn.Module, dropped: dict):
    """The sites in `dropped` run their form at every length while exporting and checking."""
    sites = [m for m in model.modules() if isinstance(m, SiteModule) and m.geometry.site_id in dropped]
    saved = [m.min_seq_len for m in sites]
    for m in sites:
        m.min_seq_len = 0
    try:
        yield
    finally:
        for m, s in zip(sites, saved):
            m.min_seq_len = s


# ---------------------------------------------------------------- the module exported


def _batch_of_two(t: torch.Tensor) -> torch.Tensor:
    """torch.export specialises a size-1 dim; export at batch 2 so the file's batch stays dynamic."""
    if t.dim() >= 1 and t.shape[0] == 1:
        return torch.cat([t, t], dim=0)
    return t


def _export_args(wrapper: nn.Module, flat: tuple) -> tuple:
    """The tensors to export with: at batch 2 for a batch-1 example, unless the compiled model
    itself fixes its batch at 1 (a graph-path model whose capture had to): then as given, and the
    file's batch is fixed like the model's."""
    wide = tuple(_batch_of_two(t) for t in flat)
    if all(w is t for w, t in zip(wide, flat)) or _accepts(wrapper, wide):
        return wide
    return flat


def _accepts(wrapper: nn.Module, inputs: tuple) -> bool:
    """Whether the compiled model runs on `inputs` (False: it names a size it was captured for)."""
    try:
        with torch.no_grad():
            wrapper(*inputs)
    except SpecializedInputError:
        return False
    return True


def _to_onnx(wrapper: nn.Module, args: tuple, dynamic_shapes, table: dict, opset: Optional[int]):
    import logging
    import warnings

    quiet = logging.getLogger("torch.onnx")  # "torchvision is not installed" and friends, on every export
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)
            return torch.onnx.export(program, dynamo=True, custom_translation_table=table, opset_version=opset,
                                     verbose=False)
    finally:
        quiet.setLevel(level)


@contextlib.contextmanager
def _all_sites_exact(model: nn.Module):
    """Every site module takes its exact fallback (the file a model without attnopt would give)."""
    sites = [m for m in model.modules() if isinstance(m, SiteModule)]
    saved = [m.min_seq_len for m in sites]
    for m in sites:
        m.min_seq_len = 2 ** 62
    try:
        yield
    finally:
        for m, s in zip(sites, saved):
            m.min_seq_len = s


# ---------------------------------------------------------------- translation table


def _lowerings() -> list[tuple[str, OpLowering]]:
    found = []
    for name in forms.names():
        lowering = forms.get(name).onnx_lowering()
        if lowering is not None:
            found.append((name, lowering))
    return found


def _translation_table(target: str, calls: list) -> dict:
    """{torch op: onnxscript function}; each call appends {"form", "op", "lowering"} to `calls`."""
    table = {}
    for form, lowering in _lowerings():
        table[lowering.torch_op()] = _recording(form, lowering, target, calls)
    return table


def _recording(form: str, lowering: OpLowering, target: str, calls: list):
    schema = lowering.torch_op()._schema
    arg_names = [a.name for a in schema.arguments]

    def translate(*args, **kwargs):
        bound = dict(zip(arg_names, args), **kwargs)
        entry = {"form": form, "op": lowering.op}
        calls.append(entry)
        if target == "custom":
            from attnopt.backends.onnx.custom import custom_domain_call

            out, function = custom_domain_call(lowering, bound, PLUGIN_VERSION)
            entry["lowering"] = f"attnopt.{lowering.name}"
            entry["function"] = function
            return out
        from attnopt.kernels.onnx import functions

        before = _recorded_ops()
        out = lowering.by_target[target](**bound)
        entry["lowering"] = _describe(before, functions.MS_DOMAIN)
        return out

    translate.__name__ = f"{lowering.name}_{target.replace('-', '_')}"
    return translate


def _recorded_ops() -> int:
    import onnxscript

    return len(getattr(onnxscript.evaluator.default(), "nodes", []))


def _describe(start: int, contrib_domain: str) -> str:
    """The contrib ops a lowering used, or "standard ops" (read from the nodes it just recorded); an If
    that picks a contrib op at run time reads "If(<then> | <else>)"."""
    import onnxscript

    def contrib(nodes) -> str:
        found = sorted({f"{n.domain}.{n.op_type}" for n in nodes if n.domain == contrib_domain})
        return ", ".join(found) if found else "standard ops"

    nodes = getattr(onnxscript.evaluator.default(), "nodes", [])[start:]
    branches = [n for n in nodes if n.op_type == "If" and not n.domain]
    if branches and contrib(nodes) == "standard ops":
        then, other = (branches[0].attributes[a].value for a in ("then_branch", "else_branch"))
        if contrib(then) != "standard ops" or contrib(other) != "standard ops":
            return f"If({contrib(then)} | {contrib(other)})"
    return contrib(nodes)


def _add_functions(model, functions: list) -> None:
    """Model-local functions of the custom-domain nodes, one per (name, overload)."""
    for function in functions:
        function.opset_imports[""] = model.opset_imports[""]  # bodies were traced at the model's opset
        model.functions.setdefault(function.identifier(), function)
    if functions:
        from attnopt.kernels.onnx.functions import ATTNOPT_DOMAIN

        model.opset_imports.setdefault(ATTNOPT_DOMAIN, 1)


def _site_calls(opt: nn.Module, wrapper: nn.Module, flat: tuple) -> list:
    """(site module, args, kwargs) of every site call of one forward, in call order (= graph order)."""
    seen: list = []
    hooks = [m.register_forward_hook(lambda mod, a, kw, out: seen.append((mod, a, kw)), with_kwargs=True)
             for m in opt.modules() if isinstance(m, SiteModule)]
    try:
        with torch.no_grad():
            wrapper(*flat)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _name_sites(calls: list, site_calls: list) -> list:
    """Each lowered op call (graph order) with the site module that made it (call order)."""
    named = []
    for i, c in enumerate(calls):
        module = site_calls[i][0] if i < len(site_calls) else None
        site = module.geometry.site_id if module is not None and module.form == c["form"] else None
        named.append({"site": site, "form": c["form"], "lowering": c["lowering"]})
    return named


# ---------------------------------------------------------------- localising a failed check


def _localise(opt: nn.Module, wrapper: nn.Module, flat: tuple, table: dict, message: str, opset: int) -> str:
    """Which site's lowering broke parity: each site module exported alone on its recorded inputs."""
    for module, a, kw in _site_calls(opt, wrapper, flat):
        site = _SiteAlone(module, a, kw)
        tensors = site.tensors(a, kw)
        try:
            program = _to_onnx(site, tensors, None, table, opset)
            err = checks.ort_rel_rms(program.model_proto, site, tensors)
        except Exception as exc:  # a lowering that fails to build or run is the failing site too
            return f"site {module.geometry.site_id} ({module.form}): {type(exc).__name__}: {exc}"
        if not err <= PARITY_TOLERANCE:
            return (f"site {module.geometry.site_id} ({module.form}): ONNX Runtime output differs from torch by "
                    f"relative RMS {err:.2e} > {PARITY_TOLERANCE:g}")
    return f"every site matches alone; the whole model does not: {message}"


class _SiteAlone(nn.Module):
    """One site module called as in the model, its tensor arguments as the inputs (None stays None)."""

    def __init__(self, site: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.site = site
        self.arg_kinds = [isinstance(x, torch.Tensor) for x in args]
        self.kw_tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.args = [None if isinstance(x, torch.Tensor) else x for x in args]
        self.kw_constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}

    def tensors(self, args: tuple, kwargs: dict) -> tuple:
        return tuple(x for x in args if isinstance(x, torch.Tensor)) + tuple(kwargs[k] for k in self.kw_tensors)

    def forward(self, *tensors):
        it = iter(tensors)
        args = [next(it) if is_tensor else x for is_tensor, x in zip(self.arg_kinds, self.args)]
        return self.site(*args, **self.kw_constants, **{k: next(it) for k in self.kw_tensors})
