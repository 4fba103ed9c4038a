"""The policy language: which rewrite form each attention site gets.

A `Policy` is an ordered list of `Rule`s; the first rule that matches a site chooses its form, and a
site no rule matches stays exact. Policies come from a preset string, a dict, or a YAML/TOML/JSON
file, and every field is checked against the form table in `attnopt.passes.forms` so that a typo
fails at parse time with the allowed values, not silently at compile time.

Preset grammar: ``form[:arg][+key:value...]``. The positional ``arg`` is the form's main knob:

    linear:<feature_map>   "linear:favor", "linear:hedgehog+num_features:64"
    window:<window>        "window:256", "window:256+sinks:4"
    ssm:<decay>            "ssm", "ssm:0.95", "ssm:retnet"
    reuse:<anchor>         "reuse", "reuse:-2+rank:8" (anchor: layer reused; negative = layers back)
    exact | keep           everything exact
    hybrid                 the seeds' recipe, see `hybrid_policy`
    auto                   per site, try forms cheapest-first; the verifier keeps the cheapest in tolerance

Values after ``:`` are read as int, then float, then true/false, else kept as text.

Layer ranges are inclusive. An endpoint is an int (negative counts from the end, -1 = last layer)
or a percentage of the depth ``"33%"`` (= floor(0.33 * num_layers)), so a recipe can scale with the
model. Endpoints resolve against `num_layers` at plan time; a range that resolves empty matches
nothing.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from attnopt.passes.forms import COMMON_PARAMS, FORMS, PolicyError, form_spec

SOURCES = ("sdpa", "explicit", "mha")
RULE_KEYS = ("layers", "module", "source", "seq_len", "form", "params")
POLICY_KEYS = ("name", "tolerance", "auto", "rules")
POLICY_SUFFIXES = (".yaml", ".yml", ".toml", ".json")
AUTO_TOLERANCE = 0.3  # default max relative RMS drift per site for "auto"

PRESETS = ("exact", "keep", "linear", "window", "ssm", "reuse", "hybrid", "auto")

# The positional argument of a preset string, per form ("window:64" sets window=64).
PRESET_ARG = {"linear": "feature_map", "window": "window", "ssm": "decay", "reuse": "anchor"}

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
            raise PolicyError(f"{where}: field 'source' got {s!r}; allowed values: {', '.join(SOURCES)}")
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
        spec = form_spec(self.form)
        object.__setattr__(self, "form", spec.name)
        given = spec.validate(dict(self.params))
        # Canonical order (the form's own knobs first, then the common ones) keeps describe() stable.
        params = {k: _plain(given[k]) for k in {**spec.params, **COMMON_PARAMS}}
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
        spec = FORMS[self.form]
        defaults = {k: p.default for k, p in {**spec.params, **COMMON_PARAMS}.items()}
        main = PRESET_ARG.get(self.form)
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


def _rule_from_dict(raw: Any, index: int) -> Rule:
    where = f"rule {index}"
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: expected a mapping of {', '.join(RULE_KEYS)} (+ form parameters), got {raw!r}")
    if "form" not in raw:
        raise PolicyError(f"{where}: missing field 'form'; allowed forms: {', '.join(FORMS)}")
    form = raw["form"]
    if not isinstance(form, str):
        raise PolicyError(f"{where}: field 'form' got {form!r}; allowed forms: {', '.join(FORMS)}")
    try:
        spec = form_spec(form)
    except PolicyError as e:
        raise PolicyError(f"{where}: field 'form': {e}") from None
    param_names = sorted({**spec.params, **COMMON_PARAMS})
    inline = {k: v for k, v in raw.items() if k not in RULE_KEYS}
    for key in inline:
        if key not in param_names:
            raise PolicyError(
                f"{where}: unknown key {key!r}; allowed keys: {', '.join(RULE_KEYS)}, "
                f"or parameters of form {spec.name!r}: {', '.join(param_names)}"
            )
    nested = raw.get("params") or {}
    if not isinstance(nested, Mapping):
        raise PolicyError(f"{where}: field 'params' got {nested!r}; expected a mapping of {', '.join(param_names)}")
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


# ---------------------------------------------------------------- auto candidates

# Tried by "auto", cheapest first at long lengths (FormSpec.cost_rank); exact is the fallback.
AUTO_CANDIDATES = (
    ("linear", {"feature_map": "elu"}),
    ("ssm", {}),
    ("window", {"window": 64, "sinks": 4}),
    ("reuse", {"anchor": -1, "rank": 8}),
)


def _precondition_failure(form: str, params: Mapping, site: Any) -> Optional[str]:
    """Why `form` cannot apply to `site` at all (None: it may, the verifier decides how well)."""
    if form == "exact":
        return None
    if site.mask.arbitrary:
        return f"mask is arbitrary ({site.mask.form}): only exact attention honours it"
    if form == "reuse":
        anchor = _anchor_layer(params["anchor"], site.layer)
        if not 0 <= anchor < site.layer:
            return f"layer {site.layer} has no earlier layer {anchor} to reuse (anchor {params['anchor']})"
    if form == "window" and isinstance(site.kv_len, int) and site.kv_len <= params["window"] + params["sinks"]:
        return f"kv_len {site.kv_len} <= window {params['window']} + sinks {params['sinks']}: nothing to save"
    if form == "ssm" and not site.causal:
        # The recurrence only carries the past: on a bidirectional site it drops every later key.
        return "ssm is causal by construction and the site is not causal"
    return None


def _anchor_layer(anchor: int, layer: int) -> int:
    """The layer a reuse site at `layer` reads q/k from: `anchor` if >= 0, else that many layers back."""
    return layer + anchor if anchor < 0 else anchor


# ---------------------------------------------------------------- policy


@dataclass(frozen=True)
class Policy:
    """Ordered rules (first match wins), an optional "auto" fallback, and a default tolerance."""

    name: str = "custom"
    rules: tuple = ()
    auto: bool = False  # sites no rule matches get `candidates(...)` instead of exact
    tolerance: Optional[float] = None  # overrides each form's default drift tolerance

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for i, r in enumerate(self.rules):
            if not isinstance(r, Rule):
                raise PolicyError(f"rule {i}: expected a Rule, got {type(r).__name__}; use Policy.parse for dicts")
        if self.tolerance is not None:
            if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or self.tolerance < 0:
                raise PolicyError(f"policy: field 'tolerance' got {self.tolerance!r}; allowed: a float >= 0 or null")
            object.__setattr__(self, "tolerance", float(self.tolerance))

    # -- deciding

    def choose(self, site: Any, num_layers: int) -> tuple[Optional[Rule], int]:
        """The first rule matching `site` and its index; (None, -1) when none does (→ exact, or auto)."""
        for i, rule in enumerate(self.rules):
            if rule.matches(site, num_layers):
                return rule, i
        return None, -1

    def candidates(self, site: Any, num_layers: int) -> list[tuple[str, dict]]:
        """Forms "auto" tries for `site`, cheapest first, ending with exact; forms that cannot apply are left out."""
        del num_layers  # layer preconditions only look back; kept for a uniform signature with choose
        out = []
        ranked = sorted(AUTO_CANDIDATES, key=lambda fp: FORMS[fp[0]].cost_rank)
        for form, params in ranked + [("exact", {})]:
            full = form_spec(form).validate(params)
            if _precondition_failure(form, full, site) is None:
                out.append((form, full))
        return out

    def excluded(self, site: Any) -> list[tuple[str, str]]:
        """(form, reason) for each auto candidate left out of `candidates` for this site."""
        out = []
        for form, params in AUTO_CANDIDATES:
            why = _precondition_failure(form, form_spec(form).validate(params), site)
            if why is not None:
                out.append((form, why))
        return out

    def tolerance_for(self, form: str, params: Mapping) -> float:
        """Drift tolerance for a chosen form: the rule's `tolerance`, else the policy's, else the form's default."""
        if params.get("tolerance") is not None:
            return float(params["tolerance"])
        if self.tolerance is not None:
            return self.tolerance
        return form_spec(form).default_tolerance

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
            f"({', '.join(PRESETS)}), a dict, a Policy, or a path ending in {', '.join(POLICY_SUFFIXES)}"
        )

    @classmethod
    def from_dict(cls, d: Mapping) -> "Policy":
        for key in d:
            if key not in POLICY_KEYS:
                raise PolicyError(f"policy: unknown key {key!r}; allowed keys: {', '.join(POLICY_KEYS)}")
        rules_raw = d.get("rules", [])
        if rules_raw is None:
            rules_raw = []
        if not isinstance(rules_raw, (list, tuple)):
            raise PolicyError(f"policy: field 'rules' got {rules_raw!r}; expected a list of rule mappings")
        auto = d.get("auto", False)
        if not isinstance(auto, bool):
            raise PolicyError(f"policy: field 'auto' got {auto!r}; allowed values: true, false")
        name = d.get("name", "custom")
        if not isinstance(name, str):
            raise PolicyError(f"policy: field 'name' got {name!r}; expected a string")
        return cls(
            name=name,
            rules=tuple(_rule_from_dict(r, i) for i, r in enumerate(rules_raw)),
            auto=auto,
            tolerance=d.get("tolerance"),
        )

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "Policy":
        """Parse a policy file safely: yaml.safe_load, tomllib, json -- plain data only, nothing executed."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in POLICY_SUFFIXES:
            raise PolicyError(f"policy file {str(path)!r} has suffix {suffix!r}; allowed: {', '.join(POLICY_SUFFIXES)}")
        if not path.is_file():
            raise PolicyError(f"policy file {str(path)!r} not found")
        text = path.read_text(encoding="utf-8")
        try:
            if suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            elif suffix == ".toml":
                try:
                    import tomllib
                except ImportError:  # Python 3.10
                    import tomli as tomllib  # type: ignore[no-redef]
                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except PolicyError:
            raise
        except Exception as e:  # yaml.YAMLError (incl. refused !!python tags), TOMLDecodeError, JSONDecodeError
            raise PolicyError(f"policy file {str(path)!r} is not valid {suffix[1:].upper()} plain data: {e}") from None
        if isinstance(data, str):
            return cls.from_preset(data)
        if not isinstance(data, Mapping):
            raise PolicyError(f"policy file {str(path)!r}: top level must be a mapping with keys {', '.join(POLICY_KEYS)}")
        data = dict(data)
        data.setdefault("name", path.stem)
        return cls.from_dict(data)

    @classmethod
    def from_preset(cls, text: str) -> "Policy":
        """Parse ``form[:arg][+key:value...]``, "hybrid" or "auto" (see the module docstring)."""
        raw = text.strip()
        head, *extras = raw.split("+")
        form, _, arg = head.partition(":")
        form = form.strip().lower()
        params: dict[str, Any] = {}
        for extra in extras:
            key, sep, value = extra.partition(":")
            if not sep or not key.strip():
                raise PolicyError(f"preset {raw!r}: extra {extra!r} is not 'key:value' (e.g. 'window:64+sinks:4')")
            params[key.strip()] = _preset_value(value.strip())
        if form in ("hybrid", "auto"):
            if arg:
                raise PolicyError(f"preset {raw!r}: {form!r} takes no ':arg'; allowed extras: +tolerance:<float>")
            unknown = set(params) - {"tolerance"}
            if unknown:
                raise PolicyError(f"preset {raw!r}: unknown key {sorted(unknown)[0]!r}; allowed: tolerance")
            tol = params.get("tolerance")
            if form == "hybrid":
                return hybrid_policy(tolerance=tol)
            # "auto" picks forms for the user, so it holds them to a tighter bar than the per-form
            # defaults an explicit choice gets (those only catch catastrophic drift).
            return cls(name=raw, auto=True, tolerance=AUTO_TOLERANCE if tol is None else tol)
        try:
            spec = form_spec(form)
        except PolicyError:
            raise PolicyError(
                f"unknown preset {raw!r}; allowed presets: {', '.join(PRESETS)} "
                f"(grammar form[:arg][+key:value...], e.g. 'window:256+sinks:4')"
            ) from None
        if arg:
            main = PRESET_ARG.get(spec.name)
            if main is None:
                raise PolicyError(f"preset {raw!r}: form {spec.name!r} takes no ':arg'; allowed: {', '.join(f'{f}:<{p}>' for f, p in PRESET_ARG.items())}")
            if main in params:
                raise PolicyError(f"preset {raw!r}: {main!r} given twice")
            params[main] = _preset_value(arg.strip())
        layers = None
        if spec.name == "reuse":
            # Every layer that has its anchor before it reuses it: from layer 1 for the default anchor -1.
            # A rank-8 residual: pure reuse (rank 0) drifts far on trained models (MiniLM cosine
            # 0.45 vs 0.90 with rank 8, benchmarks/results/compile_cpu.json).
            params.setdefault("rank", 8)
            anchor = params.setdefault("anchor", -1)
            first = 1  # a non-int anchor is reported by Rule() below
            if isinstance(anchor, int) and not isinstance(anchor, bool):
                first = -anchor if anchor < 0 else anchor + 1
            layers = (first, -1)
        try:
            rule = Rule(form=spec.name, params=params, layers=layers)
        except PolicyError as e:
            raise PolicyError(f"preset {raw!r}: {e}") from None
        return cls(name=raw, rules=(rule,))

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
            forms = " → ".join(f for f, _ in sorted(AUTO_CANDIDATES, key=lambda fp: FORMS[fp[0]].cost_rank))
            lines.append(f"  otherwise: auto, cheapest within tolerance of {forms} → exact")
        else:
            lines.append("  otherwise: exact")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _preset_value(text: str) -> Any:
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def hybrid_policy(tolerance: Optional[float] = None) -> Policy:
    """The seeds' recipe: first and last layers exact, the first third windowed, the rest linear.

    Rules, first match wins: layer 0 exact; layer -1 exact; layers 1..33% window(64, sinks 4);
    everything else linear(elu). On a 12-layer model: 0 exact, 1-3 window, 4-10 linear, 11 exact.
    """
    return Policy(
        name="hybrid",
        tolerance=tolerance,
        rules=(
            Rule(form="exact", layers=(0, 0)),
            Rule(form="exact", layers=(-1, -1)),
            Rule(form="window", params={"window": 64, "sinks": 4}, layers=(1, "33%")),
            Rule(form="linear", params={"feature_map": "elu"}),
        ),
    )
