"""Decoding window attention from a fixed-size cache: each row's S sinks and the last W − 1 columns.

The cache replaces the KV cache of a causal window site (and the window half of linear+window):
after any number of tokens it holds at most S + W − 1 keys per row, so memory and per-token work
stay O(S + W). `window_decode(q, k, v, cache, ...)` attends the new tokens -- the last Nq columns of
the sequence -- to the cache plus themselves, by exactly `window_attention`'s rule (window.py: a
causal band of W keys including self; sinks = each row's first S kept keys, counted in real tokens
so that left padding changes nothing), and returns the cache advanced by them. Causal only: a
bidirectional band would need keys that do not exist yet.

A column is one position of the batch tensor (pads included); `keep` marks the real ones. The
buffer is the last min(T, W − 1) columns with their keep flags; a sink is stored with its column,
and it is read through the buffer while it lies inside the band (counted once, as in window.py).
A row with fewer than S real tokens so far has empty sink slots that later real tokens fill.

Letters as in window.py; T columns absorbed so far, L ≤ W − 1 buffered columns, K = S + L + Nq keys
a step reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.window.reference import first_real_keys, window_attention
from attnopt.kernels.layout import check_sdpa_inputs, compute_dtype
from attnopt.kernels.token_step import NativeCall

__all__ = ["WindowCache", "WindowRing", "window_decode", "window_cache_from_keys", "window_step_keys", "RingStep",
           "ring_of", "cache_of_ring"]


@dataclass
class WindowCache:
    """Fixed-size decode cache of a causal window site (batch dimension first in every tensor)."""

    k_BHkvLD: Tensor
    v_BHkvLD: Tensor
    keep_BL: Tensor  # bool: the buffered column is a real token
    sink_k_BHkvSD: Tensor
    sink_v_BHkvSD: Tensor
    sink_col_BS: Tensor  # long: the column each sink sits in
    sink_valid_BS: Tensor  # bool: the slot holds a sink (rows with < S real tokens have empty slots)
    columns: int  # T: columns absorbed so far
    window: int
    sinks: int


def _check_window(window: int, sinks: int) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window_decode: window must be an int >= 1, got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"window_decode: sinks must be an int >= 0, got {sinks!r}")


def _empty(k: Tensor, v: Tensor, window: int, sinks: int) -> WindowCache:
    B, Hkv, _, D = k.shape
    Dv = v.shape[-1]
    return WindowCache(
        k.new_zeros(B, Hkv, 0, D), v.new_zeros(B, Hkv, 0, Dv), torch.zeros(B, 0, dtype=torch.bool, device=k.device),
        k.new_zeros(B, Hkv, sinks, D), v.new_zeros(B, Hkv, sinks, Dv),
        torch.zeros(B, sinks, dtype=torch.long, device=k.device), torch.zeros(B, sinks, dtype=torch.bool, device=k.device),
        0, window, sinks,
    )


def window_cache_from_keys(k: Tensor, v: Tensor, keep_BN: Optional[Tensor], *, window: int, sinks: int) -> WindowCache:
    """The cache after a prefill of these keys (columns 0..N−1): their sinks and last W − 1 columns."""
    _check_window(window, sinks)
    B, N = k.shape[0], k.shape[2]
    keep = torch.ones(B, N, dtype=torch.bool, device=k.device) if keep_BN is None else keep_BN
    cache = _empty(k, v, window, sinks)
    S = min(sinks, N)
    if S:
        j_BS, valid_BS = first_real_keys(keep, S, B, N, k.device)
        idx = j_BS[:, None, :, None]
        cache.sink_k_BHkvSD[:, :, :S] = torch.gather(k, 2, idx.expand(-1, k.shape[1], -1, k.shape[3]))
        cache.sink_v_BHkvSD[:, :, :S] = torch.gather(v, 2, idx.expand(-1, v.shape[1], -1, v.shape[3]))
        cache.sink_col_BS[:, :S] = j_BS
        cache.sink_valid_BS[:, :S] = valid_BS
    start = max(N - (window - 1), 0)
    return replace(cache, k_BHkvLD=k[:, :, start:].contiguous(), v_BHkvLD=v[:, :, start:].contiguous(),
                   keep_BL=keep[:, start:].contiguous(), columns=N)


@dataclass
class StepKeys:
    """The keys a step reads (sinks ‖ buffer ‖ new) and which query sees which of them."""

    k_BHkvKD: Tensor
    v_BHkvKD: Tensor
    visible_BQK: Tensor  # bool
    columns_K: Tensor  # long [B, K]: the column of each key (sinks per row)
    new_sink_BN: Tensor  # bool [B, Nq]: the new token fills a sink slot
    new_rank_BN: Tensor  # long [B, Nq]: 1-based count of sinks once this token is counted


def window_step_keys(cache: WindowCache, k: Tensor, v: Tensor, keep_BN: Tensor) -> StepKeys:
    """Every key the new queries may see, with window.py's visibility rule, in O(Nq·(S + W + Nq))."""
    W, T, dev = cache.window, cache.columns, k.device
    Nq, L = k.shape[2], cache.k_BHkvLD.shape[2]
    if Nq == 1:
        return _one_token_keys(cache, k, v, keep_BN)
    col_q = T + torch.arange(Nq, device=dev)  # [Nq]
    col_buf = torch.arange(T - L, T, device=dev)
    rank_BN = cache.sink_valid_BS.sum(-1, keepdim=True) + keep_BN.long().cumsum(-1)
    new_sink_BN = keep_BN & (rank_BN <= cache.sinks)
    d_new = col_q[:, None] - col_q[None, :]  # [Nq, Nq]: query column minus key column
    vis_new = keep_BN[:, None, :] & (d_new >= 0) & ((d_new < W) | new_sink_BN[:, None, :])
    vis_buf = cache.keep_BL[:, None, :] & ((col_q[:, None] - col_buf[None, :]) < W)
    # A sink inside the band is read through the buffer; outside it, from its slot.
    vis_sink = cache.sink_valid_BS[:, None, :] & (cache.sink_col_BS[:, None, :] <= (col_q - W)[None, :, None])
    B = k.shape[0]
    columns_K = torch.cat([cache.sink_col_BS, col_buf.expand(B, L), col_q.expand(B, Nq)], dim=1)
    return StepKeys(
        torch.cat([cache.sink_k_BHkvSD, cache.k_BHkvLD, k], dim=2),
        torch.cat([cache.sink_v_BHkvSD, cache.v_BHkvLD, v], dim=2),
        torch.cat([vis_sink, vis_buf, vis_new], dim=2), columns_K, new_sink_BN, rank_BN,
    )


def _one_token_keys(cache: WindowCache, k: Tensor, v: Tensor, keep_BN: Tensor) -> StepKeys:
    """`window_step_keys` for one new token, the decoding hot path: the whole buffer lies in its band."""
    W, T, B, L = cache.window, cache.columns, k.shape[0], cache.k_BHkvLD.shape[2]
    rank_BN = cache.sink_valid_BS.sum(-1, keepdim=True) + keep_BN.long()
    new_sink_BN = keep_BN & (rank_BN <= cache.sinks)
    vis_sink = cache.sink_valid_BS & (cache.sink_col_BS <= T - W)
    visible = torch.cat([vis_sink, cache.keep_BL, keep_BN], dim=1)[:, None, :]
    col_buf = torch.arange(T - L, T + 1, device=k.device).expand(B, L + 1)
    return StepKeys(
        torch.cat([cache.sink_k_BHkvSD, cache.k_BHkvLD, k], dim=2),
        torch.cat([cache.sink_v_BHkvSD, cache.v_BHkvLD, v], dim=2),
        visible, torch.cat([cache.sink_col_BS, col_buf], dim=1), new_sink_BN, rank_BN,
    )


def advance_window_cache(cache: WindowCache, k: Tensor, v: Tensor, keep_BN: Tensor, step: StepKeys) -> WindowCache:
    """The cache after the new columns: new sinks fill their slots, the buffer keeps the last W − 1 columns."""
    sink_k, sink_v = cache.sink_k_BHkvSD, cache.sink_v_BHkvSD
    sink_col, sink_valid = cache.sink_col_BS, cache.sink_valid_BS
    if cache.sinks and bool(step.new_sink_BN.any()):
        sink_k, sink_v, sink_col, sink_valid = sink_k.clone(), sink_v.clone(), sink_col.clone(), sink_valid.clone()
        b_idx, n_idx = step.new_sink_BN.nonzero(as_tuple=True)
        slot = step.new_rank_BN[b_idx, n_idx] - 1
        sink_k[b_idx, :, slot] = k[b_idx, :, n_idx]
        sink_v[b_idx, :, slot] = v[b_idx, :, n_idx]
        sink_col[b_idx, slot] = cache.columns + n_idx
        sink_valid[b_idx, slot] = True
    keep_all = cache.window - 1
    S = cache.sinks
    k_all, v_all = step.k_BHkvKD[:, :, S:], step.v_BHkvKD[:, :, S:]  # buffer ‖ new, already concatenated
    m_all = torch.cat([cache.keep_BL, keep_BN], dim=1)
    start = max(k_all.shape[2] - keep_all, 0)
    return WindowCache(k_all[:, :, start:], v_all[:, :, start:], m_all[:, start:], sink_k, sink_v, sink_col, sink_valid,
                       cache.columns + k.shape[2], cache.window, cache.sinks)


@dataclass
class WindowRing:
    """The same cache for a batch that never had padding, in one buffer per K and V that a step
    writes in place: S sink slots, then a ring of W slots where column c lives in slot S + c mod W.

    Held from column W + S − 1 on (`ring_of`): then every sink lies outside the band and every
    ring slot holds one of the band's W columns, so a step reads all S + W keys with no mask.
    Between steps the ring's slot for the next column holds the column that leaves the band.
    """

    k_BHkvKD: Tensor  # K = S + W
    v_BHkvKD: Tensor
    columns: int
    window: int
    sinks: int


def ring_ready(cache: WindowCache) -> bool:
    """Whether the next step may run from a ring (`RingStep`): a full band with sinks outside it."""
    return cache.columns >= cache.window + cache.sinks - 1 and cache.k_BHkvLD.shape[2] == cache.window - 1


def ring_of(cache: WindowCache) -> WindowRing:
    """The ring holding `cache` (which must be `ring_ready` and come from a batch without padding:
    sinks in columns 0..S − 1, every buffered column real)."""
    S, W, T = cache.sinks, cache.window, cache.columns
    k, v = cache.k_BHkvLD, cache.v_BHkvLD
    B, Hkv = k.shape[0], k.shape[1]
    ring_k = k.new_zeros(B, Hkv, S + W, k.shape[3])
    ring_v = v.new_zeros(B, Hkv, S + W, v.shape[3])
    ring_k[:, :, :S], ring_v[:, :, :S] = cache.sink_k_BHkvSD, cache.sink_v_BHkvSD
    slots = S + torch.arange(T - (W - 1), T, device=k.device) % W
    ring_k[:, :, slots], ring_v[:, :, slots] = k, v
    return WindowRing(ring_k, ring_v, T, W, S)


def cache_of_ring(ring: WindowRing) -> WindowCache:
    """The general cache of a ring (for a step the ring cannot take: padding, several tokens)."""
    S, W, T = ring.sinks, ring.window, ring.columns
    slots = S + torch.arange(T - (W - 1), T, device=ring.k_BHkvKD.device) % W
    B, dev = ring.k_BHkvKD.shape[0], ring.k_BHkvKD.device
    return WindowCache(ring.k_BHkvKD[:, :, slots], ring.v_BHkvKD[:, :, slots],
                       torch.ones(B, W - 1, dtype=torch.bool, device=dev),
                       ring.k_BHkvKD[:, :, :S].clone(), ring.v_BHkvKD[:, :, :S].clone(),
                       torch.arange(S, device=dev).expand(B, S).clone(), torch.ones(B, S, dtype=torch.bool, device=dev),
                       T, W, S)


class RingStep:
    """One decoding step from a ring, written IN PLACE (`SiteModule.token_stepper`): called with
    q [B, H, 1, D], k/v [B, Hkv, 1, ·], it writes the new column into its slot, advances the ring
    by one and returns out [B, 1, H, Dv]: `window_decode`'s keys, read in ring order, in the layout
    attention functions hand back."""

    __slots__ = ("state", "q_dtype", "_cdt", "_scale", "_gqa", "_slots", "_inference", "_native")

    def __init__(self, ring: WindowRing, q_dtype: torch.dtype, scale: Optional[float], gqa: bool):
        self.state, self.q_dtype, self._cdt, self._scale, self._gqa = ring, q_dtype, compute_dtype(q_dtype), scale, gqa
        # Each slot's K and V column views, made on the slot's first write and kept (the ring's
        # buffers are fixed while this step holds it): a write is then one copy.
        self._slots: list = [None] * (ring.sinks + ring.window)
        # A ring of inference tensors takes writes only inside inference mode (see PackedStateStep).
        self._inference = ring.k_BHkvKD.is_inference() or torch.is_inference_mode_enabled()
        # The whole step in one C call: made on the first call (H is known then); False where it cannot be.
        self._native = None if q_dtype == torch.float32 else False

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ring = self.state
        slot = ring.sinks + ring.columns % ring.window
        nat = self._native
        if nat is None:
            scale = 1.0 / math.sqrt(q.shape[-1]) if self._scale is None else self._scale
            nat = self._native = NativeCall.ring(ring.k_BHkvKD, ring.v_BHkvKD, q.shape[1], scale) or False
        if nat and nat.takes(q, k, v):
            out = nat(q, k, v, slot)
            ring.columns += 1
            return out
        if self._inference:
            with torch._C._InferenceMode(True):
                self._write(slot, k, v)
        else:
            self._write(slot, k, v)
        ring.columns += 1
        keys, values = ring.k_BHkvKD, ring.v_BHkvKD
        if q.dtype != self._cdt:
            q, keys, values = q.to(self._cdt), keys.to(self._cdt), values.to(self._cdt)
        out = F.scaled_dot_product_attention(q, keys, values, scale=self._scale, enable_gqa=self._gqa).transpose(1, 2)
        return out if out.dtype == self.q_dtype else out.to(self.q_dtype)

    def _write(self, slot: int, k: Tensor, v: Tensor) -> None:
        views = self._slots[slot]
        if views is None:
            ring = self.state
            views = self._slots[slot] = (ring.k_BHkvKD.narrow(2, slot, 1), ring.v_BHkvKD.narrow(2, slot, 1))
        views[0].copy_(k)
        views[1].copy_(v)


def window_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: Optional[WindowCache],
    *,
    window: int,
    sinks: int = 0,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
) -> tuple[Tensor, WindowCache]:
    """Causal window (+ sinks) attention of the new tokens q [B, H, Nq, D], k/v [B, Hkv, Nq, ·] placed
    after the cache's columns; returns (out [B, H, Nq, Dv], advanced cache).

    `cache` None starts a sequence (the prefill then runs `window_attention`'s blockwise kernel).
    `key_mask` [B, Nq] bool marks the new tokens that are real. A prefill may pass only its last
    queries (q shorter than k, bottom-right aligned); steps pass q, k and v of the same tokens. A prefill followed by any split
    into steps equals one `window_attention(causal=True)` call over the whole sequence.
    Cost per call O(Nq·(S + W + Nq)·(D + Dv)); the cache holds S + W − 1 keys per row.
    """
    check_sdpa_inputs("window_decode", q, k, v, key_mask)
    _check_window(window, sinks)
    if isinstance(cache, WindowRing):
        cache = cache_of_ring(cache)
    if cache is not None and (cache.window != window or cache.sinks != sinks):
        raise ValueError(f"window_decode: the cache was built for window {cache.window}, sinks {cache.sinks}; "
                         f"this call has window {window}, sinks {sinks}")
    keep = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if key_mask is None else key_mask
    if cache is None or cache.columns == 0:
        out = window_attention(q, k, v, window=window, causal=True, sinks=sinks, scale=scale, key_mask=key_mask)
        return out, window_cache_from_keys(k, v, key_mask, window=window, sinks=sinks)
    if q.shape[2] != k.shape[2]:  # (a prefill may ask for its last queries only: bottom-right aligned)
        raise ValueError(f"window_decode: pass the new tokens' q, k and v alike (q has {q.shape[2]}, k {k.shape[2]}); "
                         "the earlier keys live in the cache")
    step = window_step_keys(cache, k, v, keep)
    cdt = compute_dtype(q.dtype)
    vis = step.visible_BQK[:, None]  # [B, 1, Nq, K]
    out = F.scaled_dot_product_attention(q.to(cdt), step.k_BHkvKD.to(cdt), step.v_BHkvKD.to(cdt), attn_mask=vis,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    out = torch.where(vis.any(-1, keepdim=True), out, 0.0).to(q.dtype)  # no visible key: 0, as window_attention
    return out, advance_window_cache(cache, k, v, keep, step)
