"""The measured plan: which layers anchor and which reuse, from the seed's observation on the user's data.

Every site selects blocks on the recorded calls (selection.py's rule, its own q and k). The overlap
of site l with an earlier site a is the share of l's attention rows that a's selection serves: rows
where no key block left out of a's blocks holds MISSED_TARGET of the row's exact attention, in l's
worst head, over the query blocks that choose and the batches ("adjacent layers attend to the same
positions", measured where it matters). A row whose mass is spread loses little when some of it is
left out; a row that looks at one far block (a retrieval, an induction head) loses its answer.
Measured on recall_lm: layer 1 (an induction layer) shares 75% of its top-16 blocks with layer 0,
as much as the layers that reuse harmlessly, yet reading layer 0's blocks cut its hidden recall to
0.73 of the original; by this measure it scores 0.80 on layer 0, the other layers 0.99 or more.
The plan cuts the layer chain into segments: the first site of a segment anchors (exact attention,
selecting), the others read its selection, each with overlap at least the threshold. The first and
the last site stay exact. Dynamic programming finds the fewest anchors, ties going to the higher
total overlap.

Letters: B batch, H query heads, Hkv key heads, N positions, C query rows of one chunk, J key
blocks, M query blocks, K slots.
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
    overlap: list  # overlap[l][a], a < l: share of site l's rows a's blocks serve (None: not comparable)
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
                    "the measured plan keeps it exact: no earlier layer's blocks serve enough of its attention rows")
        return "the measured plan keeps it exact"

    def to_dict(self) -> dict:
        return asdict(self)


# A row loses its target when one block left out holds this share of its exact attention. 0.5 let
# recall_lm's induction layer through at 0.94 (threshold 0.95); 0.3 scores it 0.80 and still serves
# 94-98% of MiniLM's rows, whose attention is spread (its cosine stays 0.99 where they are reused).
MISSED_TARGET = 0.3
# Attention rows scored at once while measuring (scores of a chunk: B·H·C·N floats).
SCORES_PER_CHUNK = 1 << 24


@dataclass
class _Measured:
    """One recorded call of one site, in position space: its q and k, real keys, and its selection."""

    q_BHND: torch.Tensor
    k_BHkvND: torch.Tensor
    keep_BN: Optional[torch.Tensor]
    scale: float
    rule: BlockRule
    blocks_BMK: torch.Tensor  # its own selection (what it hands the layers that read it)
    rows_BN: torch.Tensor  # bool: real queries in a query block that chooses (the others read everything)


def measure_call(q_BHND: torch.Tensor, k_BHkvND: torch.Tensor, keep_BN: Optional[torch.Tensor], rule: BlockRule,
                 scale: float) -> _Measured:
    """A recorded call moved to position space, with its own selection under `rule`."""
    offsets = leading_pads(keep_BN)
    keep_pos = positions_keep(keep_BN, offsets)
    q, k = to_positions(q_BHND, offsets), to_positions(k_BHkvND, offsets)
    blocks = select_positions(q, k, keep_pos, rule, scale)
    B, N = q.shape[0], q.shape[2]
    M = blocks.shape[1]
    chooses = torch.tensor([rule.candidates(m, M) > rule.fits for m in range(M)], device=q.device)
    rows = chooses.repeat_interleave(rule.block)[:N].expand(B, N)
    if keep_pos is not None:
        rows = rows & keep_pos
    return _Measured(q, k, keep_pos, float(scale), rule, blocks, rows)


def served_rows(site: _Measured, anchors: Sequence[_Measured]) -> list[tuple[float, int]]:
    """For each anchor: (share of the site's choosing rows whose heaviest block outside the anchor's
    selection holds less than MISSED_TARGET of their exact attention, in the site's worst head; rows
    counted). Exact attention of the site's own q and k, causal or not as its rule, padding left out,
    in chunks of rows."""
    q, k, keep = site.q_BHND, site.k_BHkvND, site.keep_BN
    B, H, N, D = q.shape
    G = H // k.shape[1]
    b = site.rule.block
    J = -(-N // b)
    served = [torch.zeros(B, H, dtype=torch.float64, device=q.device) for _ in anchors]
    step = max(1, SCORES_PER_CHUNK // max(1, B * H * N))
    cols = torch.arange(N, device=q.device)
    for c0 in range(0, N, step):
        c1 = min(N, c0 + step)
        s = torch.einsum("bhcd,bhnd->bhcn", q[:, :, c0:c1].float(), k.float().repeat_interleave(G, 1)) * site.scale
        visible = torch.ones(c1 - c0, N, dtype=torch.bool, device=q.device)
        if site.rule.causal:
            visible = cols[None, :] <= torch.arange(c0, c1, device=q.device)[:, None]
        visible = visible[None, None] if keep is None else visible[None, None] & keep[:, None, None, :]
        p = torch.softmax(s.masked_fill(~visible, -torch.inf), dim=-1).nan_to_num(0.0)
        mass = torch.nn.functional.pad(p, (0, J * b - N)).view(B, H, c1 - c0, J, b).sum(-1)  # [B, H, C, J]
        mass = torch.nn.functional.pad(mass, (0, 1))  # column J: an empty slot's zero
        rows = site.rows_BN[:, c0:c1]
        block_of_row = torch.arange(c0, c1, device=q.device) // b
        for i, a in enumerate(anchors):
            ids = a.blocks_BMK[:, block_of_row]  # [B, C, K]
            read = torch.zeros(B, c1 - c0, J + 1, dtype=torch.bool, device=q.device)
            read.scatter_(-1, torch.where(ids >= 0, ids, J), True)
            missed = mass.masked_fill(read[:, None], 0.0).amax(-1)  # [B, H, C]: the heaviest block left out
            served[i] += ((missed < MISSED_TARGET) & rows[:, None]).sum(-1)
    counted = site.rows_BN.sum(-1)  # [B]
    total = int(counted.sum())
    # The worst head over the whole data: per head, its served rows summed over the batch.
    return [(float((x.sum(0) / total).min()) if total else 0.0, total) for x in served]


def overlap_matrix(site_ids: Sequence[str], calls: Mapping[str, list], rules: Mapping[str, BlockRule],
                   scales: Mapping[str, float], keep_when: Mapping[str, str]) -> list:
    """overlap[l][a] for a < l over the recorded calls (None: different shapes, or no row chooses)."""
    measured: dict = {}
    for sid in site_ids:
        per_call = []
        for c in calls.get(sid, []):
            keep = key_keep(c.mask, keep_when[sid], c.q.shape[0], c.k.shape[-2]) if c.mask is not None else None
            per_call.append(measure_call(c.q, c.k, keep, rules[sid], scales[sid]))
        measured[sid] = per_call
    n = len(site_ids)
    out: list = [[None] * n for _ in range(n)]
    for li, l in enumerate(site_ids):
        mine = measured[l]
        earlier = [ai for ai, a in enumerate(site_ids[:li]) if len(measured[a]) == len(mine) and mine
                   and all(x.blocks_BMK.shape == y.blocks_BMK.shape for x, y in zip(mine, measured[a]))]
        if not earlier:
            continue
        hit, total = [0.0] * len(earlier), 0
        for ci, call in enumerate(mine):
            got = served_rows(call, [measured[site_ids[ai]][ci] for ai in earlier])
            for i, (share, rows) in enumerate(got):
                hit[i] += share * rows
            total += got[0][1]
        for i, ai in enumerate(earlier):
            out[li][ai] = hit[i] / total if total else None
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
    # Layers whose model slides its own window neither anchor nor reuse (form.can_anchor, check_site).
    sites = sorted((s for s in context.sites if context.calls.get(s.id) and str(s.q_len) == str(s.kv_len)
                    and s.window is None),
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
