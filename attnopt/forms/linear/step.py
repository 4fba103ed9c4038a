"""linear in a decode graph: the prefix sums (S, z) as one state (`attnopt::linear_step`).

States: recurrent_state [B, Hs, M, Dv + 1] float32 -- S = Σ φ(k)vᵀ in the first Dv columns and
z = Σ φ(k) in the last (a ones column on v carries it), one per kv head (per query head for maps
that differ per head, hedgehog) -- and conv_state [B, 1, 1] int64, the real tokens absorbed.
A pad adds nothing (its φ(k) is 0). Fixed size at every context.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.forms.common.graph import (GraphStep, StepSite, add_real_tokens, new_keep, per_kv_head, per_query_head,
                                       recurrent_states)
from attnopt.forms.linear.reference import linear_attention
from attnopt.kernels.feature_maps import feature_map_of
from attnopt.kernels.normaliser import join_state, split_state
from attnopt.kernels.registration import step_op


@step_op("attnopt::linear_step", presents=("state", "count"))
def linear_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, state: Tensor, count: Tensor, feature_map: str,
                weight: Optional[Tensor], scale: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Linear attention of the new tokens from the carried (S, z); returns (out, present state, count)."""
    keep = new_keep(mask, q.shape[2])
    H, Hs, Dv = q.shape[1], state.shape[1], v.shape[-1]
    S, z = (per_query_head(t, H) for t in split_state(state, Dv, True))
    out, (S, z) = linear_attention(q, k, v, feature_map=feature_map_of(feature_map, weight), causal=True,
                                   scale=scale, eps=eps, key_mask=keep, state=(S, z))
    present = per_kv_head(join_state(S, z), Hs).to(state.dtype)
    return out, present, add_real_tokens(count, keep)


def state_heads(site: StepSite) -> int:
    """Hs: one state per kv head, or per query head for a map that differs per head."""
    return site.geometry.heads if site.module.feature_map.per_head else site.geometry.kv_heads


def states(site: StepSite) -> list:
    g = site.geometry
    return recurrent_states(state_heads(site), site.module.feature_map.num_features(g.head_dim), g.v_head_dim + 1)


def call(site: StepSite, q, k, v, mask, pasts):
    m = site.module
    out, state, count = torch.ops.attnopt.linear_step(
        q, k, v, mask, pasts[0], pasts[1], m.params["feature_map"], m.feature_map.op_weight(), float(m.geometry.scale),
        float(m.eps))
    return out, [state, count]


STEP = GraphStep(states=states, call=call)
