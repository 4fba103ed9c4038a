"""ssm in a decode graph: the decayed state S_t = γ_h S_{t−1} + φ(k_t)v_tᵀ (`attnopt::decay_step`).

States: recurrent_state [B, H, D, W] float32 -- S, with z = the decayed Σ φ(k) as its last column
when normalising (W = Dv + 1, else Dv), one per query head since γ_h is -- and conv_state
[B, 1, 1] int64, the real tokens absorbed. A pad adds no key but still decays the state, as the
torch path does. Fixed size at every context.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnopt.forms.common.graph import GraphStep, StepSite, add_real_tokens, new_keep, recurrent_states
from attnopt.forms.ssm.reference import decay_attention
from attnopt.kernels.normaliser import join_state, split_state
from attnopt.kernels.registration import step_op

# decay_attention's own ε, the one SsmSite decodes with.
EPS = 1e-6


@step_op("attnopt::decay_step", presents=("state", "count"))
def decay_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, state: Tensor, count: Tensor, decay: Tensor,
               feature_map: str, normalize: bool, scale: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Decayed attention of the new tokens from the carried state; returns (out, present state, count)."""
    keep = new_keep(mask, q.shape[2])
    out, (S, z) = decay_attention(q, k, v, decay=decay, feature_map=feature_map, normalize=normalize, scale=scale,
                                  eps=eps, key_mask=keep, state=split_state(state, v.shape[-1], normalize))
    return out, join_state(S, z).to(state.dtype), add_real_tokens(count, keep)


def states(site: StepSite) -> list:
    g = site.geometry
    return recurrent_states(g.heads, g.head_dim, g.v_head_dim + int(site.module.params["normalize"]))


def call(site: StepSite, q, k, v, mask, pasts):
    m = site.module
    out, state, count = torch.ops.attnopt.decay_step(
        q, k, v, mask, pasts[0], pasts[1], m.decay, m.params["feature_map"], bool(m.params["normalize"]),
        float(m.geometry.scale), EPS)
    return out, [state, count]


STEP = GraphStep(states=states, call=call)
