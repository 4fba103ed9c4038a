"""The keep:recall step of compile: which KV heads (or layers) of the sites its rules cover stay exact.

    probes at the compile length (probing.py)        → the original's quality
    cheap signals per KV head (passes/head_scores.py): induction/retrieval mass beyond the form's
        reach on a repeated span and two probe rows, and the form's attention-transfer error on the
        recorded calls (example and calibration batches)
    greedy confirmation (search.py), each candidate measured with the accepted all-heads modules and
        exact attention switched per head (selector.py), measurements cached on disk (store.py)
    the chosen heads built as per-head sites (fitted on their own heads) and verified again

Runs after verify (it needs the accepted modules) and before the end-to-end budget (which then
judges the final model). A site whose every KV head was chosen (by:layer) is kept exact.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from attnopt.ir.digest import json_digest, tensors_digest
from attnopt.ir.outcomes import SiteOutcome, Status
from attnopt.passes.head_scores import induction_targets, retrieval_scores, transfer_loss
from attnopt.passes.verify import tolerance_of, try_form
from attnopt.selection import store
from attnopt.selection.probing import ProbeSet, Quality, compile_length, measure, probe_set, text_rows
from attnopt.selection.search import Budget, Unit, greedy
from attnopt.selection.selector import HeadMask

KEEP_KEYS = ("keep", "exact", "recall", "by")
# The cheap signals' weights in the order candidates are tried: retrieval first, the transfer error
# (what the form gets wrong on this site at all) breaking near ties.
TRANSFER_WEIGHT = 0.25


@dataclass
class HeadSelection:
    """What keep:recall did, for the report: the budget, whether it holds, the heads chosen, the curve
    the search walked, the cheap signals, the probes and what the measurements cost."""

    budget: dict
    holds: bool
    summary: str
    chosen: dict  # site id -> [KV heads kept exact]
    exact_heads: int
    total_heads: int
    original: dict  # Quality.to_dict()
    selected: dict
    curve: list  # Point.to_dict(), in the order the search added units
    signals: dict  # site id -> {"retrieval": [per KV head], "transfer": [per KV head]}
    probes: dict
    measured: int = 0
    cached: int = 0
    seconds: float = 0.0
    notes: list = field(default_factory=list)
    decode: Optional[dict] = None  # per-token decoding time, original against selected (compile adds it)

    @property
    def fraction(self) -> float:
        return self.exact_heads / self.total_heads if self.total_heads else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "fraction": self.fraction}


@dataclass
class Selected:
    """The verification after selection: outcomes and modules, with the per-head sites in place."""

    outcomes: list
    modules: dict
    selection: Optional[HeadSelection] = None
    counts: dict = field(default_factory=dict)


def keep_plans(plans: list) -> list:
    """Indices of the plans whose rule asks keep:recall."""
    return [i for i, p in enumerate(plans) if p.candidates and p.params.get("keep") == "recall"]


def select_exact_heads(target, found, recorded, verification, opts, context, tokenizer=None,
                       step: Callable[[str], None] = lambda text: None) -> Selected:
    """keep:recall for every site its rules cover (nothing to do, and the verification unchanged, when
    no rule asks it)."""
    plans = recorded.planning.plans
    asked = keep_plans(plans)
    if not asked:
        return Selected(verification.outcomes, verification.modules)
    started = time.perf_counter()
    sites = {s.id: s for s in context.sites}
    in_play = [i for i in asked if verification.outcomes[i].status is Status.REWRITTEN
               and verification.outcomes[i].site_id in verification.modules]
    budget = budget_of([plans[i].params for i in asked])
    notes = []
    if len({json_digest({k: plans[i].params.get(k) for k in KEEP_KEYS}) for i in asked}) > 1:
        notes.append(f"rules asked keep:recall with different budgets; one search holds the strictest: recall "
                     f"{budget.recall:g}, at most {budget.exact:g} of the KV heads exact, by {budget.by}")
    if not in_play:
        return Selected(verification.outcomes, verification.modules,
                        _empty(budget, "no site the rules cover was rewritten, so no head was chosen", notes))
    length = compile_length(opts.batches, _position_limit(target.model))
    if length is None:
        raise ValueError("keep:recall measures retrieval probes at the compile length, which needs input_ids "
                         "[batch, tokens] among example_inputs; pass them as compile(..., example_inputs={'input_ids': ...})")
    step(f"keep:recall: building probes at {length} tokens")
    try:
        probes = probe_set(target.model, tokenizer if tokenizer is not None else getattr(target.model, "attnopt_tokenizer", None),
                           length, text_rows(opts.batches))
    except ValueError as exc:
        raise ValueError(f"keep:recall: {exc}") from None
    units, total = _units(in_play, plans, verification, sites, budget)
    memo = Measurements(_measure_key(target, verification, probes, in_play, plans))
    step("keep:recall: measuring the original")
    original = memo.get("original", lambda: measure(target.model, probes))
    step("keep:recall: cheap signals (induction and retrieval mass, attention transfer)")
    signals = cheap_signals(target, found, recorded, verification, in_play, plans, sites, probes)
    units = [replace(u, signal=_signal(u, signals)) for u in units]
    masks = {verification.outcomes[i].site_id: HeadMask(sites[verification.outcomes[i].site_id],
                                                        verification.modules[verification.outcomes[i].site_id])
             for i in in_play}
    installed = target.install(found.sites, {**verification.modules, **masks}).model

    def measure_units(chosen: list) -> Quality:
        heads = sorted(h for u in chosen for h in u.heads)
        for sid, mask in masks.items():
            mask.exact_kv = {j for s, j in heads if s == sid}
        return memo.get(json_digest(heads), lambda: measure(installed, probes))

    try:
        search = greedy(units, total, budget, original, measure_units, step=step)
    finally:
        for mask in masks.values():  # the all-heads modules go back to being sites of their own
            mask.module.nested = False
    memo.save()
    chosen = {}
    for sid, j in search.heads:
        chosen.setdefault(sid, []).append(j)
    chosen = {sid: sorted(js) for sid, js in chosen.items()}
    step("keep:recall: building the chosen per-head sites")
    outcomes, modules = rebuild(chosen, in_play, plans, verification, sites, context, opts)
    last = search.path[-1]
    selection = HeadSelection(
        budget=budget.to_dict(), holds=search.holds, summary=_summary(search, budget, total), chosen=chosen,
        exact_heads=last.exact_heads, total_heads=total, original=original.to_dict(),
        selected=last.quality, curve=[p.to_dict() for p in search.path],
        signals={sid: {k: [round(float(x), 6) for x in v] for k, v in s.items()} for sid, s in signals.items()},
        probes=probes.describe(), measured=search.measured, cached=memo.hits,
        seconds=round(time.perf_counter() - started, 3), notes=notes)
    counts = {"sites": len(in_play), "exact_heads": last.exact_heads, "total_heads": total, "holds": search.holds,
              "measured": search.measured, "cached": memo.hits}
    return Selected(outcomes, modules, selection, counts)


def budget_of(params_list: list) -> Budget:
    """The strictest of the rules' budgets (defaults from the form parameters' defaults)."""
    recall = max(float(p.get("recall", 0.95)) for p in params_list)
    exact = min(float(p.get("exact", 0.25)) for p in params_list)
    by = "layer" if any(p.get("by") == "layer" for p in params_list) else "head"
    return Budget(recall=recall, exact=exact, by=by)


def _units(in_play: list, plans: list, verification, sites: dict, budget: Budget) -> tuple[list, int]:
    """The units the search adds back, and the KV heads of every site in play."""
    heads = [(verification.outcomes[i].site_id, j) for i in in_play
             for j in range(sites[verification.outcomes[i].site_id].kv_heads)]
    if budget.by == "head":
        return [Unit(f"{sid} kv {j}", ((sid, j),)) for sid, j in heads], len(heads)
    by_layer: dict = {}
    for sid, j in heads:
        by_layer.setdefault(sites[sid].layer, []).append((sid, j))
    return [Unit(f"layer {layer}", tuple(h)) for layer, h in sorted(by_layer.items())], len(heads)


def _signal(unit: Unit, signals: dict) -> float:
    """A unit's cheap score: retrieval mass over its heads plus a little of their transfer error, each
    divided by the largest over all heads so neither's units matter."""
    top_r = max((max(s["retrieval"], default=0.0) for s in signals.values()), default=0.0) or 1.0
    top_t = max((max(s["transfer"], default=0.0) for s in signals.values()), default=0.0) or 1.0
    total = 0.0
    for sid, j in unit.heads:
        s = signals.get(sid)
        if s is not None:
            total += float(s["retrieval"][j]) / top_r + TRANSFER_WEIGHT * float(s["transfer"][j]) / top_t
    return total


def cheap_signals(target, found, recorded, verification, in_play: list, plans: list, sites: dict,
                  probes: ProbeSet) -> dict:
    """Per site in play: retrieval mass per KV head on the signal rows (a repeated span, a pass key and a
    copy probe) beyond the form's reach, and the form's transfer error per KV head on the recorded calls.
    (An encoder has no copying to score: its retrieval signal is 0 and the transfer error ranks.)"""
    calls_of: dict = {}
    ids = None
    if probes.repeat_row:
        rows = [probes.repeat_row] + [list(s.ids) for s in probes.rows if s.depth == probes.depths[1]
                                      and s.probe in ("passkey", "copy")]
        n = min(len(r) for r in rows)
        ids = torch.tensor([r[:n] for r in rows], dtype=torch.long)
        calls_of = target.record(_copy(found), [((), {"input_ids": ids})]).calls
    out = {}
    for i in in_play:
        sid = verification.outcomes[i].site_id
        site, module = sites[sid], verification.modules[sid]
        reach = int(plans[i].params.get("window") or 0)
        calls = calls_of.get(sid) or []
        retrieval = None
        if calls:
            retrieval = retrieval_scores(calls[0], induction_targets(ids, reach), site.scale, site.mask.keep_when,
                                         site.kv_heads)
        out[sid] = {"retrieval": retrieval if retrieval is not None else torch.zeros(site.kv_heads, dtype=torch.float64),
                    "transfer": _transfer(module, recorded.recording.calls.get(sid) or [], site.kv_heads)}
    return out


def _transfer(module, calls: list, kv_heads: int) -> torch.Tensor:
    """The form's per-KV-head relative MSE on the longest recorded call (zeros when there is none)."""
    if not calls:
        return torch.zeros(kv_heads, dtype=torch.float64)
    call = max(calls, key=lambda c: c.k.shape[-2])
    if call.q.dim() != 4:
        return torch.zeros(kv_heads, dtype=torch.float64)
    with torch.no_grad():
        out = module(call.q, call.k, call.v, call.mask)
    return transfer_loss(out, call.out, kv_heads)


def _copy(found):
    """The detection with its own site list (a transformers record re-describes sites in place)."""
    return replace(found, sites=list(found.sites), notes=list(found.notes))


def rebuild(chosen: dict, in_play: list, plans: list, verification, sites: dict, context, opts) -> tuple[list, dict]:
    """The outcomes and modules with each site in play built as chosen: its exact heads a per-head site
    (fitted on its own heads, verified again), every head exact a site kept exact, none the form."""
    outcomes, modules = list(verification.outcomes), dict(verification.modules)
    for i in in_play:
        outcome = outcomes[i]
        sid, site = outcome.site_id, sites[outcome.site_id]
        params = {k: v for k, v in outcome.params.items() if k not in KEEP_KEYS}
        heads = chosen.get(sid, [])
        if len(heads) == site.kv_heads:
            modules.pop(sid, None)
            outcomes[i] = replace(outcome, final_form="exact", status=Status.KEPT, params=params,
                                  reason=f"{plans[i].reason}; keep:recall kept every KV head of this site exact")
            continue
        if not heads:
            modules[sid].params = params
            outcomes[i] = replace(outcome, params=params,
                                  reason=f"{outcome.reason}; keep:recall kept no KV head of this site exact")
            continue
        params = {**params, "exact_heads": heads}
        tol = tolerance_of(outcome.final_form, params, opts.tolerance, opts.policy)
        attempt, module = try_form(site, outcome.final_form, params, context, tol)
        if module is None:
            modules.pop(sid, None)
            outcomes[i] = SiteOutcome(sid, outcome.planned_form, "exact", params, Status.REVERTED,
                                      f"keep:recall chose KV heads {heads} exact; {attempt.reason}", attempt.tolerance,
                                      attempt.drift, outcome.tried + (attempt,))
            continue
        modules[sid] = module
        outcomes[i] = SiteOutcome(sid, outcome.planned_form, outcome.final_form, params, Status.REWRITTEN,
                                  f"{plans[i].reason}; keep:recall kept KV heads {heads} exact; {attempt.reason}",
                                  attempt.tolerance, attempt.drift, outcome.tried + (attempt,))
    return outcomes, modules


def _summary(search, budget: Budget, total: int) -> str:
    last = search.path[-1]
    kept = ", ".join(last.exact) or "no head"
    reached = f"probe accuracy {last.probe:.3f}× the original's"
    if last.perplexity is not None:
        reached += f", perplexity {last.perplexity:.4f}×"
    share = f"{last.exact_heads} of {total} KV heads exact ({last.fraction:.1%})"
    if search.holds:
        return f"budget holds with {kept} exact: {share}; {reached}"
    return (f"budget NOT met: at most {budget.exact:.0%} of the KV heads may be exact, and with {kept} exact "
            f"({share}) the model reaches {reached} (wanted ≥ {budget.recall:g}× and perplexity ≤ "
            f"{budget.perplexity:g}×); raise +exact: or lower +recall:, or calibrate")


def _empty(budget: Budget, why: str, notes: list) -> HeadSelection:
    return HeadSelection(budget.to_dict(), False, why, {}, 0, 0, {}, {}, [], {}, {}, notes=notes)


def _position_limit(model) -> Optional[int]:
    cfg = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        limit = getattr(cfg, name, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


class Measurements:
    """The measurements of one selection, read from and written to the disk cache (store.py)."""

    def __init__(self, key: str):
        self.key = key
        self.cache = store.load()
        self.new: dict = {}
        self.hits = 0

    def get(self, what: str, compute: Callable[[], Quality]) -> Quality:
        key = f"{self.key} | {what}"
        if key in self.cache:
            self.hits += 1
            return Quality.from_dict(self.cache[key])
        q = compute()
        self.new[key] = self.cache[key] = q.to_dict()
        return q

    def save(self) -> None:
        store.store(self.new)


def _measure_key(target, verification, probes: ProbeSet, in_play: list, plans: list) -> str:
    """Everything a measurement depends on, as one digest (store.py)."""
    weights = tensors_digest({k: v for k, v in target.model.state_dict().items()})
    fitted = tensors_digest({f"{sid}/{k}": v for sid, m in verification.modules.items()
                             for k, v in m.state_dict().items()})
    text = tensors_digest({str(i): t for i, t in enumerate(probes.text)})
    recipe = {"probes": probes.describe(), "forms": sorted({json_digest(plans[i].params) for i in in_play}),
              "torch": torch.__version__, "revision": store.MEASURE_REVISION}
    return json_digest({"weights": weights, "fitted": fitted, "text": text, "recipe": recipe})

