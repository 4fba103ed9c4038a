"""Plan pass: choose a form for every site from the policy, and say why.

A rule can choose a form the site cannot honour (an arbitrary mask, a bidirectional site for the
causal-only ssm form, reuse with no compatible anchor); the plan then keeps the site exact and
records that reason instead of guessing.
"""

from __future__ import annotations

from typing import Optional

from attnopt.passes.forms import form_spec
from attnopt.passes.records import SitePlan
from attnopt.passes.site import AttentionSite


def num_layers(sites: list[AttentionSite]) -> int:
    return 1 + max((s.layer for s in sites), default=-1)


def find_anchor(site: AttentionSite, sites: list[AttentionSite], anchor: int) -> Optional[AttentionSite]:
    """The site whose q/k a reuse site borrows: layer `anchor` (negative: that many layers back)."""
    layer = site.layer + anchor if anchor < 0 else anchor
    if layer < 0 or layer >= site.layer:
        return None
    for other in sites:
        if other.layer == layer and _same_geometry(site, other):
            return other
    return None


def _same_geometry(a: AttentionSite, b: AttentionSite) -> bool:
    return (
        a.heads == b.heads
        and a.kv_heads == b.kv_heads
        and a.head_dim == b.head_dim
        and str(a.q_len) == str(b.q_len)
        and str(a.kv_len) == str(b.kv_len)
        and a.causal == b.causal
        and (a.nodes.rank if a.nodes else 4) == (b.nodes.rank if b.nodes else 4)
    )


def why_not(site: AttentionSite, form: str, params: dict, sites: list[AttentionSite]) -> Optional[str]:
    """None when `form` can replace `site`; otherwise the reason in plain words."""
    if form == "exact":
        return None
    if form != "reuse" and site.mask.arbitrary:
        return f"the site's mask ({site.mask.form}) is not causal, windowed or padding; only exact attention honours it"
    if site.dropout_p > 0:
        return f"the site applies dropout p={site.dropout_p:g} (training mode); rewrites are for inference"
    if form == "ssm":
        if not site.causal:
            return "ssm is causal by construction and this site is bidirectional; use linear or window"
        if str(site.q_len) != str(site.kv_len):
            return "ssm needs self-attention (query length == key length)"
    if form == "reuse":
        if params.get("rank", 0) > 0 and (site.mask.arbitrary or site.window is not None):
            return "the reuse residual (rank > 0) honours causal and padding masks only; use rank 0"
        anchor = find_anchor(site, sites, params["anchor"])
        if anchor is None:
            return f"no earlier site with the same heads, lengths and causality at anchor {params['anchor']}"
    if form == "window" and site.mask.window is None and not site.causal and str(site.q_len) != str(site.kv_len):
        return "window needs aligned query and key positions; this is cross-attention"
    return None


def plan_sites(sites: list[AttentionSite], policy) -> list[SitePlan]:
    """One SitePlan per site, in site order."""
    n = num_layers(sites)
    plans = []
    for site in sites:
        rule, index = policy.choose(site, n)
        if rule is None and getattr(policy, "auto", False):
            cands = [
                (form, dict(params))
                for form, params in policy.candidates(site, n)
                if form != "exact" and why_not(site, form, params, sites) is None
            ]
            reason = "auto: try forms cheapest-first, keep the first within tolerance"
            if not cands:
                reason = "auto: no cheaper form applies to this site: kept exact"
            first = cands[0] if cands else ("exact", {})
            plans.append(SitePlan(site.id, first[0], first[1], "auto", reason, tuple(cands)))
            continue
        if rule is None:
            plans.append(SitePlan(site.id, "exact", {}, None, "no rule matched: kept exact"))
            continue
        text = rule.describe()
        reason = why_not(site, rule.form, rule.params, sites)
        if reason is not None:
            plans.append(
                SitePlan(site.id, rule.form, dict(rule.params), text, f"rule {index} chose {rule.form}, but {reason}", unsupported=True)
            )
            continue
        plans.append(SitePlan(site.id, rule.form, dict(rule.params), text, f"rule {index} ({text})"))
    return plans
