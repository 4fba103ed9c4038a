"""gla+window: softmax in a sliding window (plus sinks), gated linear attention beyond it, one normaliser.

Liger's hybrid (Lan et al., ICML 2025) pairs a window of softmax attention with GLA whose gates
are pooled from the keys. The two are combined here under ONE normaliser, as linear+window
(LoLCATs) combines its parts: oᵢ = (Σ_W e^{s·q·k} v + β_h Σ_L aᵢⱼ v) / (Σ_W e^{s·q·k} + β_h Σ_L aᵢⱼ),
with aᵢⱼ the gated kernel of the keys that left the window (`reference.py`). Measured on the tiny
LM held out (benchmarks/gla_window_mixing.py), this beat Liger's fixed ½·window + ½·GLA, training-free
and calibrated (the README has the numbers). φ and the gates are those of `gla` (KeyGates); the
gate bias starts from the site's measured look-back *beyond the window*, β_h from `beta`, and the
fit step trains φ, the gates and β on the recorded calls.
"""

from __future__ import annotations

import torch

from attnopt.forms.common.base import CostAt, Param, SiteModule, io_elements, with_defaults
from attnopt.forms.common.families import FittedForm, RecurrentForm
from attnopt.forms.common.fitting import relative_mse
from attnopt.forms.gla.form import GLA_PARAMS, KeyGates, fit_with_init, gla_flops, init_gates_from_calls, module_loss
from attnopt.forms.gla_window.decode import gla_window_decode
from attnopt.forms.gla_window.reference import CHUNK, beta_tensor, gla_window_attention, window_part, with_gated_part
from attnopt.forms.linear.form import feature_count
from attnopt.forms.linear_window.form import log_beta_parameter
from attnopt.forms.window.form import WINDOW_PARAMS, WindowedForm, effective_window, visible_keys, window_cache_bytes
from attnopt.ir.masks import key_keep


class GlaWindowSite(SiteModule):
    form = "gla+window"

    def __init__(self, site, params):
        super().__init__(site, params)
        self.gates = KeyGates.of(site, params)
        self.log_beta = log_beta_parameter(site.heads, params["beta"])

    def beta(self):
        return torch.exp(self.log_beta) if self.params["beta"] > 0 else 0.0

    def options(self) -> dict:
        g, p = self.geometry, self.params
        return {"window": effective_window(p, g.model_window), "sinks": p["sinks"], "scale": g.scale,
                "linear_weight": self.beta()}

    def attend(self, q, k, v, keep, mask, x):
        phi_q, phi_k = self.gates.features(q, k, self.geometry.scale)
        return gla_window_attention(q, k, v, phi_q, phi_k, self.gates.log_gates(k), key_mask=keep, **self.options())

    def decode_step(self, q, k, v, keep, form_state):
        """The window cache, the gated state of the keys that left it and their decayed features:
        O(S + W + M·Dv) per token and kv head."""
        phi_q, phi_k = self.gates.features(q, k, self.geometry.scale)
        return gla_window_decode(q, k, v, phi_q, phi_k, self.gates.log_gates(k), form_state, key_mask=keep,
                                 **self.options())


def window_fixed_loss(module: GlaWindowSite, calls: list):
    """The fit's loss (`gla.form.module_loss`'s value) with each call's window softmax computed once:
    it reads only q, k and v, none of the fitted φ, gates or β, and was a third of every fit step."""
    if module.min_seq_len:  # an exact prefix: the module's own forward decides per row
        return lambda: module_loss(module, calls)
    geo, opts = module.geometry, module.options()
    terms = []
    with torch.no_grad():
        for c in calls:
            q, k, v = (c.q, c.k, c.v) if c.q.dim() == 4 else (module.unfold_heads(t) for t in (c.q, c.k, c.v))
            ref = c.out if c.out.dim() == 4 else module.unfold_heads(c.out)
            keep = key_keep(c.mask, geo.keep_when, q.shape[0], k.shape[-2]) if c.mask is not None else None
            o_w, lse = window_part(q, k, v, keep, opts["window"], opts["sinks"], opts["scale"])
            terms.append((q, k, v, keep, o_w, lse, ref))

    def loss():
        total = 0.0
        for q, k, v, keep, o_w, lse, ref in terms:
            phi_q, phi_k = module.gates.features(q, k, geo.scale)
            beta = beta_tensor(module.beta(), q.shape[1], q)
            out = with_gated_part(o_w, lse, v, phi_q, phi_k, module.gates.log_gates(k), beta, keep, opts["window"],
                                  opts["sinks"], CHUNK)
            total = total + relative_mse(out.to(ref.dtype), ref)
        return total / len(terms)

    return loss


class GlaWindowForm(RecurrentForm, WindowedForm, FittedForm):
    name = "gla+window"
    aliases = ("gla_window", "liger")
    summary = "softmax in a window (plus sinks), key-gated linear attention beyond it, one normaliser"
    presets = ("gla+window:64", "gla+window:64+sinks:4")
    params = {
        **with_defaults(WINDOW_PARAMS, window=64),
        **GLA_PARAMS,
        "beta": Param(float, 1.0, minimum=0.0, doc="initial per-head weight β of the gated part (0: window only)"),
    }
    preset_arg = "window"
    default_tolerance = 0.6

    def cost(self, site, params, B, Nq, Nk):
        H, Hkv, D, Dv = site.heads, site.kv_heads, site.head_dim, site.v_head_dim
        keys = visible_keys(params, True, Nk)
        M = feature_count(params["feature_map"], params["num_features"], D)
        flops = 2 * B * H * Nq * keys * (D + Dv) + gla_flops(site, params, B, Nq, Nk)
        elements = B * H * Nq * keys + B * Hkv * M * (Dv + 1) + B * Hkv * Nk * M
        return CostAt(flops, elements + io_elements(B, H, Nq, Nk, D, Dv))

    def build(self, site, params, context):
        return GlaWindowSite(site, params)

    def state_bytes(self, site, params, context, element_bytes):
        M = feature_count(params["feature_map"], params["num_features"], site.head_dim)
        buffered = min(context, effective_window(params, site.window) - 1)  # the buffered keys' decayed φ(k)
        gated = site.kv_heads * M * (site.v_head_dim + 1 + buffered) * max(element_bytes, 4)
        return window_cache_bytes(site, params, context, element_bytes) + gated

    def fit(self, module, calls, *, lr: float = 3e-2, seed: int = 0):
        """Gate bias from the look-back beyond the window, then φ, the gates and β by Adam on the calls."""
        steps = module.params["fit_steps"]
        if not calls or steps == 0:
            return None
        gates = module.gates
        weights = list(gates.parameters()) + ([module.log_beta] if module.params["beta"] > 0 else [])
        window = module.options()["window"]
        return fit_with_init(f"{module.params['feature_map']} map, key gates and β", module, calls,
                             lambda: init_gates_from_calls(module, gates, calls, offset=window), weights,
                             steps=steps, lr=lr, seed=seed, loss_on=lambda cs: window_fixed_loss(module, cs))

    def public_ops(self):
        return {"gla_window_attention": gla_window_attention, "gla_window_decode": gla_window_decode}


FORM = GlaWindowForm()
