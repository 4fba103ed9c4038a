"""A prefill's reuse attention as one op, `attnopt::reuse_attention`: the anchor's block selection
(selection.select_call) and the block-sparse softmax over the site's own q, k and v.

The site calls it only under torch.export. The selection's data-dependent steps then sit inside one
opaque node, and the prefill file lowers that node in standard ONNX ops (onnx.py,
`reuse_attention_std`). In eager mode the site runs the same two steps itself (form.py `_attend`);
the op's own eager body is what a program exported with it runs in PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.forms.reuse.reference import block_sparse_attention
from attnopt.forms.reuse.selection import BlockRule, select_call


@torch.library.custom_op("attnopt::reuse_attention", mutates_args=())
def reuse_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], anchor_q: Tensor, anchor_k: Tensor,
                    block: int, top_k: int, window: int, sinks: int, probes: int, causal: bool, mass: Optional[float],
                    scale: float, anchor_scale: float) -> Tensor:
    """q [B, H, N, D], k [B, Hkv, N, D], v [B, Hkv, N, Dv] over the blocks the anchor's queries
    anchor_q [B, Ha, N, Da] and keys anchor_k [B, Hka, N, Da] select; key_mask [B, N] bool (True:
    a real token) or None. Returns [B, H, N, Dv]."""
    rule = BlockRule(block=block, top_k=top_k, window=window, sinks=sinks, probes=probes, causal=causal, mass=mass)
    if rule.reads_everything(k.shape[2]):  # every block is read: the sparse softmax equals this one
        return exact_under_keep(q, k, v, key_mask, causal, scale)
    selection, _ = select_call(anchor_q, anchor_k, key_mask, rule, anchor_scale, None)
    return block_sparse_attention(q, k, v, selection.blocks_BQK, block=block, causal=causal, scale=scale,
                                  key_mask=key_mask, offsets=selection.offsets_B)


@reuse_attention.register_fake
def _(q, k, v, key_mask, anchor_q, anchor_k, block, top_k, window, sinks, probes, causal, mass, scale, anchor_scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def exact_under_keep(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], causal: bool, scale: float) -> Tensor:
    """Exact attention under the key mask keep [B, Nk] (a query that sees no real key: a zero row),
    what the block-sparse op gives where every block is read."""
    Nq, Nk = q.shape[2], k.shape[2]
    if keep is None and not causal:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    visible = torch.ones(q.shape[0], 1, Nq, Nk, dtype=torch.bool, device=q.device)
    if keep is not None:
        visible = visible & keep[:, None, None, :]
    if causal:
        visible = visible & (torch.arange(Nk, device=q.device) <= (Nk - Nq) + torch.arange(Nq, device=q.device)[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return torch.where(visible.any(-1, keepdim=True), out, 0.0)
