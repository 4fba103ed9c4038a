"""The policy language: which rewrite form each attention site gets.

A `Policy` is an ordered list of `Rule`s; the first rule that matches a site chooses its form, and a
site no rule matches stays exact (or, with `auto`, gets the cheapest form that verifies). Policies
come from a preset string, a dict, or a YAML/TOML/JSON file (`Policy.parse`). The policy only
matches rules: whether a form can serve a site is the form's own `why_not` (attnopt.forms).

    rules.py    rule fields (layers, module, source, seq_len) and matching
    presets.py  the preset grammar and the built-in recipes (hybrid, auto)
    parse.py    dicts and policy files
    policy.py   the Policy itself
"""

from __future__ import annotations

from attnopt.ir.errors import PolicyError
from attnopt.policy.policy import Policy, hybrid_policy
from attnopt.policy.rules import Rule

__all__ = ["Policy", "Rule", "PolicyError", "hybrid_policy"]
