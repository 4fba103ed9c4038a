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

from attnopt.forms.common.graph import GraphStep, StepSite, add_real_tokens, new_keep, recurrent_states
from attnopt.forms.gla.reference import gated_linear_attention
from attnopt.kernels.normaliser import join_state, split_state
from attnopt.kernels.registration import step_op


@step_op("attnopt::gla_step", out=("phi_q", "v"), presents=("state", "count"))
def gla_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, mask: Tensor, state: Tensor, count: Tensor,
             normalize: bool, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gated linear attention of the new tokens from the carried state; returns (out, present state, count)."""
    keep = new_keep(mask, phi_q.shape[2])
    out, (S, z) = gated_linear_attention(phi_q, phi_k, v, g, feature_map="identity", normalize=normalize, scale=1.0,
                                         eps=eps, key_mask=keep, state=split_state(state, v.shape[-1], normalize))
    present = join_state(S, z)
    return out.contiguous(), present.to(state.dtype).contiguous(), add_real_tokens(count, keep)


def width(module) -> int:
    """M, the width of φ (the head dim for the identity)."""
    fm = module.gates.feature_map
    return module.geometry.head_dim if fm is None else fm.num_features(module.geometry.head_dim)


def states(site: StepSite) -> list:
    g = site.geometry
    return recurrent_states(g.kv_heads, width(site.module), g.v_head_dim + int(site.module.params["normalize"]))


def call(site: StepSite, q, k, v, mask, pasts):
    m = site.module
    phi_q, phi_k, g = m.inputs(q, k)
    out, state, count = torch.ops.attnopt.gla_step(phi_q, phi_k, v, g, mask, pasts[0], pasts[1],
                                                   bool(m.params["normalize"]), float(m.params["eps"]))
    return out.to(q.dtype), [state, count]


STEP = GraphStep(states=states, call=call)
