"""`attnopt.compile`: capture → detect → plan → build + verify → splice → report, on a copy of the model.

Two mechanisms share every step but capture and splice:
  hf     a transformers model keeps its class (generate(), caches, any length); its attention
         modules run their site modules through attnopt's registered attention function
         (`attnopt.hf.target`);
  graph  any other module is captured with torch.export and each site is replaced in the graph
         (`attnopt.graph`).
"""

from __future__ import annotations

import copy as _copy
import time
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from attnopt.passes.plan import plan_sites
from attnopt.passes.verify import output_drift, verify_sites

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
    from attnopt.graph import GraphTarget
    from attnopt.hf.interface import is_hf_model
    from attnopt.hf.target import HfTarget
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
    policy = Policy.parse(policy)
    batches = [as_batch(example_inputs, "example_inputs")]
    batches += [as_batch(b, f"calibration[{i}]") for i, b in enumerate(calibration or [])]
    name = name or type(model).__name__
    if method == "auto":
        method = "hf" if is_hf_model(model) else "fx"
    if method == "hf" and not is_hf_model(model):
        raise ValueError(f"method='hf' needs a transformers model that uses the attention interface; {name} is not one")

    timer = _Timer()
    target = (HfTarget if method == "hf" else GraphTarget)(_copy.deepcopy(model).eval(), name)
    timer.lap("copy")
    found = target.detect(batches[:1])
    timer.lap("capture+detect")
    recording = target.record(found, batches)
    timer.lap("record")
    planning = plan_sites(found.sites, policy)
    verification = verify_sites(found.sites, planning.plans, target.build_context(found.sites, recording), policy,
                                tolerance, adapt=target.adapt_site)
    timer.lap("plan+verify_sites")
    result, splice_counts = target.splice(found.sites, verification.modules)
    e2e = output_drift(target.run(result, batches), recording.outputs, [_attention_mask_of(b) for b in batches])
    timer.lap("splice+verify_end_to_end")
    timer.timings["total"] = sum(timer.timings.values())

    counts = {"detect": found.counts, "record": recording.counts, "plan": planning.counts,
              "verify": verification.counts, "splice": splice_counts}
    result.attnopt_report = build_report(
        model_name=name, policy=policy, found=found, plans=planning.plans, outcomes=verification.outcomes,
        end_to_end=e2e, timings=timer.timings, notes=found.notes + recording.notes, counts=counts,
    )
    return result


def build_report(*, model_name, policy, found, plans, outcomes, end_to_end, timings, notes, counts):
    """The report is assembled from exactly what the passes returned; only costs are computed here."""
    from attnopt.passes.cost import cost_curve
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
            notes.append(f"site {site.id}: cost not computed ({exc})")
        records.append(SiteRecord(site=site, plan=plan, outcome=outcome, costs_before=before, costs_after=after))
    return CompileReport(
        model_name=model_name, policy=policy, capture=found.capture, sites=records, near_misses=found.near_misses,
        end_to_end=end_to_end, timings=timings, notes=notes, counts=counts,
    )


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
