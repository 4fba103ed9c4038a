"""reuse in a decode graph: the block selection from the anchor's queries and keys, then block-sparse
attention over this site's own growing K/V cache (`attnopt::reuse_step`).

States: key [B, Hkv, past_sequence, D] and value [B, Hkv, past_sequence, Dv] (reuse saves compute,
not memory: the whole K/V cache stays); probe_queries [B, Ha, P, Da], the anchor's last P queries
(the next block's probes); selected_blocks [B, 1, K], the current block's list. The anchor (an
earlier site, exact or not) hands over its new queries and its present keys. A call of T ≥ 1 tokens
after any past makes the selections of the blocks that start in it (selection.select_span, the same
rule as the prefill's) and attends with them (reference.gathered_attention), as `ReusedSite` does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.forms.common.graph import BATCH, PAST, GraphStep, StateSpec, StepSite
from attnopt.forms.reuse.reference import gathered_attention
from attnopt.forms.reuse.selection import BlockRule, select_span


@torch.library.custom_op("attnopt::reuse_step", mutates_args=())
def reuse_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, past_key: Tensor, past_value: Tensor, anchor_q: Tensor,
               anchor_keys: Tensor, past_probes: Tensor, past_blocks: Tensor, block: int, top_k: int, window: int,
               sinks: int, mass: Optional[float], scale: float,
               anchor_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (out [B, H, T, Dv], present key, present value, present probe queries, present blocks)."""
    K, V = torch.cat([past_key, k], dim=2), torch.cat([past_value, v], dim=2)
    rule = BlockRule(block=block, top_k=top_k, window=window, sinks=sinks, probes=past_probes.shape[2], causal=True,
                     mass=mass)
    keep = mask.bool()
    blocks, offsets, probes, current = select_span(anchor_q, anchor_keys, keep, rule, anchor_scale, past_probes,
                                                   past_blocks[:, 0])
    out = gathered_attention(q, K.to(q.dtype), V.to(q.dtype), blocks, block=block, causal=True, scale=scale,
                             key_mask=keep, offsets=offsets)
    return out, K, V, probes.to(past_probes.dtype), current[:, None]


@reuse_step.register_fake
def _(q, k, v, mask, past_key, past_value, anchor_q, anchor_keys, past_probes, past_blocks, block, top_k, window,
      sinks, mass, scale, anchor_scale):
    B, H, T = q.shape[0], q.shape[1], q.shape[2]
    N = past_key.shape[2] + k.shape[2]
    return (q.new_empty(B, H, T, v.shape[-1]), past_key.new_empty(B, k.shape[1], N, k.shape[-1]),
            past_value.new_empty(B, v.shape[1], N, v.shape[-1]), past_probes.new_empty(past_probes.shape),
            past_blocks.new_empty(past_blocks.shape))


def states(site: StepSite) -> list:
    g, m = site.geometry, site.module
    heads, head_dim = m.anchor_shape
    return [StateSpec("key", g.dtype, (BATCH, g.kv_heads, PAST, g.head_dim)),
            StateSpec("value", g.dtype, (BATCH, g.kv_heads, PAST, g.v_head_dim)),
            StateSpec("probe_queries", g.dtype, (BATCH, heads, m.rule.probes, head_dim)),
            StateSpec("selected_blocks", torch.int64, (BATCH, 1, m.rule.slots))]


def call(site: StepSite, q, k, v, mask, pasts, anchor=None, x=None):
    m = site.module
    r = m.rule
    out, *presents = torch.ops.attnopt.reuse_step(q, k, v, mask, *pasts[:2], anchor[0], anchor[1], *pasts[2:],
                                                  r.block, r.top_k, r.window, r.sinks, r.mass,
                                                  float(site.geometry.scale), float(m.anchor_scale))
    return out, presents


def why_not(site: StepSite) -> Optional[str]:
    if site.module is None or site.module.anchor_shape is None:
        return "its anchor is not known (a reused site built without its anchor)"
    return None


STEP = GraphStep(states=states, call=call, why_not=why_not, needs_anchor=True)
