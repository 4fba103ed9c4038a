"""What both ONNX exporters share (export.py: one prefill file; decode.py: a decode folder): the
export record, the target and opset checks, the optional packages, the dispatch thresholds a file
drops, the translation table that lowers every form's op for a target, and the search for the site
whose lowering fails alone."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from attnopt import forms
from attnopt.forms.common.base import SiteModule
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


def first_failing_site(trials: Iterable[tuple[str, Callable[[], float]]], what: str, none_alone: str) -> str:
    """Which site's lowering broke parity: the first of `trials`, (site label, a call exporting the site
    alone and returning its relative RMS against torch), that raises or exceeds PARITY_TOLERANCE, in
    one line; `none_alone` when every site matches alone. `what` names what was compared."""
    for label, measure in trials:
        try:
            err = measure()
        except Exception as exc:  # a lowering that fails to build or run is the failing site too
            return f"site {label}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if not err <= PARITY_TOLERANCE:
            return f"site {label}: {what} differs from torch by relative RMS {err:.2e} > {PARITY_TOLERANCE:g}"
    return none_alone


def histogram(model) -> dict:
    """Op counts of an onnx_ir model, "domain.op" for non-default domains, functions' bodies excluded."""
    counts = Counter((f"{n.domain}.{n.op_type}" if n.domain else n.op_type) for n in model.graph)
    return dict(sorted(counts.items()))


def to_onnx(program, table: dict, opset: Optional[int]):
    """torch.onnx.export of a torch.export program with `table`'s lowerings (and SDPA's boolean mask
    as torch reads it: kernels/onnx/masked_sdpa.py), then onnxscript's
    optimizer without its pattern rewriter: constant folding, dead nodes, shared constants and
    subexpressions. The rewriter's rules (no-op casts, reshape chains, conv and batch-norm fusions) are
    ones ORT and TensorRT apply themselves when they load a graph; skipping them is a sixth of the
    export's time. The opset-23 fusions (RMSNormalization, RotaryEmbedding) still run."""
    if opset is None or opset < 23:  # (opset 23 lowers SDPA to ONNX's Attention op instead)
        from attnopt.kernels.onnx.masked_sdpa import sdpa_zero_unseen_rows

        table = {torch.ops.aten.scaled_dot_product_attention.default: sdpa_zero_unseen_rows, **table}
    onnx_program = torch.onnx.export(program, dynamo=True, custom_translation_table=table, opset_version=opset,
                                     verbose=False, optimize=False)
    optimize_without_rewrites(onnx_program.model)
    return onnx_program


def optimize_without_rewrites(model) -> None:
    """onnxscript.optimizer.optimize_ir's passes, in its order, less the RewritePass; in place. An
    onnxscript without these public pieces runs its whole optimizer instead."""
    import onnxscript.optimizer as optimizer

    try:
        import onnx_ir as ir
        import onnx_ir.passes.common as common
        from onnxscript.optimizer import fold_constants_ir, remove_unused_functions, remove_unused_nodes
        from onnxscript.rewriter import onnx_fusions
    except ImportError:
        optimizer.optimize_ir(model)
        return
    common.InlinePass()(model)
    for _ in range(2):  # as optimize_ir: fold, drop what folding freed, once more if anything changed
        folded = fold_constants_ir(model, onnx_shape_inference=True)
        remove_unused_nodes(model)
        remove_unused_functions(model)
        common.RemoveUnusedOpsetsPass()(model)
        if not folded.modified:
            break
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)
    onnx_fusions.fuse(model)


# ---------------------------------------------------------------- argument checks


def check_target(target: str, opset: Optional[int]) -> tuple[str, Optional[int]]:
    if target not in TARGETS:
        raise ValueError(f"unknown ONNX target {target!r}; choose one of: {', '.join(TARGETS)}")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset not in SUPPORTED_OPSETS):
        raise ValueError(f"opset {opset!r} is not supported; use {SUPPORTED_OPSETS.start}.."
                         f"{SUPPORTED_OPSETS.stop - 1}, or None for torch.onnx's default")
    return target, opset


def require_packages() -> None:
    for module, why in (("onnx", "to write the file"), ("onnxscript", "for the lowerings"),
                        ("onnxruntime", "to check every export against torch")):
        try:
            __import__(module)
        except ImportError:
            raise ImportError(f"attnopt.export_onnx needs {module} ({why}); install it with "
                              f"pip install 'attnopt[onnx]'") from None


def run_time_switches(report) -> dict:
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
def dispatch_dropped(model: nn.Module, dropped: dict):
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


# ---------------------------------------------------------------- translation table


def _lowerings() -> list[tuple[str, OpLowering]]:
    found = []
    for name in forms.names():
        lowering = forms.get(name).onnx_lowering()
        if lowering is not None:
            found.append((name, lowering))
    return found


def translation_table(target: str, calls: list, lowerings: Optional[list] = None) -> dict:
    """{torch op: onnxscript function}; each call appends {"form", "op", "lowering"} to `calls`.
    `lowerings`: (form, OpLowering) pairs, default every form's prefill op."""
    table = {}
    for form, lowering in (_lowerings() if lowerings is None else lowerings):
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
        if contrib(then) == contrib(other):  # the same op either way (e.g. GQA with or without a pad bias)
            return contrib(then)
        if contrib(then) != "standard ops" or contrib(other) != "standard ops":
            return f"If({contrib(then)} | {contrib(other)})"
    return contrib(nodes)


@contextlib.contextmanager
def quiet_export():
    """torch.onnx's loggers and warnings ("torchvision is not installed" and friends) off while exporting."""
    import logging
    import warnings

    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)
