"""`attnopt.compile`: capture → detect → plan → build + verify → splice → report, on a copy of the model.

Two mechanisms share every step but capture and splice:
  hf     a transformers model keeps its class (generate(), caches, any length); its attention
         modules run their site modules through attnopt's registered attention function
         (`attnopt.targets.hf`);
  graph  any other module is captured with torch.export and each site is replaced in the graph
         (`attnopt.targets.graph`).
"""

from __future__ import annotations

import copy as _copy
import time
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from attnopt.passes.crossover import dispatch_mode, resolve_thresholds
from attnopt.passes.plan import plan_sites
from attnopt.ir.outcomes import Status
from attnopt.passes.verify import BudgetStep, output_drift, revert_for_budget, verification_length, verify_sites

# Default end-to-end budget: the worst relative RMS drift of any model output, and for sentence
# embeddings (mean-pooled last_hidden_state) a mean cosine of at least 1 − e2e_tolerance/6 too
# (0.917 at the default):
# on real MiniLM a worst relative RMS of 0.45 came with cosines from 0.87 (FAVOR+) to 0.96
# (window+sinks), so the relative RMS alone does not bound what an embedding user sees.
E2E_TOLERANCE = 0.5


def within_budget(e2e, budget: Optional[float]) -> bool:
    """Whether the end-to-end drift `e2e` (an OutputDrift) holds the budget."""
    if budget is None or e2e.worst is None:
        return True
    if not e2e.worst.rel_rms < budget:
        return False
    return e2e.embedding_cosine is None or e2e.embedding_cosine >= 1.0 - budget / 6.0

Batch = tuple  # (args: tuple, kwargs: dict)


def as_batch(inputs: Any, what: str) -> Batch:
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


class _Timer:
    """Seconds per step, in pipeline order, for the report."""

    def __init__(self):
        self.timings: dict = {}
        self._t = time.perf_counter()

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.timings[step] = now - self._t
        self._t = now


def compile(
    model: nn.Module,
    policy: Any = "hybrid",
    example_inputs: Any = None,
    *,
    tolerance: Optional[float] = None,
    e2e_tolerance: Optional[float] = E2E_TOLERANCE,
    calibration: Optional[Sequence[Any]] = None,
    verify_inputs: Optional[Sequence[Any]] = None,
    method: str = "auto",
    name: Optional[str] = None,
    dispatch: Optional[str] = None,
    progress: Optional[Any] = None,
) -> nn.Module:
    """Rewrite the attention of a copy of `model` per `policy`; return it with `.attnopt_report`.

    example_inputs: how the model is called (a tensor, a tuple of args, a dict of kwargs, or
    (args, kwargs)); the rewritten model is called the same way. calibration: more such batches;
    per-site drift is the worst over all batches. tolerance: max relative RMS drift of a site's
    output (default per form; a rule's own `tolerance` wins); sites at or above it revert to exact.
    e2e_tolerance: the budget for the worst relative RMS drift of the model's outputs (default
    0.5; None: no budget), and for sentence embeddings a mean cosine >= 1 - e2e_tolerance/6; while
    it is exceeded the worst rewritten site reverts. verify_inputs:
    batches used only to verify, e.g. inputs long enough for a window to act (a transformers
    model gets one built from the example when none is). method: "auto" (transformers models keep their class via the attention interface, anything
    else is captured with torch.export), "hf" or "fx". The original model is never modified.
    dispatch: "auto" (default; $ATTNOPT_DISPATCH when not given) gives every rewritten site whose
    rule leaves min_seq_len unset the form's measured crossover against exact attention on this
    device (cached; `attnopt.passes.crossover`), so short inputs run exact; "off" leaves them at 0
    (the form at every length). Drift is verified on the form itself, before thresholds apply.
    progress: a callable(text, done=None, total=None) told each step as it starts, and the sites
    verified so far out of all (the CLI's progress bar).
    """
    from attnopt.targets.graph import GraphTarget
    from attnopt.hf.interface import is_hf_model
    from attnopt.targets.hf import HfTarget
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
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not 0 <= tolerance < float("inf")):
        raise ValueError(f"tolerance must be a finite number >= 0 (relative RMS drift of a site); got {tolerance!r}")
    if e2e_tolerance is not None and (isinstance(e2e_tolerance, bool) or not isinstance(e2e_tolerance, (int, float))
                                      or not 0 < e2e_tolerance < float("inf")):
        raise ValueError(f"e2e_tolerance must be a finite number > 0 (relative RMS drift of the outputs) or None; "
                         f"got {e2e_tolerance!r}")
    mode = dispatch_mode(dispatch)
    say = progress or (lambda text, done=None, total=None: None)
    policy = Policy.parse(policy)
    batches = [as_batch(example_inputs, "example_inputs")]
    batches += [as_batch(b, f"calibration[{i}]") for i, b in enumerate(calibration or [])]
    batches += [as_batch(b, f"verify_inputs[{i}]") for i, b in enumerate(verify_inputs or [])]
    name = name or type(model).__name__
    if method == "auto":
        method = "hf" if is_hf_model(model) else "fx"
    if method == "hf" and not is_hf_model(model):
        raise ValueError(f"method='hf' needs a transformers model that uses the attention interface; {name} is not one")

    timer = _Timer()
    target = (HfTarget if method == "hf" else GraphTarget)(_copy.deepcopy(model).eval(), name)
    timer.lap("copy")
    say("capture + detect")
    found = target.detect(batches[:1])
    timer.lap("capture+detect")
    say("record")
    recording = target.record(found, batches)
    planning = plan_sites(found.sites, policy)
    notes = list(found.notes)
    if found.sites:
        _warn_unmatched_rules(name, planning, len({s.layer for s in found.sites}))
    need = verification_length(found.sites, planning.plans, recording.calls)
    if need is not None:  # some form changes nothing at the example length: verify where it acts
        longer, why = target.longer_batch(batches[0], need)
        if longer is None:
            notes.append(f"some planned forms act only from about {need} tokens and no input that long was given "
                         f"({why}); pass verify_inputs=: those sites stay exact, reported unverified")
        else:
            batches.append(longer)
            recording = target.record(found, batches)
            notes.append(f"verification also ran on a {longer[1]['input_ids'].shape[1]}-token input built from the "
                         f"example's tokens (repeated), for forms that act only on inputs longer than the example "
                         f"(about {need} tokens wanted)")
    timer.lap("record")
    say("build + verify sites")
    verification = verify_sites(found.sites, planning.plans, target.build_context(found.sites, recording), policy,
                                tolerance, adapt=target.adapt_site, step=say)
    timer.lap("plan+verify_sites")
    outcomes, modules = list(verification.outcomes), dict(verification.modules)
    say("splice + end-to-end check")
    masks = [_attention_mask_of(b) for b in batches]
    result, splice_counts = target.splice(found.sites, modules)
    e2e = output_drift(target.run(result, batches), recording.outputs, masks)
    steps = []
    while modules and not within_budget(e2e, e2e_tolerance):
        # The worst site goes first: its own drift is the best single predictor of its share.
        index = {o.site_id: i for i, o in enumerate(outcomes)}
        worst = max(modules, key=lambda sid: outcomes[index[sid]].drift.rel_rms)
        outcomes[index[worst]] = revert_for_budget(outcomes[index[worst]], e2e.worst.rel_rms, e2e_tolerance)
        del modules[worst]
        result, splice_counts = target.splice(found.sites, modules)
        before, e2e = e2e, output_drift(target.run(result, batches), recording.outputs, masks)
        steps.append(BudgetStep(worst, outcomes[index[worst]].drift.rel_rms, before.worst.rel_rms, e2e.worst.rel_rms))
    timer.lap("splice+verify_end_to_end")
    say("dispatch thresholds")
    # After the budget: the drifts above are the forms' own, measured where they act.
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    dispatch_result = resolve_thresholds(found.sites, outcomes, modules, mode, device=_device_of(result), step=say,
                                         max_len=limit if isinstance(limit, int) else None)
    outcomes = dispatch_result.outcomes
    timer.lap("dispatch")
    if dispatch_result.thresholds and any(t.min_seq_len for t in dispatch_result.thresholds.values()):
        notes.append("sites run exact attention below their dispatch threshold (each site's min_seq_len, shown per "
                     "site); the drifts reported are the forms' own, measured where they act")
    timer.timings["total"] = sum(timer.timings.values())
    if splice_counts.get("model_window_taken_over"):
        notes.append(f"the model slides its own attention window (a sliding window); attnopt runs it on {splice_counts['model_window_taken_over']} "
                     "sites instead (exact sites keep the same band, window sites the narrower band, linear/ssm/"
                     "linear+window replace it), so prefill and decoding agree; the KV cache is kept whole")
    _warn_if_nothing_rewritten(name, planning.plans, outcomes, steps, e2e_tolerance)

    counts = {"detect": found.counts, "record": recording.counts, "plan": planning.counts,
              "verify": verification.counts, "splice": splice_counts,
              "budget": {"e2e_tolerance": e2e_tolerance, "reverted": len(steps)}, "dispatch": dispatch_result.counts}
    result.attnopt_report = build_report(
        model_name=name, policy=policy, found=found, plans=planning.plans, outcomes=outcomes,
        end_to_end=e2e, timings=timer.timings, notes=notes + recording.notes, counts=counts, budget_steps=steps,
        thresholds=dispatch_result.thresholds,
    )
    return result


def _warn_unmatched_rules(name, planning, layers: int) -> None:
    import warnings

    for index, text in planning.unmatched_rules:
        warnings.warn(f"attnopt.compile({name}): policy rule {index} ({text}) matches no attention site of this "
                      f"model ({layers} attention layers); check its layers / module / source", stacklevel=3)


def _warn_if_nothing_rewritten(name, plans, outcomes, steps, budget) -> None:
    """A policy that asked for rewrites and got none says so, with the reasons (never silence)."""
    import warnings

    asked = [o for p, o in zip(plans, outcomes) if p.candidates or p.unsupported]
    if not asked or any(o.status is Status.REWRITTEN for o in outcomes):
        return
    why = "; ".join(sorted({str(o.status) for o in asked}))
    extra = f"; {len(steps)} reverted to hold e2e_tolerance {budget:g}" if steps else ""
    warnings.warn(f"attnopt.compile({name}): the policy asked for {len(asked)} rewrites and none was kept "
                  f"({why}{extra}); see the report's reasons, or relax tolerance / e2e_tolerance", stacklevel=3)


def _device_of(model: nn.Module) -> torch.device:
    """Where the model runs (its first parameter or buffer; CPU when it has none)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def build_report(*, model_name, policy, found, plans, outcomes, end_to_end, timings, notes, counts, budget_steps=(),
                 thresholds=None):
    """The report is assembled from exactly what the passes returned; only costs are computed here."""
    from attnopt.analysis.cost import cost_curve
    from attnopt.report import CompileReport, SiteRecord

    example_len = next((s.q_len for s in found.sites if isinstance(s.q_len, int)), None)
    records = []
    for site, plan, outcome in zip(found.sites, plans, outcomes):
        n = site.q_len if isinstance(site.q_len, int) else example_len
        try:
            before = cost_curve(site, "exact", {}, example_len=n)
            after = cost_curve(site, outcome.final_form, outcome.params, example_len=n)
        except (ValueError, KeyError) as exc:
            before, after = [], []
            why = "its length is symbolic and no site shows a static one" if "symbolic" in str(exc) else str(exc)
            notes.append(f"site {site.id}: cost not computed ({why})")
        records.append(SiteRecord(site=site, plan=plan, outcome=outcome, costs_before=before, costs_after=after,
                                  threshold=(thresholds or {}).get(site.id)))
    return CompileReport(
        model_name=model_name, policy=policy, capture=found.capture, sites=records, near_misses=found.near_misses,
        end_to_end=end_to_end, timings=timings, notes=notes, counts=counts,
        budget_steps=[s.to_dict() for s in budget_steps],
    )


def backend(policy: Any = "hybrid", *, tolerance: Optional[float] = None, e2e_tolerance: Optional[float] = E2E_TOLERANCE):
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
                mod = compile(gm, policy, example_inputs=tuple(args), tolerance=tolerance, e2e_tolerance=e2e_tolerance,
                              method="fx", name="dynamo graph")
                reports.append(mod.attnopt_report)
                compiled["module"] = mod
            return compiled["module"](*args)

        return run

    backend_fn.reports = reports
    return backend_fn
