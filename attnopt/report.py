"""The audit report: what each pass found and decided, as data, JSON, Markdown and one HTML page.

A `CompileReport` holds exactly what the passes returned (sites, plans, outcomes, costs, near
misses, end-to-end drift); totals are computed from those records, never re-derived from the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from attnopt.analysis.cost import element_bytes
from attnopt.analysis.decode_memory import decode_memory
from attnopt.analysis.timing import Conditions, ForwardTime
from attnopt.evaluation.report import written_page
from attnopt.ir.outcomes import Cost, Drift, OutputDrift, SiteOutcome, SitePlan, Status
from attnopt.ir.site import AttentionSite, MaskInfo, NearMiss, SiteNodes
from attnopt.passes.crossover import Threshold
from attnopt.policy import Policy
from attnopt.report_html import render_html
from attnopt.report_text import markdown

STATUSES = tuple(s.value for s in Status)


def _package_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # PackageNotFoundError, or a broken install's metadata
        return "unknown"


@dataclass
class SiteRecord:
    """One site with its plan, verified outcome and attention cost before/after at each length multiplier."""

    site: AttentionSite
    plan: SitePlan
    outcome: SiteOutcome
    costs_before: list = field(default_factory=list)  # list[Cost], one per CompileReport.cost_multipliers
    costs_after: list = field(default_factory=list)
    # Rewritten sites: the length below which the site runs exact attention, and where it came from.
    threshold: Optional[Threshold] = None
    # How the site's module is reached: "graph" (spliced into the captured graph), or for the hf
    # mechanism "attention-interface" or a module route ("sdpa-intercept", "forward-replace", ...).
    install: str = ""
    # The KV-head indices kept exact softmax attention: a per-head site's (`+exact_heads`, or chosen by
    # `+keep:recall`), every one of a site keep:recall kept whole; [] for any other site.
    exact_heads: list = field(default_factory=list)

    def flops_ratio(self, i: int) -> Optional[float]:
        """Attention FLOPs after / before at multiplier index `i` (None when not costed)."""
        if i >= len(self.costs_before) or i >= len(self.costs_after) or not self.costs_before[i].flops:
            return None
        return self.costs_after[i].flops / self.costs_before[i].flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site.to_dict(),
            "plan": self.plan.to_dict(),
            "outcome": self.outcome.to_dict(),
            "costs_before": [c.to_dict() for c in self.costs_before],
            "costs_after": [c.to_dict() for c in self.costs_after],
            "threshold": self.threshold.to_dict() if self.threshold is not None else None,
            "install": self.install,
            "exact_heads": list(self.exact_heads),
        }


@dataclass
class CompileReport:
    """Everything `attnopt.compile` did to one model, for people (Markdown/HTML) and tools (JSON)."""

    model_name: str
    policy: Any  # a Policy, its to_dict(), or the preset string
    capture: str  # how the graph was captured, e.g. "torch.export", "dynamo"
    sites: list = field(default_factory=list)  # list[SiteRecord], in plan order
    near_misses: list = field(default_factory=list)  # list[NearMiss]
    end_to_end: Optional[OutputDrift] = None
    timings: dict = field(default_factory=dict)  # pass name -> seconds
    # The whole model's forward on the verification input, original against rewritten (None: not measured).
    forward_time: Optional[ForwardTime] = None
    conditions: Optional[Conditions] = None  # what the step timings were taken under
    notes: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # pass name -> what that pass counted
    budget_steps: list = field(default_factory=list)  # sites reverted to hold the end-to-end budget, in order
    cost_multipliers: tuple = (1, 4, 16)  # the lengths (× example length) of each SiteRecord.costs_*
    exports: list = field(default_factory=list)  # one OnnxExport.to_dict() per attnopt.export_onnx call
    calibration: Optional[dict] = None  # what attnopt.calibrate did (Calibration.to_dict()), once run
    evaluation: Optional[dict] = None  # the capability audit (EvalReport.to_dict()), from evaluate(..., attach=True)
    mechanism: str = ""  # "hf" (the model keeps its class) or "graph" (a captured graph); "" in old reports
    # What keep:recall measured and chose (attnopt.selection.HeadSelection.to_dict()); None when no rule asked it.
    head_selection: Optional[dict] = None
    torch_version: str = field(default_factory=lambda: _package_version("torch"))
    attnopt_version: str = field(default_factory=lambda: _package_version("attnopt"))

    # ------------------------------------------------------------ totals

    def count(self, status: str) -> int:
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}; allowed: {', '.join(STATUSES)}")
        return sum(1 for r in self.sites if r.outcome.status == status)

    def _summed(self, costs: str, what: str) -> list[float]:
        """The sites' `costs` ("costs_before" or "costs_after") summed by `what` at each multiplier."""
        return [sum(getattr(getattr(r, costs)[i], what) for r in self.sites if i < len(getattr(r, costs)))
                for i in range(len(self.cost_multipliers))]

    # Total attention FLOPs and bytes of the original and the compiled model at each multiplier.
    flops_before = property(lambda self: self._summed("costs_before", "flops"))
    flops_after = property(lambda self: self._summed("costs_after", "flops"))
    bytes_before = property(lambda self: self._summed("costs_before", "bytes"))
    bytes_after = property(lambda self: self._summed("costs_after", "bytes"))

    @property
    def flops_ratio(self) -> list[Optional[float]]:
        """After / before at each multiplier (None where nothing was costed)."""
        return [a / b if b else None for a, b in zip(self.flops_after, self.flops_before)]

    def exact_head_fraction(self) -> float:
        """Exact KV heads over all KV heads of the rewritten sites (a per-head site counts its exact heads;
        a site keep:recall kept whole counts all of its); 0.0 when nothing was rewritten."""
        counted = [r for r in self.sites if r.outcome.status == Status.REWRITTEN or r.exact_heads]
        total = sum(r.site.kv_heads for r in counted)
        return sum(len(r.exact_heads) for r in counted) / total if total else 0.0

    def head_map(self) -> list:
        """Layers x KV heads: per attention layer (in order), one entry per KV head of each of its sites:
        "exact" where the head is exact softmax, else the form it runs ("exact" for a site left exact)."""
        rows: dict = {}
        for r in self.sites:
            heads = set(r.exact_heads)
            form = r.outcome.final_form
            rows.setdefault(r.site.layer, []).extend(
                "exact" if form == "exact" or j in heads else form for j in range(r.site.kv_heads))
        return [rows[layer] for layer in sorted(rows)]

    def kept_kv(self) -> Optional[dict]:
        """{"contexts", "exact_heads", "original"}: bytes per batch row of the K/V the exact heads keep at
        each decode-memory context, against the KV cache of every causal site; None without causal sites."""
        mem = self.decode_memory
        if mem is None:
            return None
        kept = []
        for n in mem.contexts:
            kept.append(sum(len(r.exact_heads) * n * (r.site.head_dim + (r.site.v_head_dim or r.site.head_dim))
                            * _element_bytes(r.site.dtype) for r in self.sites if r.site.causal))
        return {"contexts": list(mem.contexts), "exact_heads": kept, "original": list(mem.original)}

    @property
    def decode_memory(self):
        """Decode-state bytes per batch row at 1k / 32k / 128k context against the original KV cache
        (None for models without causal sites)."""
        return decode_memory(self.sites)

    @property
    def totals(self) -> dict[str, Any]:
        return {
            "sites": len(self.sites),
            **{s: self.count(s) for s in STATUSES},
            "near_misses": len(self.near_misses),
            "multipliers": list(self.cost_multipliers),
            "flops_before": self.flops_before,
            "flops_after": self.flops_after,
            "flops_ratio": self.flops_ratio,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
        }

    @property
    def mechanism_text(self) -> str:
        """The mechanism and how many sites each install took, e.g. "hf (sdpa-intercept: 2 sites)"."""
        counts: dict = {}
        for r in self.sites:
            if r.install:
                counts[r.install] = counts.get(r.install, 0) + 1
        how = ", ".join(f"{k}: {n} site{'s' if n != 1 else ''}" for k, n in counts.items())
        return f"{self.mechanism or 'unknown'}" + (f" ({how})" if how else "")

    # ------------------------------------------------------------ policy text

    def policy_dict(self) -> Any:
        to_dict = getattr(self.policy, "to_dict", None)
        return to_dict() if callable(to_dict) else self.policy

    def policy_text(self) -> str:
        if isinstance(self.policy, str):
            return self.policy
        if hasattr(self.policy, "describe"):
            return self.policy.describe()
        return json.dumps(self.policy, indent=2, default=str)

    # ------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "policy": self.policy_dict(),
            "capture": self.capture,
            "mechanism": self.mechanism,
            "sites": [r.to_dict() for r in self.sites],
            "near_misses": [n.to_dict() for n in self.near_misses],
            "end_to_end": self.end_to_end.to_dict() if self.end_to_end is not None else None,
            "totals": self.totals,
            "timings": dict(self.timings),
            "conditions": None if self.conditions is None else self.conditions.to_dict(),
            "forward_time": None if self.forward_time is None else self.forward_time.to_dict(),
            "notes": list(self.notes),
            "counts": dict(self.counts),
            "budget_steps": list(self.budget_steps),
            "decode_memory": None if self.decode_memory is None else self.decode_memory.to_dict(),
            "cost_multipliers": list(self.cost_multipliers),
            "exports": list(self.exports),
            "calibration": self.calibration,
            "evaluation": self.evaluation,
            "head_selection": self.head_selection,
            "exact_head_fraction": self.exact_head_fraction(),
            "versions": {"torch": self.torch_version, "attnopt": self.attnopt_version},
        }

    def to_json(self, path: Union[str, Path, None] = None) -> str:
        """Strict JSON (non-finite floats written as the strings "nan", "inf", "-inf"); written to `path` if given."""
        text = json.dumps(finite_json(self.to_dict()), indent=2, default=str, allow_nan=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompileReport":
        """Rebuild a report from `to_dict()` / parsed `to_json()` output (totals are recomputed)."""
        d = _unfinite(d)
        versions = d.get("versions", {})
        return cls(
            model_name=d["model_name"],
            policy=policy_from_dict(d["policy"]),
            capture=d["capture"],
            mechanism=d.get("mechanism", ""),
            sites=[_record_from_dict(r) for r in d.get("sites", [])],
            near_misses=[NearMiss(**n) for n in d.get("near_misses", [])],
            end_to_end=_output_drift_from_dict(d.get("end_to_end")),
            timings=dict(d.get("timings", {})),
            conditions=Conditions.from_dict(d.get("conditions")),
            forward_time=ForwardTime.from_dict(d.get("forward_time")),
            notes=list(d.get("notes", [])),
            counts=dict(d.get("counts", {})),
            budget_steps=list(d.get("budget_steps", [])),
            cost_multipliers=tuple(d.get("cost_multipliers", (1, 4, 16))),
            exports=list(d.get("exports", [])),
            calibration=d.get("calibration"),
            evaluation=d.get("evaluation"),
            head_selection=d.get("head_selection"),
            torch_version=versions.get("torch", "unknown"),
            attnopt_version=versions.get("attnopt", "unknown"),
        )

    # ------------------------------------------------------------ text

    def to_markdown(self) -> str:
        return markdown(self)

    def to_html(self, path: Union[str, Path, None] = None) -> str:
        """One self-contained page (inline CSS and SVG, nothing fetched); written to `path` if given."""
        return written_page(render_html(self), path)

    def __str__(self) -> str:
        t = self.totals
        line = (
            f"attnopt report for {self.model_name}: {t['sites']} attention sites — "
            f"{t['rewritten']} rewritten, {t['kept']} kept, {t['reverted']} reverted, {t['unsupported']} unsupported, {t['unverified']} unverified"
        )
        ratios = self.flops_ratio
        if ratios and ratios[-1] is not None:
            line += f"; attention FLOPs at {self.cost_multipliers[-1]}× length: {ratios[-1]:.3g}× of original"
        if self.end_to_end is not None and self.end_to_end.worst is not None:
            line += f"; end-to-end worst rel RMS {self.end_to_end.worst.rel_rms:.3g}"
        return line


def _element_bytes(dtype: str) -> int:
    try:
        return element_bytes(dtype)
    except ValueError:
        return 4


# ---------------------------------------------------------------- JSON helpers


def finite_json(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def _unfinite(x: Any) -> Any:
    if isinstance(x, str) and x in ("nan", "inf", "-inf"):
        return float(x)
    if isinstance(x, dict):
        return {k: _unfinite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unfinite(v) for v in x]
    return x


def _tuple(x: Any) -> Any:
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


def _drift(d: Optional[dict]) -> Optional[Drift]:
    return None if d is None else Drift(**d)


def _site_from_dict(d: dict) -> AttentionSite:
    d = dict(d)
    mask = dict(d.pop("mask"))
    mask.pop("kind", None)
    mask["shape"] = _tuple(mask.get("shape"))
    nodes = dict(d.pop("nodes"))
    nodes["members"] = _tuple(nodes.get("members", ()))
    d["spelling"] = _tuple(d.get("spelling", ()))
    d["runtime_inputs"] = _tuple(d.get("runtime_inputs", ()))
    return AttentionSite(mask=MaskInfo(**mask), nodes=SiteNodes(**nodes), **d)


def policy_from_dict(d: Any) -> Any:
    """A policy dict as a Policy again, so the report describes its rules; anything else as it is."""
    if not isinstance(d, dict):
        return d
    try:
        return Policy.from_dict(d)
    except (ValueError, TypeError, KeyError):  # a dict this version cannot read: kept, shown as JSON
        return d


def _record_from_dict(d: dict) -> SiteRecord:
    return SiteRecord(
        site=_site_from_dict(d["site"]),
        plan=SitePlan.from_dict(d["plan"]),
        outcome=SiteOutcome.from_dict(d["outcome"]),
        costs_before=[Cost(**c) for c in d.get("costs_before", [])],
        costs_after=[Cost(**c) for c in d.get("costs_after", [])],
        threshold=Threshold.from_dict(d["threshold"]) if d.get("threshold") else None,
        install=d.get("install", ""),
        exact_heads=list(d.get("exact_heads", [])),
    )


def _output_drift_from_dict(d: Optional[dict]) -> Optional[OutputDrift]:
    if d is None:
        return None
    return OutputDrift(
        per_output={k: Drift(**v) for k, v in d.get("per_output", {}).items()},
        worst=_drift(d.get("worst")),
        embedding_cosine=d.get("embedding_cosine"),
    )
