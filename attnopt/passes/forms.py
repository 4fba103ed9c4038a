"""The rewrite forms a policy may choose, with their parameters, defaults and allowed values.

This table is the one place that names the forms: the policy parser validates against it, the
planner prices sites with it, and the rewrite pass builds ops from it. Adding a form means one
kernel file in `attnopt/kernels/` plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional


class PolicyError(ValueError):
    """A policy names an unknown form, field or value. The message names the allowed values."""


@dataclass(frozen=True)
class Param:
    """One parameter of a form: its type, default and (optionally) the allowed values."""

    type: type | tuple  # int, float, str, bool, or a tuple of accepted types
    default: Any
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    doc: str = ""

    def check(self, form: str, name: str, value: Any) -> Any:
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if bool not in types and isinstance(value, bool):
            raise PolicyError(f"form {form!r}: parameter {name!r} got {value!r}; expected {_tname(types)}")
        if not isinstance(value, types):
            raise PolicyError(
                f"form {form!r}: parameter {name!r} got {value!r} ({type(value).__name__}); "
                f"expected {_tname(types)}"
            )
        if self.choices is not None and value not in self.choices:
            raise PolicyError(
                f"form {form!r}: parameter {name!r} got {value!r}; allowed values: "
                + ", ".join(repr(c) for c in self.choices)
            )
        if self.minimum is not None and isinstance(value, (int, float)) and value < self.minimum:
            raise PolicyError(f"form {form!r}: parameter {name!r} got {value!r}; must be >= {self.minimum:g}")
        return value


def _tname(types: tuple) -> str:
    return " or ".join(t.__name__ for t in types)


# Parameters every form accepts: run-time fallback to exact below `min_seq_len`, and a per-rule
# drift tolerance (relative RMS of the site output) overriding the form's default.
COMMON_PARAMS: dict[str, Param] = {
    "min_seq_len": Param(int, 0, minimum=0, doc="below this query length the site runs exact attention"),
    "tolerance": Param((float, type(None)), None, minimum=0.0, doc="max relative RMS drift of the site output"),
}


@dataclass(frozen=True)
class FormSpec:
    """A rewrite form: its parameters, default drift tolerance, and place in the cheapest-first order."""

    name: str
    params: Mapping[str, Param]
    # Max relative RMS drift of the site output (given the original inputs) before it reverts. An
    # explicit choice only reverts on catastrophic drift (an error as large as the signal for the
    # fixed-feature forms); "auto" applies its own tighter bar (attnopt.policy.AUTO_TOLERANCE).
    default_tolerance: float
    cost_rank: int  # order tried by "auto": lower is cheaper at long sequence lengths
    doc: str = ""
    required: tuple = ()

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Fill defaults and check every value; raise PolicyError naming the field and allowed values."""
        allowed = {**self.params, **COMMON_PARAMS}
        out: dict[str, Any] = {}
        for key, value in params.items():
            if key not in allowed:
                raise PolicyError(
                    f"form {self.name!r} has no parameter {key!r}; allowed: {', '.join(sorted(allowed))}"
                )
            out[key] = allowed[key].check(self.name, key, value)
        for key in self.required:
            if key not in out:
                raise PolicyError(f"form {self.name!r} needs parameter {key!r} ({allowed[key].doc})")
        for key, p in allowed.items():
            out.setdefault(key, p.default)
        return out


FEATURE_MAPS = ("elu", "relu", "favor", "hedgehog", "taylor")

FORMS: dict[str, FormSpec] = {
    "exact": FormSpec("exact", {}, default_tolerance=0.0, cost_rank=99, doc="keep softmax attention as is"),
    "linear": FormSpec(
        "linear",
        {
            "feature_map": Param(str, "elu", choices=FEATURE_MAPS, doc="kernel feature map φ"),
            "num_features": Param(int, 0, minimum=0, doc="feature count M for favor/hedgehog (0: 2*D for favor, D for hedgehog)"),
            "seed": Param(int, 0, doc="seed of the FAVOR+ projection / hedgehog init"),
            "eps": Param(float, 1e-6, minimum=0.0, doc="added to the denominator φ(q)ᵀz"),
        },
        default_tolerance=1.0,
        cost_rank=0,
        doc="kernelised attention, O(N·D·M)",
    ),
    "ssm": FormSpec(
        "ssm",
        {
            "decay": Param((str, float, list, tuple), "retnet", doc="'retnet' (γ_h = 1 − 2^(−5−h)), one γ, or one γ per head"),
            "feature_map": Param(str, "elu", choices=("identity", "elu", "relu"), doc="φ applied to q and k"),
            "normalize": Param(bool, True, doc="divide by the decayed φ(q)ᵀz, as linear attention does"),
        },
        default_tolerance=1.0,
        cost_rank=1,
        doc="decayed recurrent state S_t = γ S_{t−1} + φ(k_t) v_tᵀ; causal by construction",
    ),
    "window": FormSpec(
        "window",
        {
            "window": Param(int, 256, minimum=1, doc="keys visible per query, incl. self (causal); half-width+1 otherwise"),
            "sinks": Param(int, 0, minimum=0, doc="first tokens every query also sees (StreamingLLM)"),
        },
        default_tolerance=0.6,
        cost_rank=2,
        doc="softmax restricted to a band of keys, O(N·W)",
    ),
    "reuse": FormSpec(
        "reuse",
        {
            "anchor": Param(int, -1, doc="layer whose q/k are reused; negative = that many layers back"),
            "rank": Param(int, 0, minimum=0, doc="rank of the residual logits correction (0: pure reuse)"),
        },
        default_tolerance=0.8,
        cost_rank=3,
        doc="reuse an earlier layer's q and k plus a low-rank residual",
    ),
}

FORM_ALIASES = {"keep": "exact", "recurrent": "ssm", "retention": "ssm", "windowed": "window", "residual": "reuse"}


def form_spec(name: str) -> FormSpec:
    name = FORM_ALIASES.get(name, name)
    if name not in FORMS:
        raise PolicyError(f"unknown form {name!r}; allowed forms: {', '.join(FORMS)} (aliases: {', '.join(FORM_ALIASES)})")
    return FORMS[name]
