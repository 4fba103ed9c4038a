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
from attnopt.forms.window.step import buffer_specs, cache_of, state_of, window_and_sinks
from attnopt.kernels.feature_maps import feature_map_of
from attnopt.kernels.normaliser import join_state, split_state
from attnopt.kernels.registration import step_op


@step_op("attnopt::linear_window_step", presents=("buffer", "slots", "linear"))
def linear_window_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, buffer: Tensor, slots: Tensor,
                       linear: Tensor, feature_map: str, weight: Optional[Tensor], beta: Tensor, window: int,
                       sinks: int, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """linear+window attention of the new tokens from the carried state; returns (out, buffer, slots, linear)."""
    T, Dv = q.shape[2], v.shape[-1]
    keep = new_keep(mask, T)
    cache = cache_of(buffer, slots, mask.shape[1] - T, window, sinks, k.shape[-1])
    state = None if cache is None else LinearWindowState(cache, *split_state(linear, Dv, True))
    out, state = linear_window_decode(q, k, v, state, window=window, sinks=sinks,
                                      feature_map=feature_map_of(feature_map, weight), scale=scale,
                                      linear_weight=beta, key_mask=keep)
    present, slots = state_of(state.window, slots[:, 0, 0] + keep.long().sum(-1), buffer.dtype)
    return out, present, slots, join_state(state.S_BHMDv, state.z_BHM).to(linear.dtype)


def states(site: StepSite) -> list:
    g = site.geometry
    M = site.module.feature_map.num_features(g.head_dim)
    return buffer_specs(site) + [StateSpec("linear_state", torch.float32, (BATCH, g.heads, M, g.v_head_dim + 1))]


def beta_of(module) -> Tensor:
    """β per query head [H] as the site applies it (0 when the linear part is off)."""
    if module.params["beta"] > 0:
        return torch.exp(module.log_beta.detach()).float()
    return torch.zeros(module.geometry.heads)


def call(site: StepSite, q, k, v, mask, pasts):
    m = site.module
    W, S = window_and_sinks(site)
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
