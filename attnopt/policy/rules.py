"""Rule fields and matching: which sites a rule covers (layers, module glob, source, seq_len).

Layer ranges are inclusive. An endpoint is an int (negative counts from the end, -1 = last layer)
or a percentage of the depth ``"33%"`` (= floor(0.33 * num_layers)), so a recipe can scale with the
model. Endpoints resolve against `num_layers` at plan time; a range that resolves empty matches
nothing.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from attnopt import forms
from attnopt.ir.errors import PolicyError

# Where a site was found: SDPA, a hand-written chain, nn.MultiheadAttention, the HF attention interface.
SOURCES = ("sdpa", "explicit", "mha", "hf")
RULE_KEYS = ("layers", "module", "source", "seq_len", "form", "params")

# A layer endpoint: an int (negative = from the end) or "P%" of the depth.
LayerEnd = Union[int, str]


# ---------------------------------------------------------------- layer ranges


def _parse_layer_end(text: Any, where: str) -> LayerEnd:
    if isinstance(text, bool):
        raise PolicyError(f"{where}: field 'layers' endpoint {text!r} is a bool; expected an int or 'P%'")
    if isinstance(text, int):
        return text
    if isinstance(text, str):
        s = text.strip()
        if re.fullmatch(r"[+-]?\d+", s):
            return int(s)
        m = re.fullmatch(r"(\d+(?:\.\d+)?)%", s)
        if m and float(m.group(1)) <= 100:
            return f"{m.group(1)}%"
    raise PolicyError(
        f"{where}: field 'layers' has a bad endpoint {text!r}; allowed: an int (negative counts from the end, -1 = last) "
        f"or a percentage of the depth like '33%'"
    )


def _parse_layers(value: Any, where: str) -> Optional[tuple]:
    """Accept 3, "3", [1, 4], "1..4", "-2..-1", "2..", "..4", "1..33%"; return (start, stop) or None."""
    if value is None:
        return None
    allowed = "an int, [start, stop], or 'start..stop' (inclusive; negative from the end; 'P%' of depth; either side may be empty)"
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        text = str(value).strip()
        if ".." in text:
            left, _, right = text.partition("..")
            start = _parse_layer_end(left, where) if left.strip() else 0
            stop = _parse_layer_end(right, where) if right.strip() else -1
        else:
            try:
                start = stop = _parse_layer_end(text, where)
            except PolicyError:
                raise PolicyError(f"{where}: field 'layers' got {value!r}; allowed: {allowed}") from None
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        start = 0 if value[0] is None else _parse_layer_end(value[0], where)
        stop = -1 if value[1] is None else _parse_layer_end(value[1], where)
    else:
        raise PolicyError(f"{where}: field 'layers' got {value!r}; allowed: {allowed}")
    if isinstance(start, int) and isinstance(stop, int) and (start < 0) == (stop < 0) and start > stop:
        raise PolicyError(f"{where}: field 'layers' got {value!r}: start {start} is after stop {stop}; allowed: {allowed}")
    return (start, stop)


def resolve_layer(end: LayerEnd, num_layers: int) -> int:
    """An endpoint as a layer index for a model with `num_layers` attention layers."""
    if isinstance(end, str):
        return min(int(math.floor(float(end[:-1]) / 100.0 * num_layers)), max(num_layers - 1, 0))
    return end + num_layers if end < 0 else end


def _layers_text(layers: tuple) -> str:
    start, stop = layers
    return f"layer {start}" if start == stop else f"layers {start}..{stop}"


def _parse_seq_len(value: Any, where: str) -> Optional[tuple]:
    """Accept [min, max] (null = open), {"min":..,"max":..}, or "512..", "..4096", "512..4096"."""
    if value is None:
        return None
    allowed = "[min, max] (null for open), {min: .., max: ..}, or 'min..max' with either side empty"
    if isinstance(value, Mapping):
        extra = set(value) - {"min", "max"}
        if extra:
            raise PolicyError(f"{where}: field 'seq_len' has unknown key {sorted(extra)[0]!r}; allowed keys: min, max")
        lo, hi = value.get("min"), value.get("max")
    elif isinstance(value, str) and ".." in value:
        left, _, right = value.partition("..")
        lo, hi = left.strip() or None, right.strip() or None
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        lo, hi = value
    else:
        raise PolicyError(f"{where}: field 'seq_len' got {value!r}; allowed: {allowed}")
    bounds = []
    for b in (lo, hi):
        if b is not None and isinstance(b, str) and b.isdigit():
            b = int(b)
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise PolicyError(f"{where}: field 'seq_len' got {value!r}; bound {b!r} is not a non-negative int; allowed: {allowed}")
        bounds.append(b)
    if bounds[0] is not None and bounds[1] is not None and bounds[0] > bounds[1]:
        raise PolicyError(f"{where}: field 'seq_len' got {value!r}: min {bounds[0]} > max {bounds[1]}")
    return tuple(bounds)


def _parse_source(value: Any, where: str) -> Optional[frozenset]:
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple, set, frozenset)) or not items:
        raise PolicyError(f"{where}: field 'source' got {value!r}; allowed values: {', '.join(SOURCES)} (or a list of them)")
    for s in items:
        if s not in SOURCES:
            raise PolicyError(f"{where}: field 'source' got {s!r}{forms.did_you_mean(s, SOURCES)}; allowed values: "
                              f"{', '.join(SOURCES)}")
    return frozenset(items)



# ---------------------------------------------------------------- rules


def _plain(value: Any) -> Any:
    """Tuples as lists, so a rule equals itself after a trip through JSON/YAML."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Rule:
    """Match fields (None = any) plus the form and its validated parameters (defaults filled).

    `layers`: (start, stop) inclusive, endpoints int (negative from the end) or "P%" of depth.
    `module`: fnmatch glob on AttentionSite.module_path. `source`: set of "sdpa"/"explicit"/"mha".
    `seq_len`: (min, max) bounds on the site's query length at the example input, None = open; a
    symbolic length (str) matches any range.
    """

    form: str = "exact"
    params: dict = field(default_factory=dict, hash=False)
    layers: Optional[tuple] = None
    module: Optional[str] = None
    source: Optional[frozenset] = None
    seq_len: Optional[tuple] = None

    def __post_init__(self) -> None:
        spec = forms.get(self.form)
        object.__setattr__(self, "form", spec.name)
        check_names(spec, self.params, "rule")
        given = spec.validate(dict(self.params))
        # Canonical order (the form's own knobs first, then the common ones) keeps describe() stable.
        params = {k: _plain(given[k]) for k in spec.all_params() if k in given}  # (unfilled per-head keys absent)
        object.__setattr__(self, "params", params)
        if self.layers is not None:
            object.__setattr__(self, "layers", _parse_layers(self.layers, "rule"))
        if self.source is not None:
            object.__setattr__(self, "source", _parse_source(sorted(self.source) if isinstance(self.source, (set, frozenset)) else self.source, "rule"))
        if self.seq_len is not None:
            object.__setattr__(self, "seq_len", _parse_seq_len(self.seq_len, "rule"))
        if self.module is not None and not isinstance(self.module, str):
            raise PolicyError(f"rule: field 'module' got {self.module!r}; expected a glob string like '*.self_attn'")

    # -- matching

    def layer_range(self, num_layers: int) -> Optional[tuple[int, int]]:
        """The inclusive (start, stop) layer indices this rule covers in a `num_layers`-layer model."""
        if self.layers is None:
            return None
        return resolve_layer(self.layers[0], num_layers), resolve_layer(self.layers[1], num_layers)

    def matches(self, site: Any, num_layers: int) -> bool:
        if self.layers is not None:
            start, stop = self.layer_range(num_layers)
            if not start <= site.layer <= stop:
                return False
        if self.module is not None and not fnmatch.fnmatchcase(site.module_path, self.module):
            return False
        if self.source is not None and site.source not in self.source:
            return False
        if self.seq_len is not None and isinstance(site.q_len, int):
            lo, hi = self.seq_len
            if (lo is not None and site.q_len < lo) or (hi is not None and site.q_len > hi):
                return False
        return True

    # -- text

    def changed_params(self) -> dict:
        """Parameters that differ from the form's defaults, plus the form's main knob."""
        spec = forms.get(self.form)
        defaults = {k: p.default for k, p in spec.all_params().items()}
        main = spec.preset_arg
        return {k: v for k, v in self.params.items() if k == main or v != defaults.get(k)}

    def describe(self) -> str:
        """One line, e.g. "layers 1..4, module '*.attn' → window(window=64, sinks=4)"."""
        parts = []
        if self.layers is not None:
            parts.append(_layers_text(self.layers))
        if self.module is not None:
            parts.append(f"module {self.module!r}")
        if self.source is not None:
            parts.append("source " + "|".join(sorted(self.source)))
        if self.seq_len is not None:
            lo, hi = self.seq_len
            parts.append(f"seq_len {'' if lo is None else lo}..{'' if hi is None else hi}")
        args = ", ".join(f"{k}={v}" for k, v in self.changed_params().items())
        target = f"{self.form}({args})" if args else self.form
        return f"{', '.join(parts) or 'all sites'} → {target}"

    def to_dict(self) -> dict:
        d: dict[str, Any] = {}
        if self.layers is not None:
            d["layers"] = list(self.layers)
        if self.module is not None:
            d["module"] = self.module
        if self.source is not None:
            d["source"] = sorted(self.source)
        if self.seq_len is not None:
            d["seq_len"] = list(self.seq_len)
        d["form"] = self.form
        d["params"] = {k: _plain(v) for k, v in self.changed_params().items()}
        return d


def check_names(spec, params: Mapping, where: str) -> None:
    """PolicyError for a parameter the form does not have, or a value outside its fixed choices, naming
    the closest one (the form's `validate` checks everything else)."""
    allowed = spec.all_params()
    for key, value in params.items():
        full = spec.preset_keys.get(key, key)
        if full not in allowed:
            hint = forms.did_you_mean(key, [*allowed, *spec.preset_keys])
            raise PolicyError(f"{where}: form {spec.name!r} has no parameter {key!r}{hint}; allowed: "
                              f"{', '.join(sorted(allowed))}")
        choices = allowed[full].choices
        if choices is not None and isinstance(value, str) and value not in choices:
            hint = forms.did_you_mean(value, [str(c) for c in choices])
            raise PolicyError(f"{where}: form {spec.name!r}: parameter {full!r} got {value!r}{hint}; allowed values: "
                              f"{', '.join(repr(c) for c in choices)}")


def rule_from_dict(raw: Any, index: int) -> Rule:
    where = f"rule {index}"
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: expected a mapping of {', '.join(RULE_KEYS)} (+ form parameters), got {raw!r}")
    if "form" not in raw:
        raise PolicyError(f"{where}: missing field 'form'; allowed forms: {', '.join(forms.names())}")
    form = raw["form"]
    if not isinstance(form, str):
        raise PolicyError(f"{where}: field 'form' got {form!r}; allowed forms: {', '.join(forms.names())}")
    try:
        spec = forms.get(form)
    except PolicyError as e:
        raise PolicyError(f"{where}: field 'form': {e}") from None
    param_names = sorted(spec.all_params())
    inline = {spec.preset_keys.get(k, k): v for k, v in raw.items() if k not in RULE_KEYS}
    for key in inline:
        if key not in param_names:
            hint = forms.did_you_mean(key, [*RULE_KEYS, *param_names, *spec.preset_keys])
            raise PolicyError(
                f"{where}: unknown key {key!r}{hint}; allowed keys: {', '.join(RULE_KEYS)}, "
                f"or parameters of form {spec.name!r}: {', '.join(param_names)}"
            )
    nested = raw.get("params") or {}
    if not isinstance(nested, Mapping):
        raise PolicyError(f"{where}: field 'params' got {nested!r}; expected a mapping of {', '.join(param_names)}")
    check_names(spec, {**nested, **inline}, where)
    both = set(inline) & set(nested)
    if both:
        raise PolicyError(f"{where}: parameter {sorted(both)[0]!r} given both inline and under 'params'; give it once")
    module = raw.get("module")
    if module is not None and not isinstance(module, str):
        raise PolicyError(f"{where}: field 'module' got {module!r}; expected a glob string like '*.self_attn'")
    try:
        params = spec.validate({**nested, **inline})
    except PolicyError as e:
        raise PolicyError(f"{where}: {e}") from None
    return Rule(
        form=spec.name,
        params=params,
        layers=_parse_layers(raw.get("layers"), where),
        module=module,
        source=_parse_source(raw.get("source"), where),
        seq_len=_parse_seq_len(raw.get("seq_len"), where),
    )
