"""linear: kernelised attention o_i = φ(q_i)ᵀS / (φ(q_i)ᵀz + ε), S = Σ φ(k_j)v_jᵀ, z = Σ φ(k_j).

O(N·M·Dv) instead of O(N²·D). Fixed maps (elu, relu, favor, taylor) need no data; hedgehog is
fitted to the site's own softmax outputs at compile time (attention transfer, as in LoLCATs).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from attnopt.forms.common.base import CostAt, Form, Param, SiteModule, io_elements, no_arbitrary_mask
from attnopt.forms.common.fitting import adam_fit, relative_mse, sample_rows
from attnopt.forms.linear.reference import default_chunk, linear_attention
from attnopt.ir.masks import key_keep
from attnopt.kernels.feature_maps import FEATURE_MAP_NAMES, favor_projection, make_feature_map
from attnopt.kernels.layout import compute_dtype
from attnopt.kernels.normaliser import packed_state, split_state
from attnopt.kernels.token_step import PackedStateStep, elu_plus_one


def feature_count(feature_map: str, num_features: int, D: int) -> int:
    """M, the width of φ(x), for a feature map and head dim D (num_features 0 = the map's default)."""
    if feature_map in ("elu", "relu", "identity"):
        return D
    if feature_map == "favor":
        return num_features or 2 * D
    if feature_map == "hedgehog":
        return 2 * (num_features or D)  # softmax over [Wx, −Wx]: twice the projected width
    if feature_map == "taylor":
        return 1 + D + D * D  # 2nd-order Taylor expansion of exp(qᵀk): 1, x, x⊗x
    raise ValueError(f"unknown feature map {feature_map!r}; known: identity, {', '.join(FEATURE_MAP_NAMES)}")


def kernel_flops(B: int, H: int, Nq: int, Nk: int, D: int, Dv: int, feature_map: str, num_features: int,
                 causal: bool, chunk: Optional[int] = None) -> float:
    """FLOPs of linear attention: featurise, build the state, read it per query (+ in-chunk blocks of
    `chunk` rows, by default the linear op's `default_chunk`)."""
    M = feature_count(feature_map, num_features, D)
    flops = 2 * B * H * M * (Dv + 1) * (Nq + Nk)
    if feature_map in ("favor", "hedgehog"):  # random / learned projection of q and k
        flops += 2 * B * H * (Nq + Nk) * D * (M // 2 if feature_map == "hedgehog" else M)
    if causal:  # masked C×C products inside each chunk of the scan
        flops += 2 * B * H * Nq * min(chunk or default_chunk(M), Nq) * (M + Dv)
    return flops


def linear_state_bytes(site, params, element_bytes: int) -> int:
    """One row's (S, z) per query head: M·(Dv + 1) accumulators each, in fp32 at least."""
    M = feature_count(params["feature_map"], params["num_features"], site.head_dim)
    return site.heads * M * (site.v_head_dim + 1) * max(element_bytes, 4)


LINEAR_PARAMS = {
    "feature_map": Param(str, "elu", choices=FEATURE_MAP_NAMES, doc="kernel feature map φ"),
    "num_features": Param(int, 0, minimum=0, doc="feature count for favor/hedgehog (0: 2·D for favor, D for hedgehog)"),
    "seed": Param(int, 0, doc="seed of the FAVOR+ projection / hedgehog init"),
}


class LinearSite(SiteModule):
    form = "linear"
    reads_padding_only = True
    attend_output_is_fresh = True

    def __init__(self, site, params):
        super().__init__(site, params)
        self.feature_map = make_feature_map(params["feature_map"], site.head_dim, site.heads,
                                            num_features=params["num_features"], seed=params["seed"])

    @property
    def eps(self) -> float:
        eps = self.params.get("eps")
        return (0.0 if self.params["feature_map"] == "favor" else 1e-6) if eps is None else float(eps)

    def attend(self, q, k, v, keep, mask, x):
        g = self.geometry
        return linear_attention(q, k, v, feature_map=self.feature_map, causal=g.causal, scale=g.scale,
                                eps=self.eps, key_mask=keep)

    def decode_step(self, q, k, v, keep, form_state):
        """The prefix sums (S [B, H, M, Dv], z [B, H, M]) of φ(k)vᵀ and φ(k): O(M·Dv) per token and head."""
        g = self.geometry
        if form_state is None:
            B, H, M, Dv = q.shape[0], q.shape[1], self.feature_map.num_features(g.head_dim), v.shape[-1]
            cdt = compute_dtype(q.dtype)
            form_state = (q.new_zeros(B, H, M, Dv, dtype=cdt), q.new_zeros(B, H, M, dtype=cdt))
        return linear_attention(q, k, v, feature_map=self.feature_map, causal=True, scale=g.scale,
                                eps=self.eps, key_mask=keep, state=form_state)

    def token_stepper(self, form_state, q, k):
        """(S, z) as views of one [S ‖ z] buffer, advanced in place (FAVOR+: none; its key stabiliser
        is per call)."""
        fmap = self.feature_map
        if fmap.name == "favor":
            return None
        cdt = compute_dtype(q.dtype)
        T_BHMW = packed_state(*form_state, cdt)
        Dv = T_BHMW.shape[-1] - 1
        weight = fmap.op_weight()
        weight = None if weight is None else weight.to(device=q.device, dtype=cdt)
        if fmap.name == "elu":
            features = elu_plus_one
        else:
            features = functools.partial(type(fmap).features, scale=self.geometry.scale, weight=weight)
        return PackedStateStep(T_BHMW, split_state(T_BHMW, Dv, True), q.dtype, features,
                               kv_heads=k.shape[1], per_head=fmap.per_head, eps=self.eps,
                               guard_zero=self.eps < torch.finfo(cdt).tiny)


def quadratic_linear(module: LinearSite, call, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The site's linear attention in explicit N×N form, o = (A v) / (A 1 + ε) with A = φ(q)φ(k)ᵀ.

    The op's output, but the fastest to differentiate at compile-time lengths (the op's backward
    recomputes a chunked scan). With `rows`, only that many evenly spaced query rows are evaluated
    (rows are independent). Returns (output, matching target rows).
    """
    g = module.geometry
    s = sample_rows(module, call, rows)
    a = module.feature_map(s.q, g.scale) @ module.feature_map(s.k, g.scale).transpose(-2, -1)  # [B, H, R, Nk]
    if call.mask is not None:
        a = a * key_keep(call.mask, g.keep_when, a.shape[0], a.shape[-1])[:, None, None, :]
    if g.causal:
        a = a * (torch.arange(a.shape[-1], device=a.device)[None, :] <= s.positions[:, None])
    out = (a @ s.v) / (a.sum(-1, keepdim=True) + module.eps)
    return out, s.ref


class LinearForm(Form):
    name = "linear"
    summary = "kernelised attention φ(q)ᵀS / (φ(q)ᵀz + ε), O(N·D·M)"
    presets = ("linear", "linear:favor", "linear:hedgehog", "linear:taylor", "linear:relu")
    params = {
        **LINEAR_PARAMS,
        "eps": Param((float, type(None)), None, minimum=0.0,
                     doc="added to the denominator φ(q)ᵀz (null: 1e-6; 0 for favor, whose kernel is positive and "
                         "whose stabilised units would make a split run differ from a whole one)"),
    }
    preset_arg = "feature_map"
    preset_keys = {"map": "feature_map"}
    default_tolerance = 0.8
    cost_rank = 0
    auto_params = {"feature_map": "elu"}

    def check_site(self, site, params, sites):
        return no_arbitrary_mask(site)

    def cost(self, site, params, B, Nq, Nk):
        H, D, Dv = site.heads, site.head_dim, site.v_head_dim
        M = feature_count(params["feature_map"], params["num_features"], D)
        flops = kernel_flops(B, H, Nq, Nk, D, Dv, params["feature_map"], params["num_features"], site.causal)
        return CostAt(flops, B * H * M * (Dv + 1) + io_elements(B, H, Nq, Nk, D, Dv))

    def build(self, site, params, context):
        return LinearSite(site, params)

    def state_bytes(self, site, params, context, element_bytes):
        return linear_state_bytes(site, params, element_bytes)

    def public_ops(self):
        return {"linear_attention": linear_attention, "make_feature_map": make_feature_map,
                "favor_projection": favor_projection}

    def fit(self, module, calls, *, steps: int = 100, lr: float = 3e-2, rows: int = 64, seed: int = 0):
        """Hedgehog: Adam on the map's weights over `rows` query rows per call (fixed maps: None)."""
        weights = list(module.feature_map.parameters())
        if not weights:
            return None
        calls = [c.detached() for c in calls]

        def loss(sampled: bool):
            return sum(relative_mse(*quadratic_linear(module, c, rows if sampled else 0)) for c in calls) / len(calls)

        return adam_fit(f"{module.params['feature_map']} map", weights, loss, steps=steps, lr=lr, seed=seed)


FORM = LinearForm()
