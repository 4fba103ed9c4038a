"""delta in a decode graph: the delta-rule state S (`attnopt::delta_step`).

States: recurrent_state [B, Hkv, M, Dv] float32 -- S_T = exp(g_T)(I − β_T k̂_T k̂_Tᵀ)S_{T−1} + β_T k̂_T v_Tᵀ
over the real tokens, one per kv head -- and conv_state: with the short convolution its history,
the last K−1 real [k ‖ v] inputs [B, Hkv·(K−1), D + Dv] (onnxruntime-genai's own gated-delta models
carry their convolution there too), else [B, 1, 1] int64, the real tokens absorbed. A pad is an exact
no-op (k̂ = 0, g = 0, β = 0, and the history does not move). Fixed size at every context.

The convolution, q̂ (with the output scale on it), k̂, g and β are computed outside the step op by the
site's own tensors (plain torch ops), so the op and its lowering see the delta rule's inputs only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnopt.forms.common.graph import (BATCH, GraphStep, StateSpec, StepSite, add_real_tokens, new_keep,
                                       recurrent_states)
from attnopt.forms.delta.form import state_width
from attnopt.forms.delta.reference import gated_delta_attention
from attnopt.kernels.registration import step_op


@step_op("attnopt::delta_step", presents=("state",))
def delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mask: Tensor,
               state: Tensor) -> tuple[Tensor, Tensor]:
    """The gated delta rule over the new tokens from the carried state; returns (out, present state)."""
    keep = new_keep(mask, q.shape[2])
    out, S = gated_delta_attention(q, k, v, g, beta, scale=1.0, key_mask=keep, state=state)
    return out.contiguous(), S.to(state.dtype).contiguous()


def states(site: StepSite) -> list:
    g = site.geometry
    recurrent, count = recurrent_states(g.kv_heads, state_width(site.module.geometry, site.module.params), g.v_head_dim)
    conv = site.module.conv_HkvWK
    if conv is None:
        return [recurrent, count]
    taps = conv.shape[-1]
    return [recurrent, StateSpec("conv_state", torch.float32, (BATCH, g.kv_heads * (taps - 1), conv.shape[1]))]


def call(site: StepSite, q, k, v, mask, pasts):
    module = site.module
    keep = new_keep(mask, q.shape[2])
    if module.conv_HkvWK is None:
        k_mixed, v_mixed, conv_state = k, v, add_real_tokens(pasts[1], keep)
    else:
        B, Hkv, W = k.shape[0], k.shape[1], module.conv_HkvWK.shape[1]
        history = pasts[1].view(B, Hkv, module.conv_HkvWK.shape[-1] - 1, W).to(k.dtype)
        k_mixed, v_mixed, history = module.mix(k, v, keep, history)
        conv_state = history.reshape(B, -1, W).to(pasts[1].dtype)
    q_hat, k_hat, v_mixed, g, beta = module.inputs(q, k_mixed, v_mixed)
    out, state = torch.ops.attnopt.delta_step(q_hat, k_hat, v_mixed, g, beta, mask, pasts[0])
    return out.to(q.dtype), [state, conv_state]


STEP = GraphStep(states=states, call=call)
