"""reuse in a decode graph: softmax over the anchor's q and cached keys plus the rank-r residual
(`attnopt::reuse_step`).

The anchor (an earlier exact site) caches its own keys; this site caches its values, value
[B, Hkv, past_sequence, Dv], and, for rank > 0, its residual keys x̂B, residual_key
[B, H, past_sequence, r] (what replaces its K cache). A query at column c sees the real columns
j ≤ c with logits s_a·([q_a, x̂A]·[k_a, x̂B]ᵀ), as `ReuseSite` decodes.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.common.graph import BATCH, PAST, GraphStep, StateSpec, StepSite


def _homogeneous(x: Tensor, rows: int) -> Tensor:
    """x̂ [B, 1, T, C'] : x, with a column of ones when the factors carry a bias row."""
    xh = x if rows == x.shape[-1] else torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)
    return xh[:, None]


@torch.library.custom_op("attnopt::reuse_step", mutates_args=())
def reuse_step(q_anchor: Tensor, k_anchor: Tensor, v: Tensor, mask: Tensor, past_value: Tensor, x: Optional[Tensor],
               A: Optional[Tensor], B: Optional[Tensor], past_residual: Optional[Tensor],
               scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out, present values, present residual keys (empty at rank 0))."""
    H, T = q_anchor.shape[1], q_anchor.shape[2]
    V = torch.cat([past_value, v], dim=2)
    q2, k2 = q_anchor, k_anchor.repeat_interleave(H // k_anchor.shape[1], dim=1)
    residual = v.new_zeros(0)
    if A is not None:
        xh = _homogeneous(x, A.shape[1]).to(q2.dtype)
        residual = torch.cat([past_residual, xh @ B.to(q2.dtype)], dim=2)
        q2, k2 = torch.cat([q2, xh @ A.to(q2.dtype)], dim=-1), torch.cat([k2, residual], dim=-1)
    N = k2.shape[2]
    col_q = (N - T) + torch.arange(T, device=q2.device)
    visible = ((torch.arange(N, device=q2.device)[None, :] <= col_q[:, None])[None] & mask.bool()[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(q2, k2, V.repeat_interleave(H // V.shape[1], dim=1), attn_mask=visible,
                                         scale=scale)
    return torch.where(visible.any(-1, keepdim=True), out, 0.0), V, residual


@reuse_step.register_fake
def _(q_anchor, k_anchor, v, mask, past_value, x, A, B, past_residual, scale):
    Bt, H, T = q_anchor.shape[0], q_anchor.shape[1], q_anchor.shape[2]
    N = past_value.shape[2] + v.shape[2]
    residual = v.new_empty(0) if A is None else past_residual.new_empty(Bt, H, N, A.shape[-1])
    return q_anchor.new_empty(Bt, H, T, v.shape[-1]), past_value.new_empty(Bt, v.shape[1], N, v.shape[-1]), residual


def _rank(module) -> int:
    return 0 if module.residual_A is None else int(module.residual_A.shape[-1])


def states(site: StepSite) -> list:
    g = site.geometry
    specs = [StateSpec("value", g.dtype, (BATCH, g.kv_heads, PAST, g.v_head_dim))]
    if site.anchor:  # a later reuse site reads this one's own q and keys
        specs.insert(0, StateSpec("key", g.dtype, (BATCH, g.kv_heads, PAST, g.head_dim)))
    if _rank(site.module):
        specs.append(StateSpec("residual_key", g.dtype, (BATCH, g.heads, PAST, _rank(site.module))))
    return specs


def call(site: StepSite, q, k, v, mask, pasts, anchor=None, x=None):
    m = site.module
    q_anchor, k_anchor = anchor
    own = [torch.cat([pasts[0], k], dim=2)] if site.anchor else []  # its own keys, for the next reuse site
    pasts = pasts[1:] if site.anchor else pasts
    ranked = _rank(m) > 0
    out, value, residual = torch.ops.attnopt.reuse_step(
        q_anchor, k_anchor, v, mask, pasts[0], x if ranked else None, m.residual_A if ranked else None,
        m.residual_B if ranked else None, pasts[1] if ranked else None, float(m.anchor_scale))
    return out, own + ([value, residual] if ranked else [value])


STEP = GraphStep(states=states, call=call, needs_anchor=True)
