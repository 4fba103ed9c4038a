"""One-token update of a fixed-size linear state, shared by the linear and decay decode steps.

One program per (batch, query head, value block) reads its [M, BV] slice of S once and writes the
updated slice to a new tensor (states stay functional): S = γ_h S + φ(k)vᵀ (γ = 1 without decay),
z likewise, then o = φ(q)ᵀS / (φ(q)ᵀz + eps) or s·φ(q)ᵀS. States are fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnopt.kernels.triton.runtime import pow2, require_runtime
from attnopt.kernels.triton.tiles import phi


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
    fq = tl.where(m_ok, phi(tl.load(Q + pid_bh * M + rm, mask=m_ok, other=0.0).to(tl.float32), FMAP), 0.0)
    fk = tl.where(m_ok, phi(tl.load(K + hk * M + rm, mask=m_ok, other=0.0).to(tl.float32), FMAP), 0.0)
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


def check_one_token(who: str, q_t: Tensor, k_t: Tensor, v_t: Tensor) -> None:
    for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if t.dim() != 4 or t.shape[2] != 1:
            raise ValueError(f"{who}: {name} must be one token [B, heads, 1, dim], got {tuple(t.shape)}")
    if q_t.shape[1] % k_t.shape[1] != 0:
        raise ValueError(f"{who}: H={q_t.shape[1]} is not a multiple of Hkv={k_t.shape[1]}")
    require_runtime(who, q_t)


def state_step(q_t, k_t, v_t, S, z, log2g, fmap, normalize, scale, eps):
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
