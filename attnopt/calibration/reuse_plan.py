"""Reuse planning from measurement: which layers may borrow an earlier layer's attention pattern.

On calibration data, `drift[l][a]` is how far site l's output moves when it attends with site a's
q and k instead of its own (pure reuse: softmax(s_a q_a k_aᵀ) v_l against the exact output, relative
RMS, worst over batches). The plan cuts the layer chain into segments: the first site of a segment
computes its own q and k (an anchor), every later site of it reuses that anchor, and each reusing
site's drift must stay within the budget. Dynamic programming over the chain finds the plan with
the fewest anchors (most reuse), ties going to the lower total drift. The residuals of the chosen
sites are then fitted by `attnopt.calibrate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from attnopt.calibration.targets import record_targets
from attnopt.compiler import compile as attnopt_compile
from attnopt.ir.batch import as_batch
from attnopt.ir.errors import CalibrationError
from attnopt.ir.masks import exact_attention
from attnopt.targets import target_of


@dataclass
class ReusePlan:
    """The measured drift matrix and the chosen anchors; `policy` compiles it."""

    site_ids: list
    layers: list
    drift: list  # drift[l][a]: pure-reuse drift of site l on site a's q, k (None: a >= l or shapes differ)
    budget: float
    anchors: list = field(default_factory=list)  # site ids that compute their own q, k
    reuse: dict = field(default_factory=dict)  # site id -> anchor site id
    rank: int = 8

    @property
    def policy(self) -> dict:
        """A policy dict for attnopt.compile: each reusing layer borrows its anchor's layer, rank-r residual."""
        layer_of = dict(zip(self.site_ids, self.layers))
        rules = [{"layers": str(layer_of[s]), "form": "reuse", "anchor": int(layer_of[a]), "rank": self.rank}
                 for s, a in self.reuse.items()]
        return {"name": f"reuse plan (budget {self.budget:g})", "rules": rules}

    def to_dict(self) -> dict:
        return {**asdict(self), "policy": self.policy}


def drift_matrix(site_ids: Sequence[str], calls: dict, geometry: dict) -> list:
    """drift[l][a] over the recorded calls; `geometry[sid]` = (heads, kv_heads, head_dim, causal, scale, keep_when)."""
    n = len(site_ids)
    out: list = [[None] * n for _ in range(n)]
    for li, l in enumerate(site_ids):
        for ai, a in enumerate(site_ids[:li]):
            if geometry[a][:4] != geometry[l][:4] or len(calls.get(a, [])) != len(calls.get(l, [])) or not calls.get(l):
                continue
            worst = 0.0
            for ca, cl in zip(calls[a], calls[l]):
                if ca.q.shape != cl.q.shape or ca.k.shape != cl.k.shape:
                    worst = None
                    break
                _, _, _, causal, scale_a, keep_when = geometry[a]
                o = exact_attention(ca.q, ca.k, cl.v, cl.mask, keep_when=keep_when,
                                    is_causal=causal and cl.mask is None, scale=scale_a)
                d = ((o.double() - cl.out.double()).norm() / cl.out.double().norm().clamp_min(1e-30)).item()
                worst = max(worst, d)
            out[li][ai] = worst
    return out


def choose_anchors(drift: list, budget: float) -> tuple[list, dict]:
    """(anchor indices, {reusing index: anchor index}) minimising anchors, then total drift."""
    n = len(drift)
    inf = (float("inf"), float("inf"))
    best: list = [inf] * (n + 1)  # best[j]: (anchors, total drift) covering sites 0..j-1
    choice: list = [None] * (n + 1)
    best[0] = (0, 0.0)
    for j in range(1, n + 1):
        for i in range(j):  # segment [i, j): anchor i, sites i+1..j-1 reuse it
            ds = [drift[m][i] for m in range(i + 1, j)]
            if any(d is None or d > budget for d in ds) or best[i] == inf:
                continue
            cand = (best[i][0] + 1, best[i][1] + sum(ds))
            if cand < best[j]:
                best[j], choice[j] = cand, i
    anchors, reuse, j = [], {}, n
    while j > 0:
        i = choice[j]
        anchors.append(i)
        reuse.update({m: i for m in range(i + 1, j)})
        j = i
    return sorted(anchors), dict(sorted(reuse.items()))


def plan_reuse(model, batches: Sequence[Any], *, budget: float = 0.5, rank: int = 8) -> ReusePlan:
    """Measure cross-layer reuse drift on `batches` and choose anchors within `budget`.

    `model` is the original model (or a compiled one); compile the returned `plan.policy` and run
    `attnopt.calibrate` to fit the residuals.
    """

    if not batches:
        raise CalibrationError("plan_reuse needs at least one batch of model inputs")
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not budget > 0:
        raise CalibrationError(f"budget must be a number > 0 (relative RMS drift of a reusing site); got {budget!r}")
    compiled = model
    if getattr(model, "attnopt_report", None) is None:
        compiled = attnopt_compile(model, "exact", example_inputs=batches[0], e2e_tolerance=None)

    report = compiled.attnopt_report
    targets = record_targets(compiled, [as_batch(b, f"batches[{i}]") for i, b in enumerate(batches)], report)
    sites = [target_of(compiled).adapt_site(r.site) for r in report.sites if r.site.id in targets.calls]
    ids = [s.id for s in sites]
    geometry = {s.id: (s.heads, s.kv_heads, s.head_dim, s.causal, float(s.scale), s.mask.keep_when) for s in sites}
    drift = drift_matrix(ids, targets.calls, geometry)
    anchors, reuse = choose_anchors(drift, float(budget))
    return ReusePlan(ids, [s.layer for s in sites], drift, float(budget), [ids[i] for i in anchors],
                     {ids[m]: ids[a] for m, a in reuse.items()}, rank)


def reuse_matrix_in_use(records: Sequence, calls: dict, modules: dict) -> dict:
    """For the report: the drift matrix on the calibration data and the anchors the model uses."""
    sites = [r.site for r in records if r.site.id in calls]
    ids = [s.id for s in sites]
    keep = {sid: m.geometry.keep_when for sid, m in modules.items()}
    geometry = {s.id: (s.heads, s.kv_heads, s.head_dim, s.causal, float(s.scale), keep.get(s.id, s.mask.keep_when))
                for s in sites}
    in_use = {sid: m.anchor_id for sid, m in modules.items() if m.uses_anchor_qk and sid in geometry}
    return {"site_ids": ids, "layers": [s.layer for s in sites], "drift": drift_matrix(ids, calls, geometry),
            "reuse": in_use}
