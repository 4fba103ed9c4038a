"""gla in a decode graph: the gated state S ‖ z as one tensor (`attnopt::gla_step`).

States: recurrent_state [B, Hkv, M, W] float32 -- S = Σ_j exp(Σ_{j<s<=T} g_s) φ(k_j) v_jᵀ in the
first Dv columns and, when normalising, the gated Σ φ(k) in the last (W = Dv + 1, else Dv), one per
kv head (φ and the gates are per kv head, so the G query heads of a group read one state) -- and
conv_state [B, 1, 1] int64, the real tokens absorbed. A pad neither adds nor decays (its φ(k) and
log-gate are 0), as the torch op does. Fixed size at every context.

φ(q), φ(k) and the log-gates are computed outside the step op, by the site's own KeyGates (plain
torch ops: the exporter lowers them), so the op and its lowering see only featurised inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnopt.forms.common.graph import (
    BATCH,
    GraphStep,
    StateSpec,
    StepSite,
    add_real_tokens,
    count_spec,
    new_keep,
)
from attnopt.forms.gla.reference import gated_linear_attention


@torch.library.custom_op("attnopt::gla_step", mutates_args=())
def gla_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, mask: Tensor, state: Tensor, count: Tensor,
             normalize: bool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gated linear attention of the new tokens from the carried state; returns (out, present state, count)."""
    keep = new_keep(mask, phi_q.shape[2])
    Dv = v.shape[-1]
    S, z = (state[..., :Dv], state[..., Dv]) if normalize else (state, None)
    out, (S, z) = gated_linear_attention(phi_q, phi_k, v, g, feature_map="identity", normalize=normalize, scale=1.0,
                                         eps=eps, key_mask=keep, state=(S, z))
    present = torch.cat([S, z[..., None]], dim=-1) if normalize else S
    return out.contiguous(), present.to(state.dtype).contiguous(), add_real_tokens(count, keep)


@gla_step.register_fake
def _(phi_q, phi_k, v, g, mask, state, count, normalize, eps):
    return (phi_q.new_empty(phi_q.shape[0], phi_q.shape[1], phi_q.shape[2], v.shape[-1]), state.new_empty(state.shape),
            count.new_empty(count.shape))


def width(module) -> int:
    """M, the width of φ (the head dim for the identity)."""
    fm = module.gates.feature_map
    return module.geometry.head_dim if fm is None else fm.num_features(module.geometry.head_dim)


def states(site: StepSite) -> list:
    g = site.geometry
    W = g.v_head_dim + (1 if site.module.params["normalize"] else 0)
    return [StateSpec("recurrent_state", torch.float32, (BATCH, g.kv_heads, width(site.module), W)), count_spec()]


def call(site: StepSite, q, k, v, mask, pasts):
    m = site.module
    phi_q, phi_k, g = m.inputs(q, k)
    out, state, count = torch.ops.attnopt.gla_step(phi_q, phi_k, v, g, mask, pasts[0], pasts[1],
                                                   bool(m.params["normalize"]), float(m.params["eps"]))
    return out.to(q.dtype), [state, count]


STEP = GraphStep(states=states, call=call)
