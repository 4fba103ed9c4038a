"""gla: gated linear attention whose gates come from the site's own keys (Liger's recipe), causal only.

    S_t = diag(exp g_t) S_{t−1} + φ(k_t) v_tᵀ,  z_t = exp(g_t) ⊙ z_{t−1} + φ(k_t),  o_t = φ(q_t)ᵀS_t / φ(q_t)ᵀz_t

Gates. Liger (Lan et al., ICML 2025) adds no gate projection: it pools the key projection's output
to the gate width and squashes it, g_t = logsigmoid(pool(k_t)) / 16. Here the pooling is a small
learnable matrix per kv head, initialised to exactly that pooling (AdaptiveAvgPool1d from D to the
gate width: the identity per channel, the mean per head), plus a per-channel bias, so

    g_t = logsigmoid(k_t P_h + b_h) / 16        (P_h [D, Mg], b_h [Mg]; Mg = M per channel, 1 per head)

and nothing new reads the layer input. The bias is set at compile time from the site's own
activations: the exact softmax's mean look-back on the recorded calls gives each kv head the decay
γ whose geometric weights have that mean (γ/(1 − γ) = mean lag), and b = logit(γ^16) − mean(k P)
puts the typical gate there. The fit step then trains φ, P and b on the recorded calls (attention
transfer); `attnopt.calibrate` trains the same tensors on more data, and LoRA (params="forms+lora")
adapts k itself, which moves the gates with it.

φ is hedgehog by default (one learnable map per kv head, so K/V are never repeated; initialised to
softmax over the scaled coordinates, Liger's own choice of map, and its mirror) or elu / relu.
The normaliser (default on) keeps the output a weighted mean of the values before any training;
normalize=False is Liger's unnormalised form with scale 1.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from attnopt.forms.common.base import CostAt, FitResult, Param, SiteModule, io_elements
from attnopt.forms.common.families import FittedForm, RecurrentForm
from attnopt.forms.common.fitting import adam_fit, relative_mse, sample_rows
from attnopt.forms.common.plain_autograd import plain_autograd
from attnopt.forms.gla.reference import (
    gated_linear_attention,
    gated_linear_attention_step,
    init_gated_linear_state,
)
from attnopt.forms.linear.form import feature_count, kernel_flops
from attnopt.ir.masks import key_keep
from attnopt.kernels.feature_maps import make_feature_map

GATE_NORMALIZER = 16.0  # Liger's gate_logit_normalizer: g = logsigmoid(·) / 16
# k P + b is clamped to ±60 before the logsigmoid: g = logsigmoid(x) / 16 then lies in [−3.75, 0] (a decay
# of at least 0.024 per token, below DECAY_RANGE's 0.05), so a fit or calibration step that drives x far
# out leaves the gates finite with no gradient pushing x further, and a chunk of 16 tokens never spans
# more than 60 of decay: the ops' two-matmul chunks (gla.reference.factored_chunk) serve every gate.
GATE_PRE_LIMIT = 60.0
GLA_FEATURE_MAPS = ("hedgehog", "elu", "relu")  # names of attnopt.kernels.feature_maps the gated forms accept
DECAY_RANGE = (0.05, 0.9995)  # the decays a compile-time initialisation may pick

GLA_PARAMS = {
    "feature_map": Param(str, "hedgehog", choices=GLA_FEATURE_MAPS, doc="φ applied to q and k (hedgehog: learnable)"),
    "num_features": Param(int, 0, minimum=0, doc="hedgehog projection width P (0: D); φ has 2·P features"),
    "seed": Param(int, 0, doc="seed of the hedgehog init columns beyond D"),
    "gate": Param(str, "channel", choices=("channel", "head"), doc="one gate per feature channel (GLA) or per head"),
    "fit_steps": Param(int, 100, minimum=0, doc="Adam steps fitting φ and the gates at compile time (0: no fit)"),
}


def pooling_matrix(D: int, width: int) -> Tensor:
    """AdaptiveAvgPool1d(width) over D channels as a [D, width] matrix (float64)."""
    P = torch.zeros(D, width, dtype=torch.float64)
    for i in range(width):
        lo, hi = (i * D) // width, -(-((i + 1) * D) // width)
        P[lo:hi, i] = 1.0 / (hi - lo)
    return P


class KeyGates(nn.Module):
    """φ and the log-gates of a gated site, both from the site's own q and k (per kv head)."""

    def __init__(self, head_dim: int, kv_heads: int, feature_map: str, num_features: int, seed: int, gate: str):
        super().__init__()
        self.feature_map = None if feature_map == "identity" else make_feature_map(
            feature_map, head_dim, kv_heads, num_features=num_features, seed=seed)  # identity: φ(x) = x
        self.per_channel = gate == "channel"
        M = head_dim if self.feature_map is None else self.feature_map.num_features(head_dim)
        if not self.per_channel:
            pool = pooling_matrix(head_dim, 1)
        elif feature_map == "hedgehog":  # both halves of φ read projected channel m: pool D -> P twice
            half = pooling_matrix(head_dim, M // 2)
            pool = torch.cat([half, half], dim=1)
        else:
            pool = pooling_matrix(head_dim, M)
        width = pool.shape[1]
        self.gate_proj_HkvDG = nn.Parameter(pool.expand(kv_heads, head_dim, width).clone().float(), requires_grad=False)
        self.gate_bias_HkvG = nn.Parameter(torch.zeros(kv_heads, width), requires_grad=False)

    @classmethod
    def of(cls, site, params, gate: Optional[str] = None) -> "KeyGates":
        """The gates a site's parameters describe (`gate` overrides params["gate"])."""
        return cls(site.head_dim, site.kv_heads, params["feature_map"], params["num_features"], params["seed"],
                   gate or params["gate"])

    def features(self, q_BHND: Tensor, k_BHkvND: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """φ(q) [B, H, Nq, M] and φ(k) [B, Hkv, Nk, M]: the map of a kv head serves its G query heads."""
        if self.feature_map is None:
            return q_BHND, k_BHkvND
        weight = self.feature_map.op_weight()
        if weight is None:
            return self.feature_map.features(q_BHND, scale, None), self.feature_map.features(k_BHkvND, scale, None)
        G = q_BHND.shape[1] // k_BHkvND.shape[1]
        w_q = weight.repeat_interleave(G, dim=0) if G > 1 else weight
        return self.feature_map.features(q_BHND, scale, w_q), self.feature_map.features(k_BHkvND, scale, weight)

    def pre_activation(self, k_BHkvND: Tensor) -> Tensor:
        """k P_h + b_h [B, Hkv, Nk, Mg]."""
        proj = self.gate_proj_HkvDG.to(k_BHkvND.dtype)
        return k_BHkvND @ proj[None] + self.gate_bias_HkvG.to(k_BHkvND.dtype)[None, :, None, :]

    def log_gates(self, k_BHkvND: Tensor) -> Tensor:
        """g = logsigmoid(clamp(k P + b, ±60)) / 16 in [−3.75, 0]: [B, Hkv, Nk, M] per channel, [B, Hkv, Nk] per head.
        Written min(x, 0) − log(1 + e^{−|x|}): exported, F.logsigmoid becomes Log(Sigmoid(x)), and ONNX
        Runtime's Sigmoid is 0 from x = −18 (2× off at −17): −inf for a gate bias fitted to a short look-back."""
        x = self.pre_activation(k_BHkvND).clamp(-GATE_PRE_LIMIT, GATE_PRE_LIMIT)
        g = (x.clamp(max=0.0) - torch.log1p(torch.exp(-x.abs()))) / GATE_NORMALIZER
        return g if self.per_channel else g[..., 0]


def mean_lags(module: SiteModule, calls: list, offset: int = 0, rows: int = 64) -> Tensor:
    """Per query head [H] (float64): the exact softmax's mean look-back beyond `offset` keys,
    E[i − j − offset | i − j >= offset], over `rows` evenly spaced queries of each recorded call
    (queries in the first half of a call are left out: their look-back is cut short)."""
    g = module.geometry
    total, count = 0.0, 0.0
    for call in calls:
        s = sample_rows(module, call.detached(), rows)
        nk = s.k.shape[-2]
        logits = g.scale * (s.q.double() @ s.k.double().transpose(-1, -2))  # [B, H, R, Nk]
        lag = s.positions[:, None] - torch.arange(nk, device=s.q.device)[None, :]  # [R, Nk]
        allowed = lag >= 0
        if call.mask is not None:
            keep = key_keep(call.mask, g.keep_when, logits.shape[0], nk)
            allowed = allowed[None, None] & keep[:, None, None, :]
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        p = torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))  # a pad query sees no key
        tail = (lag >= offset).to(p.dtype)
        mass = (p * tail).sum(-1)
        mean = (p * tail * (lag - offset).clamp_min(0).to(p.dtype)).sum(-1) / mass.clamp_min(1e-30)
        late = (s.positions >= nk // 2).to(p.dtype)[None, None, :] * (mass > 1e-12)  # [B, H, R]
        total = total + (mean * late).sum(dim=(0, 2))
        count = count + late.sum(dim=(0, 2))
    return total / torch.as_tensor(count).clamp_min(1.0)


def decay_for_lag(lag_H: Tensor) -> Tensor:
    """The γ whose geometric weights γ^t have mean look-back `lag`: γ = lag / (1 + lag), clamped."""
    return (lag_H / (1.0 + lag_H)).clamp(*DECAY_RANGE)


def gate_bias_for(decay: Tensor) -> Tensor:
    """b with logsigmoid(b) / 16 = log γ, i.e. σ(b) = γ^16."""
    a = decay.double() ** GATE_NORMALIZER
    return torch.log(a) - torch.log1p(-a)


def per_kv_head(x_H: Tensor, kv_heads: int) -> Tensor:
    return x_H.reshape(kv_heads, -1).mean(dim=1)


def module_loss(module: SiteModule, calls: list) -> Tensor:
    """Mean relative MSE of the module's output against the exact one on the recorded calls."""
    return sum(relative_mse(module(c.q, c.k, c.v, c.mask), c.out) for c in calls) / len(calls)


def fit_with_init(what: str, module: SiteModule, calls: list, init, params: list, *, steps: int,
                  lr: float = 3e-2, seed: int = 0, loss_on=None) -> FitResult:
    """`init()` (a closed-form start from the calls), then Adam on `params` against the module's own
    output (the op: exact, O(N) memory, and at compile-time lengths as fast as any dense shortcut);
    never hands back a module worse than the one it was given (relative RMS on all calls).
    `loss_on(calls)` may give a zero-argument loss equal to `module_loss` that precomputes what the
    fitted tensors do not change (default: module_loss itself)."""
    calls = [c.detached() for c in calls]
    with torch.no_grad():
        loss = loss_on(calls) if loss_on is not None else (lambda: module_loss(module, calls))
        before = float(loss()) ** 0.5
        start = [p.detach().clone() for p in params]
        init()

    with plain_autograd():
        result = adam_fit(what, params, lambda sampled: loss(), steps=steps, lr=lr, seed=seed)
    if not result.rel_rms_after <= before:
        with torch.no_grad():
            for p, kept in zip(params, start):
                p.copy_(kept)
        return FitResult(what, before, before, result.steps)
    return FitResult(what, before, result.rel_rms_after, result.steps)


def init_gates_from_calls(module: SiteModule, gates: KeyGates, calls: list, offset: int = 0) -> None:
    """Bias b so that each kv head's typical gate is the decay of its measured look-back (in place)."""
    kv = gates.gate_bias_HkvG.shape[0]
    target = gate_bias_for(decay_for_lag(per_kv_head(mean_lags(module, calls, offset), kv)))  # [Hkv]
    pre = []
    for c in calls:
        k = c.k if c.k.dim() == 4 else module.unfold_heads(c.k)
        pre.append((gates.pre_activation(k.detach().float()) - gates.gate_bias_HkvG[None, :, None, :]).mean(dim=(0, 2)))
    centre = torch.stack(pre).mean(0)  # [Hkv, Mg] mean of k P
    gates.gate_bias_HkvG.copy_((target[:, None].float() - centre).to(gates.gate_bias_HkvG.dtype))


class GlaSite(SiteModule):
    form = "gla"

    def __init__(self, site, params):
        super().__init__(site, params)
        self.gates = KeyGates.of(site, params)

    def inputs(self, q, k):
        """The op's featurised inputs: φ(q) [B, H, N, M], φ(k) [B, Hkv, N, M] and the log-gates g."""
        phi_q, phi_k = self.gates.features(q, k, self.geometry.scale)
        return phi_q, phi_k, self.gates.log_gates(k)

    def _options(self) -> dict:
        return {"feature_map": "identity", "normalize": self.params["normalize"], "scale": 1.0,
                "eps": self.params["eps"]}

    def attend(self, q, k, v, keep, mask, x):
        phi_q, phi_k, g = self.inputs(q, k)
        return gated_linear_attention(phi_q, phi_k, v, g, key_mask=keep, **self._options())

    def decode_step(self, q, k, v, keep, form_state):
        """The gated state (S [B, Hkv, M, Dv], z [B, Hkv, M]): O(M·Dv) per token and kv head."""
        phi_q, phi_k, g = self.inputs(q, k)
        if form_state is None:
            form_state = init_gated_linear_state(q.shape[0], k.shape[1], phi_k.shape[-1], v.shape[-1],
                                                 normalize=self.params["normalize"], dtype=q.dtype, device=q.device)
        elif q.shape[2] == 1 and k.shape[2] == 1:
            return gated_linear_attention_step(phi_q, phi_k, v, g, form_state, key_mask=keep, **self._options())
        return gated_linear_attention(phi_q, phi_k, v, g, key_mask=keep, state=form_state, **self._options())


def gla_flops(site, params, B: int, Nq: int, Nk: int) -> float:
    """Featurise, gate, build the state and read it (+ the in-chunk blocks), per kv head for K/V."""
    H, Hkv, D, Dv = site.heads, site.kv_heads, site.head_dim, site.v_head_dim
    M = feature_count(params["feature_map"], params["num_features"], D)
    flops = kernel_flops(B, H, Nq, 0, D, Dv, params["feature_map"], params["num_features"], causal=True)
    flops += kernel_flops(B, Hkv, 0, Nk, D, Dv, params["feature_map"], params["num_features"], causal=False)
    Mg = M if params["gate"] == "channel" else 1
    return flops + 2 * B * Hkv * Nk * D * Mg + 4 * B * Hkv * Nk * Mg  # gate projection, logsigmoid and exp


class GlaForm(RecurrentForm, FittedForm):
    name = "gla"
    aliases = ("gated_linear",)
    summary = "gated linear attention, per-channel gates pooled from the keys (Liger); causal sites only"
    presets = ("gla", "gla:elu", "gla+gate:head")
    params = {
        **GLA_PARAMS,
        "normalize": Param(bool, True, doc="divide by the gated φ(q)ᵀz (off: Liger's unnormalised form, scale 1)"),
        "eps": Param(float, 1e-6, minimum=0.0, doc="added to the denominator φ(q)ᵀz"),
    }
    preset_arg = "feature_map"
    default_tolerance = 0.8

    def cost(self, site, params, B, Nq, Nk):
        M = feature_count(params["feature_map"], params["num_features"], site.head_dim)
        elements = B * site.kv_heads * M * (site.v_head_dim + 1) + B * site.kv_heads * Nk * M
        return CostAt(gla_flops(site, params, B, Nq, Nk),
                      elements + io_elements(B, site.heads, Nq, Nk, site.head_dim, site.v_head_dim))

    def build(self, site, params, context):
        return GlaSite(site, params)

    def state_bytes(self, site, params, context, element_bytes):
        M = feature_count(params["feature_map"], params["num_features"], site.head_dim)
        return site.kv_heads * M * (site.v_head_dim + int(params["normalize"])) * max(element_bytes, 4)

    def fit(self, module, calls, *, lr: float = 3e-2, seed: int = 0):
        """Gate bias from the calls' look-back, then φ, the pooling and the bias by Adam on the calls."""
        steps = module.params["fit_steps"]
        if not calls or steps == 0:
            return None
        gates = module.gates
        return fit_with_init(f"{module.params['feature_map']} map and key gates", module, calls,
                             lambda: init_gates_from_calls(module, gates, calls), list(gates.parameters()),
                             steps=steps, lr=lr, seed=seed)

    def public_ops(self):
        return {"gated_linear_attention": gated_linear_attention,
                "gated_linear_attention_step": gated_linear_attention_step,
                "init_gated_linear_state": init_gated_linear_state}


FORM = GlaForm()
