"""Verify pass: how far each rewritten site and the whole model moved, and which sites to revert.

Per site, the rewritten op runs on the ORIGINAL upstream activations recorded from the exact model
(q, k, v, mask of that site), so a site's drift is its own approximation error, not the sum of
everything upstream. End to end, the rewritten model runs on the same inputs as the original.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree

from attnopt.passes.records import Drift, OutputDrift


@dataclass
class SiteCall:
    """One recorded call of a site: its inputs in the site's layout and the exact output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    out: torch.Tensor  # [B, H, Nq, Dv] (or the site's rank-3 layout)
    x: Optional[torch.Tensor] = None  # the layer's input to its q projection [B, N, C], when recorded


class NodeRecorder(torch.fx.Interpreter):
    """Runs a whole graph and keeps the values of the named nodes (the sites' inputs and outputs)."""

    def __init__(self, gm: torch.fx.GraphModule, names: set):
        super().__init__(gm, garbage_collect_values=True)
        self.names = names
        self.kept: dict = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        if n.name in self.names:
            self.kept[n.name] = value
        return value


def drift(out: torch.Tensor, ref: torch.Tensor) -> Drift:
    """Relative RMS ‖out−ref‖/‖ref‖, cosine, max |out−ref| (float64); non-finite output flagged."""
    a = out.detach().to(torch.float64).reshape(-1)
    b = ref.detach().to(torch.float64).reshape(-1)
    finite = bool(torch.isfinite(a).all())
    if not finite:
        return Drift(rel_rms=float("inf"), cosine=float("nan"), max_abs=float("inf"), finite=False)
    diff = a - b
    ref_norm = float(b.norm())
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    denom = float(a.norm()) * ref_norm
    cos = float(a @ b) / denom if denom > 0 else (1.0 if float(diff.norm()) == 0 else 0.0)
    return Drift(rel_rms=rel, cosine=cos, max_abs=float(diff.abs().max()) if diff.numel() else 0.0, finite=True)


def worst(drifts: list[Drift]) -> Drift:
    """The worst of several drifts (one per recorded batch)."""
    return Drift(
        rel_rms=max(d.rel_rms for d in drifts),
        cosine=min(d.cosine for d in drifts),
        max_abs=max(d.max_abs for d in drifts),
        finite=all(d.finite for d in drifts),
    )


@torch.no_grad()
def site_drift(module: torch.nn.Module, calls: list[SiteCall], anchor_calls: Optional[list[SiteCall]] = None) -> Drift:
    """Drift of `module` (a RewrittenSite) over the recorded calls of its site.

    For a reuse site the anchor's recorded q and k stand in for the site's own.
    """
    drifts = []
    for i, call in enumerate(calls):
        q, k = call.q, call.k
        if anchor_calls is not None:
            q, k = anchor_calls[i].q, anchor_calls[i].k
        out = module(q, k, call.v, call.mask, x=call.x)
        drifts.append(drift(out, call.out))
    return worst(drifts)


def judge(d: Drift, tolerance: float) -> tuple[bool, str]:
    """Accept or revert a site drift, with the reason in words."""
    if not d.finite:
        return False, "output has NaN/Inf: reverted to exact"
    if d.rel_rms > tolerance:
        return False, f"drift {d.rel_rms:.3g} > tolerance {tolerance:.3g}: reverted to exact"
    return True, f"drift {d.rel_rms:.3g} <= tolerance {tolerance:.3g}"


def _leaves(output: Any) -> list[tuple[str, torch.Tensor]]:
    flat, _ = pytree.tree_flatten_with_path(output)
    out = []
    for path, leaf in flat:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            out.append((pytree.keystr(path) or "output", leaf))
    return out


def _hidden_states(output: Any) -> Optional[torch.Tensor]:
    hs = getattr(output, "last_hidden_state", None)
    if hs is None and isinstance(output, dict):
        hs = output.get("last_hidden_state")
    return hs if isinstance(hs, torch.Tensor) and hs.dim() == 3 else None


def embedding_cosine(out: Any, ref: Any, attention_mask: Optional[torch.Tensor]) -> Optional[float]:
    """Mean cosine of mean-pooled token states (sentence-transformers pooling), when the output has them."""
    a, b = _hidden_states(out), _hidden_states(ref)
    if a is None or b is None or a.shape != b.shape:
        return None
    if attention_mask is not None and attention_mask.shape == a.shape[:2]:
        w = attention_mask.to(torch.float64).unsqueeze(-1)
    else:
        w = torch.ones(a.shape[:2] + (1,), dtype=torch.float64)
    pa = (a.double() * w).sum(1) / w.sum(1).clamp_min(1)
    pb = (b.double() * w).sum(1) / w.sum(1).clamp_min(1)
    return float(torch.nn.functional.cosine_similarity(pa, pb, dim=-1).mean())


def output_drift(outs: list[Any], refs: list[Any], attention_masks: list[Optional[torch.Tensor]]) -> OutputDrift:
    """End-to-end drift over batches: per output leaf (worst over batches) and the worst leaf."""
    per: dict[str, list[Drift]] = {}
    cosines = []
    for out, ref, am in zip(outs, refs, attention_masks):
        ref_leaves = dict(_leaves(ref))
        for name, leaf in _leaves(out):
            if name in ref_leaves and ref_leaves[name].shape == leaf.shape:
                per.setdefault(name, []).append(drift(leaf, ref_leaves[name]))
        c = embedding_cosine(out, ref, am)
        if c is not None:
            cosines.append(c)
    per_output = {k: worst(v) for k, v in per.items()}
    worst_leaf = max(per_output.values(), key=lambda d: d.rel_rms, default=None)
    return OutputDrift(
        per_output=per_output,
        worst=worst_leaf,
        embedding_cosine=sum(cosines) / len(cosines) if cosines else None,
    )
