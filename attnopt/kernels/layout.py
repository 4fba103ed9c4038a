"""What every op shares: the SDPA layout checks (q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]),
the compute dtype, the zero-safe normaliser ratio and the tests for tensors without values."""

from __future__ import annotations

import math
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


def values_known(t: Tensor) -> bool:
    """Whether a value check can look at `t`: not a fake tensor (torch.export) and not while
    torch.compile traces (a data-dependent branch there would only break the graph)."""
    return t.numel() > 0 and not torch.compiler.is_compiling() and not is_fake_tensor(t)


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


def check_causal_inputs(who: str, what: str, q: Tensor, k: Tensor, v: Tensor,
                        key_mask: Optional[Tensor] = None) -> None:
    """`check_sdpa_inputs`, plus Nq <= Nk: a causal op (`what` it computes) places its queries at the
    last Nq positions, so a query without a key position of its own is a caller's mistake."""
    check_sdpa_inputs(who, q, k, v, key_mask)
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"{who}: {q.shape[2]} queries but only {k.shape[2]} keys; {what} is causal and needs "
                         "Nq <= Nk (queries are the last Nq positions)")


def check_scan_options(who: str, scale, chunk_size, *, normalize: bool = False, eps: float = 0.0) -> None:
    """The options of a chunked recurrent op: `scale` a finite number or None (1/√D), `chunk_size` an
    int >= 1 or None (a one-token step has none), `normalize` a bool, `eps` a number >= 0."""
    if not isinstance(normalize, bool):
        raise TypeError(f"{who}: normalize must be a bool, got {normalize!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"{who}: scale must be a finite float or None (1/sqrt(D)), got {scale!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{who}: eps must be a float >= 0, got {eps!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{who}: chunk_size must be an int >= 1, got {chunk_size!r}")


def check_int(who: str, name: str, value, minimum: int) -> int:
    """`value` itself when it is an int (not a bool) >= `minimum`; else a TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{who}: {name} must be >= {minimum}, got {value}")
    return value
