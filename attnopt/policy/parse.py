"""Policies written as data: a dict, or a YAML / TOML / JSON file (plain data only, nothing executed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Union

from attnopt import forms
from attnopt.ir.errors import PolicyError
from attnopt.policy.presets import parse_preset
from attnopt.policy.rules import rule_from_dict

POLICY_KEYS = ("name", "tolerance", "auto", "rules")
POLICY_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def parse_dict(d: Mapping) -> dict[str, Any]:
    """The Policy fields (name, rules, auto, tolerance) of a policy mapping; PolicyError on any bad key."""
    for key in d:
        if key not in POLICY_KEYS:
            raise PolicyError(f"policy: unknown key {key!r}{forms.did_you_mean(key, POLICY_KEYS)}; allowed keys: "
                              f"{', '.join(POLICY_KEYS)}")
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
    rules = tuple(rule_from_dict(r, i) for i, r in enumerate(rules_raw))
    return {"name": name, "rules": rules, "auto": auto, "tolerance": d.get("tolerance")}


def parse_file(path: Union[str, Path]) -> dict[str, Any]:
    """The Policy fields of a policy file: yaml.safe_load, tomllib or json; a top-level string is a preset."""
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
    except Exception as e:  # yaml.YAMLError (incl. refused !!python tags), TOMLDecodeError, JSONDecodeError
        raise PolicyError(f"policy file {str(path)!r} is not valid {suffix[1:].upper()} plain data: "
                          f"{_one_line_error(e)}") from None
    if isinstance(data, str):
        return parse_preset(data)
    if not isinstance(data, Mapping):
        raise PolicyError(f"policy file {str(path)!r}: top level must be a mapping with keys {', '.join(POLICY_KEYS)}")
    data = dict(data)
    data.setdefault("name", path.stem)
    return parse_dict(data)


def _one_line_error(e: Exception) -> str:
    """A parser's error in one line: PyYAML's problem and its line and column, not its context dump."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(e).split())
