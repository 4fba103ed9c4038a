"""The decay form's fixed vocabulary, shared by the PyTorch op and its Triton kernel: RetNet's
per-head schedule and the feature maps φ the recurrence accepts."""

from __future__ import annotations

import torch
from torch import Tensor

DECAY_FEATURE_MAPS = ("identity", "elu", "relu")


def retnet_decay(heads: int) -> Tensor:
    """RetNet's per-head decays γ_h = 1 - 2^(-5-h), h = 0..heads-1, as float64 [heads]."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"retnet_decay: heads must be a positive int, got {heads!r}")
    return 1.0 - torch.pow(2.0, -5.0 - torch.arange(heads, dtype=torch.float64))
