"""Plain data the planner and the verifier produce; the report is built from exactly these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class SitePlan:
    """What the planner chose for one site, and why."""

    site_id: str
    form: str  # a key of attnopt.passes.forms.FORMS ("exact" = keep)
    params: dict  # validated parameters of the form, defaults filled in
    rule: Optional[str]  # text of the policy rule that chose it (None: no rule matched -> exact)
    reason: str  # plain words: "rule 2 (layers 1..4) chose window", "mask is arbitrary: kept exact", ...
    candidates: tuple = ()  # for "auto": forms to try cheapest-first, each a (form, params) pair
    unsupported: bool = False  # `form` cannot replace this site (`reason` says why): it stays exact

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
class SiteOutcome:
    """The final decision for one site after verification."""

    site_id: str
    planned_form: str
    final_form: str  # == planned_form when accepted, "exact" when reverted
    params: dict
    status: str  # "rewritten" | "kept" (planned exact) | "reverted" | "unsupported"
    reason: str  # plain words, e.g. "drift 0.41 > tolerance 0.35: reverted to exact"
    tolerance: Optional[float] = None
    drift: Optional[Drift] = None  # site drift given the ORIGINAL upstream activations
    tried: tuple = ()  # for "auto": ((form, params, Drift|None, verdict), ...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
