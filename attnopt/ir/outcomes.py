"""What the passes decided about each site: plans, attempts, outcomes, drifts and costs.

Plain data the report is built from, exactly as the passes returned it."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


class Status(str, enum.Enum):
    """What became of a site. A str, so reports and JSON read the plain word."""

    REWRITTEN = "rewritten"  # the planned form runs, verified within tolerance
    KEPT = "kept"  # the plan chose exact (a policy rule, or the form's own plan: a reuse anchor)
    REVERTED = "reverted"  # the form was built and verified, and failed its tolerance
    UNSUPPORTED = "unsupported"  # the form cannot serve this site (the reason says why): exact
    UNVERIFIED = "unverified"  # the form changes nothing on any verification input: kept exact

    def __str__(self) -> str:
        return self.value


class Verdict(str, enum.Enum):
    """How one attempt of one form on one site ended."""

    ACCEPTED = "accepted"
    OVER_TOLERANCE = "over_tolerance"
    NOT_FINITE = "not_finite"
    UNSUPPORTED = "unsupported"  # the form could not be built here (SiteUnsupported)
    FAILED = "failed"  # building or running it raised
    UNVERIFIED = "unverified"  # no verification input is long enough for the form to act
    KEPT_BY_PLAN = "kept_by_plan"  # the form's own plan keeps the site exact (KeptByPlan: a reuse anchor)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SitePlan:
    """What the planner chose for one site, and why."""

    site_id: str
    form: str  # a registered form name (attnopt.forms; "exact" = keep)
    params: dict  # validated parameters of the form, defaults filled in
    rule: Optional[str]  # text of the policy rule that chose it (None: no rule matched -> exact)
    reason: str  # plain words: "rule 2 (layers 1..4) chose window", "mask is arbitrary: kept exact", ...
    candidates: tuple = ()  # forms to try in order, each a (form, params) pair (one for a rule, several for auto)
    unsupported: bool = False  # `form` cannot replace this site (`reason` says why): it stays exact

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SitePlan":
        d = dict(d)
        d["candidates"] = tuple(tuple(c) for c in d.get("candidates", ()))
        return cls(**d)


@dataclass(frozen=True)
class Drift:
    """How far one output moved: relative RMS ‖a−b‖/‖b‖, cosine, max |a−b|, and finiteness."""

    rel_rms: float
    cosine: float
    max_abs: float
    finite: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Attempt:
    """One form tried on one site: its parameters, measured drift, verdict and the reason in words."""

    form: str
    params: dict
    drift: Optional["Drift"]
    verdict: Verdict
    reason: str
    tolerance: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Attempt":
        d = dict(d)
        drift = d.get("drift")
        d["drift"] = Drift(**drift) if isinstance(drift, dict) else None
        d["verdict"] = Verdict(d["verdict"])
        return cls(**d)


@dataclass(frozen=True)
class SiteOutcome:
    """The final decision for one site after verification."""

    site_id: str
    planned_form: str
    final_form: str  # == planned_form when accepted, "exact" when reverted
    params: dict
    status: Status
    reason: str  # plain words, e.g. "drift 0.41 > tolerance 0.35: reverted to exact"
    tolerance: Optional[float] = None
    drift: Optional[Drift] = None  # site drift given the ORIGINAL upstream activations
    tried: tuple = ()  # every Attempt, in the order tried

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = Status(self.status).value
        d["tried"] = [a.to_dict() for a in self.tried]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SiteOutcome":
        d = dict(d)
        d["status"] = Status(d["status"])
        d["drift"] = Drift(**d["drift"]) if isinstance(d.get("drift"), dict) else None
        d["tried"] = tuple(Attempt.from_dict(a) for a in d.get("tried", ()))
        return cls(**d)


@dataclass(frozen=True)
class Cost:
    """Attention cost at one query length: multiply-add FLOPs and bytes of attention-only memory."""

    seq_len: int
    flops: float
    bytes: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class OutputDrift:
    """End-to-end drift of the model outputs, one Drift per output leaf plus the worst case."""

    per_output: dict = field(default_factory=dict)  # leaf name -> Drift
    worst: Optional[Drift] = None
    embedding_cosine: Optional[float] = None  # mean cosine of mean-pooled hidden states, when it applies

    def to_dict(self) -> dict[str, Any]:
        return {
            "per_output": {k: v.to_dict() for k, v in self.per_output.items()},
            "worst": self.worst.to_dict() if self.worst else None,
            "embedding_cosine": self.embedding_cosine,
        }
