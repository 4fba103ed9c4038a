"""`attnopt.compile`: capture -> detect -> plan -> rewrite -> verify -> report, on a copy of the model.

Two rewrite mechanisms share every pass but the splice:
  hf  a transformers model keeps its class (generate(), caches, any length); its attention modules
      are pointed at attnopt's registered attention function, which runs each site's RewrittenSite;
  fx  any other module is captured with torch.export and each site is replaced in the graph.
"""

from __future__ import annotations

import copy as _copy
import time
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from attnopt.passes.calibrate import fit_feature_map
from attnopt.passes.plan import find_anchor, plan_sites
from attnopt.passes.records import Drift, SiteOutcome
from attnopt.passes.rewrite import RewrittenSite, SiteUnsupported, rewrite_graph
from attnopt.passes.verify import NodeRecorder, SiteCall, judge, output_drift, site_drift

Batch = tuple  # (args: tuple, kwargs: dict)


def _as_batch(inputs: Any, what: str) -> Batch:
    """Example inputs as (args, kwargs): a tuple/list of args, a mapping of kwargs, or one tensor."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        if len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], Mapping):
            return tuple(inputs[0]), dict(inputs[1])
        return tuple(inputs), {}
    raise TypeError(
        f"{what} must be a tensor, a tuple of positional arguments, a dict of keyword arguments, or "
        f"(args, kwargs); got {type(inputs).__name__}"
    )


def _attention_mask_of(batch: Batch) -> Optional[torch.Tensor]:
    am = batch[1].get("attention_mask")
    return am if isinstance(am, torch.Tensor) else None


class CompiledModule(nn.Module):
    """A rewritten captured graph, called like the original module (same arguments, same outputs)."""

    def __init__(self, graph_module: nn.Module, original_name: str):
        super().__init__()
        self.graph_module = graph_module
        self.original_name = original_name

    def forward(self, *args, **kwargs):
        try:
            return self.graph_module(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            if "kwarg" in str(exc) or "argument" in str(exc) or "pytree" in str(exc).lower():
                raise TypeError(
                    f"the compiled {self.original_name} takes its inputs in the same form as the "
                    f"example_inputs it was compiled with (same argument names/positions): {exc}"
                ) from exc
            raise


def _tolerance(params: dict, form: str, tolerance: Optional[float], policy) -> float:
    """A rule's own tolerance, else compile(tolerance=...), else the policy's, else the form's default."""
    if tolerance is not None and params.get("tolerance") is None:
        return float(tolerance)
    return float(policy.tolerance_for(form, params))


def _no_residual(site, anchor, params, calls):
    raise SiteUnsupported(
        "reuse with rank > 0 needs the layer input and separate q/k projections, which this version "
        "reads from transformers attention modules only; use rank 0 here"
    )


def _try_form(site, form, params, sites, calls, adapt_site, residual_fn, tol):
    """Build one form for one site and verify it: ((form, params, Drift|None, verdict), module|None)."""
    anchor = find_anchor(site, sites, params["anchor"]) if form == "reuse" else None
    try:
        residual = None
        if form == "reuse" and params.get("rank", 0) > 0:
            residual = residual_fn(site, anchor, params, calls)
        module = RewrittenSite(adapt_site(site), form, params, anchor=adapt_site(anchor) if anchor else None,
                               residual=residual)
        # Fitted on the example batch only: calibration batches stay held out for the verdict.
        fit = fit_feature_map(module, calls[site.id][:1])
        d = site_drift(module, calls[site.id], calls.get(anchor.id) if anchor else None)
    except SiteUnsupported as exc:
        return (form, params, None, f"unsupported: {exc}"), None
    except Exception as exc:  # a failed rewrite leaves the site exact, and says why
        return (form, params, None, f"rewrite failed: {type(exc).__name__}: {exc}"), None
    ok, verdict = judge(d, tol)
    if fit is not None:
        verdict = (f"{params['feature_map']} map fitted to this site's softmax outputs "
                   f"(rel RMS {fit.rel_rms_before:.3g} -> {fit.rel_rms_after:.3g}); {verdict}")
    return (form, params, d, verdict), (module if ok else None)


def decide(sites, plans, calls: dict, policy, tolerance, adapt_site=lambda s: s, residual_fn=_no_residual):
    """Build, verify and accept or revert every planned site.

    Returns (outcomes, accepted modules by site id). `calls` maps site id -> recorded SiteCalls;
    `residual_fn(site, anchor, params, calls)` gives a reuse site's residual factors (A, B).
    """
    outcomes, modules = [], {}
    for site, plan in zip(sites, plans):
        if plan.unsupported:
            outcomes.append(SiteOutcome(site.id, plan.form, "exact", plan.params, "unsupported", plan.reason))
            continue
        options = list(plan.candidates) if plan.rule == "auto" else [(plan.form, plan.params)]
        if not options or options[0][0] == "exact":  # planned exact, or auto with nothing cheaper
            outcomes.append(SiteOutcome(site.id, "exact", "exact", plan.params, "kept", plan.reason))
            continue
        if not calls.get(site.id):
            outcomes.append(SiteOutcome(site.id, options[0][0], "exact", options[0][1], "unsupported",
                                        "the site was not reached on the example inputs, so it cannot be verified: kept exact"))
            continue
        tried, chosen = [], None
        for form, params in options:
            entry, module = _try_form(site, form, params, sites, calls, adapt_site, residual_fn,
                                      _tolerance(params, form, tolerance, policy))
            tried.append(entry)
            if module is not None:
                chosen = (form, params, module, entry[2], _tolerance(params, form, tolerance, policy), entry[3])
                break
        if chosen is not None:
            form, params, module, d, tol, verdict = chosen
            modules[site.id] = module
            reason = f"{plan.reason}; {verdict}" if plan.rule != "auto" else f"auto: {form} is the cheapest form within tolerance ({verdict})"
            outcomes.append(SiteOutcome(site.id, options[0][0], form, params, "rewritten", reason, tol, d, tuple(tried)))
        else:
            last = tried[-1]
            d = last[2]
            tol = _tolerance(last[1], last[0], tolerance, policy)
            status = "reverted"
            if plan.rule == "auto":
                reason = "auto: no form within tolerance (" + "; ".join(f"{t[0]}: {t[3]}" for t in tried) + "): kept exact"
            else:
                reason = last[3]
                status = "unsupported" if reason.startswith("unsupported: ") else "reverted"
            outcomes.append(SiteOutcome(site.id, options[0][0], "exact", options[0][1], status, reason, tol, d, tuple(tried)))
    return outcomes, modules


# --------------------------------------------------------------------------------------------
# The two mechanisms


def _forward_params(model: nn.Module) -> set:
    import inspect as pyinspect

    try:
        return set(pyinspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _compile_hf(model_copy, batches, policy, tolerance, timings, notes):
    from attnopt import hf

    t = time.perf_counter()
    sites, near_misses, method = [], [], "hf"
    try:
        from attnopt.inspection import inspect as _inspect

        args, kwargs = batches[0]
        if "use_cache" not in kwargs and "use_cache" in _forward_params(model_copy):
            kwargs = {**kwargs, "use_cache": False}  # a KV-cache object is not an exportable output
        insp = _inspect(model_copy, *args, dynamic=False, **kwargs)
        sites, near_misses, method = list(insp.sites), list(insp.near_misses), "export+hf"
    except Exception as exc:  # the attention interface still shows every site; say why export failed
        notes.append(f"torch.export capture failed ({type(exc).__name__}: {str(exc)[:300]}); sites were described from the attention interface calls")
        insp = None
    timings["detect"] = time.perf_counter() - t

    t = time.perf_counter()
    hf.switch(model_copy, hf.implementation_for(model_copy))
    try:
        recorded, ref_outs = hf.record_calls(model_copy, batches)
    except Exception as exc:
        raise ValueError(
            f"the model failed when called with the example inputs ({type(exc).__name__}: {exc}); "
            "pass example_inputs the way you call the model: a dict of keyword arguments such as the "
            "tokenizer's output, a tuple of positional arguments, or (args, kwargs)"
        ) from exc
    timings["record"] = time.perf_counter() - t
    modules_by_path = dict(model_copy.named_modules())
    if insp is None:
        order = list(recorded)
        for i, path in enumerate(order):
            call, info = recorded[path][0]
            layer = getattr(modules_by_path[path], "layer_idx", None)
            sites.append(hf.site_from_call(path, modules_by_path[path], call, info, layer if isinstance(layer, int) else i))
    calls = {}
    for site in sites:
        per_module = [s for s in sites if s.module_path == site.module_path]
        rec = recorded.get(site.module_path, [])
        if len(per_module) == 1 and len(rec) == len(batches):
            calls[site.id] = [c for c, _ in rec]
        elif rec:
            notes.append(f"site {site.id}: {len(rec)} attention-interface calls for {len(per_module)} sites; not rewritten")

    # HF hands masks in its own spelling (bool keep for sdpa, additive for eager): read them as such.
    def adapt(site):
        return replace(site, mask=replace(site.mask, keep_when="zero"))

    def residual(site, anchor, params, calls_by_id):
        return hf.residual_factors(model_copy, site, anchor, params["rank"], calls_by_id[site.id], calls_by_id[anchor.id])

    t = time.perf_counter()
    plans = plan_sites(sites, policy)
    outcomes, modules = decide(sites, plans, calls, policy, tolerance, adapt_site=adapt, residual_fn=residual)
    timings["plan+verify_sites"] = time.perf_counter() - t

    t = time.perf_counter()
    reuse_cache: dict = {}
    by_id = {s.id: s for s in sites}
    for site_id, module in modules.items():
        target = model_copy.get_submodule(by_id[site_id].module_path)
        target.attnopt_site = module
        state = target.__dict__.setdefault("_attnopt_state", hf.ModuleState())
        state.reuse_cache = reuse_cache
        if module.anchor_id is not None:
            anchor_mod = model_copy.get_submodule(by_id[module.anchor_id].module_path)
            astate = anchor_mod.__dict__.setdefault("_attnopt_state", hf.ModuleState())
            astate.store_qk, astate.reuse_cache = True, reuse_cache
            module.anchor_key = id(anchor_mod)
            if module.residual_A is not None:
                hf.watch_layer_input(target)
    with torch.no_grad():
        outs = [hf.call_model(model_copy, b) for b in batches]
    e2e = output_drift(outs, ref_outs, [_attention_mask_of(b) for b in batches])
    timings["verify_end_to_end"] = time.perf_counter() - t
    return model_copy, sites, near_misses, plans, outcomes, e2e, method


def _compile_fx(model_copy, batches, policy, tolerance, timings, notes, name):
    from attnopt.passes.capture import capture_export
    from attnopt.passes.detect import detect

    t = time.perf_counter()
    args, kwargs = batches[0]
    captured = capture_export(model_copy, args, kwargs, dynamic=True)
    timings["capture"] = time.perf_counter() - t
    t = time.perf_counter()
    det = detect(captured)
    sites, near_misses = list(det.sites), list(det.near_misses)
    notes.extend(captured.notes)  # e.g. dynamic export fell back to static shapes
    timings["detect"] = time.perf_counter() - t

    t = time.perf_counter()
    names = set()
    for s in sites:
        names.update(n for n in (s.nodes.query, s.nodes.key, s.nodes.value, s.nodes.output, s.nodes.mask) if n)
    calls: dict = {s.id: [] for s in sites}
    ref_outs = []
    for b_args, b_kwargs in batches:
        values, out = _record_batch(captured, names, b_args, b_kwargs)
        ref_outs.append(out)
        for s in sites:
            k = values[s.nodes.key]
            if s.nodes.key_is_transposed:
                k = k.transpose(-2, -1)
            calls[s.id].append(SiteCall(values[s.nodes.query], k, values[s.nodes.value],
                                        values[s.nodes.mask] if s.nodes.mask else None, values[s.nodes.output]))
    timings["record"] = time.perf_counter() - t

    t = time.perf_counter()
    plans = plan_sites(sites, policy)
    outcomes, modules = decide(sites, plans, calls, policy, tolerance)
    timings["plan+verify_sites"] = time.perf_counter() - t

    t = time.perf_counter()
    gm = rewrite_graph(captured.graph_module, sites, modules)
    compiled = CompiledModule(gm, name)
    with torch.no_grad():
        outs = [compiled(*a, **k) for a, k in batches]
    e2e = output_drift(outs, ref_outs, [_attention_mask_of(b) for b in batches])
    timings["rewrite+verify_end_to_end"] = time.perf_counter() - t
    return compiled, sites, near_misses, plans, outcomes, e2e, captured.method


def _record_batch(captured, names: set, args: tuple, kwargs: dict):
    """Run the captured graph on one batch; return ({node name: value} for `names`, the outputs)."""
    from torch.export._tree_utils import reorder_kwargs

    gm = captured.graph_module
    if kwargs and captured.in_spec is not None:
        kwargs = reorder_kwargs(kwargs, captured.in_spec)
    flat = gm.graph._codegen.process_inputs(tuple(args), kwargs)
    recorder = NodeRecorder(gm, set(names))
    with torch.no_grad():
        out = recorder.run(*flat)
    if isinstance(out, list):
        out = gm.graph._codegen.process_outputs(out)
    return recorder.kept, out


def compile(
    model: nn.Module,
    policy: Any = "hybrid",
    example_inputs: Any = None,
    *,
    tolerance: Optional[float] = None,
    calibration: Optional[Sequence[Any]] = None,
    method: str = "auto",
    name: Optional[str] = None,
) -> nn.Module:
    """Rewrite the attention of a copy of `model` per `policy`; return it with `.attnopt_report`.

    example_inputs: how the model is called (a tensor, a tuple of args, a dict of kwargs, or
    (args, kwargs)); the rewritten model is called the same way. calibration: more such batches;
    per-site drift is the worst over all batches. tolerance: max relative RMS drift of a site's
    output (default per form; a rule's own `tolerance` wins); sites above it revert to exact.
    method: "auto" (transformers models keep their class via the attention interface, anything
    else is captured with torch.export), "hf" or "fx". The original model is never modified.
    """
    from attnopt import hf
    from attnopt.policy import Policy

    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.compile expects a torch.nn.Module; got {type(model).__name__}")
    if example_inputs is None:
        raise ValueError(
            "attnopt.compile needs example_inputs (how the model is called), e.g. "
            "example_inputs=tokenizer(text, return_tensors='pt') or example_inputs=(x,)"
        )
    if method not in ("auto", "hf", "fx"):
        raise ValueError(f"method must be 'auto', 'hf' or 'fx'; got {method!r}")
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise ValueError(f"tolerance must be a number >= 0 (relative RMS drift of a site); got {tolerance!r}")
    policy = Policy.parse(policy)
    batches = [_as_batch(example_inputs, "example_inputs")]
    batches += [_as_batch(b, f"calibration[{i}]") for i, b in enumerate(calibration or [])]
    name = name or type(model).__name__
    if method == "auto":
        method = "hf" if hf.is_hf_model(model) else "fx"
    if method == "hf" and not hf.is_hf_model(model):
        raise ValueError(f"method='hf' needs a transformers model that uses the attention interface; {name} is not one")

    timings: dict = {}
    notes: list = []
    t0 = time.perf_counter()
    model_copy = _copy.deepcopy(model).eval()
    timings["copy"] = time.perf_counter() - t0
    if method == "hf":
        result, sites, near, plans, outcomes, e2e, cap = _compile_hf(model_copy, batches, policy, tolerance, timings, notes)
    else:
        result, sites, near, plans, outcomes, e2e, cap = _compile_fx(model_copy, batches, policy, tolerance, timings, notes, name)
    timings["total"] = time.perf_counter() - t0

    result.attnopt_report = _build_report(
        model_name=name, policy=policy, method=cap, sites=sites, near_misses=near, plans=plans,
        outcomes=outcomes, end_to_end=e2e, timings=timings, notes=notes, example_len=_example_len(sites),
    )
    return result


def _build_report(*, model_name, policy, method, sites, near_misses, plans, outcomes, end_to_end, timings, notes, example_len):
    """The report is assembled from exactly what the passes returned; only costs are computed here."""
    from attnopt.passes.cost import cost_curve
    from attnopt.report import CompileReport, SiteRecord

    records = []
    for site, plan, outcome in zip(sites, plans, outcomes):
        n = site.q_len if isinstance(site.q_len, int) else example_len
        try:
            before = cost_curve(site, "exact", {}, example_len=n)
            after = cost_curve(site, outcome.final_form, outcome.params, example_len=n)
        except (ValueError, KeyError) as exc:
            before, after = [], []
            notes.append(f"site {site.id}: cost not computed ({exc})")
        records.append(SiteRecord(site=site, plan=plan, outcome=outcome, costs_before=before, costs_after=after))
    return CompileReport(
        model_name=model_name, policy=policy, capture=method, sites=records, near_misses=near_misses,
        end_to_end=end_to_end, timings=timings, notes=notes,
    )


def _example_len(sites) -> Optional[int]:
    for s in sites:
        if isinstance(s.q_len, int):
            return s.q_len
    return None


def backend(policy: Any = "hybrid", *, tolerance: Optional[float] = None):
    """A torch.compile backend: `torch.compile(model, backend=attnopt.backend("window:64"))`.

    Each graph Dynamo hands over is rewritten on its first real call (verification needs real
    inputs); the reports collect in `backend_fn.reports`.
    """
    from attnopt.policy import Policy

    policy = Policy.parse(policy)
    reports: list = []

    def backend_fn(gm: torch.fx.GraphModule, example_inputs):
        compiled: dict = {}

        def run(*args):
            if "module" not in compiled:
                mod = compile(gm, policy, example_inputs=tuple(args), tolerance=tolerance, method="fx", name="dynamo graph")
                reports.append(mod.attnopt_report)
                compiled["module"] = mod
            return compiled["module"](*args)

        return run

    backend_fn.reports = reports
    return backend_fn
