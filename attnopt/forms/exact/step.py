"""exact in a decode graph: softmax attention over a growing K/V cache (`attnopt::exact_step`).

States: key [B, Hkv, past_sequence, D] and value [B, Hkv, past_sequence, Dv], the keys and values
of every column so far (pads included, hidden by the mask), present = past ++ new. A query at
column c sees the real columns j ≤ c; one that sees none (a pad row before its first real token)
gets 0. With the model's own sliding window (a site the model slides, left exact) the step is the
window form's, not this one (backends/onnx/graph_model.py).

Under a dispatch threshold (`min_seq_len` = T, the site module runs exact attention for each row's
first T real tokens, SiteModule.decode) a rewritten site also carries `attnopt::exact_prefix_step`'s
state: exact_prefix [B, Hkv, T, D + Dv], keys ‖ values of each row's first T real tokens, the j-th
real token in slot j (pads take no slot, so the size is T whatever the padding). A query whose real
position p is below T attends slots 0..p by softmax and replaces the form's output; the form's own
state advances over every token all along, so nothing changes when a row passes T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.common.graph import BATCH, PAST, GraphStep, StateSpec, StepSite, new_keep


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


# ---------------------------------------------------------------- the exact prefix under min_seq_len

PREFIX_STATE = "exact_prefix"


def real_positions_of(mask: Tensor, keep_BT: Tensor) -> Tensor:
    """Long [B, T]: each new column's index among its row's real tokens (a pad gets its predecessor's),
    from the mask over every column so far (the real tokens before this call = all − new)."""
    before = mask.long().sum(-1, keepdim=True) - keep_BT.long().sum(-1, keepdim=True)
    return before + keep_BT.long().cumsum(-1) - 1


@torch.library.custom_op("attnopt::exact_prefix_step", mutates_args=())
def exact_prefix_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, prefix: Tensor, form_out: Tensor,
                      scale: float) -> tuple[Tensor, Tensor]:
    """The form's output with causal softmax attention where the query's real position is below
    T = the prefix's slots (as SiteModule.decode's exact prefix); returns (out, present prefix)."""
    B, Hkv, T = q.shape[0], k.shape[1], q.shape[2]
    slots, width = prefix.shape[2], prefix.shape[3]
    keep = new_keep(mask, T)
    pos_BT = real_positions_of(mask, keep)
    write_BT = keep & (pos_BT < slots)
    # Each written token into its real slot; the rest into a spare slot past the end, then dropped.
    target = torch.where(write_BT, pos_BT, slots)[:, None, :, None].expand(B, Hkv, T, width)
    spare = torch.cat([prefix, prefix.new_zeros(B, Hkv, 1, width)], dim=2)
    kv = torch.cat([k, v], dim=-1).to(prefix.dtype)
    present = spare.scatter(2, target, kv)[:, :, :slots]
    slot = torch.arange(slots, device=q.device)
    visible = slot[None, None, :] <= pos_BT[:, :, None]  # [B, T, slots]: the row's real tokens up to the query
    D = k.shape[-1]
    exact = F.scaled_dot_product_attention(q, present[..., :D].to(q.dtype), present[..., D:].to(q.dtype),
                                           attn_mask=visible[:, None], scale=scale, enable_gqa=Hkv != q.shape[1])
    exact = torch.where(visible.any(-1)[:, None, :, None], exact, 0.0)
    below = (pos_BT < slots)[:, None, :, None]
    return torch.where(below, exact.to(form_out.dtype), form_out), present


@exact_prefix_step.register_fake
def _(q, k, v, mask, prefix, form_out, scale):
    return form_out.new_empty(form_out.shape), prefix.new_empty(prefix.shape)


def prefix_spec(site: StepSite, slots: int) -> StateSpec:
    g = site.geometry
    return StateSpec(PREFIX_STATE, g.dtype, (BATCH, g.kv_heads, int(slots), g.head_dim + g.v_head_dim))


def call_prefix(site: StepSite, q, k, v, mask, form_out, prefix):
    """The exact prefix op over a site's step output: (out, present prefix)."""
    return torch.ops.attnopt.exact_prefix_step(q, k, v, mask, prefix, form_out, float(site.geometry.scale))
