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
    # (index, text, claimed) of rules that chose no site; claimed: ((earlier index, its text, sites), ...)
    # for the sites the rule matches that an earlier rule took first (the first matching rule wins)
    unmatched_rules: list = field(default_factory=list)


def num_layers(sites: list[AttentionSite]) -> int:
    return 1 + max((s.layer for s in sites), default=-1)


def plan_sites(sites: list[AttentionSite], policy) -> Planning:
    """One SitePlan per site, in site order, with the candidates the verifier tries in order."""
    n = num_layers(sites)
    plans, chosen = [], []
    for site in sites:
        rule, index = policy.choose(site, n)
        chosen.append(index)
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
    return Planning(plans, counts, unmatched_rules(sites, policy, chosen, n))


def unmatched_rules(sites: list, policy, chosen: list, n: int) -> list:
    """The non-exact rules that chose no site: (index, text, the earlier rules that claimed its sites,
    the form's hint of why its parameters match none)."""
    out = []
    for i, rule in enumerate(policy.rules):
        if i in chosen or rule.form == "exact":
            continue
        claimed: dict = {}
        for site, index in zip(sites, chosen):
            if rule.matches(site, n):
                claimed[index] = claimed.get(index, 0) + 1
        out.append((i, rule.describe(), tuple((j, policy.rules[j].describe(), k) for j, k in sorted(claimed.items())),
                    forms.get(rule.form).unmatched_hint(rule.params, len({s.layer for s in sites}))))
    return out


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
    kept = forms.get(rule.form).keeps_exact(site, rule.params, sites)
    if kept is not None:  # the form's own plan for this site is exact attention (a reuse anchor)
        return SitePlan(site.id, rule.form, dict(rule.params), text, f"rule {index} chose {rule.form}; {kept}")
    return SitePlan(site.id, rule.form, dict(rule.params), text, f"rule {index} ({text})",
                    ((rule.form, dict(rule.params)),))
