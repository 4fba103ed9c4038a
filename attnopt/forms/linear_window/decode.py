"""Decoding linear+window attention from a fixed-size state: a window cache plus a linear state.

The state is window_decode.py's cache (each row's S sinks and last W − 1 columns) and the linear sums
(S [B, H, M, Dv], z [B, H, M]) of every real, non-sink key that has left the buffer: exactly the keys
L(i) of linear_window.py for the next query, whose band starts W − 1 columns back. A key moves from
the buffer into (S, z) when it leaves it, so the state stays O(S + W + M·Dv) per head at any length.

A step evaluates linear_window.py's formula directly, in true feature units:

    oᵢ = (Σ_{W(i)} e^{s·qᵢ·kⱼ − mᵢ} vⱼ + β_h e^{−mᵢ} φ(qᵢ)ᵀS) / (Σ_{W(i)} e^{s·qᵢ·kⱼ − mᵢ} + β_h e^{−mᵢ} φ(qᵢ)ᵀz)

with mᵢ the largest visible window logit. Keys of this call that already lie outside a later query's
band (only when Nq > W) enter that query's linear sum explicitly. φ is applied per query head
(keys repeated to H heads), which is what per-head maps such as hedgehog need and equals the
shared-map result for the others.

Letters as in linear_window.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from attnopt.forms.linear_window.reference import linear_window_attention
from attnopt.forms.window.decode import (
    WindowCache,
    advance_window_cache,
    window_cache_from_keys,
    window_step_keys,
)
from attnopt.kernels.feature_maps import FeatureMap, resolve_feature_map
from attnopt.kernels.layout import check_sdpa_inputs, compute_dtype

__all__ = ["LinearWindowState", "linear_window_decode"]


@dataclass
class LinearWindowState:
    """Window cache plus the linear sums over the keys that left it (fp32 for half inputs)."""

    window: WindowCache
    S_BHMDv: Tensor
    z_BHM: Tensor


def _per_head(x_BHkvND: Tensor, H: int) -> Tensor:
    return x_BHkvND.repeat_interleave(H // x_BHkvND.shape[1], dim=1) if x_BHkvND.shape[1] != H else x_BHkvND


def _linear_sums(fmap: FeatureMap, k: Tensor, v: Tensor, take_BN: Tensor, H: int, scale: float, cdt) -> tuple:
    """Σ φ(kⱼ)vⱼᵀ and Σ φ(kⱼ) over the keys `take_BN` marks, per query head."""
    phi = fmap(_per_head(k, H).to(cdt), scale) * take_BN[:, None, :, None].to(cdt)  # [B, H, N, M]
    return phi.transpose(-1, -2) @ _per_head(v, H).to(cdt), phi.sum(2)


def _is_sink(cache: WindowCache, columns_BN: Tensor) -> Tensor:
    """Bool [B, N]: the column holds one of its row's sinks."""
    if cache.sinks == 0:
        return torch.zeros_like(columns_BN, dtype=torch.bool)
    hit = (columns_BN[:, :, None] == cache.sink_col_BS[:, None, :]) & cache.sink_valid_BS[:, None, :]
    return hit.any(-1)


def linear_window_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Optional[LinearWindowState],
    *,
    window: int,
    sinks: int = 0,
    feature_map: Union[str, FeatureMap] = "elu",
    scale: Optional[float] = None,
    linear_weight: Union[float, Tensor] = 1.0,
    key_mask: Optional[Tensor] = None,
) -> tuple[Tensor, LinearWindowState]:
    """Causal linear+window attention of the new tokens (q [B, H, Nq, D], k/v [B, Hkv, Nq, ·]) after
    the state's columns; returns (out [B, H, Nq, Dv], advanced state).

    `state` None starts a sequence (the prefill runs the `linear_window_attention` op). Same
    arguments as `linear_window_attention(causal=True)`; prefill plus steps equals one call over the
    whole sequence. Cost per call O(Nq·(S + W + Nq)·(D + Dv) + Nq·M·Dv); state O(S + W + M·Dv) per head.
    """
    check_sdpa_inputs("linear_window_decode", q, k, v, key_mask)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cdt = compute_dtype(q.dtype)
    s = float(scale) if scale is not None else D ** -0.5
    fmap = resolve_feature_map(feature_map, D, H)
    beta_H = (linear_weight if isinstance(linear_weight, Tensor) else torch.tensor(float(linear_weight)))
    beta_H = beta_H.to(device=q.device, dtype=cdt).expand(H)
    keep = torch.ones(B, Nk, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    if state is None or state.window.columns == 0:
        out = linear_window_attention(q, k, v, window=window, sinks=sinks, causal=True, feature_map=fmap, scale=s,
                                      linear_weight=beta_H, key_mask=key_mask)
        cache = window_cache_from_keys(k, v, key_mask, window=window, sinks=sinks)
        left = max(Nk - (window - 1), 0)  # columns already outside the next query's band
        cols = torch.arange(left, device=q.device).expand(B, left)
        take = keep[:, :left] & ~_is_sink(cache, cols)
        S, z = _linear_sums(fmap, k[:, :, :left], v[:, :, :left], take, H, s, cdt)
        return out, LinearWindowState(cache, S, z)
    if Nq != Nk:  # (a prefill may ask for its last queries only: bottom-right aligned)
        raise ValueError(f"linear_window_decode: pass the new tokens' q, k and v alike (q has {Nq}, k {Nk}); "
                         "the earlier keys live in the state")
    cache = state.window
    if cache.window != window or cache.sinks != sinks:
        raise ValueError(f"linear_window_decode: the state was built for window {cache.window}, sinks {cache.sinks}; "
                         f"this call has window {window}, sinks {sinks}")
    step = window_step_keys(cache, k, v, keep)
    k_H, v_H = _per_head(step.k_BHkvKD, H).to(cdt), _per_head(step.v_BHkvKD, H).to(cdt)
    logits = (q.to(cdt) * s) @ k_H.transpose(-1, -2)  # [B, H, Nq, K]
    vis = step.visible_BQK[:, None]
    logits = logits.masked_fill(~vis, float("-inf"))
    seen = vis.any(-1, keepdim=True)
    m = torch.where(seen, logits.amax(-1, keepdim=True), 0.0).detach()
    w = torch.exp(logits - m)  # 0 where hidden
    num, den = w @ v_H, w.sum(-1)
    phi_q = fmap(q.to(cdt), s)  # [B, H, Nq, M]
    lin_num, lin_den = phi_q @ state.S_BHMDv, (phi_q * state.z_BHM[:, :, None]).sum(-1)
    if Nq > 1:  # this call's own keys that a later query already sees as linear keys
        cols_K = step.columns_K[:, cache.sinks:]  # buffer ‖ new
        keep_K = torch.cat([cache.keep_BL, keep], dim=1) & ~(_is_sink(cache, cols_K) | torch.cat(
            [torch.zeros_like(cache.keep_BL), step.new_sink_BN], dim=1))
        col_q = cache.columns + torch.arange(Nq, device=q.device)
        far = keep_K[:, None, :] & (cols_K[:, None, :] <= (col_q - window)[None, :, None])  # [B, Nq, L + Nq]
        a = (phi_q @ fmap(k_H[:, :, cache.sinks:], s).transpose(-1, -2)) * far[:, None].to(cdt)
        lin_num = lin_num + a @ v_H[:, :, cache.sinks:]
        lin_den = lin_den + a.sum(-1)
    factor = beta_H[None, :, None] * torch.exp(-m[..., 0])  # [B, H, Nq]
    num = num + factor[..., None] * lin_num
    den = den + factor * lin_den
    out = (num / torch.where(den > 0, den, 1.0)[..., None]).to(q.dtype)
    # Keys leaving the buffer join the linear sums (sinks stay in their slots).
    new_cache = advance_window_cache(cache, k, v, keep, step)
    n_out = cache.k_BHkvLD.shape[2] + Nq - new_cache.k_BHkvLD.shape[2]
    S, z = state.S_BHMDv, state.z_BHM
    if n_out > 0:  # the oldest n_out columns of buffer ‖ new, which the step already concatenated
        out_cols = slice(cache.sinks, cache.sinks + n_out)
        cols = step.columns_K[:, out_cols]
        L = cache.keep_BL.shape[1]
        keep_out = cache.keep_BL[:, :n_out] if n_out <= L else torch.cat([cache.keep_BL, keep[:, :n_out - L]], dim=1)
        take = keep_out & ~_is_sink(new_cache, cols)
        dS, dz = _linear_sums(fmap, step.k_BHkvKD[:, :, out_cols], step.v_BHkvKD[:, :, out_cols], take, H, s, cdt)
        S, z = S + dS, z + dz
    return out, LinearWindowState(new_cache, S, z)
