"""The short causal depthwise convolution Gated DeltaNet puts on its keys and values, over real tokens only.

    y_t = Σ_j w_j ⊙ x_{t−K+1+j}     (j = 0 … K−1, per head and channel; the taps are the row's previous
                                      real tokens, so a pad neither enters a tap nor shifts the history)

Applied to the site's own k and v before the delta rule: initialised to the identity (w_{K−1} = 1),
so a conversion starts as the plain delta rule and the fit step and `attnopt.calibrate` learn the
local mixing. The history (the last K−1 real inputs per row) is the decode state's conv part, a fixed
[B, Hkv, K−1, W] whatever the context.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def identity_taps(heads: int, width: int, taps: int) -> Tensor:
    """Weights [heads, width, taps] of the identity convolution (only the current token, weight 1)."""
    w = torch.zeros(heads, width, taps)
    w[..., -1] = 1.0
    return w


def causal_short_conv(x_BHNW: Tensor, w_HWK: Tensor, history_BHKW: Optional[Tensor] = None,
                      keep_BN: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(y [B, H, N, W], the history after these tokens [B, H, K−1, W]) of the causal depthwise conv of x
    with taps w, continuing `history` (zeros: the sequence starts here). keep [B, N] bool: a False
    token is skipped (its output is 0, the history does not move) -- left padding is then exact."""
    B, H, N, W = x_BHNW.shape
    K = w_HWK.shape[-1]
    if history_BHKW is None:
        history_BHKW = x_BHNW.new_zeros(B, H, K - 1, W)
    w_HWK = w_HWK.to(x_BHNW.dtype)
    X = torch.cat([history_BHKW.to(x_BHNW.dtype), x_BHNW], dim=2)  # [B, H, K−1+N, W]
    if keep_BN is None:
        return _taps(X, w_HWK, N), X[:, :, X.shape[2] - (K - 1):]
    # Pack each row's real tokens to the front (history first), convolve the packed rows, read back.
    L = X.shape[2]
    keep_BL = torch.cat([keep_BN.new_ones(B, K - 1), keep_BN.bool()], dim=1)
    rank_BL = keep_BL.long().cumsum(-1) - 1  # each real column's place among its row's real columns
    slot_BL = torch.where(keep_BL, rank_BL, L)  # pads go to a spare slot no tap reads
    packed = X.new_zeros(B, H, L + 1, W).scatter(2, slot_BL[:, None, :, None].expand(B, H, L, W), X)
    y_packed = _taps(packed[:, :, :L], w_HWK, L - (K - 1))  # the packed column K−1+i's output at i
    read_BN = (rank_BL[:, K - 1:] - (K - 1)).clamp_min(0)
    y = y_packed.gather(2, read_BN[:, None, :, None].expand(B, H, N, W))
    y = y * keep_BN[:, None, :, None].to(y.dtype)
    last_B = keep_BL.long().sum(-1)  # real columns, history included: ≥ K−1
    hist_idx = last_B[:, None] - (K - 1) + torch.arange(K - 1, device=X.device)[None, :]
    return y, packed.gather(2, hist_idx[:, None, :, None].expand(B, H, K - 1, W))


def _taps(X_BHLW: Tensor, w_HWK: Tensor, n: int) -> Tensor:
    """Σ_j w_j ⊙ X[:, :, i + j] for i < n: the K shifted products, one fused multiply-add each."""
    K = w_HWK.shape[-1]
    y = X_BHLW[:, :, K - 1:K - 1 + n] * w_HWK[None, :, None, :, K - 1]
    for j in range(K - 1):
        y = y + X_BHLW[:, :, j:j + n] * w_HWK[None, :, None, :, j]
    return y
