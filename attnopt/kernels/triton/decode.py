"""One-token decode steps on fixed-size states, as Triton kernels (forward only: decoding).

* `linear_decode_step`: the linear-attention state (S [B, H, M, Dv], z [B, H, M]) of
  `attnopt.kernels.linear.linear_attention(..., state=)`: S += φ(k)vᵀ, z += φ(k), then
  o = φ(q)ᵀS / (φ(q)ᵀz + eps) -- the new token sees itself, as in the prefill.
* `decay_decode_step`: `attnopt.kernels.decay.decay_attention_step`'s state (S, z-or-None):
  S = γ_h S + φ(k)vᵀ (z likewise), o = s·φ(q)ᵀS, or normalised.
  Both share `_state_step_kernel`: one program per (batch, query head, value block) reads its
  [M, BV] slice of S once and writes the updated slice to a new tensor (states stay functional).
* `window_decode_step`: sliding window + sinks over a fixed cache of S + W slots -- S sink slots
  (token p < S goes to slot p) and a ring of W (token p >= S goes to slot S + p mod W, overwriting
  the token that just left the window) -- with the slots' positions (−1 = empty). The query at
  position p sees sink slots and ring slots with position > p − W, so a sink inside the window is
  counted once. Padding is not modelled: every token is real (the first S tokens are the sinks).

States are fp32 (the reference ops' compute dtype for fp16/bf16 inputs); outputs are q's dtype.
Fused feature maps only (elu, relu, identity for decay).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnopt.kernels.triton.chunk_scan import _phi
from attnopt.kernels.triton.decay import _gamma
from attnopt.kernels.triton.runtime import FMAP_CODES, interpreting, pow2, require_runtime
from attnopt.kernels.triton.window import LOG2E


@triton.jit
def _state_step_kernel(
    Q, K, V, S, Z, LOG2G, O, S_OUT, Z_OUT,
    H, M, Dv, G, scale, eps,
    FMAP: tl.constexpr, HAS_DECAY: tl.constexpr, NORMALIZE: tl.constexpr, HAS_Z: tl.constexpr,
    BM: tl.constexpr, BV: tl.constexpr,
):
    """q [B, H, M], k [B, Hkv, M], v [B, Hkv, Dv] (one token, contiguous); S [B, H, M, Dv], Z [B, H, M] fp32."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = b * (H // G) + h // G
    rm = tl.arange(0, BM)
    rv = pid_v * BV + tl.arange(0, BV)
    m_ok = rm < M
    v_ok = rv < Dv
    fq = tl.where(m_ok, _phi(tl.load(Q + pid_bh * M + rm, mask=m_ok, other=0.0).to(tl.float32), FMAP), 0.0)
    fk = tl.where(m_ok, _phi(tl.load(K + hk * M + rm, mask=m_ok, other=0.0).to(tl.float32), FMAP), 0.0)
    vx = tl.load(V + hk * Dv + rv, mask=v_ok, other=0.0).to(tl.float32)
    st_ptr = (pid_bh * M + rm)[:, None] * Dv + rv[None, :]
    mv = m_ok[:, None] & v_ok[None, :]
    st = tl.load(S + st_ptr, mask=mv, other=0.0)
    if HAS_DECAY:
        gamma = tl.exp2(tl.load(LOG2G + h))
        st = st * gamma
    st = st + fk[:, None] * vx[None, :]
    tl.store(S_OUT + st_ptr, st, mask=mv)
    num = tl.sum(fq[:, None] * st, axis=0)
    if HAS_Z:
        z = tl.load(Z + pid_bh * M + rm, mask=m_ok, other=0.0)
        if HAS_DECAY:
            z = z * gamma
        z = z + fk
        if pid_v == 0:
            tl.store(Z_OUT + pid_bh * M + rm, z, mask=m_ok)
    if NORMALIZE:
        den = tl.sum(fq * z, axis=0) + eps
        out = num / tl.where(den == 0.0, 1.0, den)
    else:
        out = num * scale
    tl.store(O + pid_bh * Dv + rv, out.to(O.dtype.element_ty), mask=v_ok)


@triton.jit
def _ring_attend_kernel(
    Q, KC, VC, POS, O,
    H, L, D, Dv, G, NS, W, p, scale2,
    BL: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """Softmax of one query (position p) over the cache slots it sees: the NS sink slots and the ring
    slots still inside the window. KC/VC [B, Hkv, L, ·], POS [B, L] int32 (−1 = empty)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    hk = b * (H // G) + h // G
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    d_ok = rd < D
    v_ok = rv < Dv
    q = tl.load(Q + pid_bh * D + rd, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.full([1], -1.0e30, dtype=tl.float32)
    l = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BV], dtype=tl.float32)
    for s0 in range(0, L, BL):
        sl = s0 + tl.arange(0, BL)
        sl_ok = sl < L
        pos = tl.load(POS + b * L + sl, mask=sl_ok, other=-1)
        vis = sl_ok & (pos >= 0) & (pos <= p) & ((sl < NS) | (pos > p - W))
        kx = tl.load(KC + (hk * L + sl)[:, None] * D + rd[None, :], mask=sl_ok[:, None] & d_ok[None, :], other=0.0)
        vx = tl.load(VC + (hk * L + sl)[:, None] * Dv + rv[None, :], mask=sl_ok[:, None] & v_ok[None, :], other=0.0)
        s = tl.sum(kx.to(tl.float32) * q[None, :], axis=1) * scale2
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        pr = tl.exp2(s - m_new)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(pr, axis=0)
        acc = acc * alpha + tl.sum(pr[:, None] * vx.to(tl.float32), axis=0)
        m = m_new
    out = acc / tl.where(l > 0.0, l, 1.0)
    tl.store(O + pid_bh * Dv + rv, out.to(O.dtype.element_ty), mask=v_ok)


def _one_token(who: str, q_t: Tensor, k_t: Tensor, v_t: Tensor) -> None:
    for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if t.dim() != 4 or t.shape[2] != 1:
            raise ValueError(f"{who}: {name} must be one token [B, heads, 1, dim], got {tuple(t.shape)}")
    if q_t.shape[1] % k_t.shape[1] != 0:
        raise ValueError(f"{who}: H={q_t.shape[1]} is not a multiple of Hkv={k_t.shape[1]}")
    require_runtime(who, q_t)


def _state_step(q_t, k_t, v_t, S, z, log2g, fmap, normalize, scale, eps):
    B, H, _, M = q_t.shape
    Dv = v_t.shape[3]
    G = H // k_t.shape[1]
    S_out = torch.empty(B, H, M, Dv, device=q_t.device, dtype=torch.float32)
    z_out = torch.empty(B, H, M, device=q_t.device, dtype=torch.float32) if z is not None else None
    out = torch.empty(B, H, 1, Dv, device=q_t.device, dtype=q_t.dtype)
    BV = min(64, pow2(Dv))
    S = S.to(torch.float32).contiguous()
    zz = z.to(torch.float32).contiguous() if z is not None else S
    _state_step_kernel[(B * H, triton.cdiv(Dv, BV))](
        q_t.contiguous(), k_t.contiguous(), v_t.contiguous(), S, zz, q_t if log2g is None else log2g, out, S_out,
        S_out if z_out is None else z_out, H, M, Dv, G, scale, eps,
        FMAP=fmap, HAS_DECAY=log2g is not None, NORMALIZE=normalize, HAS_Z=z is not None, BM=pow2(M), BV=BV,
    )
    return out, S_out, z_out


def linear_decode_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[tuple], *, feature_map: str = "elu", eps: float = 1e-6
):
    """One token of causal linear attention. state (S [B, H, M, Dv], z [B, H, M]) or None (zeros).
    Returns (o_t [B, H, 1, Dv], (S, z)), the layout of `linear_attention(..., state=)`."""
    who = "linear_decode_step"
    _one_token(who, q_t, k_t, v_t)
    if feature_map not in ("elu", "relu"):
        raise ValueError(f"{who}: only the fused maps elu / relu decode on the Triton path, got {feature_map!r}")
    B, H, _, M = q_t.shape
    Dv = v_t.shape[3]
    if state is None:
        state = (q_t.new_zeros(B, H, M, Dv, dtype=torch.float32), q_t.new_zeros(B, H, M, dtype=torch.float32))
    S, z = state
    out, S, z = _state_step(q_t, k_t, v_t, S, z, None, FMAP_CODES[feature_map], True, 1.0, float(eps))
    return out, (S, z)


def decay_decode_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    state: Optional[tuple],
    *,
    decay: Union[None, float, Sequence[float], Tensor] = None,
    feature_map: str = "identity",
    normalize: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
):
    """`attnopt.kernels.decay.decay_attention_step` on a Triton kernel; same arguments and result."""
    who = "decay_decode_step"
    _one_token(who, q_t, k_t, v_t)
    B, H, _, D = q_t.shape
    Dv = v_t.shape[3]
    if state is None:
        state = (q_t.new_zeros(B, H, D, Dv, dtype=torch.float32),
                 q_t.new_zeros(B, H, D, dtype=torch.float32) if normalize else None)
    S, z = state
    if normalize and z is None:
        raise ValueError(f"{who}: normalize=True needs the state's z [B, H, D]")
    log2g = torch.log2(_gamma(decay, H)).to(device=q_t.device, dtype=torch.float32)
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out, S, z = _state_step(q_t, k_t, v_t, S, z if normalize else None, log2g, FMAP_CODES[feature_map],
                            bool(normalize), s, float(eps))
    return out, (S, z)


def init_window_cache(B: int, Hkv: int, D: int, Dv: int, *, window: int, sinks: int, dtype, device=None):
    """Empty cache: keys [B, Hkv, S + W, D], values [B, Hkv, S + W, Dv], slot positions [B, S + W] = −1."""
    L = sinks + window
    return (torch.zeros(B, Hkv, L, D, dtype=dtype, device=device), torch.zeros(B, Hkv, L, Dv, dtype=dtype, device=device),
            torch.full((B, L), -1, dtype=torch.int32, device=device))


def window_decode_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    cache: tuple,
    position: int,
    *,
    window: int,
    sinks: int = 0,
    scale: Optional[float] = None,
):
    """Token at `position` (0-based, = tokens seen before it): write it into the cache, then attend.
    cache from `init_window_cache` (same window/sinks); returns (o_t [B, H, 1, Dv], cache), the cache
    updated in place (it is a fixed-size buffer, like a KV cache)."""
    who = "window_decode_step"
    _one_token(who, q_t, k_t, v_t)
    kc, vc, pos = cache
    L = sinks + window
    if kc.shape[2] != L or pos.shape[1] != L:
        raise ValueError(f"{who}: cache has {kc.shape[2]} slots, expected sinks + window = {L}")
    slot = position if position < sinks else sinks + position % window
    kc[:, :, slot] = k_t[:, :, 0].to(kc.dtype)
    vc[:, :, slot] = v_t[:, :, 0].to(vc.dtype)
    pos[:, slot] = position
    B, H, _, D = q_t.shape
    Dv = v_t.shape[3]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty(B, H, 1, Dv, device=q_t.device, dtype=q_t.dtype)
    BL = 16 if interpreting() else 64
    _ring_attend_kernel[(B * H,)](
        q_t.contiguous(), kc, vc, pos, out, H, L, D, Dv, H // k_t.shape[1], sinks, window, int(position), s * LOG2E,
        BL=BL, BD=pow2(D), BV=pow2(Dv),
    )
    return out, (kc, vc, pos)
