"""Decoding gla+window from a fixed-size state: a window cache, a gated state and decayed key features.

The state holds
* window.decode's cache: each row's S sinks and its last W − 1 columns (raw k and v);
* the gated state S [B, Hkv, M, Dv + 1] of every kept, non-sink key that has left the buffer --
  Σ_j exp(Σ_{j<t<=T} g_t) φ(kⱼ)[vⱼ, 1]ᵀ, decayed up to the last absorbed column T (the last column
  carries the denominator);
* for each buffered column j, φ(kⱼ) decayed the same way, exp(Σ_{j<t<=T} g_t) φ(kⱼ) [B, Hkv, L, M]
  (0 for a sink or a dropped column), so that a key leaving the buffer joins S already decayed.

A step with one new token t: every decay advances by exp(g_t) (1 for a dropped token), the query
reads S (the keys j <= t − W) and the window (sinks, buffer, itself) exactly as `reference.py`, both
combined by `reference.combine`; then the oldest buffered column leaves into S. Memory O(S + W·(D +
M) + M·Dv) per kv head at any length; a step costs O((S + W)·(D + Dv) + M·(W + Dv)). A call with
several new tokens after a state runs them one by one (generation and chunked prefill are rare
enough that the loop is the simple, exact choice); a prefill (state None) runs the op once.

Letters as in reference.py; T columns absorbed, L <= W − 1 buffered columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from attnopt.forms.gla.reference import rev_cumsum_exclusive
from attnopt.forms.gla_window.reference import (
    beta_tensor,
    check_inputs,
    combine,
    gla_window_attention,
)
from attnopt.forms.window.decode import (
    WindowCache,
    advance_window_cache,
    window_cache_from_keys,
    window_step_keys,
)
from attnopt.forms.window.reference import sink_key_mask
from attnopt.kernels.layout import compute_dtype

__all__ = ["GlaWindowState", "gla_window_decode"]


@dataclass
class GlaWindowState:
    """Window cache, the gated state of the keys that left it, and the buffered keys' decayed φ(k)."""

    window: WindowCache
    S_BHkvMW: Tensor  # W = Dv + 1: the last column is the denominator's state
    phi_BHkvLM: Tensor  # aligned with window.k_BHkvLD


def _gates4(g: Tensor) -> Tensor:
    return g if g.dim() == 4 else g[..., None]


def _prefill(q, k, v, phi_q, phi_k, g, keep, key_mask, window, sinks, scale, beta):
    out = gla_window_attention(q, k, v, phi_q, phi_k, g, window=window, sinks=sinks, scale=scale, linear_weight=beta,
                               key_mask=key_mask)
    cdt = compute_dtype(q.dtype)
    B, Nk = k.shape[0], k.shape[2]
    cache = window_cache_from_keys(k, v, key_mask, window=window, sinks=sinks)
    g4 = _gates4(g).to(cdt) * keep[:, None, :, None].to(cdt)
    take = keep & ~sink_key_mask(key_mask, sinks, B, Nk, q.device)
    decayed = phi_k.to(cdt) * torch.exp(rev_cumsum_exclusive(g4, dim=2)) * take[:, None, :, None].to(cdt)
    start = max(Nk - (window - 1), 0)  # columns before it already left the buffer
    v1 = torch.cat([v.to(cdt), torch.ones_like(v[..., :1], dtype=cdt)], dim=-1)
    S = decayed[:, :, :start].transpose(-1, -2) @ v1[:, :, :start]
    return out, GlaWindowState(cache, S, decayed[:, :, start:].contiguous())


def _step(q, k, v, phi_q, g, keep, state: GlaWindowState, scale: float, beta_H: Tensor, phi_k):
    """One new column for every row: (out [B, H, 1, Dv], the advanced state)."""
    cdt = compute_dtype(q.dtype)
    cache = state.window
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    a = torch.exp(_gates4(g).to(cdt)[:, :, 0] * keep[:, :, None].to(cdt))  # [B, Hkv, Mg]: 1 for a dropped token
    S = a[..., None] * state.S_BHkvMW
    lin = (phi_q.to(cdt).reshape(B, Hkv, H // Hkv, -1) @ S).reshape(B, H, 1, -1)
    step = window_step_keys(cache, k, v, keep)
    logits = (q.to(cdt) * scale) @ step.k_BHkvKD.to(cdt).repeat_interleave(H // Hkv, 1).transpose(-1, -2)
    vis = step.visible_BQK[:, None]  # [B, 1, 1, K]
    logits = logits.masked_fill(~vis, float("-inf"))
    m = logits.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - m)
    den = e.sum(-1, keepdim=True)
    o_w = (e @ step.v_BHkvKD.to(cdt).repeat_interleave(H // Hkv, 1)) / torch.where(den > 0, den, 1.0)
    lse = torch.where(den > 0, m + torch.log(torch.where(den > 0, den, 1.0)), float("-inf"))[..., 0]
    out = combine(o_w, lse, lin, beta_H).to(q.dtype)

    new_cache = advance_window_cache(cache, k, v, keep, step)
    take = (keep & ~step.new_sink_BN)[:, None, :, None].to(cdt)
    phi_all = torch.cat([state.phi_BHkvLM * a[:, :, None, :], phi_k.to(cdt) * take], dim=2)
    n_out = phi_all.shape[2] - new_cache.k_BHkvLD.shape[2]
    if n_out > 0:  # the oldest buffered column leaves the window: it joins S, already decayed
        S_ = cache.sinks
        v_out = step.v_BHkvKD[:, :, S_:S_ + n_out].to(cdt)
        S = S + phi_all[:, :, :n_out].transpose(-1, -2) @ torch.cat([v_out, torch.ones_like(v_out[..., :1])], dim=-1)
    return out, GlaWindowState(new_cache, S, phi_all[:, :, n_out:])


def gla_window_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    phi_q: Tensor,
    phi_k: Tensor,
    g: Tensor,
    state: Optional[GlaWindowState],
    *,
    window: int,
    sinks: int = 0,
    scale: Optional[float] = None,
    linear_weight: Union[float, Tensor] = 1.0,
    key_mask: Optional[Tensor] = None,
) -> tuple[Tensor, GlaWindowState]:
    """gla+window attention of the new tokens (q [B, H, Nq, D], k/v [B, Hkv, Nq, ·], their φ and
    gates as for `gla_window_attention`) after the state's columns; returns (out [B, H, Nq, Dv], the
    advanced state). `state` None starts a sequence (the prefill may pass only its last queries,
    bottom-right aligned). A prefill plus any split into steps equals one `gla_window_attention` call."""
    check_inputs(q, k, v, phi_q, phi_k, g, key_mask, window, sinks, who="gla_window_decode")
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    beta = beta_tensor(linear_weight, q.shape[1], q)
    keep = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    if state is None or state.window.columns == 0:
        return _prefill(q, k, v, phi_q, phi_k, g, keep, key_mask, window, sinks, s, beta)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"gla_window_decode: pass the new tokens' q, k and v alike (q has {q.shape[2]}, k "
                         f"{k.shape[2]}); the earlier keys live in the state")
    if state.window.window != window or state.window.sinks != sinks:
        raise ValueError(f"gla_window_decode: the state was built for window {state.window.window}, sinks "
                         f"{state.window.sinks}; this call has window {window}, sinks {sinks}")
    outs = []
    for t in range(q.shape[2]):
        one = slice(t, t + 1)
        out, state = _step(q[:, :, one], k[:, :, one], v[:, :, one], phi_q[:, :, one], g[:, :, one], keep[:, one],
                           state, s, beta, phi_k[:, :, one])
        outs.append(out)
    return torch.cat(outs, dim=2), state
