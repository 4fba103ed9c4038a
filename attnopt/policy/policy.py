"""`Policy`: ordered rules (first match wins), an optional `auto` fallback, and a default tolerance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from attnopt import forms
from attnopt.ir.errors import PolicyError
from attnopt.policy.parse import POLICY_SUFFIXES, parse_dict, parse_file
from attnopt.policy.presets import hybrid_rules, parse_preset, preset_names
from attnopt.policy.rules import Rule


@dataclass(frozen=True)
class Policy:
    """Ordered rules (first match wins), an optional "auto" fallback, and a default tolerance."""

    name: str = "custom"
    rules: tuple = ()
    auto: bool = False  # sites no rule matches get `auto_candidates()` instead of exact
    tolerance: Optional[float] = None  # overrides each form's default drift tolerance

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for i, r in enumerate(self.rules):
            if not isinstance(r, Rule):
                raise PolicyError(f"rule {i}: expected a Rule, got {type(r).__name__}; use Policy.parse for dicts")
        if self.tolerance is not None:
            t = self.tolerance
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
                raise PolicyError(f"policy: field 'tolerance' got {t!r}; allowed: a finite float >= 0 or null")
            object.__setattr__(self, "tolerance", float(t))

    # -- matching

    def choose(self, site: Any, num_layers: int) -> tuple[Optional[Rule], int]:
        """The first rule matching `site` and its index; (None, -1) when none does (→ exact, or auto)."""
        for i, rule in enumerate(self.rules):
            if rule.matches(site, num_layers):
                return rule, i
        return None, -1

    @staticmethod
    def auto_candidates() -> list[tuple[str, dict]]:
        """(form, validated params) that "auto" tries, cheapest first; the planner keeps those that apply."""
        return [(f.name, f.validate(dict(f.auto_params))) for f in forms.registry().values() if f.auto_params is not None]

    def tolerance_for(self, form: str, params: Mapping) -> float:
        """Drift tolerance for a chosen form: the rule's `tolerance`, else the policy's, else the form's default."""
        if params.get("tolerance") is not None:
            return float(params["tolerance"])
        if self.tolerance is not None:
            return self.tolerance
        return forms.get(form).default_tolerance

    # -- parsing and printing

    @classmethod
    def parse(cls, spec: Any) -> "Policy":
        """A Policy from a Policy, a preset string, a dict, or a .yaml/.yml/.toml/.json path."""
        if isinstance(spec, Policy):
            return spec
        if isinstance(spec, Path) or (isinstance(spec, str) and spec.strip().lower().endswith(POLICY_SUFFIXES)):
            return cls.from_file(spec)
        if isinstance(spec, str):
            return cls.from_preset(spec)
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        raise PolicyError(
            f"cannot read a policy from {type(spec).__name__} {spec!r}; give a preset string "
            f"({', '.join(preset_names())}), a dict, a Policy, or a path ending in {', '.join(POLICY_SUFFIXES)}"
        )

    @classmethod
    def from_dict(cls, d: Mapping) -> "Policy":
        return cls(**parse_dict(d))

    @classmethod
    def from_file(cls, path) -> "Policy":
        return cls(**parse_file(path))

    @classmethod
    def from_preset(cls, text: str) -> "Policy":
        return cls(**parse_preset(text))

    def to_dict(self) -> dict:
        d: dict[str, Any] = {"name": self.name}
        if self.tolerance is not None:
            d["tolerance"] = self.tolerance
        if self.auto:
            d["auto"] = True
        d["rules"] = [r.to_dict() for r in self.rules]
        return d

    def describe(self) -> str:
        lines = [f"policy {self.name!r}" + (f" (tolerance {self.tolerance:g})" if self.tolerance is not None else "")]
        for i, r in enumerate(self.rules):
            lines.append(f"  rule {i}: {r.describe()}")
        if self.auto:
            order = " → ".join(f for f, _ in self.auto_candidates())
            lines.append(f"  otherwise: auto, cheapest within tolerance of {order} → exact")
        else:
            lines.append("  otherwise: exact")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def hybrid_policy(tolerance: Optional[float] = None) -> Policy:
    """The seeds' recipe (see `presets.hybrid_rules`): exact ends, windowed early layers, linear middle."""
    return Policy(name="hybrid", tolerance=tolerance, rules=hybrid_rules())
