"""The preset grammar and the built-in recipes.

Grammar: ``form[:arg][+key:value...]``. The form name is any registered form or alias (names may
contain '+', as in ``linear+window``: the longest name that prefixes the text wins). The
positional ``arg`` is the form's main knob (`Form.preset_arg`): ``window:64`` sets window=64,
``linear:favor`` sets feature_map=favor. Values are read as int, then float, then true/false, else
kept as text. Two recipes are not forms:

    hybrid   first and last layers exact, the first third windowed, the rest linear
    auto     per site, the cheapest form whose drift verifies within tolerance
"""

from __future__ import annotations

import re
from typing import Any, Optional

from attnopt import forms
from attnopt.ir.errors import PolicyError
from attnopt.policy.rules import Rule

RECIPES = ("hybrid", "auto")
# "auto" picks forms for the user, so it holds them to a tighter bar than the per-form defaults an
# explicit choice gets (those only catch catastrophic drift).
AUTO_TOLERANCE = 0.3


def preset_names() -> tuple[str, ...]:
    return tuple(forms.names()) + tuple(forms.aliases()) + RECIPES


RECIPE_ROWS = (
    "| `hybrid` | recipe | tolerance | first and last layers exact, the first third `window:64+sinks:4`, the rest `linear` |",
    "| `auto` | recipe | tolerance (default 0.3) | per site, the cheapest form whose drift is within tolerance |",
)


def policy_reference() -> str:
    """The policy table of the README and the CLI: every registered form, then the recipes."""
    return forms.policy_table() + "\n" + "\n".join(RECIPE_ROWS)


def hybrid_rules() -> tuple[Rule, ...]:
    """The seeds' recipe. Rules, first match wins: layer 0 exact; layer -1 exact; layers 1..33%
    window(64, sinks 4); everything else linear(elu). On 12 layers: 0 exact, 1-3 window, 4-10 linear, 11 exact."""
    return (
        Rule(form="exact", layers=(0, 0)),
        Rule(form="exact", layers=(-1, -1)),
        Rule(form="window", params={"window": 64, "sinks": 4}, layers=(1, "33%")),
        Rule(form="linear", params={"feature_map": "elu"}),
    )


def _split_form(raw: str) -> tuple[str, str]:
    """(form name, rest) of a preset: the longest known name followed by ':' or '+' or the end."""
    text = raw.strip().lower()
    for name in sorted(preset_names(), key=len, reverse=True):
        if text == name or text.startswith(name + ":") or text.startswith(name + "+"):
            return name, raw.strip()[len(name):]
    head = re.split(r"[:+]", text, maxsplit=1)[0]
    return head, raw.strip()[len(head):]


def parse_preset(raw: str) -> dict[str, Any]:
    """The Policy fields (name, rules, auto, tolerance) a preset string spells."""
    form_name, rest = _split_form(raw)
    arg: Optional[str] = None
    if rest.startswith(":"):
        arg, _, rest = rest[1:].partition("+")
        rest = "+" + rest if rest else ""
    params: dict[str, Any] = {}
    for extra in [e for e in rest.split("+")[1:]] if rest else []:
        key, sep, value = extra.partition(":")
        key = key.strip()
        if not sep or not key:
            raise PolicyError(f"preset {raw!r}: extra {extra!r} is not 'key:value' (e.g. 'window:64+sinks:4')")
        if key in params:
            raise PolicyError(f"preset {raw!r}: {key!r} given twice; give it once")
        params[key] = preset_value(value.strip())
    if form_name in RECIPES:
        if arg:
            raise PolicyError(f"preset {raw!r}: {form_name!r} takes no ':arg'; allowed extras: +tolerance:<float>")
        unknown = set(params) - {"tolerance"}
        if unknown:
            raise PolicyError(f"preset {raw!r}: unknown key {sorted(unknown)[0]!r}; allowed: tolerance")
        tol = params.get("tolerance")
        if form_name == "hybrid":
            return {"name": "hybrid", "rules": hybrid_rules(), "tolerance": tol}
        return {"name": raw.strip(), "auto": True, "tolerance": AUTO_TOLERANCE if tol is None else tol}
    try:
        spec = forms.get(form_name)
    except PolicyError:
        raise PolicyError(
            f"unknown preset {raw!r}; allowed presets: {', '.join(preset_names())} "
            f"(grammar form[:arg][+key:value...], e.g. 'window:256+sinks:4')"
        ) from None
    if arg is not None:
        if not arg.strip():
            raise PolicyError(f"preset {raw!r}: empty value after ':'")
        if spec.preset_arg is None:
            takes = ", ".join(f"{f.name}:<{f.preset_arg}>" for f in forms.registry().values() if f.preset_arg)
            raise PolicyError(f"preset {raw!r}: form {spec.name!r} takes no ':arg'; allowed: {takes}")
        if spec.preset_arg in params or any(spec.preset_keys.get(k) == spec.preset_arg for k in params):
            raise PolicyError(f"preset {raw!r}: {spec.preset_arg!r} given twice; give it once")
        params = {spec.preset_arg: preset_value(arg.strip()), **params}
    params = {spec.preset_keys.get(k, k): v for k, v in params.items()}
    params, layers = spec.preset_rule(params)
    try:
        rule = Rule(form=spec.name, params=params, layers=layers)
    except PolicyError as e:
        raise PolicyError(f"preset {raw!r}: {e}") from None
    return {"name": raw.strip(), "rules": (rule,)}


def preset_value(text: str) -> Any:
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


if __name__ == "__main__":  # python -m attnopt.policy.presets: the README policy table
    print(policy_reference())
