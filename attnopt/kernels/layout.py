"""What every op shares: the SDPA layout checks (q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]),
the compute dtype, the zero-safe normaliser ratio and the fake-tensor test."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 accumulate in fp32; fp32 and fp64 keep their own precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ratio_or_zero(num: Tensor, den: Tensor, eps: float) -> Tensor:
    """num / (den + eps); a row whose denominator is exactly 0 (φ(q)ᵀz = 0, eps = 0) is 0, not NaN."""
    den = den + eps
    return num / torch.where(den == 0, torch.ones_like(den), den)


def is_fake_tensor(t: Tensor) -> bool:
    """Whether t is a fake tensor (torch.export / AOT tracing): it has a shape but no values."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def check_sdpa_inputs(who: str, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor] = None) -> None:
    """Raise a TypeError/ValueError that says what to change when q, k, v or key_mask break the layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{who}: {name} must be 4-D [B, heads, N, dim] (SDPA layout), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{who}: {name} must be floating point, got {t.dtype}")
    B, H, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"{who}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{who}: k has {k.shape[1]} heads but v has {v.shape[1]}; they must match")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{who}: k has {k.shape[2]} keys but v has {v.shape[2]} values; they must match")
    if k.shape[3] != D:
        raise ValueError(f"{who}: q head dim {D} != k head dim {k.shape[3]}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{who}: query heads H={H} must be a multiple of key/value heads Hkv={Hkv} (GQA)")
    if key_mask is not None:
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            raise TypeError(f"{who}: key_mask must be a bool tensor [B, Nk] with True = keep")
        if tuple(key_mask.shape) != (B, k.shape[2]):
            raise ValueError(f"{who}: key_mask must have shape [B, Nk] = {(B, k.shape[2])}, got {tuple(key_mask.shape)}")
