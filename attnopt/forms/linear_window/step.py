"""linear+window in a decode graph: the window buffer plus the linear sums of the keys that left it
(`attnopt::linear_window_step`).

States: the window form's two (recurrent_state [B, Hkv, S + W − 1, D + Dv] and conv_state
[B, 1, 1 + S + W − 1], see forms/window/step.py) and linear_state [B, H, M, Dv + 1] float32: S ‖ z
over every real, non-sink key that has left the buffer, per query head (φ is applied per query
head, as `linear_window_decode` does). Fixed size at every context.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.forms.common.graph import BATCH, GraphStep, StateSpec, StepSite, new_keep
from attnopt.forms.linear_window.decode import LinearWindowState, linear_window_decode
from attnopt.forms.window.form import effective_window
from attnopt.forms.window.step import cache_of, state_of
from attnopt.kernels.feature_maps import feature_map_of


@torch.library.custom_op("attnopt::linear_window_step", mutates_args=())
def linear_window_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, buffer: Tensor, slots: Tensor,
                       linear: Tensor, feature_map: str, weight: Optional[Tensor], beta: Tensor, window: int,
                       sinks: int, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """linear+window attention of the new tokens from the carried state; returns (out, buffer, slots, linear)."""
    T, Dv = q.shape[2], v.shape[-1]
    keep = new_keep(mask, T)
    cache = cache_of(buffer, slots, mask.shape[1] - T, window, sinks, k.shape[-1])
    state = None if cache is None else LinearWindowState(cache, linear[..., :Dv], linear[..., Dv])
    out, state = linear_window_decode(q, k, v, state, window=window, sinks=sinks,
                                      feature_map=feature_map_of(feature_map, weight), scale=scale,
                                      linear_weight=beta, key_mask=keep)
    present, slots = state_of(state.window, slots[:, 0, 0] + keep.long().sum(-1), buffer.dtype)
    return out, present, slots, torch.cat([state.S_BHMDv, state.z_BHM[..., None]], dim=-1).to(linear.dtype)


@linear_window_step.register_fake
def _(q, k, v, mask, buffer, slots, linear, feature_map, weight, beta, window, sinks, scale):
    return (q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), buffer.new_empty(buffer.shape),
            slots.new_empty(slots.shape), linear.new_empty(linear.shape))


def _window(site: StepSite) -> tuple[int, int]:
    p = site.module.params
    return effective_window(p, site.module.geometry.model_window), p["sinks"]


def states(site: StepSite) -> list:
    g = site.geometry
    W, S = _window(site)
    M = site.module.feature_map.num_features(g.head_dim)
    return [StateSpec("recurrent_state", g.dtype, (BATCH, g.kv_heads, S + W - 1, g.head_dim + g.v_head_dim)),
            StateSpec("conv_state", torch.int64, (BATCH, 1, S + W)),
            StateSpec("linear_state", torch.float32, (BATCH, g.heads, M, g.v_head_dim + 1))]


def beta_of(module) -> Tensor:
    """β per query head [H] as the site applies it (0 when the linear part is off)."""
    if module.params["beta"] > 0:
        return torch.exp(module.log_beta.detach()).float()
    return torch.zeros(module.geometry.heads)


def call(site: StepSite, q, k, v, mask, pasts):
    m = site.module
    W, S = _window(site)
    out, buffer, slots, linear = torch.ops.attnopt.linear_window_step(
        q, k, v, mask, pasts[0], pasts[1], pasts[2], m.params["feature_map"], m.feature_map.op_weight(), beta_of(m),
        W, S, float(m.geometry.scale))
    return out, [buffer, slots, linear]


def why_not(site: StepSite) -> Optional[str]:
    if site.module.params["feature_map"] == "favor":
        return ("the favor map's stabiliser does not cancel against the softmax terms of linear+window, which the "
                "decode graph does not carry; use hedgehog, elu, relu or taylor")
    return None


STEP = GraphStep(states=states, call=call, why_not=why_not)
