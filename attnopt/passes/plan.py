"""Plan pass: choose the forms to try for every site from the policy, and say why.

The policy matches rules; whether a form can serve a site is the form's own `why_not`, asked the
same way for an explicit rule and for `auto`. A rule whose form cannot serve its site (an arbitrary
mask, ssm on a bidirectional site, reuse with no anchor) keeps the site exact with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnopt import forms
from attnopt.ir.outcomes import SitePlan
from attnopt.ir.site import AttentionSite


@dataclass
class Planning:
    """The plans, one per site in site order, and how many sites each kind of plan covers."""

    plans: list = field(default_factory=list)  # list[SitePlan]
    counts: dict = field(default_factory=dict)  # "rule", "auto", "no_rule", "unsupported" -> sites
    unmatched_rules: list = field(default_factory=list)  # (index, text) of rules no site matched


def num_layers(sites: list[AttentionSite]) -> int:
    return 1 + max((s.layer for s in sites), default=-1)


def plan_sites(sites: list[AttentionSite], policy) -> Planning:
    """One SitePlan per site, in site order, with the candidates the verifier tries in order."""
    n = num_layers(sites)
    plans, matched = [], set()
    for site in sites:
        rule, index = policy.choose(site, n)
        matched.add(index)
        if rule is None and policy.auto:
            plans.append(_auto_plan(site, sites, policy))
        elif rule is None:
            plans.append(SitePlan(site.id, "exact", {}, None, "no rule matched: kept exact"))
        else:
            plans.append(_rule_plan(site, sites, rule, index))
    counts = {"sites": len(plans), "rule": 0, "auto": 0, "no_rule": 0, "unsupported": 0}
    for p in plans:
        key = "unsupported" if p.unsupported else "auto" if p.rule == "auto" else "rule" if p.rule else "no_rule"
        counts[key] += 1
    unmatched = [(i, r.describe()) for i, r in enumerate(policy.rules) if i not in matched and r.form != "exact"]
    return Planning(plans, counts, unmatched)


def _auto_plan(site, sites, policy) -> SitePlan:
    candidates, skipped = [], []
    for name, params in policy.auto_candidates():
        why = forms.get(name).why_not(site, params, sites)
        if why is None:
            candidates.append((name, params))
        else:
            skipped.append(f"{name}: {why}")
    reason = "auto: try forms cheapest-first, keep the first within tolerance"
    if not candidates:
        reason = "auto: no cheaper form applies to this site: kept exact"
    if skipped:
        reason += " (not applicable: " + "; ".join(skipped) + ")"
    first = candidates[0] if candidates else ("exact", {})
    return SitePlan(site.id, first[0], first[1], "auto", reason, tuple(candidates))


def _rule_plan(site, sites, rule, index) -> SitePlan:
    text = rule.describe()
    if rule.form == "exact":
        return SitePlan(site.id, "exact", dict(rule.params), text, f"rule {index} ({text})")
    why = forms.get(rule.form).why_not(site, rule.params, sites)
    if why is not None:
        return SitePlan(site.id, rule.form, dict(rule.params), text, f"rule {index} chose {rule.form}, but {why}",
                        unsupported=True)
    return SitePlan(site.id, rule.form, dict(rule.params), text, f"rule {index} ({text})",
                    ((rule.form, dict(rule.params)),))
