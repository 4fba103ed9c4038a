"""Band visibility shared by the windowed Triton kernels (window, linear+window): which keys a query sees,
and the walk over them.

A query at position p sees the band (causal p − W < j <= p; bidirectional |p − j| < W) plus the
sink keys [s0, s1) of its row (the first S real tokens), among the kept keys. A program owns a block
of BQ queries (`band_queries`) and walks two key ranges (`band_part`): the sink blocks that lie
wholly before its band, then the band's blocks; `band_keys` loads each key block with its visibility.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnopt.kernels.triton.softmax import key_tile
from attnopt.kernels.triton.tiles import span

LOG2E = 1.4426950408889634


@triton.jit
def visible(p, j, keep_j, s0, s1, Nk, W, CAUSAL: tl.constexpr):
    """[BQ, BK] visibility: (band | sink) & kept & in range. p [BQ] positions, j/keep_j [BK]."""
    d = p[:, None] - j[None, :]
    is_sink = (j >= s0) & (j < s1)
    if CAUSAL:
        vis = (d >= 0) & ((d < W) | is_sink[None, :])
    else:
        vis = ((d < W) & (d > -W)) | is_sink[None, :]
    return vis & (keep_j & (j < Nk))[None, :]


@triton.jit
def key_range(p_lo, p_hi, Nk, W, BK: tl.constexpr, CAUSAL: tl.constexpr):
    """First block-aligned key and one-past-last key of the band of positions p_lo..p_hi."""
    lo = tl.maximum(p_lo - W + 1, 0)
    if CAUSAL:
        hi = tl.minimum(p_hi + 1, Nk)
    else:
        hi = tl.minimum(p_hi + W, Nk)
    return (lo // BK) * BK, hi


@triton.jit
def sinks_of(SINK, b):
    """(s0, s1): the sink keys [s0, s1) of batch row b, from SINK [B, 2] int32 (`sink_range`)."""
    return tl.load(SINK + 2 * b), tl.load(SINK + 2 * b + 1)


@triton.jit
def band_queries(SINK, b, pid_q, Nq, Nk, W, BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr):
    """Query block pid_q of batch row b (bottom-right: query i sits at p = Nk − Nq + i): (rq, q_ok, p,
    band_lo, band_hi: the keys of its band, the sinks s0, s1 of its row from SINK [B, 2] int32)."""
    rq, q_ok = span(pid_q * BQ, Nq, BQ)
    off = Nk - Nq
    band_lo, band_hi = key_range(off + pid_q * BQ, off + tl.minimum(pid_q * BQ + BQ, Nq) - 1, Nk, W, BK, CAUSAL)
    s0, s1 = sinks_of(SINK, b)
    return rq, q_ok, off + rq, band_lo, band_hi, s0, s1


@triton.jit
def band_part(part, s0, s1, band_lo, band_end, BK: tl.constexpr):
    """[start, end) of the keys a query block walks in pass `part`: 0 the sink blocks wholly before its
    band (the band pass sees the rest), 1 the band up to band_end."""
    if part == 0:
        start = (s0 // BK) * BK
        end = tl.minimum(s1, band_lo)
    else:
        start = band_lo
        end = band_end
    return start, end


@triton.jit
def band_keys(K, V, KEEP, b, hk, j0, p, s0, s1, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv, W,
              CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr):
    """Key block j0 of kv head hk: (j, k, v, keep, vis [BQ, BK]: which of them the positions p see)."""
    j = j0 + tl.arange(0, BK)
    kx, vx, keep_j = key_tile(K, V, KEEP, b, hk, j, j < Nk, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv,
                              HAS_KEEP, BD, BV)
    return j, kx, vx, keep_j, visible(p, j, keep_j, s0, s1, Nk, W, CAUSAL)


def clamp_window(window: int, Nq: int, Nk: int) -> int:
    """The window the kernels take: one wider than every query-key distance sees nothing more, and the
    clamp keeps the positions p ± W in int32."""
    return min(window, Nk + abs(Nk - Nq) + Nq + 1)


def sink_range(key_mask: Optional[Tensor], B: int, Nk: int, sinks: int, device) -> Tensor:
    """int32 [B, 2]: (s0, s1) with the sinks = kept keys in [s0, s1), the first `sinks` real tokens."""
    if sinks <= 0 or Nk == 0:
        return torch.zeros(B, 2, dtype=torch.int32, device=device)
    if key_mask is None:
        return torch.tensor([[0, min(sinks, Nk)]] * B, dtype=torch.int32, device=device)
    count = key_mask.to(torch.int32).cumsum(1)
    s0 = (count == 0).sum(1)  # index of the first kept key (Nk if none)
    s1 = ((count < sinks).sum(1) + 1).clamp(max=Nk)  # one past the sinks-th kept key
    return torch.stack([s0, torch.maximum(s0, s1)], 1).to(torch.int32).contiguous()
