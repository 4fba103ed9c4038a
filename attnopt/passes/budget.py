"""End-to-end budget pass: while the model's outputs drift by `e2e_tolerance` or more, the worst
remaining rewritten site reverts to exact; each revert is one BudgetStep in the report.

The drift is the worst relative RMS of any model output and, for sentence embeddings (mean-pooled
last_hidden_state), a mean cosine of at least 1 − e2e_tolerance/6 too (0.917 at the default): on
real MiniLM a worst relative RMS of 0.45 came with cosines from 0.87 (FAVOR+) to 0.96
(window+sinks), so the relative RMS alone does not bound what an embedding user sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from attnopt.ir.outcomes import OutputDrift, SiteOutcome, Status
from attnopt.passes.verify import output_drift

E2E_TOLERANCE = 0.5  # the default budget


@dataclass(frozen=True)
class BudgetStep:
    """One revert made to hold the end-to-end budget: which site, and the model drift before/after."""

    site_id: str
    site_drift: float
    e2e_before: float
    e2e_after: float

    def to_dict(self) -> dict:
        return {"site_id": self.site_id, "site_drift": self.site_drift, "e2e_before": self.e2e_before,
                "e2e_after": self.e2e_after}


def revert_for_budget(outcome: SiteOutcome, e2e_drift: float, budget: float) -> SiteOutcome:
    """The outcome of a site reverted because the whole model drifted too far with it."""
    return replace(outcome, final_form="exact", status=Status.REVERTED,
                   reason=(f"{outcome.reason}; end-to-end drift {e2e_drift:.3g} >= e2e_tolerance {budget:.3g}: "
                           "reverted as the worst remaining site"))


@dataclass
class Budget:
    """The model after the budget: its outcomes, the site modules still in it, its end-to-end drift."""

    model: Any
    outcomes: list
    modules: dict
    end_to_end: OutputDrift
    install_counts: dict
    steps: list = field(default_factory=list)  # BudgetStep, in order

    @property
    def counts(self) -> dict:
        return {"reverted": len(self.steps)}


def within_budget(e2e: OutputDrift, budget: Optional[float]) -> bool:
    """Whether the end-to-end drift `e2e` holds the budget."""
    if budget is None or e2e.worst is None:
        return True
    if not e2e.worst.rel_rms < budget:
        return False
    return e2e.embedding_cosine is None or e2e.embedding_cosine >= 1.0 - budget / 6.0


def hold_budget(install: Callable[[dict], tuple], run: Callable[[Any], list], outcomes: list, modules: dict,
                reference_outputs: list, masks: list, budget: Optional[float]) -> Budget:
    """Install `modules` (site id -> SiteModule), then revert the worst site until the outputs of
    `run(model)` hold `budget` against `reference_outputs`. `install(modules)` -> (model, counts)."""
    outcomes, modules = list(outcomes), dict(modules)
    model, counts = install(modules)
    e2e = output_drift(run(model), reference_outputs, masks)
    result = Budget(model, outcomes, modules, e2e, counts)
    index = {o.site_id: i for i, o in enumerate(outcomes)}
    while modules and not within_budget(e2e, budget):
        # The worst site goes first: its own drift is the best single predictor of its share.
        worst = max(modules, key=lambda sid: outcomes[index[sid]].drift.rel_rms)
        outcomes[index[worst]] = revert_for_budget(outcomes[index[worst]], e2e.worst.rel_rms, budget)
        del modules[worst]
        model, counts = install(modules)
        before, e2e = e2e, output_drift(run(model), reference_outputs, masks)
        result.steps.append(BudgetStep(worst, outcomes[index[worst]].drift.rel_rms, before.worst.rel_rms,
                                       e2e.worst.rel_rms))
    result.model, result.end_to_end, result.install_counts = model, e2e, counts
    return result
