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
import functools
import inspect
import re
import os
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from attnopt.backends.export_inputs import (
    TensorForward,
    compiled_for_export,
    dynamic_shapes,
    example_args,
)
from attnopt.backends.onnx import checks
from attnopt.backends.onnx import decode as decode_module
from attnopt.backends.onnx.common import (  # noqa: F401  (check_target, histogram: part of this module's API)
    PARITY_TOLERANCE,
    SUPPORTED_OPSETS,
    OnnxExport,
    check_target,
    dispatch_dropped,
    first_failing_site,
    histogram,
    require_packages,
    run_time_switches,
    to_onnx,
    translation_table,
)
from attnopt.backends.onnx.graph_model import key_masks
from attnopt.forms.common.base import SiteModule
from attnopt.hf.interface import ANCHOR_QK
from attnopt.ir.errors import SpecializedInputError
from attnopt.passes.input_guard import GUARD_NAME


def export_onnx(model: nn.Module, path, example_inputs: Any = None, *, decode: Optional[bool] = None,
                target: str = "ort", opset: Optional[int] = None, dynamic: bool = True, policy: Any = None,
                check_lengths: Optional[Sequence[int]] = None, baseline: bool = True, tokenizer: Any = None):
    """Export a compiled model (HF or graph path; or an original one plus `policy=`) to `path`.

    `decode=True` writes the folder `path/` a runtime generates from (backends/onnx/decode.py: one
    graph for prefill and decoding with state inputs and outputs, genai_config.json, the tokenizer
    files) and returns a DecodeExport; it needs a causal LM. `decode=None` (the default) does that
    for a causal LM (`model.can_generate()`) given a folder path (an existing directory or a name
    without the .onnx suffix), and otherwise writes today's one prefill file; `decode=False`
    always writes the file. `tokenizer`: shipped in the folder (default `model.attnopt_tokenizer`
    when the model has one). What follows is the prefill file.

    `target`: "ort" (ONNX Runtime contrib kernels where exact), "onnx-std" (standard ops only) or
    "custom" (each site one `attnopt`-domain node with a model-local function: a runtime with a
    kernel or plugin of that name uses it, any other inlines the function). The file is checked
    (onnx.checker; ORT CPU parity with torch at the export length and one other, relative RMS ≤
    1e-4; ReferenceEvaluator on a short input for onnx-std and custom) before it is returned, and
    the result is appended to `model.attnopt_report.exports`. `check_lengths` overrides the two
    parity lengths; `baseline=False` skips the all-exact export behind `ops_before` (a second
    export, about as long as the first). Thresholds the automatic dispatch measured are left out of
    the file (its sites run their form at every length; `dispatch_dropped` lists them); a
    min_seq_len the policy gave is refused. `opset`: the ONNX opset (default torch.onnx's; 23 lowers
    SDPA to ONNX's Attention op). `dynamic=False` fixes batch and length at the example's.
    """
    folder = decode or (decode is None and decode_module.wants_folder(model, path))
    if check_lengths is not None:
        _check_lengths(check_lengths, folder)
    if folder:
        return decode_module.export_decoder(model, path, example_inputs, target=target, opset=opset, policy=policy,
                                            tokenizer=tokenizer)
    started = time.perf_counter()
    target, opset = check_target(target, opset)
    require_packages()
    out_path = writable_file(path)
    if decode is None and decode_module.cannot_generate(model) is None:
        # The README's first export of a causal LM once wrote this file and stopped there.
        warnings.warn(f"export_onnx: {out_path.name} is one prefill file (the logits of whole sequences, no state to "
                      "decode from); to generate, export a folder: export_onnx(model, 'out_dir') or decode=True "
                      "(decode=False says this file is what you want)", stacklevel=2)
    opt = compiled_for_export(model, policy, example_inputs)
    dropped = run_time_switches(opt.attnopt_report)
    with dispatch_dropped(opt, dropped):
        result = _export(opt, out_path, example_inputs, target, opset, dynamic, check_lengths, baseline)
    result.dispatch_dropped = dropped
    result.seconds = time.perf_counter() - started
    opt.attnopt_report.exports.append(result.to_dict())
    return result


def _check_lengths(lengths, folder: bool) -> None:
    """check_lengths: a non-empty list of positive int lengths, for a prefill file only."""
    if folder:
        raise ValueError("export_onnx: check_lengths sets a prefill file's parity lengths; a decode folder checks "
                         "a prompt and decoding steps of its own (drop check_lengths, or pass decode=False)")
    ok = isinstance(lengths, (list, tuple)) and lengths and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
    if not ok:
        raise ValueError(f"export_onnx: check_lengths must be a non-empty list of positive int sequence lengths, "
                         f"got {lengths!r}; e.g. check_lengths=[64, 200]")


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
    table = translation_table(target, calls)
    with key_masks(opt):  # a transformers model's sites get the padding mask, not a [B, 1, N, N] one
        after = _to_onnx(wrapper, export_args, shapes, table, opset)
    _add_functions(after.model, [c.pop("function") for c in calls if "function" in c])
    result = OnnxExport(path=str(out_path), target=target, opset=after.model.opset_imports[""],
                        sites=_name_sites(calls, _site_calls(opt, wrapper, flat)),
                        ops_before=histogram(before.model) if before else {}, ops_after=histogram(after.model))
    flat_names = io_names(after.model, wrapper, args, flat)  # after an eager call (_site_calls) named the output

    proto = after.model_proto
    checks.check_model(proto)
    # The other lengths run at the batch the file was exported at (2 for a batch-1 example, unless
    # the compiled model fixes its batch).
    other_batch = int(export_args[0].shape[0]) if export_args and export_args[0].dim() else 1
    lengths = check_lengths or _default_lengths(opt, wrapper, flat, dynamic, other_batch)
    result.parity = checks.ort_parity(proto, wrapper, flat, lengths, PARITY_TOLERANCE,
                                      on_failure=lambda msg: _localise(opt, wrapper, flat, table, msg, opset),
                                      other_batch=other_batch, flat_names=flat_names)
    if target in ("onnx-std", "custom"):
        result.parity.append(checks.reference_parity(proto, wrapper, flat, PARITY_TOLERANCE, flat_names=flat_names))
    after.save(str(out_path))
    return result


def io_names(model, wrapper: "TensorForward", args: tuple, flat: tuple) -> list:
    """Name the file's inputs as the model's call does (its keywords, its positional parameters) and
    its outputs as the model's (logits, last_hidden_state; else output, output_<i>), in place; returns
    the name of each flat input (the exporter drops those the graph never reads)."""
    params = _positional_names(wrapper.model, len(args))
    flat_names = params + list(wrapper.names)
    by_export_name = {f"flat_{i}": name for i, name in enumerate(flat_names)}
    for value in model.graph.inputs:
        value.name = by_export_name.get(value.name, value.name)
    outputs = list(model.graph.outputs)
    first = wrapper.output_name or "output"
    for i, value in enumerate(outputs):
        value.name = first if len(outputs) == 1 else f"{first}_{i}" if i else first
    return flat_names


def _positional_names(model: nn.Module, n: int) -> list:
    """The names of `n` positional arguments: a graph-path model's as its capture wrote them (x,
    inputs_ids for inputs['ids']), else forward()'s; input_<i> where neither says."""
    guard = getattr(getattr(model, "graph_module", None), GUARD_NAME, None)
    rules = [r for r in getattr(getattr(guard, "contract", None), "rules", ()) if r.kind == "tensor"]
    if len(rules) == n:
        names = [re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9_]", "_", r.name)).strip("_") or f"input_{i}"
                 for i, r in enumerate(rules)]
        if len(set(names)) == n:
            return names
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i].name if i < len(params) else f"input_{i}" for i in range(n)]


def _default_lengths(opt, wrapper: nn.Module, flat: tuple, dynamic: bool, batch: int) -> list:
    """The export length, and for a dynamic export one other that the compiled model itself runs at
    (a static export, or a graph-path model captured at a fixed length, runs at its own only)."""
    if not dynamic:
        return [checks.sequence_length(flat)]
    first, *others = checks.default_lengths(flat, opt)
    return [first] + [n for n in others if _accepts(wrapper, checks.at_length(flat, n, batch))]


# ---------------------------------------------------------------- argument checks


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
            return to_onnx(program, table, opset)
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
    handing = ANCHOR_QK.set(True)  # a reuse site gets its anchor's (q, k): alone, it selects in its op
    try:
        with torch.no_grad():
            wrapper(*flat)
    finally:
        ANCHOR_QK.reset(handing)
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

    def site_alone(module, a, kw) -> float:
        site = _SiteAlone(module, a, kw)
        tensors = site.tensors(a, kw)
        return checks.ort_rel_rms(_to_onnx(site, tensors, None, table, opset).model_proto, site, tensors)

    trials = ((f"{module.geometry.site_id} ({module.form})", functools.partial(site_alone, module, a, kw))
              for module, a, kw in _site_calls(opt, wrapper, flat))
    return first_failing_site(trials, "ONNX Runtime output",
                              f"every site matches alone; the whole model does not: {message}")


def _tensors_only(x) -> bool:
    """A tensor, or a tuple of them (a reuse site's anchor (q, k))."""
    return isinstance(x, torch.Tensor) or (isinstance(x, tuple) and len(x) > 0
                                           and all(isinstance(t, torch.Tensor) for t in x))


class _SiteAlone(nn.Module):
    """One site module called as in the model, its tensor arguments as the inputs (None stays None;
    a keyword holding a tuple of tensors gets them as inputs too)."""

    def __init__(self, site: nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.site = site
        self.arg_kinds = [isinstance(x, torch.Tensor) for x in args]
        self.kw_tensors = {k: (len(v) if isinstance(v, tuple) else None) for k, v in kwargs.items() if _tensors_only(v)}
        self.args = [None if isinstance(x, torch.Tensor) else x for x in args]
        self.kw_constants = {k: v for k, v in kwargs.items() if k not in self.kw_tensors}

    def tensors(self, args: tuple, kwargs: dict) -> tuple:
        kw = [t for k in self.kw_tensors for t in (kwargs[k] if isinstance(kwargs[k], tuple) else (kwargs[k],))]
        return tuple(x for x in args if isinstance(x, torch.Tensor)) + tuple(kw)

    def forward(self, *tensors):
        it = iter(tensors)
        args = [next(it) if is_tensor else x for is_tensor, x in zip(self.arg_kinds, self.args)]
        kw = {k: next(it) if n is None else tuple(next(it) for _ in range(n)) for k, n in self.kw_tensors.items()}
        return self.site(*args, **self.kw_constants, **kw)
