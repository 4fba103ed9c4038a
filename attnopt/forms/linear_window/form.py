"""linear+window: softmax inside a sliding window, linear attention over every other key, one normaliser.

The LoLCATs recipe: o_i = (Σ_{W(i)} e^{s q·k} v + β_h Σ_{L(i)} φ(q)·φ(k) v) / (Σ_{W(i)} e^{s q·k} + β_h Σ_{L(i)} φ(q)·φ(k)).
The window keeps what softmax does best (the local, sharp part) and the linear term carries the
long range in O(N·M·Dv). The default map is hedgehog, fitted at compile time together with the
per-head β to the site's own softmax outputs, as `linear:hedgehog` is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnopt.forms.common.base import CostAt, Param, SiteModule, io_elements, with_defaults
from attnopt.forms.common.families import FittedForm
from attnopt.forms.common.fitting import adam_fit, relative_mse, sample_rows
from attnopt.forms.linear.form import LINEAR_PARAMS, feature_count, kernel_flops, linear_state_bytes
from attnopt.forms.linear_window.decode import LinearWindowState, linear_window_decode, linear_window_step_
from attnopt.forms.linear_window.reference import linear_window_attention
from attnopt.forms.window.decode import WindowRing, ring_of, ring_ready
from attnopt.forms.window.form import WINDOW_PARAMS, WindowedForm, effective_window, visible_keys, window_cache_bytes
from attnopt.ir.masks import key_keep
from attnopt.kernels.feature_maps import make_feature_map


def log_beta_parameter(heads: int, beta: float) -> torch.nn.Parameter:
    """log β_h per query head, the weight of the part beyond the window (linear+window, gla+window):
    β_h = exp(log β_h) > 0 is learnable without a constraint."""
    start = torch.full((heads,), float(beta), dtype=torch.float64)
    return torch.nn.Parameter(torch.log(start.clamp_min(1e-30)).float(), requires_grad=False)


class LinearWindowSite(SiteModule):
    form = "linear+window"
    reads_padding_only = True

    def __init__(self, site, params):
        super().__init__(site, params)
        self.feature_map = make_feature_map(params["feature_map"], site.head_dim, site.heads,
                                            num_features=params["num_features"], seed=params["seed"])
        self.log_beta = log_beta_parameter(site.heads, params["beta"])

    def options(self) -> dict:
        g, p = self.geometry, self.params
        return {"window": effective_window(p, g.model_window), "sinks": p["sinks"], "feature_map": self.feature_map,
                "scale": g.scale, "linear_weight": torch.exp(self.log_beta) if p["beta"] > 0 else 0.0}

    def attend(self, q, k, v, keep, mask, x):
        return linear_window_attention(q, k, v, causal=self.geometry.causal, key_mask=keep, **self.options())

    def decode_step(self, q, k, v, keep, form_state):
        """The window cache plus the linear sums of the keys that left it: O(S + W + M·Dv) per token."""
        return linear_window_decode(q, k, v, form_state, key_mask=keep, **self.options())

    def decode_token(self, q, k, v, form_state):
        """The window half as a ring written in place; the keys leaving it join (S, z) in place."""
        if not isinstance(form_state.window, WindowRing):
            if not ring_ready(form_state.window):
                return None
            form_state = LinearWindowState(ring_of(form_state.window), form_state.S_BHMDv, form_state.z_BHM)
        beta = torch.exp(self.log_beta) if self.params["beta"] > 0 else torch.zeros(())
        beta_H = beta.to(device=q.device, dtype=form_state.S_BHMDv.dtype).expand(q.shape[1])
        out = linear_window_step_(q, k, v, form_state, fmap=self.feature_map, scale=self.geometry.scale, beta_H=beta_H)
        return out, form_state


@dataclass
class RowTerms:
    """What a fit step needs of one call on a set of query rows, precomputed: the window part does
    not depend on φ or β, so only the linear part is recomputed per step."""

    q: torch.Tensor  # [B, H, R, D] the query rows
    k: torch.Tensor  # [B, H, Nk, D] keys, repeated to H heads
    v: torch.Tensor  # [B, H, Nk, Dv]
    window_num: torch.Tensor  # [B, H, R, Dv] Σ_W e^{s q·k − m} v
    window_den: torch.Tensor  # [B, H, R, 1]  Σ_W e^{s q·k − m}
    linear_keys: torch.Tensor  # [B, 1, R, Nk] bool, L(i)
    shift: torch.Tensor  # [B, H, R, 1] e^{−m}
    ref: torch.Tensor  # [B, H, R, Dv] the exact output rows


def row_terms(module: "LinearWindowSite", call, rows: int = 0) -> RowTerms:
    """The formula's window sums and key sets on `rows` evenly spaced query rows (0: all), densely."""
    g, p = module.geometry, module.params
    s = sample_rows(module, call, rows)
    q, k, v, ref = s.q, s.k, s.v, s.ref
    B, nk = q.shape[0], k.shape[-2]
    keep = torch.ones(B, nk, dtype=torch.bool, device=q.device)
    if call.mask is not None:
        keep = key_keep(call.mask, g.keep_when, B, nk)
    pos = s.positions[:, None]  # [R, 1] key position of each query row
    j = torch.arange(nk, device=q.device)[None, :]
    w = effective_window(p, g.model_window)
    band = ((pos - j >= 0) & (pos - j < w)) if g.causal else ((pos - j).abs() < w)
    allowed = (j <= pos) if g.causal else torch.ones_like(band)
    sink = keep & (keep.cumsum(-1) <= p["sinks"])  # [B, Nk]: each row's first S real keys
    in_window = ((band[None] | sink[:, None, :]) & allowed[None] & keep[:, None, :])[:, None]  # [B, 1, R, Nk]
    in_linear = (allowed[None] & keep[:, None, :])[:, None] & ~in_window
    logits = g.scale * (q @ k.transpose(-1, -2))
    m = logits.masked_fill(~in_window, float("-inf")).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(in_window, torch.exp(logits - m), 0.0)
    return RowTerms(q, k, v, e @ v, e.sum(-1, keepdim=True), in_linear, torch.exp(-m), ref)


def rows_output(module: "LinearWindowSite", t: RowTerms) -> torch.Tensor:
    """The site's output on the rows of `t` with the module's current φ and β (differentiable in both)."""
    g, p = module.geometry, module.params
    beta = torch.exp(module.log_beta).to(t.q.dtype)[None, :, None, None] if p["beta"] > 0 else 0.0
    lin = module.feature_map(t.q, g.scale) @ module.feature_map(t.k, g.scale).transpose(-1, -2)
    lin = torch.where(t.linear_keys, beta * lin, 0.0) * t.shift
    den = t.window_den + lin.sum(-1, keepdim=True)
    return (t.window_num + lin @ t.v) / torch.where(den > 0, den, torch.ones_like(den))


class LinearWindowForm(WindowedForm, FittedForm):
    name = "linear+window"
    aliases = ("linear_window", "lolcats")
    summary = "softmax in a window (plus sinks), β-weighted linear attention outside it, one normaliser"
    presets = ("linear+window:64", "linear+window:64+sinks:4", "linear+window:64+map:elu")
    params = {
        **with_defaults(WINDOW_PARAMS, window=64),
        **with_defaults(LINEAR_PARAMS, feature_map="hedgehog"),
        "beta": Param(float, 1.0, minimum=0.0, doc="initial per-head weight β of the linear part (0: window only)"),
        "fit_steps": Param(int, 100, minimum=0, doc="Adam steps fitting φ and β at compile time (0: no fit)"),
    }
    preset_arg = "window"
    default_tolerance = 0.6
    cost_rank = 1

    def cost(self, site, params, B, Nq, Nk):
        H, D, Dv = site.heads, site.head_dim, site.v_head_dim
        keys = visible_keys(params, site.causal, Nk)
        M = feature_count(params["feature_map"], params["num_features"], D)
        flops = 2 * B * H * Nq * keys * (D + Dv)
        flops += kernel_flops(B, H, Nq, Nk, D, Dv, params["feature_map"], params["num_features"], causal=True)
        if not site.causal:  # the suffix scan over the reversed sequence
            flops += 2 * B * H * Nq * min(64, Nq) * (M + Dv)
        elements = B * H * Nq * keys + B * H * M * (Dv + 1) + io_elements(B, H, Nq, Nk, D, Dv)
        return CostAt(flops, elements)

    def build(self, site, params, context):
        return LinearWindowSite(site, params)

    def state_bytes(self, site, params, context, element_bytes):
        return window_cache_bytes(site, params, context, element_bytes) + linear_state_bytes(site, params, element_bytes)

    def fit(self, module, calls, *, lr: float = 3e-2, rows: int = 64, seed: int = 0):
        """φ's weights (hedgehog) and β, by Adam on the relative MSE of `rows` query rows per call."""
        steps = module.params["fit_steps"]
        weights = list(module.feature_map.parameters()) + ([module.log_beta] if module.params["beta"] > 0 else [])
        if not weights or steps == 0:
            return None
        with torch.no_grad():
            sampled_terms = [row_terms(module, c.detached(), rows) for c in calls]
            all_terms = [row_terms(module, c.detached()) for c in calls]

        def loss(sampled: bool):
            terms = sampled_terms if sampled else all_terms
            return sum(relative_mse(rows_output(module, t), t.ref) for t in terms) / len(terms)

        return adam_fit(f"{module.params['feature_map']} map and β", weights, loss, steps=steps, lr=lr, seed=seed)

    def public_ops(self):
        return {"linear_window_attention": linear_window_attention, "linear_window_decode": linear_window_decode}


FORM = LinearWindowForm()
