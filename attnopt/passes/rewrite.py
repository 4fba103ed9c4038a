"""Rewrite pass: each planned site becomes a `RewrittenSite` module that calls its form's op.

The same module serves both rewrite mechanisms: spliced into a captured FX graph (`rewrite_graph`)
or called from the Hugging Face attention interface (`attnopt.hf`). It takes the site's tensors in
the layout the site was found in and returns the attention output in that layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from attnopt.passes.masks import exact_attention, key_keep
from attnopt.passes.site import AttentionSite


class SiteUnsupported(ValueError):
    """A planned form cannot be built for this site by this rewrite mechanism; the message says why."""


@dataclass(frozen=True)
class SiteGeometry:
    """What a rewritten site must know about the attention it replaces (copied from AttentionSite)."""

    site_id: str
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    model_window: Optional[int]  # the model's own sliding window, if any
    keep_when: str

    @classmethod
    def of(cls, site: AttentionSite) -> "SiteGeometry":
        return cls(
            site_id=site.id,
            heads=site.heads,
            kv_heads=site.kv_heads,
            head_dim=site.head_dim,
            scale=float(site.scale),
            causal=bool(site.causal),
            model_window=site.window,
            keep_when=site.mask.keep_when,
        )


def _run_linear(mod: "RewrittenSite", q, k, v, keep):
    from attnopt.kernels.linear import linear_attention

    p = mod.params
    return linear_attention(
        q, k, v, feature_map=mod.feature_map, causal=mod.geometry.causal, scale=mod.geometry.scale,
        eps=p["eps"], key_mask=keep,
    )


def _run_window(mod: "RewrittenSite", q, k, v, keep):
    from attnopt.kernels.window import window_attention

    g, p = mod.geometry, mod.params
    # A model that already slides a window keeps its own when it is the narrower one.
    window = p["window"] if g.model_window is None else min(p["window"], g.model_window)
    return window_attention(q, k, v, window=window, causal=g.causal, sinks=p["sinks"], scale=g.scale, key_mask=keep)


def _run_ssm(mod: "RewrittenSite", q, k, v, keep):
    from attnopt.kernels.decay import decay_attention

    p = mod.params
    return decay_attention(
        q, k, v, decay=mod.decay, feature_map=p["feature_map"], normalize=p["normalize"],
        scale=mod.geometry.scale, key_mask=keep,
    )


def _run_reuse(mod: "RewrittenSite", q, k, v, keep, mask=None, x=None):
    # q and k are the anchor layer's (wired in by the caller): softmax(s_a·q_a k_aᵀ + mask_l) v_l,
    # plus s_a·(x_l A)(x_l B)ᵀ when the site carries a low-rank residual.
    g = mod.geometry
    if mod.residual_A is None:
        return exact_attention(q, k, v, mask, keep_when=g.keep_when, is_causal=g.causal and mask is None, scale=mod.anchor_scale)
    from attnopt.kernels.reuse import reuse_attention

    if x is None:
        raise ValueError(f"site {g.site_id}: reuse with a residual needs the layer input x")
    if q.shape[-2] == k.shape[-2] == x.shape[-2]:
        return reuse_attention(q, k, v, x, mod.residual_A, mod.residual_B, scale=mod.anchor_scale, causal=g.causal, key_mask=keep)
    # Decoding: x covers every key (the cached x of earlier tokens + this step's); the queries are the
    # last Nq of them. Same logits, s_a·[q_a, x A]·[k_a, x B]ᵀ, built explicitly for Nq < Nk.
    ones = x.new_ones(x.shape[:-1] + (1,))
    xh = torch.cat([x, ones], dim=-1).unsqueeze(1)  # [B, 1, Nk, C+1]
    A, B_ = mod.residual_A.to(x.dtype), mod.residual_B.to(x.dtype)
    groups = q.shape[1] // k.shape[1]
    k_full = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    q2 = torch.cat([q, (xh[:, :, -q.shape[-2]:] @ A)], dim=-1)
    k2 = torch.cat([k_full, xh @ B_], dim=-1)
    v_full = v.repeat_interleave(groups, dim=1) if groups > 1 else v
    return exact_attention(q2, k2, v_full, mask, keep_when=g.keep_when, is_causal=g.causal and mask is None, scale=mod.anchor_scale)


# One entry per form in attnopt.passes.forms.FORMS (except "exact").
FORM_RUNNERS: dict[str, Callable] = {
    "linear": _run_linear,
    "window": _run_window,
    "ssm": _run_ssm,
    "reuse": _run_reuse,
}


def _decay_vector(decay, heads: int) -> torch.Tensor:
    from attnopt.kernels.decay import retnet_decay

    if isinstance(decay, str):
        if decay != "retnet":
            raise ValueError(f"ssm decay {decay!r}: expected 'retnet', a float in (0, 1], or one float per head")
        return retnet_decay(heads).to(torch.float64)
    if isinstance(decay, (int, float)):
        return torch.full((heads,), float(decay), dtype=torch.float64)
    values = torch.tensor([float(x) for x in decay], dtype=torch.float64)
    if values.numel() != heads:
        raise ValueError(f"ssm decay lists {values.numel()} values but the site has {heads} heads")
    return values


class RewrittenSite(nn.Module):
    """One site in its planned form, exact below `min_seq_len` (and always for form "exact")."""

    def __init__(self, site: AttentionSite, form: str, params: dict, anchor: Optional[AttentionSite] = None,
                 residual: Optional[tuple] = None):
        super().__init__()
        self.geometry = SiteGeometry.of(site)
        self.form = form
        self.params = dict(params)
        self.min_seq_len = int(params.get("min_seq_len", 0) or 0)
        self.feature_map = None
        self.anchor_id = anchor.id if anchor is not None else None
        self.anchor_scale = float(anchor.scale) if anchor is not None else self.geometry.scale
        if form == "linear":
            from attnopt.kernels.feature_maps import make_feature_map

            self.feature_map = make_feature_map(
                params["feature_map"], site.head_dim, site.heads, num_features=params["num_features"], seed=params["seed"]
            )
        if form == "ssm":
            self.register_buffer("decay", _decay_vector(params["decay"], site.heads), persistent=False)
        if form == "reuse" and anchor is None:
            raise ValueError(f"site {site.id}: the reuse form needs an anchor site")
        # Low-rank residual factors (A, B) [H, C+1, r] of the reuse form; None for pure reuse.
        self.register_buffer("residual_A", residual[0] if residual else None)
        self.register_buffer("residual_B", residual[1] if residual else None)

    def extra_repr(self) -> str:
        return f"site={self.geometry.site_id!r}, form={self.form!r}, params={self.params}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                x: Optional[torch.Tensor] = None):
        g = self.geometry
        if self.form == "exact" or q.shape[-2] < self.min_seq_len:
            return self._exact(q, k, v, mask)
        squeeze = q.dim() == 3
        if squeeze:  # bmm spelling [B*H, N, D]: heads are folded into the batch
            q, k, v = self._unfold_heads(q), self._unfold_heads(k), self._unfold_heads(v)
        keep = None
        if mask is not None:  # padding may appear at run time even if the example had none
            keep = key_keep(mask, g.keep_when, q.shape[0], k.shape[-2], rank=4 if not squeeze else 3)
            if squeeze and keep is not None:
                keep = keep.reshape(q.shape[0], -1, k.shape[-2])[:, 0] if keep.shape[0] != q.shape[0] else keep
        if self.form == "reuse":
            out = _run_reuse(self, q, k, v, keep, mask=mask if not squeeze else None, x=x)
        else:
            out = FORM_RUNNERS[self.form](self, q, k, v, keep)
        if squeeze:
            out = out.reshape(-1, out.shape[-2], out.shape[-1])
        return out

    def _unfold_heads(self, x: torch.Tensor) -> torch.Tensor:
        h = self.geometry.heads if x.shape[0] % max(self.geometry.heads, 1) == 0 else 1
        return x.reshape(x.shape[0] // h, h, x.shape[-2], x.shape[-1])

    def _exact(self, q, k, v, mask):
        g = self.geometry
        # No mask tensor on a causal site: causality came as a flag (SDPA is_causal, or HF skipping
        # a mask it could prove unneeded).
        return exact_attention(q, k, v, mask, keep_when=g.keep_when, is_causal=mask is None and g.causal, scale=g.scale)


def rewrite_graph(graph_module: torch.fx.GraphModule, sites: list, modules: dict) -> torch.fx.GraphModule:
    """Replace each site whose id is in `modules` by a call to its RewrittenSite, in place.

    `modules` maps site id -> RewrittenSite; a reuse site's module is called with its anchor's q and
    k nodes instead of its own. Dead nodes of the old chains are removed afterwards.
    """
    by_id = {s.id: s for s in sites}
    nodes = {n.name: n for n in graph_module.graph.nodes}
    graph = graph_module.graph
    for i, (site_id, module) in enumerate(modules.items()):
        site = by_id[site_id]
        sn = site.nodes
        qsite = by_id[module.anchor_id] if module.anchor_id else site
        q, k = nodes[qsite.nodes.query], nodes[qsite.nodes.key]
        v = nodes[sn.value]
        out = nodes[sn.output]
        mask = nodes[sn.mask] if sn.mask else None
        name = f"attnopt_site_{i}"
        graph_module.add_submodule(name, module)
        with graph.inserting_before(out):
            if qsite.nodes.key_is_transposed:
                k = graph.call_function(torch.ops.aten.transpose.int, (k, -2, -1))
            new = graph.call_module(name, (q, k, v, mask))
        new.meta.update({k_: v_ for k_, v_ in out.meta.items() if k_ in ("nn_module_stack", "stack_trace", "val")})
        out.replace_all_uses_with(new)
    graph.eliminate_dead_code()
    graph.lint()
    graph_module.recompile()
    return graph_module
