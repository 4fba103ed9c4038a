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
    StepKeys,
    WindowCache,
    WindowRing,
    advance_window_cache,
    cache_of_ring,
    window_cache_from_keys,
    window_step_keys,
)
from attnopt.kernels.feature_maps import FeatureMap, resolve_feature_map
from attnopt.kernels.layout import check_sdpa_inputs, compute_dtype

__all__ = ["LinearWindowState", "linear_window_decode", "linear_window_step_"]


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


@dataclass(frozen=True)
class _DecodeArgs:
    """A call's arguments resolved once: query heads H, softmax scale s (also φ's), the feature map,
    β per query head [H], the new tokens' keep mask [B, Nq] and the compute dtype."""

    H: int
    scale: float
    fmap: FeatureMap
    beta_H: Tensor
    keep_BN: Tensor
    cdt: torch.dtype


def _resolve_args(q: Tensor, k: Tensor, feature_map, scale, linear_weight, key_mask: Optional[Tensor]) -> _DecodeArgs:
    """Defaults filled in (s = 1/√D, keep every key) and β broadcast to one value per query head."""
    B, H, _, D = q.shape
    cdt = compute_dtype(q.dtype)
    s = float(scale) if scale is not None else D ** -0.5
    fmap = resolve_feature_map(feature_map, D, H)
    beta_H = (linear_weight if isinstance(linear_weight, Tensor) else torch.tensor(float(linear_weight)))
    beta_H = beta_H.to(device=q.device, dtype=cdt).expand(H)
    keep_BN = torch.ones(B, k.shape[2], dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    return _DecodeArgs(H, s, fmap, beta_H, keep_BN, cdt)


def _prefill(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], window: int, sinks: int,
             args: _DecodeArgs) -> tuple[Tensor, LinearWindowState]:
    """A sequence's first call: the `linear_window_attention` op over it, and a state whose linear sums
    already hold its real non-sink keys that lie outside the next query's band."""
    B, Nk = k.shape[0], k.shape[2]
    out = linear_window_attention(q, k, v, window=window, sinks=sinks, causal=True, feature_map=args.fmap,
                                  scale=args.scale, linear_weight=args.beta_H, key_mask=key_mask)
    cache = window_cache_from_keys(k, v, key_mask, window=window, sinks=sinks)
    left = max(Nk - (window - 1), 0)  # columns already outside the next query's band
    cols_BN = torch.arange(left, device=q.device).expand(B, left)
    take_BN = args.keep_BN[:, :left] & ~_is_sink(cache, cols_BN)
    S, z = _linear_sums(args.fmap, k[:, :, :left], v[:, :, :left], take_BN, args.H, args.scale, args.cdt)
    return out, LinearWindowState(cache, S, z)


def _checked_cache(state: LinearWindowState, Nq: int, Nk: int, window: int, sinks: int) -> WindowCache:
    """The state's window cache, once the call is known to continue it (new tokens only, same window)."""
    if Nq != Nk:  # (a prefill may ask for its last queries only: bottom-right aligned)
        raise ValueError(f"linear_window_decode: pass the new tokens' q, k and v alike (q has {Nq}, k {Nk}); "
                         "the earlier keys live in the state")
    cache = state.window
    if cache.window != window or cache.sinks != sinks:
        raise ValueError(f"linear_window_decode: the state was built for window {cache.window}, sinks {cache.sinks}; "
                         f"this call has window {window}, sinks {sinks}")
    return cache


def _window_terms(q: Tensor, k_BHKD: Tensor, v_BHKDv: Tensor, visible_BQK: Tensor,
                  args: _DecodeArgs) -> tuple[Tensor, Tensor, Tensor]:
    """Σ e^{s·q·k − m} v [B, H, Nq, Dv] and Σ e^{s·q·k − m} [B, H, Nq] over each query's visible step
    keys, and m [B, H, Nq, 1], the largest visible logit (0 where none is visible; detached)."""
    logits_BHQK = (q.to(args.cdt) * args.scale) @ k_BHKD.transpose(-1, -2)
    vis_B1QK = visible_BQK[:, None]
    logits_BHQK = logits_BHQK.masked_fill(~vis_B1QK, float("-inf"))
    seen_B1Q1 = vis_B1QK.any(-1, keepdim=True)
    m_BHQ1 = torch.where(seen_B1Q1, logits_BHQK.amax(-1, keepdim=True), 0.0).detach()
    w_BHQK = torch.exp(logits_BHQK - m_BHQ1)  # 0 where hidden
    return w_BHQK @ v_BHKDv, w_BHQK.sum(-1), m_BHQ1


def _far_new_keys(cache: WindowCache, step: StepKeys, keep_BN: Tensor, window: int, Nq: int) -> Tensor:
    """Bool [B, Nq, L + Nq] over buffer ‖ new columns: real, non-sink keys that are already outside the
    query's band, so that query reads them as linear keys (only when Nq > 1)."""
    cols_BK = step.columns_K[:, cache.sinks:]  # buffer ‖ new
    keep_BK = torch.cat([cache.keep_BL, keep_BN], dim=1) & ~(_is_sink(cache, cols_BK) | torch.cat(
        [torch.zeros_like(cache.keep_BL), step.new_sink_BN], dim=1))
    col_q = cache.columns + torch.arange(Nq, device=keep_BN.device)
    return keep_BK[:, None, :] & (cols_BK[:, None, :] <= (col_q - window)[None, :, None])


def _linear_terms(phi_q_BHQM: Tensor, state: LinearWindowState, cache: WindowCache, step: StepKeys,
                  k_BHKD: Tensor, v_BHKDv: Tensor, window: int, args: _DecodeArgs) -> tuple[Tensor, Tensor]:
    """φ(q)ᵀS [B, H, Nq, Dv] and φ(q)ᵀz [B, H, Nq] in true units: the state's sums plus, when Nq > 1,
    this call's own keys that a later query already sees as linear keys."""
    lin_num = phi_q_BHQM @ state.S_BHMDv
    lin_den = (phi_q_BHQM * state.z_BHM[:, :, None]).sum(-1)
    Nq = phi_q_BHQM.shape[2]
    if Nq > 1:
        far_BQK = _far_new_keys(cache, step, args.keep_BN, window, Nq)
        phi_k_BHKM = args.fmap(k_BHKD[:, :, cache.sinks:], args.scale)
        a_BHQK = (phi_q_BHQM @ phi_k_BHKM.transpose(-1, -2)) * far_BQK[:, None].to(args.cdt)
        lin_num = lin_num + a_BHQK @ v_BHKDv[:, :, cache.sinks:]
        lin_den = lin_den + a_BHQK.sum(-1)
    return lin_num, lin_den


def _step_output(q: Tensor, state: LinearWindowState, cache: WindowCache, step: StepKeys, window: int,
                 args: _DecodeArgs) -> Tensor:
    """The formula of the module docstring for the new queries, [B, H, Nq, Dv] in q's dtype."""
    k_BHKD, v_BHKDv = _per_head(step.k_BHkvKD, args.H).to(args.cdt), _per_head(step.v_BHkvKD, args.H).to(args.cdt)
    num, den, m_BHQ1 = _window_terms(q, k_BHKD, v_BHKDv, step.visible_BQK, args)
    phi_q_BHQM = args.fmap(q.to(args.cdt), args.scale)
    lin_num, lin_den = _linear_terms(phi_q_BHQM, state, cache, step, k_BHKD, v_BHKDv, window, args)
    factor_BHQ = args.beta_H[None, :, None] * torch.exp(-m_BHQ1[..., 0])
    num = num + factor_BHQ[..., None] * lin_num
    den = den + factor_BHQ * lin_den
    return (num / torch.where(den > 0, den, 1.0)[..., None]).to(q.dtype)


def _advance_state(state: LinearWindowState, cache: WindowCache, step: StepKeys, k: Tensor, v: Tensor,
                   args: _DecodeArgs) -> LinearWindowState:
    """The window cache advanced past the new tokens; keys leaving its buffer join the linear sums
    (sinks stay in their slots)."""
    Nq = k.shape[2]
    new_cache = advance_window_cache(cache, k, v, args.keep_BN, step)
    n_out = cache.k_BHkvLD.shape[2] + Nq - new_cache.k_BHkvLD.shape[2]
    S, z = state.S_BHMDv, state.z_BHM
    if n_out > 0:  # the oldest n_out columns of buffer ‖ new, which the step already concatenated
        out_cols = slice(cache.sinks, cache.sinks + n_out)
        cols_BN = step.columns_K[:, out_cols]
        L = cache.keep_BL.shape[1]
        keep_out_BN = (cache.keep_BL[:, :n_out] if n_out <= L
                       else torch.cat([cache.keep_BL, args.keep_BN[:, :n_out - L]], dim=1))
        take_BN = keep_out_BN & ~_is_sink(new_cache, cols_BN)
        dS, dz = _linear_sums(args.fmap, step.k_BHkvKD[:, :, out_cols], step.v_BHkvKD[:, :, out_cols], take_BN,
                              args.H, args.scale, args.cdt)
        S, z = S + dS, z + dz
    return LinearWindowState(new_cache, S, z)


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
    args = _resolve_args(q, k, feature_map, scale, linear_weight, key_mask)
    if state is not None and isinstance(state.window, WindowRing):
        state = LinearWindowState(cache_of_ring(state.window), state.S_BHMDv, state.z_BHM)
    if state is None or state.window.columns == 0:
        return _prefill(q, k, v, key_mask, window, sinks, args)
    cache = _checked_cache(state, q.shape[2], k.shape[2], window, sinks)
    step = window_step_keys(cache, k, v, args.keep_BN)
    out = _step_output(q, state, cache, step, window, args)  # before the cache advances
    return out, _advance_state(state, cache, step, k, v, args)


def linear_window_step_(q: Tensor, k: Tensor, v: Tensor, state: LinearWindowState, *, fmap: FeatureMap,
                        scale: float, beta_H: Tensor) -> Tensor:
    """One decoding step of a batch that never had padding, from a state whose window is a
    `WindowRing`, advanced IN PLACE: the new key takes the ring slot of the column that left the
    band, and the column leaving it next joins (S, z). The module docstring's formula, read in
    ring order; q [B, H, 1, D], k/v [B, Hkv, 1, ·]; returns out [B, H, 1, Dv]."""
    ring = state.window
    Sk, W, T = ring.sinks, ring.window, ring.columns
    B, H, _, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    G = H // Hkv
    cdt = state.S_BHMDv.dtype
    slot = Sk + T % W
    ring.k_BHkvKD[:, :, slot] = k[:, :, 0]
    ring.v_BHkvKD[:, :, slot] = v[:, :, 0]
    ring.columns += 1
    k_BHkv1KD, v_BHkv1KD = ring.k_BHkvKD.to(cdt)[:, :, None], ring.v_BHkvKD.to(cdt)[:, :, None]
    q_BHkvG1D = q.to(cdt).view(B, Hkv, G, 1, D)
    logits = (q_BHkvG1D * scale) @ k_BHkv1KD.transpose(-1, -2)  # [B, Hkv, G, 1, K]: every key visible
    m = logits.amax(-1, keepdim=True)
    w = torch.exp(logits - m)
    num = (w @ v_BHkv1KD).view(B, H, 1, Dv)
    den = w.sum(-1).view(B, H, 1)
    phi_q = fmap(q.to(cdt), scale)  # [B, H, 1, M]
    lin_num = phi_q @ state.S_BHMDv
    lin_den = (phi_q * state.z_BHM[:, :, None]).sum(-1)
    factor = beta_H[None, :, None] * torch.exp(-m.view(B, H, 1))
    num = num + factor[..., None] * lin_num
    den = den + factor * lin_den
    out = (num / torch.where(den > 0, den, 1.0)[..., None]).to(q.dtype)
    nxt = Sk + (T + 1) % W  # column T + 1 − W: leaves the band before the next query
    phi_k = fmap(_per_head(ring.k_BHkvKD[:, :, nxt:nxt + 1], H).to(cdt), scale)  # [B, H, 1, M]
    state.S_BHMDv.addcmul_(phi_k[:, :, 0, :, None], _per_head(ring.v_BHkvKD[:, :, nxt:nxt + 1], H).to(cdt)[:, :, 0, None, :])
    state.z_BHM.add_(phi_k[:, :, 0])
    return out
