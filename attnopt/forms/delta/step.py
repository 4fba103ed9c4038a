"""delta in a decode graph: the delta-rule state S (`attnopt::delta_step`).

States: recurrent_state [B, Hkv, M, Dv] float32 -- S_T = exp(g_T)(I − β_T k̂_T k̂_Tᵀ)S_{T−1} + β_T k̂_T v_Tᵀ
over the real tokens, one per kv head -- and conv_state [B, 1, 1] int64, the real tokens absorbed.
A pad is an exact no-op (k̂ = 0, g = 0, β = 0). Fixed size at every context.

q̂ (with the output scale on it), k̂, g and β are computed outside the step op by the site's own
tensors (plain torch ops), so the op and its lowering see the delta rule's inputs only.
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
from attnopt.forms.delta.form import state_width
from attnopt.forms.delta.reference import gated_delta_attention


@torch.library.custom_op("attnopt::delta_step", mutates_args=())
def delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mask: Tensor, state: Tensor,
               count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gated delta rule over the new tokens from the carried state; returns (out, present state, count)."""
    keep = new_keep(mask, q.shape[2])
    out, S = gated_delta_attention(q, k, v, g, beta, scale=1.0, key_mask=keep, state=state)
    return out.contiguous(), S.to(state.dtype).contiguous(), add_real_tokens(count, keep)


@delta_step.register_fake
def _(q, k, v, g, beta, mask, state, count):
    return (q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), state.new_empty(state.shape),
            count.new_empty(count.shape))


def states(site: StepSite) -> list:
    g = site.geometry
    M = state_width(site.module.geometry, site.module.params)
    return [StateSpec("recurrent_state", torch.float32, (BATCH, g.kv_heads, M, g.v_head_dim)), count_spec()]


def call(site: StepSite, q, k, v, mask, pasts):
    q_hat, k_hat, v, g, beta = site.module.inputs(q, k, v)
    out, state, count = torch.ops.attnopt.delta_step(q_hat, k_hat, v, g, beta, mask, pasts[0], pasts[1])
    return out.to(q.dtype), [state, count]


STEP = GraphStep(states=states, call=call)
