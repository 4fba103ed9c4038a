"""exact in a decode graph: softmax attention over a growing K/V cache (`attnopt::exact_step`).

States: key [B, Hkv, past_sequence, D] and value [B, Hkv, past_sequence, Dv], the keys and values
of every column so far (pads included, hidden by the mask), present = past ++ new. A query at
column c sees the real columns j ≤ c; one that sees none (a pad row before its first real token)
gets 0. With the model's own sliding window (a site the model slides, left exact) the step is the
window form's, not this one (backends/onnx/graph_model.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.common.graph import BATCH, PAST, GraphStep, StateSpec, StepSite


@torch.library.custom_op("attnopt::exact_step", mutates_args=())
def exact_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, past_key: Tensor, past_value: Tensor,
               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Causal softmax attention of the T new tokens over past ++ new; returns (out, present K, present V)."""
    K = torch.cat([past_key, k], dim=2)
    V = torch.cat([past_value, v], dim=2)
    P, T, N = past_key.shape[2], q.shape[2], K.shape[2]
    col_q = P + torch.arange(T, device=q.device)
    visible = (torch.arange(N, device=q.device)[None, :] <= col_q[:, None])[None] & mask.bool()[:, None, :]
    visible = visible[:, None]  # [B, 1, T, N]
    out = F.scaled_dot_product_attention(q, K.to(q.dtype), V.to(q.dtype), attn_mask=visible, scale=scale,
                                         enable_gqa=K.shape[1] != q.shape[1])
    return torch.where(visible.any(-1, keepdim=True), out, 0.0), K, V


@exact_step.register_fake
def _(q, k, v, mask, past_key, past_value, scale):
    B, H, T = q.shape[0], q.shape[1], q.shape[2]
    N = past_key.shape[2] + k.shape[2]
    return (q.new_empty(B, H, T, v.shape[-1]), past_key.new_empty(B, k.shape[1], N, k.shape[-1]),
            past_value.new_empty(B, v.shape[1], N, v.shape[-1]))


def states(site: StepSite) -> list:
    g = site.geometry
    return [StateSpec("key", g.dtype, (BATCH, g.kv_heads, PAST, g.head_dim)),
            StateSpec("value", g.dtype, (BATCH, g.kv_heads, PAST, g.v_head_dim))]


def call(site: StepSite, q, k, v, mask, pasts):
    out, key, value = torch.ops.attnopt.exact_step(q, k, v, mask, pasts[0], pasts[1], float(site.geometry.scale))
    return out, [key, value]


STEP = GraphStep(states=states, call=call)
