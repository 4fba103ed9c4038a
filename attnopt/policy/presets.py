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
    """The Policy fields (name, rules, auto, tolerance) a preset string spells. A misspelt form name,
    key or value is an error that names the nearest preset that parses ("did you mean
    'gla+window:16'?")."""
    return _parse(raw, hints=True)


def _parse(raw: str, hints: bool) -> dict[str, Any]:
    def hint() -> str:
        fix = suggest_preset(raw) if hints else None
        return f" (did you mean {fix!r}?)" if fix else ""

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
            raise PolicyError(f"preset {raw!r}: extra {extra!r} is not 'key:value' (e.g. 'window:64+sinks:4')"
                              f"{hint()}")
        if key in params:
            raise PolicyError(f"preset {raw!r}: {key!r} given twice; give it once")
        params[key] = preset_value(value.strip())
    if form_name in RECIPES:
        if arg:
            raise PolicyError(f"preset {raw!r}: {form_name!r} takes no ':arg'; allowed extras: +tolerance:<float>")
        unknown = set(params) - {"tolerance"}
        if unknown:
            raise PolicyError(f"preset {raw!r}: unknown key {sorted(unknown)[0]!r}{hint()}; allowed: tolerance")
        tol = params.get("tolerance")
        if form_name == "hybrid":
            return {"name": "hybrid", "rules": hybrid_rules(), "tolerance": tol}
        return {"name": raw.strip(), "auto": True, "tolerance": AUTO_TOLERANCE if tol is None else tol}
    try:
        spec = forms.get(form_name)
    except PolicyError:
        raise PolicyError(
            f"unknown preset {raw!r}{hint()}; allowed presets: {', '.join(preset_names())} "
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
    allowed = spec.all_params()
    for key, value in params.items():
        if key not in allowed:
            raise PolicyError(f"preset {raw!r}: form {spec.name!r} has no parameter {key!r}{hint()}; allowed: "
                              f"{', '.join(sorted(allowed))}")
        choices = allowed[key].choices
        if choices is not None and isinstance(value, str) and value not in choices:
            raise PolicyError(f"preset {raw!r}: form {spec.name!r}: parameter {key!r} got {value!r}{hint()}; "
                              f"allowed values: {', '.join(repr(c) for c in choices)}")
    params, layers = spec.preset_rule(params)
    try:
        rule = Rule(form=spec.name, params=params, layers=layers)
    except PolicyError as e:
        raise PolicyError(f"preset {raw!r}: {e}") from None
    return {"name": raw.strip(), "rules": (rule,)}


def suggest_preset(raw: str) -> Optional[str]:
    """The nearest preset that parses with one misspelt word corrected (the form name, '+' and all, a
    key, or a value with a fixed set of choices); None when no single correction gives one."""
    for candidate in _corrections(raw.strip()):
        try:
            _parse(candidate, hints=False)
        except PolicyError:
            continue
        return candidate
    return None


def _corrections(text: str):
    """Candidate presets, each `text` with one word replaced by the closest known one."""
    name, sep, rest = text.partition(":")
    # The name part as one form name: 'gla+windw:16' -> 'gla+window:16' (a '+' may be inside a name).
    match = forms.closest(name, preset_names())
    if match is not None and match != name.lower():
        yield match + sep + rest
    head, tail = _split_form(text)
    if head in RECIPES:
        spec, keys = None, ["tolerance"]
    else:
        try:
            spec = forms.get(head)
        except PolicyError:
            return
        keys = [*spec.all_params(), *spec.preset_keys]
    prefix, parts = text[: len(text) - len(tail)], tail.split("+")  # parts[0]: ":arg" or ""
    for i, part in enumerate(parts):
        if i == 0:
            if part.startswith(":") and spec is not None and spec.preset_arg is not None:
                for value in _value_fixes(spec, spec.preset_arg, part[1:]):
                    yield prefix + "+".join([":" + value] + parts[1:])
            continue
        key, colon, value = part.partition(":")
        options = []
        fixed_key = forms.closest(key, keys)
        if fixed_key is not None and fixed_key != key:
            options.append(fixed_key + colon + value)
        if spec is not None:
            options += [key + colon + v for v in _value_fixes(spec, spec.preset_keys.get(key, key), value)]
        for option in options:
            yield prefix + "+".join(parts[:i] + [option] + parts[i + 1:])


def _value_fixes(spec, key: str, value: str):
    param = spec.all_params().get(key)
    if param is not None and param.choices is not None:
        fixed = forms.closest(value, [str(c) for c in param.choices])
        if fixed is not None and fixed != value:
            yield fixed


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
