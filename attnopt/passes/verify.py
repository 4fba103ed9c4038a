"""Verify pass: build each planned form, measure its drift, and accept it or keep the site exact.

Per site, the rewritten op runs on the ORIGINAL upstream activations recorded from the exact model
(q, k, v, mask of that site), so a site's drift is its own approximation error, not the sum of
everything upstream. End to end, the rewritten model runs on the same inputs as the original.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.forms.common.fitting import fit_progress
from attnopt.forms.common.mixed_heads import build_site, fit_site
from attnopt.ir.calls import SiteCall
from attnopt.ir.masks import key_keep
from attnopt.ir.errors import KeptByPlan, SiteUnsupported
from attnopt.ir.outcomes import (
    Attempt,
    Drift,
    OutputDrift,
    SiteOutcome,
    Status,
    Verdict,
)
from attnopt.passes.machine_load import ThreadBackoff


def drift(out: torch.Tensor, ref: torch.Tensor) -> Drift:
    """Relative RMS ‖out−ref‖/‖ref‖, cosine, max |out−ref| (float64); non-finite output flagged."""
    a = out.detach().to(torch.float64).reshape(-1)
    b = ref.detach().to(torch.float64).reshape(-1)
    finite = bool(torch.isfinite(a).all())
    if not finite:
        return Drift(rel_rms=float("inf"), cosine=float("nan"), max_abs=float("inf"), finite=False)
    diff = a - b
    ref_norm = float(b.norm())
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    denom = float(a.norm()) * ref_norm
    cos = float(a @ b) / denom if denom > 0 else (1.0 if float(diff.norm()) == 0 else 0.0)
    return Drift(rel_rms=rel, cosine=cos, max_abs=float(diff.abs().max()) if diff.numel() else 0.0, finite=True)


def worst(drifts: list[Drift]) -> Drift:
    """The worst of several drifts (one per recorded batch)."""
    return Drift(
        rel_rms=max(d.rel_rms for d in drifts),
        cosine=min(d.cosine for d in drifts),
        max_abs=max(d.max_abs for d in drifts),
        finite=all(d.finite for d in drifts),
    )


@torch.no_grad()
def site_drift(module: torch.nn.Module, calls: list[SiteCall], anchor_calls: Optional[list[SiteCall]] = None) -> Drift:
    """Drift of `module` (a RewrittenSite) over the recorded calls of its site.

    A reuse site is also handed its anchor's recorded q and k of the same batch.
    """
    drifts = []
    for i, call in enumerate(calls):
        extra = {} if anchor_calls is None else {"anchor": (anchor_calls[i].q, anchor_calls[i].k)}
        out = module(call.q, call.k, call.v, call.mask, **extra)
        rows = real_query_rows(call, getattr(getattr(module, "geometry", None), "keep_when", None))
        if rows is not None:  # a padding query's output is read by no one: not the form's error
            out, ref = out * rows, call.out * rows
        else:
            ref = call.out
        drifts.append(drift(out, ref))
    return worst(drifts)


def real_query_rows(call: SiteCall, keep_when: Optional[str]) -> Optional[torch.Tensor]:
    """[B, 1, Nq, 1] 1.0 where a self-attention query is a real token (its own key is not padding),
    0.0 where it is padding; None when every row is real or the call does not show it."""
    q, mask = call.q, call.mask
    if mask is None or keep_when is None or q.dim() != 4 or q.shape[2] != call.k.shape[2] or q.shape[2] < 2:
        return None
    try:
        keep_BN = key_keep(mask, keep_when, q.shape[0], call.k.shape[2])
    except RuntimeError:  # a mask whose batch does not follow q's: nothing to read
        return None
    if keep_BN is None or bool(keep_BN.all()):
        return None
    return keep_BN[:, None, :, None].to(call.out.dtype)


def judge(d: Drift, tolerance: float) -> tuple[Verdict, str]:
    """Accept or revert a site drift, with the reason in words."""
    if not d.finite:
        return Verdict.NOT_FINITE, "output has NaN/Inf: reverted to exact"
    # >=: a tolerance is the first drift refused, so an all-zero output (drift exactly 1) never
    # passes a tolerance of 1 or below.
    if d.rel_rms >= tolerance:
        return Verdict.OVER_TOLERANCE, f"drift {d.rel_rms:.3g} >= tolerance {tolerance:.3g}: reverted to exact"
    return Verdict.ACCEPTED, f"drift {d.rel_rms:.3g} < tolerance {tolerance:.3g}"


def call_lengths(call: SiteCall) -> tuple[int, int]:
    """(query length, key length) of a recorded call."""
    return call.q.shape[-2], call.k.shape[-2]


@dataclass
class SiteVerification:
    """Every site's outcome, the accepted site modules by site id, and the counts per status."""

    outcomes: list = field(default_factory=list)  # list[SiteOutcome], in site order
    modules: dict = field(default_factory=dict)  # site id -> SiteModule (accepted sites only)
    counts: dict = field(default_factory=dict)
    threads: list = field(default_factory=list)  # torch threads each site was built and fitted with


def tolerance_of(form: str, params: dict, tolerance: Optional[float], policy) -> float:
    """A rule's own tolerance, else compile(tolerance=...), else the policy's, else the form's default."""
    if tolerance is not None and params.get("tolerance") is None:
        return float(tolerance)
    return float(policy.tolerance_for(form, params))


def try_form(site, form: str, params: dict, context: BuildContext, tol: float,
             on_fit_step: Optional[Callable[[int, int], None]] = None) -> tuple[Attempt, Any]:
    """Build one form for one site, fit it, verify it: (the Attempt, the module if accepted else None).
    `on_fit_step(step, steps)` is told the fit's progress."""
    spec = forms.get(form)
    calls = context.calls[site.id]
    # Only inputs the form changes count: a window as wide as the input, or a length below
    # min_seq_len, runs exact attention and would verify with drift 0.
    acting = [i for i, c in enumerate(calls) if spec.acts_at(site, params, *call_lengths(c))]
    if not acting:
        lengths = sorted({call_lengths(c)[1] for c in calls})
        need = spec.acting_length(site, params)
        return Attempt(form, params, None, Verdict.UNVERIFIED,
                       f"unverified: {form} changes nothing at the verification lengths {lengths}; it is verified "
                       f"from about {need} tokens{_threshold_note(params)}: pass verify_inputs= at that length "
                       "(kept exact)", tol), None
    try:
        module = build_site(spec, site, params, context)  # a per-head site when params name exact heads
        # Fitted on the example batch only: calibration batches stay held out for the verdict.
        with fit_progress(on_fit_step or (lambda step, steps: None)):
            fit = fit_site(spec, module, calls[:1])
        anchor_calls = context.calls.get(module.anchor_id) if module.uses_anchor_qk else None
        d = site_drift(module, [calls[i] for i in acting], [anchor_calls[i] for i in acting] if anchor_calls else None)
    except KeptByPlan as exc:
        return Attempt(form, params, None, Verdict.KEPT_BY_PLAN, f"kept exact: {exc}", tol), None
    except SiteUnsupported as exc:
        return Attempt(form, params, None, Verdict.UNSUPPORTED, f"unsupported: {exc}", tol), None
    except Exception as exc:  # a failed rewrite leaves the site exact, and says why
        return Attempt(form, params, None, Verdict.FAILED, f"rewrite failed: {type(exc).__name__}: {exc}", tol), None
    verdict, reason = judge(d, tol)
    if d.finite and d.rel_rms == 0.0:  # acted in principle, changed nothing in fact: nothing was verified
        verdict, reason = Verdict.UNVERIFIED, (f"unverified: {form} gave exactly the exact output on every "
                                               "verification input, so its drift says nothing (kept exact)")
    if len(acting) < len(calls):
        reason += f" (on the {len(acting)} of {len(calls)} verification inputs where {form} acts)"
    if fit is not None:
        reason = (f"{fit.what} fitted to this site's softmax outputs "
                  f"(rel RMS {fit.rel_rms_before:.3g} -> {fit.rel_rms_after:.3g} in {fit.steps} steps); {reason}")
    return Attempt(form, params, d, verdict, reason, tol), (module if verdict is Verdict.ACCEPTED else None)


def verify_sites(sites, plans, context: BuildContext, policy, tolerance: Optional[float] = None,
                 adapt: Callable = lambda s: s, step: Callable = lambda text, done, total: None) -> SiteVerification:
    """Build, verify and accept or revert every planned site; `adapt` gives the mechanism's view of a site.
    `step(text, done, total)` is told each site before it is verified, and its fit's steps (a progress bar).
    Each site runs at the threads the cores left by other work allow (`ThreadBackoff`): the fits are
    thousands of small ops, which an oversubscribed thread pool slows tenfold."""
    outcomes, modules = [], {}
    adapted = [adapt(s) for s in sites]
    context = replace(context, sites=adapted)
    backoff = ThreadBackoff()
    n = len(adapted)
    for i, (site, plan) in enumerate(zip(adapted, plans)):
        step(f"verifying site {site.id}", i, n)

        def fit_step(done: int, steps: int, i=i) -> None:
            step(f"fit site {i + 1}/{n}: step {done}/{steps}", i, n)

        outcome, module = backoff.run(lambda: _decide(site, plan, context, policy, tolerance, fit_step))
        outcomes.append(outcome)
        if module is not None:
            modules[site.id] = module
    counts = {str(s): 0 for s in Status}
    for o in outcomes:
        counts[str(o.status)] += 1
    counts["attempts"] = sum(len(o.tried) for o in outcomes)
    planned = {name: p for name, f in forms.registry().items() if (p := f.plan_report(context)) is not None}
    if planned:  # what a form planned across sites (reuse: the measured overlap matrix and anchors)
        counts["plans"] = planned
    return SiteVerification(outcomes, modules, counts, backoff.used)


def _decide(site, plan, context, policy, tolerance, on_fit_step=None) -> tuple[SiteOutcome, Any]:
    if plan.unsupported:
        return SiteOutcome(site.id, plan.form, "exact", plan.params, Status.UNSUPPORTED, plan.reason), None
    if not plan.candidates:  # planned exact (by a rule, or by the form's own plan), or auto with nothing cheaper
        return SiteOutcome(site.id, plan.form, "exact", plan.params, Status.KEPT, plan.reason), None
    first_form, first_params = plan.candidates[0]
    if not context.calls.get(site.id):
        sharing = sum(s.module_path == site.module_path for s in context.sites)
        why = (f"its attention module {site.module_path} serves {sharing} layers (one module called {sharing} times "
               "per forward, as ALBERT shares its layers); attnopt rewrites a module that serves one layer: kept exact"
               if sharing > 1 else
               "the site was not reached on the example inputs, so it cannot be verified: kept exact")
        return SiteOutcome(site.id, first_form, "exact", first_params, Status.UNSUPPORTED, why), None
    tried = []
    for form, params in plan.candidates:
        attempt, module = try_form(site, form, params, context, tolerance_of(form, params, tolerance, policy),
                                   on_fit_step)
        tried.append(attempt)
        if module is not None:
            reason = (f"auto: {form} is the cheapest form within tolerance ({attempt.reason})" if plan.rule == "auto"
                      else f"{plan.reason}; {attempt.reason}")
            return SiteOutcome(site.id, first_form, form, params, Status.REWRITTEN, reason, attempt.tolerance,
                               attempt.drift, tuple(tried)), module
    last = tried[-1]
    if plan.rule == "auto":
        status = Status.UNVERIFIED if all(t.verdict is Verdict.UNVERIFIED for t in tried) else Status.REVERTED
        reason = "auto: no form within tolerance (" + "; ".join(f"{t.form}: {t.reason}" for t in tried) + "): kept exact"
    else:
        status = {Verdict.UNSUPPORTED: Status.UNSUPPORTED, Verdict.UNVERIFIED: Status.UNVERIFIED,
                  Verdict.KEPT_BY_PLAN: Status.KEPT}.get(last.verdict, Status.REVERTED)
        reason = last.reason
    return SiteOutcome(site.id, first_form, "exact", first_params, status, reason, last.tolerance, last.drift,
                       tuple(tried)), None


def _leaves(output: Any) -> list[tuple[str, torch.Tensor]]:
    flat, _ = pytree.tree_flatten_with_path(output)
    out = []
    for path, leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            out.append((pytree.keystr(path) or "output", leaf))
    return out


def _hidden_states(output: Any) -> Optional[torch.Tensor]:
    hs = getattr(output, "last_hidden_state", None)
    if hs is None and isinstance(output, dict):
        hs = output.get("last_hidden_state")
    return hs if isinstance(hs, torch.Tensor) and hs.dim() == 3 else None


def embedding_cosine(out: Any, ref: Any, attention_mask: Optional[torch.Tensor]) -> Optional[float]:
    """Mean cosine of mean-pooled token states (sentence-transformers pooling), when the output has them."""
    a, b = _hidden_states(out), _hidden_states(ref)
    if a is None or b is None or a.shape != b.shape:
        return None
    if attention_mask is not None and attention_mask.shape == a.shape[:2]:
        w = attention_mask.to(torch.float64).unsqueeze(-1)
    else:
        w = torch.ones(a.shape[:2] + (1,), dtype=torch.float64)
    pa = (a.double() * w).sum(1) / w.sum(1).clamp_min(1)
    pb = (b.double() * w).sum(1) / w.sum(1).clamp_min(1)
    return float(torch.nn.functional.cosine_similarity(pa, pb, dim=-1).mean())


def output_drift(outs: list[Any], refs: list[Any], attention_masks: list[Optional[torch.Tensor]]) -> OutputDrift:
    """End-to-end drift over batches: per output leaf (worst over batches) and the worst leaf."""
    per: dict[str, list[Drift]] = {}
    cosines = []
    for out, ref, am in zip(outs, refs, attention_masks):
        ref_leaves = dict(_leaves(ref))
        for name, leaf in _leaves(out):
            if name in ref_leaves and ref_leaves[name].shape == leaf.shape:
                want = ref_leaves[name]
                if am is not None and am.dim() == 2 and leaf.dim() >= 2 and tuple(leaf.shape[:2]) == tuple(am.shape):
                    # padding positions' outputs are read by no one (as embedding_cosine weighs them)
                    real = am.to(torch.float64).reshape(*am.shape, *([1] * (leaf.dim() - 2)))
                    leaf, want = leaf.to(torch.float64) * real, want.to(torch.float64) * real
                per.setdefault(name, []).append(drift(leaf, want))
        c = embedding_cosine(out, ref, am)
        if c is not None:
            cosines.append(c)
    per_output = {k: worst(v) for k, v in per.items()}
    worst_leaf = max(per_output.values(), key=lambda d: d.rel_rms, default=None)
    return OutputDrift(
        per_output=per_output,
        worst=worst_leaf,
        embedding_cosine=sum(cosines) / len(cosines) if cosines else None,
    )


def verification_length(sites, plans, calls: dict) -> Optional[int]:
    """The length a longer verification input needs so every planned form acts somewhere; None if
    the recorded inputs already suffice."""
    need = []
    for site, plan in zip(sites, plans):
        for form, params in plan.candidates:
            spec = forms.get(form)
            recorded = calls.get(site.id) or []
            if recorded and not any(spec.acts_at(site, params, *call_lengths(c)) for c in recorded):
                need.append(spec.acting_length(site, params))
    return max(need) if need else None


def _threshold_note(params) -> str:
    T = int(params.get("min_seq_len", 0) or 0)
    return f" (min_seq_len {T}: the first {T} positions run exact)" if T else ""
