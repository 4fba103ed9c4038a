"""window (+ sinks) in a decode graph: a fixed buffer of S + W − 1 slots (`attnopt::window_step`).

States, per row:
  recurrent_state [B, Hkv, S + W − 1, D + Dv]: keys ‖ values of slots 0..S−1 (each row's sinks:
      its first S real tokens, in the order they came) and S..S+W−2 (the last W − 1 columns, oldest
      first, column P − (W − 1) + j in slot S + j; columns before 0 are empty);
  conv_state [B, 1, 1 + S + W − 1] int64: the real tokens absorbed, then each sink slot's column + 1
      (0 = empty), then each buffer slot's keep flag (1 = a real token).
Exactly `window_decode`'s cache, at a fixed size: a query at column c sees the buffered and new real
columns j with c − W < j ≤ c, and the sinks at columns ≤ c − W (nearer ones are in the band).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.forms.common.graph import BATCH, GraphStep, StateSpec, StepSite, new_keep
from attnopt.forms.window.decode import WindowCache, window_decode
from attnopt.forms.window.form import effective_window
from attnopt.kernels.registration import step_op


def cache_of(buffer: Tensor, slots: Tensor, P: int, window: int, sinks: int, D: int) -> Optional[WindowCache]:
    """The `window_decode` cache these state tensors hold after P columns (None before any)."""
    if P == 0:
        return None
    S, L = sinks, window - 1
    n = min(P, L)  # buffered columns that exist
    ring = buffer[:, :, S + L - n:]
    pos1 = slots[:, 0, 1:1 + S]
    return WindowCache(ring[..., :D], ring[..., D:], slots[:, 0, 1 + S + L - n:] > 0,
                       buffer[:, :, :S, :D], buffer[:, :, :S, D:], (pos1 - 1).clamp(min=0), pos1 > 0, P, window, S)


def state_of(cache: WindowCache, count: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(buffer, slots) holding `cache` at the fixed size; `count` [B] the real tokens absorbed."""
    L = cache.window - 1
    k, v = cache.k_BHkvLD, cache.v_BHkvLD
    B, Hkv, n = k.shape[0], k.shape[1], k.shape[2]
    ring = k.new_zeros(B, Hkv, L, k.shape[-1] + v.shape[-1], dtype=dtype)
    ring[:, :, L - n:] = torch.cat([k, v], dim=-1).to(dtype)
    keep = torch.zeros(B, L, dtype=torch.long, device=k.device)
    keep[:, L - n:] = cache.keep_BL.long()
    sinks = torch.cat([cache.sink_k_BHkvSD, cache.sink_v_BHkvSD], dim=-1).to(dtype)
    pos1 = torch.where(cache.sink_valid_BS, cache.sink_col_BS + 1, 0)
    slots = torch.cat([count[:, None], pos1, keep], dim=-1)[:, None]
    return torch.cat([sinks, ring], dim=2), slots


@step_op("attnopt::window_step", presents=("buffer", "slots"))
def window_step(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, buffer: Tensor, slots: Tensor, window: int,
                sinks: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Window (+ sinks) attention of the new tokens from the fixed buffer; returns (out, buffer, slots)."""
    T = q.shape[2]
    keep = new_keep(mask, T)
    cache = cache_of(buffer, slots, mask.shape[1] - T, window, sinks, k.shape[-1])
    out, cache = window_decode(q, k, v, cache, window=window, sinks=sinks, scale=scale, key_mask=keep)
    present, slots = state_of(cache, slots[:, 0, 0] + keep.long().sum(-1), buffer.dtype)
    return out, present, slots


def window_and_sinks(site: StepSite) -> tuple[int, int]:
    """(W, S) of a window site, or of an exact site the model slides its own window over."""
    if site.module is None:
        return int(site.window), 0
    return effective_window(site.module.params, site.module.geometry.model_window), site.module.params["sinks"]


def buffer_specs(site: StepSite) -> list:
    g = site.geometry
    W, S = window_and_sinks(site)
    return [StateSpec("recurrent_state", g.dtype, (BATCH, g.kv_heads, S + W - 1, g.head_dim + g.v_head_dim)),
            StateSpec("conv_state", torch.int64, (BATCH, 1, S + W))]


def scale_of(site: StepSite) -> float:
    return float(site.geometry.scale if site.module is None else site.module.geometry.scale)


def call(site: StepSite, q, k, v, mask, pasts):
    W, S = window_and_sinks(site)
    out, buffer, slots = torch.ops.attnopt.window_step(q, k, v, mask, pasts[0], pasts[1], W, S, scale_of(site))
    return out, [buffer, slots]


def why_not(site: StepSite) -> Optional[str]:
    W, S = window_and_sinks(site)
    if S + W - 1 < 1:
        return "a window of 1 key without sinks keeps no state; use window >= 2"
    return None


STEP = GraphStep(states=buffer_specs, call=call, why_not=why_not)
