"""ssm: a decayed recurrent state S_t = γ·S_{t−1} + φ(k_t)v_tᵀ (retention / SSM); causal by construction.

Per head γ_h (RetNet's 1 − 2^(−5−h) by default). With `normalize`, the output is divided by the
decayed φ(q)ᵀz as linear attention is, which keeps it on the scale of softmax outputs.
"""

from __future__ import annotations

import math

import torch

from attnopt.forms.common.base import CostAt, Param, SiteModule, io_elements
from attnopt.forms.common.families import RecurrentForm
from attnopt.forms.linear.form import feature_count, kernel_flops
from attnopt.forms.ssm.reference import (
    CHUNK,
    DECAY_FEATURE_MAPS,
    decay_attention,
    decay_attention_step,
    decay_features,
    init_decay_state,
    retnet_decay,
)
from attnopt.ir.errors import PolicyError
from attnopt.kernels.layout import compute_dtype
from attnopt.kernels.normaliser import packed_state, split_state
from attnopt.kernels.token_step import PackedStateStep


def decay_vector(decay, heads: int) -> torch.Tensor:
    """The per-head γ [H] (float64) of a validated `decay` parameter."""
    if isinstance(decay, str):
        return retnet_decay(heads).to(torch.float64)
    if isinstance(decay, (int, float)):
        return torch.full((heads,), float(decay), dtype=torch.float64)
    values = torch.tensor([float(x) for x in decay], dtype=torch.float64)
    if values.numel() != heads:
        raise ValueError(f"ssm decay lists {values.numel()} values but the site has {heads} heads")
    return values


class SsmSite(SiteModule):
    form = "ssm"
    reads_padding_only = True

    def __init__(self, site, params):
        super().__init__(site, params)
        self.register_buffer("decay", decay_vector(params["decay"], site.heads), persistent=False)

    def attend(self, q, k, v, keep, mask, x):
        p = self.params
        return decay_attention(q, k, v, decay=self.decay, feature_map=p["feature_map"], normalize=p["normalize"],
                               scale=self.geometry.scale, key_mask=keep)

    def decode_step(self, q, k, v, keep, form_state):
        """The decayed state S_t = γ S_{t−1} + φ(k_t)v_tᵀ (and z_t when normalising): O(D·Dv) per token and head."""
        p = self.params
        if form_state is None:
            form_state = init_decay_state(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1], normalize=p["normalize"],
                                          dtype=q.dtype, device=q.device)
        elif q.shape[2] == 1 and (keep is None or bool(keep.all())):  # one real token: the O(1) recurrence
            return decay_attention_step(q, k, v, form_state, decay=self.decay, feature_map=p["feature_map"],
                                        normalize=p["normalize"], scale=self.geometry.scale)
        return decay_attention(q, k, v, decay=self.decay, feature_map=p["feature_map"], normalize=p["normalize"],
                               scale=self.geometry.scale, key_mask=keep, state=form_state)

    def token_stepper(self, form_state, q, k):
        """The recurrence on one [S ‖ z] buffer (S alone without normalising), decayed and advanced in place."""
        p = self.params
        cdt = compute_dtype(q.dtype)
        packed = packed_state(*form_state, cdt)
        state = split_state(packed, packed.shape[-1] - 1, p["normalize"])
        scale = self.geometry.scale
        return PackedStateStep(packed, state, q.dtype, decay_features(p["feature_map"]), kv_heads=k.shape[1],
                               normalize=p["normalize"], eps=1e-6, guard_zero=p["feature_map"] == "identity",
                               decay_H=self.decay.to(q.device),
                               out_scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale))


class SsmForm(RecurrentForm):
    name = "ssm"
    aliases = ("recurrent", "retention")
    summary = "decayed recurrent state S_t = γ S_{t−1} + φ(k_t) v_tᵀ (causal sites only)"
    presets = ("ssm", "ssm:0.95")
    params = {
        "decay": Param((str, float, list, tuple), "retnet", doc="'retnet' (γ_h = 1 − 2^(−5−h)), one γ, or one γ per head"),
        "feature_map": Param(str, "elu", choices=DECAY_FEATURE_MAPS, doc="φ applied to q and k"),
        "normalize": Param(bool, True, doc="divide by the decayed φ(q)ᵀz, as linear attention does"),
    }
    preset_arg = "decay"
    default_tolerance = 0.8
    auto_params = {}

    def check_params(self, params):
        decay = params["decay"]
        if isinstance(decay, str):
            if decay != "retnet":
                raise PolicyError(f"form 'ssm': parameter 'decay' got {decay!r}; allowed: 'retnet', a γ in (0, 1], or one γ per head")
            return
        values = [decay] if isinstance(decay, (int, float)) else list(decay)
        for g in values:
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < float(g) <= 1.0:
                raise PolicyError(f"form 'ssm': parameter 'decay' got {decay!r}; every γ must lie in (0, 1] (1 = no decay)")

    def cost(self, site, params, B, Nq, Nk):
        H, D, Dv = site.heads, site.head_dim, site.v_head_dim
        M = feature_count(params["feature_map"], 0, D)
        flops = kernel_flops(B, H, Nq, Nk, D, Dv, params["feature_map"], 0, causal=True, chunk=CHUNK)
        return CostAt(flops, B * H * M * (Dv + 1) + io_elements(B, H, Nq, Nk, D, Dv))

    def build(self, site, params, context):
        return SsmSite(site, params)

    def state_bytes(self, site, params, context, element_bytes):
        return site.heads * site.head_dim * (site.v_head_dim + int(params["normalize"])) * max(element_bytes, 4)

    def public_ops(self):
        return {"decay_attention": decay_attention, "decay_attention_step": decay_attention_step,
                "retnet_decay": retnet_decay, "init_decay_state": init_decay_state}


FORM = SsmForm()
