"""Band visibility shared by the windowed Triton kernels (window, linear+window): which keys a query sees.

A query at position p sees the band (causal p − W < j <= p; bidirectional |p − j| < W) plus the
sink keys [s0, s1) of its row (the first S real tokens), among the kept keys.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

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
