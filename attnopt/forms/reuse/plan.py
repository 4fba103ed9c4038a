"""The measured plan: which layers anchor and which reuse, from the seed's observation on the user's data.

Every site selects its own blocks on the recorded calls (selection.py's rule, its own q and k). The
overlap of site l with an earlier site a is the share of l's chosen blocks (sinks and window left
out: every layer reads those) that a's choice also holds, averaged over the query blocks that choose
and over the batches: "adjacent layers attend to the same positions", measured. The plan cuts the
layer chain into segments: the first site of a segment anchors (exact attention, selecting), the
others read its selection, each with overlap at least the threshold. The first and the last site
stay exact. Dynamic programming finds the fewest anchors, ties going to the higher total overlap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from attnopt.forms.reuse.selection import BlockRule, leading_pads, positions_keep, select_positions, to_positions
from attnopt.ir.masks import key_keep

_MEMO = "reuse:measured-plan"


@dataclass
class ReusePlan:
    """The overlap matrix and the anchors chosen from it."""

    site_ids: list
    layers: list
    overlap: list  # overlap[l][a], a < l: share of site l's chosen blocks site a also chooses (None: not comparable)
    threshold: float
    rule: dict  # block, top_k, window, sinks, probes, mass
    anchors: list = field(default_factory=list)  # site ids that attend exactly and select
    reuse: dict = field(default_factory=dict)  # site id -> the anchor site id it reads

    def why_not(self, site_id: str) -> str:
        """Why the plan keeps a site exact, in words."""
        i = self.site_ids.index(site_id) if site_id in self.site_ids else None
        if i is None:
            return "the site was not measured (no recorded call), so the plan cannot place it"
        if i == 0 or i == len(self.site_ids) - 1:
            return f"the {'first' if i == 0 else 'last'} layer stays exact in a measured plan"
        if site_id in self.anchors:
            readers = [self.layers[self.site_ids.index(s)] for s, a in self.reuse.items() if a == site_id]
            return (f"an anchor in the measured plan: it attends exactly and selects blocks for layers "
                    f"{', '.join(map(str, readers))}" if readers else
                    "the measured plan keeps it exact: its top blocks overlap no earlier layer's enough")
        return "the measured plan keeps it exact"

    def to_dict(self) -> dict:
        return asdict(self)


def chosen_blocks(q_BHND: torch.Tensor, k_BHkvND: torch.Tensor, keep_BN: Optional[torch.Tensor], rule: BlockRule,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Bool [B, M, J]: the blocks each query block chooses by mass, sinks and window left out;
    bool [B, M]: the query blocks that choose at all), in position space."""
    offsets = leading_pads(keep_BN)
    keep_pos = positions_keep(keep_BN, offsets)
    blocks = select_positions(to_positions(q_BHND, offsets), to_positions(k_BHkvND, offsets), keep_pos, rule, scale)
    B, M, _ = blocks.shape
    J = M
    j = torch.arange(J)
    m = torch.arange(M)[:, None]
    in_window = ((j >= m - rule.window) & (j <= m)) if rule.causal else ((j - m).abs() <= rule.window)
    forced = (j < rule.sinks) | in_window  # [M, J]
    read = torch.zeros(B, M, J + 1, dtype=torch.bool)
    read.scatter_(-1, torch.where(blocks >= 0, blocks, J), True)
    chosen = read[..., :J] & ~forced
    chooses = torch.tensor([rule.candidates(int(mm), J) > rule.fits for mm in range(M)])[None, :].expand(B, M)
    if keep_pos is not None:  # query blocks with a real query only
        real = torch.nn.functional.pad(keep_pos, (0, M * rule.block - keep_pos.shape[1])).view(B, M, rule.block).any(-1)
        chooses = chooses & real
    return chosen, chooses


def overlap_matrix(site_ids: Sequence[str], calls: Mapping[str, list], rules: Mapping[str, BlockRule],
                   scales: Mapping[str, float], keep_when: Mapping[str, str]) -> list:
    """overlap[l][a] for a < l over the recorded calls (None: different shapes, or nothing chosen)."""
    chosen: dict = {}
    for sid in site_ids:
        per_call = []
        for c in calls.get(sid, []):
            keep = key_keep(c.mask, keep_when[sid], c.q.shape[0], c.k.shape[-2]) if c.mask is not None else None
            per_call.append(chosen_blocks(c.q, c.k, keep, rules[sid], scales[sid]))
        chosen[sid] = per_call
    n = len(site_ids)
    out: list = [[None] * n for _ in range(n)]
    for li, l in enumerate(site_ids):
        for ai, a in enumerate(site_ids[:li]):
            mine, theirs = chosen[l], chosen[a]
            if not mine or len(mine) != len(theirs):
                continue
            hit = total = 0.0
            for (cl, wl), (ca, _) in zip(mine, theirs):
                if cl.shape != ca.shape:
                    hit = total = None
                    break
                count = (cl & wl[..., None]).sum().item()
                hit += (cl & ca & wl[..., None]).sum().item()
                total += count
            out[li][ai] = None if not total else hit / total
    return out


def choose_anchors(overlap: list, threshold: float, *, keep_last: bool = True) -> tuple[list, dict]:
    """(anchor indices, {reusing index: anchor index}): segments whose members overlap their first
    site by at least `threshold`; the fewest anchors, ties to the higher total overlap. Index 0
    anchors; with keep_last the last index stays exact (neither anchor nor reuser)."""
    n = len(overlap) - (1 if keep_last and len(overlap) > 1 else 0)
    worst = (float("inf"), float("inf"))
    best: list = [worst] * (n + 1)  # best[j]: (anchors, −total overlap) covering sites 0..j-1
    choice: list = [None] * (n + 1)
    best[0] = (0, 0.0)
    for j in range(1, n + 1):
        for i in range(j):  # segment [i, j): site i anchors, i+1 .. j-1 read it
            got = [overlap[m][i] for m in range(i + 1, j)]
            if best[i] == worst or any(o is None or o < threshold for o in got):
                continue
            cand = (best[i][0] + 1, best[i][1] - sum(got))
            if cand < best[j]:
                best[j], choice[j] = cand, i
    anchors, reuse, j = [], {}, n
    while j > 0:
        i = choice[j]
        reuse.update({m: i for m in range(i + 1, j)})
        if j - i > 1:
            anchors.append(i)
        j = i
    return sorted(anchors), dict(sorted(reuse.items()))


def _key(params: Mapping[str, Any]) -> tuple:
    return tuple(params[k] for k in ("block", "top_k", "window", "sinks", "probes", "mass", "overlap"))


def measured_plan(context, params: Mapping[str, Any]) -> ReusePlan:
    """The plan for the sites of one build (made once per build and parameters, kept in context.memo)."""
    memo = context.memo.setdefault(_MEMO, {})
    key = _key(params)
    if key in memo:
        return memo[key]
    sites = sorted((s for s in context.sites if context.calls.get(s.id) and str(s.q_len) == str(s.kv_len)),
                   key=lambda s: (s.layer, s.id))
    ids = [s.id for s in sites]
    rules = {s.id: _rule(params, s.causal) for s in sites}
    overlap = overlap_matrix(ids, context.calls, rules, {s.id: float(s.scale) for s in sites},
                             {s.id: s.mask.keep_when for s in sites})
    anchors, reuse = choose_anchors(overlap, float(params["overlap"]))
    plan = ReusePlan(ids, [s.layer for s in sites], overlap, float(params["overlap"]), _rule_dict(params),
                     [ids[i] for i in anchors], {ids[m]: ids[a] for m, a in reuse.items()})
    memo[key] = plan
    return plan


def plan_report(context) -> Optional[dict]:
    """The measured plans this build made, for the report (None when none was made)."""
    memo = context.memo.get(_MEMO)
    if not memo:
        return None
    plans = [p.to_dict() for p in memo.values()]
    return plans[0] if len(plans) == 1 else {"plans": plans}


def overlap_in_use(records: Sequence, calls: Mapping[str, list], modules: Mapping[str, Any]) -> dict:
    """For the calibration report: the overlap matrix on the calibration data, under the rule of the
    reused sites, and the anchors the model uses."""
    reused = {sid: m for sid, m in modules.items() if getattr(m, "uses_anchor_qk", False)}
    params = next(iter(reused.values())).params
    sites = [r.site for r in records if r.site.id in calls and str(r.site.q_len) == str(r.site.kv_len)]
    ids = [s.id for s in sites]
    keep = {s.id: modules[s.id].geometry.keep_when if s.id in modules else s.mask.keep_when for s in sites}
    overlap = overlap_matrix(ids, calls, {s.id: _rule(params, s.causal) for s in sites},
                             {s.id: float(s.scale) for s in sites}, keep)
    reuse = {sid: m.anchor_id for sid, m in reused.items() if sid in ids}
    return {"site_ids": ids, "layers": [s.layer for s in sites], "overlap": overlap, "threshold": params["overlap"],
            "rule": _rule_dict(params), "anchors": sorted(set(reuse.values()), key=ids.index), "reuse": reuse}


def _rule(params, causal) -> BlockRule:
    probes = params["block"] if params["probes"] is None else params["probes"]
    return BlockRule(block=params["block"], top_k=params["top_k"], window=params["window"], sinks=params["sinks"],
                     probes=probes, causal=bool(causal), mass=params["mass"])


def _rule_dict(params) -> dict:
    return {k: params[k] for k in ("block", "top_k", "window", "sinks", "probes", "mass")}
