"""gla+window in a decode graph: the window buffer, the gated state of the keys that left it, and the
buffered keys' decayed features (`attnopt::gla_window_step`).

States, per row -- exactly `gla_window_decode`'s GlaWindowState at a fixed size:
  recurrent_state [B, Hkv, S + W − 1, D + Dv] and conv_state [B, 1, S + W] int64: the window form's
      buffer (sink slots, then the last W − 1 columns) and its slots (forms/window/step.py);
  gated_state [B, Hkv, M, Dv + 1] float32: S ‖ z of every kept, non-sink key that has left the
      buffer, decayed up to the last column absorbed;
  gated_keys [B, Hkv, W − 1, M] float32: φ(k) of each buffer slot decayed the same way (0 for a sink,
      a pad or an empty slot), so that a key leaving the buffer joins S already decayed.
Fixed size at every context. φ(q), φ(k) and the log-gates are computed outside the op by the site's
own KeyGates (plain torch ops the exporter lowers), as for gla.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.forms.common.graph import BATCH, GraphStep, StateSpec, StepSite, new_keep
from attnopt.forms.gla.step import width
from attnopt.forms.gla_window.decode import GlaWindowState, gla_window_decode
from attnopt.forms.linear_window.step import beta_of
from attnopt.forms.window.step import buffer_specs, cache_of, state_of, window_and_sinks
from attnopt.kernels.registration import step_op


@step_op("attnopt::gla_window_step", presents=("buffer", "slots", "gated", "gated_keys"))
def gla_window_step(q: Tensor, k: Tensor, v: Tensor, phi_q: Tensor, phi_k: Tensor, g: Tensor, mask: Tensor,
                    buffer: Tensor, slots: Tensor, gated: Tensor, gated_keys: Tensor, beta: Tensor, window: int,
                    sinks: int, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """gla+window attention of the new tokens from the carried state; returns (out, buffer, slots, gated,
    gated_keys)."""
    T, L = q.shape[2], window - 1
    keep = new_keep(mask, T)
    cache = cache_of(buffer, slots, mask.shape[1] - T, window, sinks, k.shape[-1])
    state = None
    if cache is not None:
        n = cache.k_BHkvLD.shape[2]  # the buffered columns that exist: the last n slots
        state = GlaWindowState(cache, gated, gated_keys[:, :, L - n:])
    out, state = gla_window_decode(q, k, v, phi_q, phi_k, g, state, window=window, sinks=sinks, scale=scale,
                                   linear_weight=beta, key_mask=keep)
    present, slots = state_of(state.window, slots[:, 0, 0] + keep.long().sum(-1), buffer.dtype)
    n = state.phi_BHkvLM.shape[2]
    keys = gated_keys.new_zeros(gated_keys.shape)
    keys[:, :, L - n:] = state.phi_BHkvLM.to(keys.dtype)
    return out.contiguous(), present, slots, state.S_BHkvMW.to(gated.dtype).contiguous(), keys


def states(site: StepSite) -> list:
    g = site.geometry
    W, _ = window_and_sinks(site)
    M = width(site.module)
    return buffer_specs(site) + [StateSpec("gated_state", torch.float32, (BATCH, g.kv_heads, M, g.v_head_dim + 1)),
                                 StateSpec("gated_keys", torch.float32, (BATCH, g.kv_heads, W - 1, M))]


def call(site: StepSite, q, k, v, mask, pasts):
    m = site.module
    W, S = window_and_sinks(site)
    phi_q, phi_k = m.gates.features(q, k, m.geometry.scale)
    out, *presents = torch.ops.attnopt.gla_window_step(q, k, v, phi_q, phi_k, m.gates.log_gates(k), mask, *pasts,
                                                       beta_of(m), W, S, float(m.geometry.scale))
    return out.to(q.dtype), presents


def why_not(site: StepSite) -> Optional[str]:
    W, _ = window_and_sinks(site)
    if W < 2:
        return "a window of 1 key buffers no column for the gated part; use window >= 2"
    return None


STEP = GraphStep(states=states, call=call, why_not=why_not)
