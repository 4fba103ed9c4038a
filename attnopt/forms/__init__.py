"""The rewrite forms: one folder per form in this package, discovered here.

    from attnopt import forms
    forms.get("window").why_not(site, params)

A folder `attnopt/forms/<form>/` whose `form.py` defines `FORM = SomeForm()` is a form; it holds
everything about it (form.py, reference.py, decode.py, triton.py, onnx.py). What forms share lives
in `forms/common/` and `attnopt/kernels/`. The registry is the one list of forms: the policy
parser, the planner, the cost model, the verifier, the CLI help and the README policy table all
read it, so adding a folder is all a new form needs.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Any, Iterable, Optional

from attnopt.forms.common.base import (
    COMMON_PARAMS,
    BuildContext,
    CostAt,
    FitResult,
    Form,
    Param,
    SiteGeometry,
    SiteModule,
)
from attnopt.ir.errors import PolicyError, SiteUnsupported

__all__ = ["Form", "Param", "SiteModule", "SiteGeometry", "SiteUnsupported", "BuildContext", "FitResult", "CostAt",
           "COMMON_PARAMS", "registry", "get", "names", "aliases", "policy_table", "closest", "did_you_mean"]

# The folder in this package that holds shared pieces, not a form.
_SHARED = "common"


def _discover() -> dict[str, Form]:
    found: dict[str, Form] = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg or info.name == _SHARED or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}.form")
        form = getattr(module, "FORM", None)
        if not isinstance(form, Form):
            raise TypeError(f"attnopt/forms/{info.name}/form.py must define FORM = <a Form instance>")
        if form.name in found:
            raise TypeError(f"two forms are named {form.name!r}")
        found[form.name] = form
    # Cheapest first at long lengths, exact last: the order "auto" tries them and the help lists them.
    return dict(sorted(found.items(), key=lambda kv: (kv[1].cost_rank, kv[0])))


_REGISTRY: Optional[dict[str, Form]] = None


def registry() -> dict[str, Form]:
    """{name: Form}, cheapest first at long lengths (exact last)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _discover()
    return _REGISTRY


def names() -> tuple[str, ...]:
    return tuple(registry())


def aliases() -> dict[str, str]:
    """{alias: form name}, e.g. {"keep": "exact"}."""
    return {a: f.name for f in registry().values() for a in f.aliases}


def get(name: str) -> Form:
    """The form called `name` (or one of its aliases); PolicyError naming the closest name and listing
    the forms otherwise."""
    reg = registry()
    if not isinstance(name, str):
        raise PolicyError(f"a form name must be a string; got {name!r}; allowed forms: {', '.join(reg)}")
    key = aliases().get(name, name)
    if key not in reg:
        extra = f" (aliases: {', '.join(aliases())})" if aliases() else ""
        hint = did_you_mean(name, [*reg, *aliases()])
        raise PolicyError(f"unknown form {name!r}{hint}; allowed forms: {', '.join(reg)}{extra}")
    return reg[key]


def closest(word: Any, choices: Iterable[str]) -> Optional[str]:
    """The choice a misspelt `word` most likely meant (difflib's ratio >= 0.6, case ignored); None
    when none is that close or `word` is not text."""
    if not isinstance(word, str) or not word.strip():
        return None
    by_lower = {c.lower(): c for c in choices if isinstance(c, str)}
    match = difflib.get_close_matches(word.strip().lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def did_you_mean(word: Any, choices: Iterable[str]) -> str:
    """" (did you mean 'linear'?)" for an error message about `word`, or "" when nothing is close."""
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match is not None and match != word else ""


def policy_table() -> str:
    """The README / CLI policy reference as a Markdown table, generated from the registry."""
    rows = ["| preset | form | parameters | meaning |", "|---|---|---|---|"]
    for form in registry().values():
        presets = ", ".join(f"`{p}`" for p in form.presets) or f"`{form.name}`"
        params = ", ".join(_param_text(form, k, p) for k, p in form.params.items()) or "—"
        rows.append(f"| {presets} | {form.name} | {params} | {form.summary} |")
    return "\n".join(rows)


def _param_text(form: Form, key: str, p: Param) -> str:
    short = [s for s, full in form.preset_keys.items() if full == key]
    name = key + (f" (`{short[0]}`)" if short else "") + (" (`:arg`)" if form.preset_arg == key else "")
    return f"{name}={p.default!r}"
