"""delta: the gated delta rule (Gated DeltaNet) on the site's own q, k and v, causal sites only.

    S_t = exp(g_t)(I − β_t k̂_t k̂_tᵀ)S_{t−1} + β_t k̂_t v_tᵀ,    o_t = c_h · S_tᵀ q̂_t

with q̂, k̂ the L2-normalised query and key features (Gated DeltaNet normalises SiLU features of q
and k; here φ is hedgehog by default -- learnable, one map per kv head, softmax-shaped at init -- or
the identity), so the delta rule writes v_t at the unit key k̂_t, replacing what the state held
along it. A conversion adds no projection: the gate and the write strength come from small
per-kv-head tensors read off the keys,

    g_t = logsigmoid(k_t·w_h + b_h) / 16,     β_t = σ(k̂_t·u_h + a_h),     c_h = exp(log_scale_h),

with w_h initialised to Liger's pooling (the mean of the key channels), b_h from the site's
measured look-back (the decay whose geometric weights have the exact softmax's mean look-back),
u_h = 0, a_h = logit(β) (the `beta` parameter), and the output scale c_h per query head by least
squares against the exact output, all at compile time from the recorded calls; then the fit step
trains them (attention transfer). `attnopt.calibrate` trains the same tensors on more data, and
LoRA (params="forms+lora") adapts q, k and v, which moves the gates with them.

Before all of it k and v pass Gated DeltaNet's short causal depthwise convolution (`conv` taps,
short_conv.py), the identity at init: softmax attention reads its recent tokens sharply, a unit-key
delta state blurs them, and a few learnt taps give that locality back (on the tiny LM held out,
calibrated: perplexity 4.11 without it, 3.79 with 4 taps; benchmarks/results/fidelity_gated_delta_conv.json at aec5989).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnopt.forms.common.base import CostAt, Param, SiteModule, io_elements
from attnopt.forms.common.families import FittedForm, RecurrentForm
from attnopt.forms.delta.reference import CHUNK, gated_delta_attention, gated_delta_attention_step, init_gated_delta_state
from attnopt.forms.delta.short_conv import causal_short_conv, identity_taps
from attnopt.forms.gla.form import GLA_FEATURE_MAPS, KeyGates, fit_with_init, init_gates_from_calls
from attnopt.forms.linear.form import feature_count



class DeltaSite(SiteModule):
    form = "delta"

    def __init__(self, site, params):
        super().__init__(site, params)
        p = params
        # φ per kv head and the per-head log-gate g = logsigmoid(k·w + b)/16 (w: the mean of the key channels)
        self.gates = KeyGates.of(site, p, gate="head")
        M = state_width(site, p)
        beta = min(max(float(p["beta"]), 1e-4), 1 - 1e-4)
        self.beta_proj_HkvM = nn.Parameter(torch.zeros(site.kv_heads, M), requires_grad=False)
        self.beta_bias_Hkv = nn.Parameter(torch.full((site.kv_heads,), math.log(beta / (1 - beta))), requires_grad=False)
        self.log_scale_H = nn.Parameter(torch.zeros(site.heads), requires_grad=False)
        taps = int(p["conv"])
        # one depthwise filter per kv head over the channels of [k ‖ v]; None: no convolution
        self.conv_HkvWK = (nn.Parameter(identity_taps(site.kv_heads, site.head_dim + site.v_head_dim, taps),
                                        requires_grad=False) if taps > 1 else None)

    def mix(self, k_BHkvND: Tensor, v_BHkvND: Tensor, keep: Optional[Tensor],
            history: Optional[Tensor]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """k and v through the short convolution, continuing `history` [B, Hkv, K−1, D + Dv] (None: the
        sequence starts here); returns (k, v, the history after them). Without a convolution: as given."""
        if self.conv_HkvWK is None:
            return k_BHkvND, v_BHkvND, None
        D = k_BHkvND.shape[-1]
        kv, history = causal_short_conv(torch.cat([k_BHkvND, v_BHkvND.to(k_BHkvND.dtype)], dim=-1), self.conv_HkvWK,
                                        history, keep)
        return kv[..., :D], kv[..., D:].to(v_BHkvND.dtype), history

    def inputs(self, q_BHND: Tensor, k_BHkvND: Tensor, v_BHkvND: Tensor) -> tuple[Tensor, ...]:
        """The op's (q, k, v, g, β): c_h·q̂ [B, H, N, M] (the output scale rides on the query; the op's own
        scale is 1), k̂ [B, Hkv, N, M], v, the log-gates g and the write strengths β [B, Hkv, N]."""
        phi_q, phi_k = self.gates.features(q_BHND, k_BHkvND, self.geometry.scale)
        q_hat = F.normalize(phi_q, dim=-1) * torch.exp(self.log_scale_H).to(q_BHND.dtype)[None, :, None, None]
        k_hat = F.normalize(phi_k, dim=-1)
        dt = k_hat.dtype
        beta = torch.sigmoid((k_hat * self.beta_proj_HkvM.to(dt)[None, :, None]).sum(-1)
                             + self.beta_bias_Hkv.to(dt)[None, :, None])
        return q_hat, k_hat, v_BHkvND, self.gates.log_gates(k_BHkvND), beta

    def attend(self, q, k, v, keep, mask, x):
        k, v, _ = self.mix(k, v, keep, None)
        return gated_delta_attention(*self.inputs(q, k, v), scale=1.0, key_mask=keep)

    def decode_step(self, q, k, v, keep, form_state):
        """The delta-rule state S [B, Hkv, M, Dv], O(M·Dv) per token and kv head; with the convolution
        the form state is (S, its history [B, Hkv, K−1, D + Dv])."""
        S, history = form_state if self.conv_HkvWK is not None and form_state is not None else (form_state, None)
        k, v, history = self.mix(k, v, keep, history)
        q_hat, k_hat, v, g, beta = self.inputs(q, k, v)
        if S is None:
            S = init_gated_delta_state(q.shape[0], k.shape[1], k_hat.shape[-1], v.shape[-1], dtype=q.dtype,
                                       device=q.device)
        if q.shape[2] == 1 and k.shape[2] == 1:
            out, S = gated_delta_attention_step(q_hat, k_hat, v, g, beta, S, scale=1.0, key_mask=keep)
        else:
            out, S = gated_delta_attention(q_hat, k_hat, v, g, beta, scale=1.0, key_mask=keep, state=S)
        return out, (S if history is None else (S, history))


def init_from_calls(module: DeltaSite, calls: list) -> None:
    """The gate bias from the calls' look-back, then each query head's output scale by least squares."""
    init_gates_from_calls(module, module.gates, calls)
    module.log_scale_H.zero_()
    dot, sq = 0.0, 0.0
    for c in calls:
        out, ref = module(c.q, c.k, c.v, c.mask), c.out
        if out.dim() == 3:
            out, ref = module.unfold_heads(out), module.unfold_heads(ref)
        dot = dot + (out.double() * ref.double()).sum(dim=(0, 2, 3))
        sq = sq + (out.double() ** 2).sum(dim=(0, 2, 3))
    scale = (torch.as_tensor(dot) / torch.as_tensor(sq).clamp_min(1e-30)).clamp(1e-3, 1e3)
    module.log_scale_H.copy_(torch.log(scale).float())


def state_width(site, params) -> int:
    """M, the width of k̂: D for the identity, the feature map's width otherwise."""
    if params["feature_map"] == "identity":
        return site.head_dim
    return feature_count(params["feature_map"], params["num_features"], site.head_dim)


class DeltaForm(RecurrentForm, FittedForm):
    name = "delta"
    aliases = ("gated_delta", "gdn")
    summary = "gated delta rule on L2-normalised q/k, gates and β from small per-head tensors; causal sites only"
    presets = ("delta", "delta:0.5")
    params = {
        # 0.9: on the tiny LM held out, β = 0.9 gave 6.75 / 4.10 perplexity (training-free / calibrated)
        # against 6.83 / 4.21 for 0.5 (benchmarks/results/fidelity_gated.json at 0fd6a0f, rows "delta:0.9" and "delta").
        "beta": Param(float, 0.9, minimum=0.0001, maximum=0.9999, doc="initial write strength β (its bias: logit β)"),
        "feature_map": Param(str, "hedgehog", choices=("identity",) + GLA_FEATURE_MAPS,
                             doc="φ before the L2 norm (hedgehog: learnable; identity: q and k themselves)"),
        "num_features": Param(int, 0, minimum=0, doc="hedgehog projection width P (0: D); φ has 2·P features"),
        "seed": Param(int, 0, doc="seed of the hedgehog init columns beyond D"),
        "conv": Param(int, 4, minimum=0, doc="taps of the short causal convolution on k and v, the identity at init "
                                             "(0 or 1: none)"),
        "fit_steps": Param(int, 100, minimum=0, doc="Adam steps fitting φ, the gates, β and the output scale (0: none)"),
    }
    preset_arg = "beta"
    default_tolerance = 0.8

    def cost(self, site, params, B, Nq, Nk):
        H, Hkv, D, Dv = site.heads, site.kv_heads, site.head_dim, site.v_head_dim
        M = state_width(site, params)
        C = min(CHUNK, max(Nk, 1))
        flops = 2 * B * Hkv * Nk * (3 * M * Dv + C * (M + Dv))  # state updates, the WY transform per chunk
        flops += 2 * B * H * Nq * (M * Dv + C * (M + Dv)) + 6 * B * Hkv * Nk * M  # reads, norms and gates
        if params["feature_map"] == "hedgehog":
            flops += 2 * B * (H * Nq + Hkv * Nk) * D * (M // 2)
        if params["conv"] > 1:
            flops += 2 * B * Hkv * Nk * (D + Dv) * params["conv"]
        return CostAt(flops, B * Hkv * M * Dv + B * Hkv * Nk * C + io_elements(B, H, Nq, Nk, D, Dv))

    def build(self, site, params, context):
        return DeltaSite(site, params)

    def state_bytes(self, site, params, context, element_bytes):
        own = site.kv_heads * state_width(site, params) * site.v_head_dim * max(element_bytes, 4)  # fp32 state
        return own + site.kv_heads * max(params["conv"] - 1, 0) * (site.head_dim + site.v_head_dim) * element_bytes

    def fit(self, module, calls, *, lr: float = 3e-2, seed: int = 0):
        """Closed-form start from the calls, then Adam on the gates, β and the output scale."""
        steps = module.params["fit_steps"]
        if not calls or steps == 0:
            return None
        return fit_with_init("key gates, β and output scale", module, calls, lambda: init_from_calls(module, calls),
                             list(module.parameters()), steps=steps, lr=lr, seed=seed)

    def public_ops(self):
        return {"gated_delta_attention": gated_delta_attention,
                "gated_delta_attention_step": gated_delta_attention_step,
                "init_gated_delta_state": init_gated_delta_state}


FORM = DeltaForm()
