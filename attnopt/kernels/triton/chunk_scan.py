"""Chunked causal scans for linear attention and its decayed form (retention / diagonal SSM).

One program owns one query head and walks the key positions chunk by chunk (C = BC positions),
carrying the running state S = Σ_j w_j φ(k_j) v_jᵀ [M, Dv] (and z = Σ_j w_j φ(k_j) [M]) in
registers: within a chunk the C×C block φ(q)φ(k)ᵀ is masked (j <= i, times γ^(i-j) with decay)
and applied directly, earlier chunks enter through the state. This is the "fused chunk" order
(state kept on chip, never written), chosen over fla's two-kernel "chunk" order (per-chunk states
written to memory, then outputs in parallel) because it needs no [N/C, M, Dv] buffer and one launch;
its parallelism is B·H·(Dv/BV) programs, enough at B·H >= 32 on an H200.

Alignment is bottom-right: query i sits at position Nk − Nq + i, so the chunk of key positions
[c0, c0 + C) pairs with the queries at those positions; queries placed before key 0 see nothing
(their rows stay 0, written by the host's zero-filled output).

Decay: w_ij = γ_h^(p_i − j), applied in log2 space as exp2((r_i − r_j)·log2 γ) with the upper
triangle masked BEFORE exp2 (for small γ, γ^(negative) overflows and inf·0 is NaN).

Feature maps fused into the loads (FMAP): 0 identity (φ precomputed on the host: FAVOR+, hedgehog,
Taylor), 1 ELU+1, 2 ReLU. key padding: φ(k_j) = 0 for dropped keys (their positions still count
for decay).

Backward (dn = ∂L/∂n, dd = ∂L/∂den from the host, n the numerator, den the denominator):
  dφq_i = Σ_{j<=i} w_ij (dn_i·v_j + dd_i) φk_j      forward scan, state (S, z)      -> `_dq_kernel`
  dφk_j = Σ_{i>=j} w_ij (dn_i·v_j + dd_i) φq_i      reverse scan, state (R, r)      -> `_dk_kernel`
  dv_j  = Σ_{i>=j} w_ij (φq_i·φk_j) dn_i            reverse scan, state R           -> `_dv_kernel`
with R = Σ_i w φq_i dn_iᵀ [M, Dv], r = Σ_i w φq_i dd_i [M]. The dq/dk kernels split the feature
dim M over programs, the forward and dv kernels split Dv; each program keeps a [BM, BV] state.
dk/dv are written per query head (fp32) and summed over the GQA group on the host.

Letters: B batch, H query heads, Hk heads of k (Hkv, or H for per-head maps), Hv heads of v,
Nq/Nk lengths, M feature width (= D for fused maps), Dv value dim, C = BC chunk length.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnopt.kernels.triton.runtime import interpreting, launcher, low_precision, pow2


@triton.jit
def phi(x, FMAP: tl.constexpr):
    if FMAP == 1:
        return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.maximum(x, 0.0)
    else:
        return x


@triton.jit
def _dphi(x, FMAP: tl.constexpr):
    """dφ/dx at x (1 for identity)."""
    if FMAP == 1:
        return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.where(x > 0, 1.0, 0.0)
    else:
        return tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def dot(a, b, LOWP: tl.constexpr, DT: tl.constexpr):
    # LOWP (runtime.low_precision): bf16/fp16 inputs: operands in the input dtype (tensor cores), fp32 accumulation;
    # fp32 inputs: IEEE fp32 (tf32 would cost ~3 decimal digits the fp32 oracle tests check).
    if LOWP == 1:
        return tl.dot(a.to(DT), b.to(DT))
    elif LOWP == 2:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _chunk_fwd_kernel(
    Q, K, V, KEEP, LOG2G, O, DEN,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
    H, Nq, Nk, M, Dv, GK, GV, scale, eps,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_DECAY: tl.constexpr, NORMALIZE: tl.constexpr,
    LOWP: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    DT = Q.dtype.element_ty
    rc = tl.arange(0, BC)
    rm = tl.arange(0, BM)
    rv = pid_v * BV + tl.arange(0, BV)
    m_ok = rm < M
    v_ok = rv < Dv
    off = Nk - Nq
    q_base = Q + b * s_qb + h * s_qh
    k_base = K + b * s_kb + (h // GK) * s_kh
    v_base = V + b * s_vb + (h // GV) * s_vh
    o_base = O + b * s_ob + h * s_oh
    tri = rc[:, None] >= rc[None, :]
    if HAS_DECAY:
        lg = tl.load(LOG2G + h)
        w_cc = tl.exp2(tl.where(tri, (rc[:, None] - rc[None, :]).to(tl.float32) * lg, float("-inf")))
        q_dec = tl.exp2((rc + 1).to(tl.float32) * lg)  # from the previous chunk's end
        k_dec = tl.exp2((BC - 1 - rc).to(tl.float32) * lg)  # to this chunk's end
        step = tl.exp2(BC * lg)
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos = c0 + rc
        k_in = pos < Nk
        qi = pos - off
        q_in = (qi >= 0) & k_in
        kx = tl.load(k_base + pos[:, None] * s_kn + rm[None, :], mask=k_in[:, None] & m_ok[None, :], other=0.0)
        fk = tl.where(k_in[:, None] & m_ok[None, :], phi(kx.to(tl.float32), FMAP), 0.0)
        if HAS_KEEP:
            keep = tl.load(KEEP + b * Nk + pos, mask=k_in, other=0)
            fk = tl.where(keep[:, None] != 0, fk, 0.0)
        vx = tl.load(v_base + pos[:, None] * s_vn + rv[None, :], mask=k_in[:, None] & v_ok[None, :], other=0.0)
        vx = vx.to(tl.float32)
        qx = tl.load(q_base + qi[:, None] * s_qn + rm[None, :], mask=q_in[:, None] & m_ok[None, :], other=0.0)
        fq = tl.where(q_in[:, None] & m_ok[None, :], phi(qx.to(tl.float32), FMAP), 0.0)
        A = dot(fq, tl.trans(fk), LOWP, DT)
        if HAS_DECAY:
            A = A * w_cc
            fq_in = fq * q_dec[:, None]
            fk_out = fk * k_dec[:, None]
        else:
            A = tl.where(tri, A, 0.0)
            fq_in = fq
            fk_out = fk
        num = dot(A, vx, LOWP, DT) + dot(fq_in, S, LOWP, DT)
        if NORMALIZE:
            den = tl.sum(A, axis=1) + tl.sum(fq_in * z[None, :], axis=1) + eps
            out = num / tl.where(den == 0.0, 1.0, den)[:, None]
            if pid_v == 0:
                tl.store(DEN + pid_bh * Nq + qi, den, mask=q_in)
        else:
            out = num * scale
        tl.store(o_base + qi[:, None] * s_on + rv[None, :], out.to(O.dtype.element_ty),
                 mask=q_in[:, None] & v_ok[None, :])
        if HAS_DECAY:
            S = S * step + dot(tl.trans(fk_out), vx, LOWP, DT)
            z = z * step + tl.sum(fk_out, axis=0)
        else:
            S = S + dot(tl.trans(fk_out), vx, LOWP, DT)
            z = z + tl.sum(fk_out, axis=0)


@triton.jit
def _dq_kernel(
    Q, K, V, KEEP, LOG2G, DN, DD, DQ,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    H, Nq, Nk, M, Dv, GK, GV,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DD: tl.constexpr,
    LOWP: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """dq (through φ') for one query head and one block of BM features. DN [B, H, Nq, Dv] fp32,
    DD [B, H, Nq] fp32, DQ [B, H, Nq, M] fp32 (contiguous, like q's)."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    DT = Q.dtype.element_ty
    rc = tl.arange(0, BC)
    rm = pid_m * BM + tl.arange(0, BM)
    rv = tl.arange(0, BV)
    m_ok = rm < M
    v_ok = rv < Dv
    off = Nk - Nq
    q_base = Q + b * s_qb + h * s_qh
    k_base = K + b * s_kb + (h // GK) * s_kh
    v_base = V + b * s_vb + (h // GV) * s_vh
    tri = rc[:, None] >= rc[None, :]
    if HAS_DECAY:
        lg = tl.load(LOG2G + h)
        w_cc = tl.exp2(tl.where(tri, (rc[:, None] - rc[None, :]).to(tl.float32) * lg, float("-inf")))
        q_dec = tl.exp2((rc + 1).to(tl.float32) * lg)
        k_dec = tl.exp2((BC - 1 - rc).to(tl.float32) * lg)
        step = tl.exp2(BC * lg)
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos = c0 + rc
        k_in = pos < Nk
        qi = pos - off
        q_in = (qi >= 0) & k_in
        kx = tl.load(k_base + pos[:, None] * s_kn + rm[None, :], mask=k_in[:, None] & m_ok[None, :], other=0.0)
        fk = tl.where(k_in[:, None] & m_ok[None, :], phi(kx.to(tl.float32), FMAP), 0.0)
        if HAS_KEEP:
            keep = tl.load(KEEP + b * Nk + pos, mask=k_in, other=0)
            fk = tl.where(keep[:, None] != 0, fk, 0.0)
        vx = tl.load(v_base + pos[:, None] * s_vn + rv[None, :], mask=k_in[:, None] & v_ok[None, :], other=0.0)
        vx = vx.to(tl.float32)
        row = pid_bh * Nq + qi
        dn = tl.load(DN + row[:, None] * Dv + rv[None, :], mask=q_in[:, None] & v_ok[None, :], other=0.0)
        P = dot(dn, tl.trans(vx), LOWP, DT)
        if HAS_DD:
            dd = tl.load(DD + row, mask=q_in, other=0.0)
            P = P + dd[:, None]
        if HAS_DECAY:
            P = P * w_cc
        else:
            P = tl.where(tri, P, 0.0)
        dfq = dot(P, fk, LOWP, DT)
        inter = dot(dn, tl.trans(S), LOWP, DT)
        if HAS_DD:
            inter = inter + dd[:, None] * z[None, :]
        if HAS_DECAY:
            dfq = dfq + q_dec[:, None] * inter
        else:
            dfq = dfq + inter
        qx = tl.load(q_base + qi[:, None] * s_qn + rm[None, :], mask=q_in[:, None] & m_ok[None, :], other=0.0)
        dq = dfq * _dphi(qx.to(tl.float32), FMAP)
        tl.store(DQ + row[:, None] * M + rm[None, :], dq, mask=q_in[:, None] & m_ok[None, :])
        if HAS_DECAY:
            fk = fk * k_dec[:, None]
            S = S * step + dot(tl.trans(fk), vx, LOWP, DT)
            z = z * step + tl.sum(fk, axis=0)
        else:
            S = S + dot(tl.trans(fk), vx, LOWP, DT)
            z = z + tl.sum(fk, axis=0)


@triton.jit
def _dkv_kernel(
    Q, K, V, KEEP, LOG2G, DN, DD, DK, DV,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    H, Nq, Nk, M, Dv, GK, GV,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_DD: tl.constexpr,
    FOR_K: tl.constexpr, LOWP: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """Reverse scan. FOR_K: dk (through φ' and the key mask) for features block pid·BM of one query
    head, into DK [B, H, Nk, M] fp32; else dv for value block pid·BV into DV [B, H, Nk, Dv] fp32.
    The dimension that is not split (BV for dk, BM for dv) is the full padded width: the C×C
    products dn·vᵀ (dk) and φ(q)φ(k)ᵀ (dv) need all of it."""
    pid_bh = tl.program_id(0)
    pid_x = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    DT = Q.dtype.element_ty
    rc = tl.arange(0, BC)
    if FOR_K:
        rm = pid_x * BM + tl.arange(0, BM)
        rv = tl.arange(0, BV)
    else:
        rm = tl.arange(0, BM)
        rv = pid_x * BV + tl.arange(0, BV)
    m_ok = rm < M
    v_ok = rv < Dv
    off = Nk - Nq
    q_base = Q + b * s_qb + h * s_qh
    k_base = K + b * s_kb + (h // GK) * s_kh
    v_base = V + b * s_vb + (h // GV) * s_vh
    tri = rc[:, None] >= rc[None, :]
    if HAS_DECAY:
        lg = tl.load(LOG2G + h)
        w_cc = tl.exp2(tl.where(tri, (rc[:, None] - rc[None, :]).to(tl.float32) * lg, float("-inf")))
        q_dec = tl.exp2((rc + 1).to(tl.float32) * lg)
        k_dec = tl.exp2((BC - 1 - rc).to(tl.float32) * lg)
        step = tl.exp2(BC * lg)
    R = tl.zeros([BM, BV], dtype=tl.float32)
    r = tl.zeros([BM], dtype=tl.float32)
    n_chunks = tl.cdiv(Nk, BC)
    for t in range(0, n_chunks):
        c0 = (n_chunks - 1 - t) * BC
        pos = c0 + rc
        k_in = pos < Nk
        qi = pos - off
        q_in = (qi >= 0) & k_in
        row = pid_bh * Nq + qi
        keep_ok = k_in
        if HAS_KEEP:
            keep = tl.load(KEEP + b * Nk + pos, mask=k_in, other=0)
            keep_ok = keep_ok & (keep != 0)
        # the query side: φ(q) on this program's features, dn on its values
        qx = tl.load(q_base + qi[:, None] * s_qn + rm[None, :], mask=q_in[:, None] & m_ok[None, :], other=0.0)
        fq = tl.where(q_in[:, None] & m_ok[None, :], phi(qx.to(tl.float32), FMAP), 0.0)
        dn = tl.load(DN + row[:, None] * Dv + rv[None, :], mask=q_in[:, None] & v_ok[None, :], other=0.0)
        if HAS_DD:
            dd = tl.load(DD + row, mask=q_in, other=0.0)
        if FOR_K:
            vx = tl.load(v_base + pos[:, None] * s_vn + rv[None, :], mask=k_in[:, None] & v_ok[None, :], other=0.0)
            vx = vx.to(tl.float32)
            P = dot(dn, tl.trans(vx), LOWP, DT)  # [C_i, C_j]
            if HAS_DD:
                P = P + dd[:, None]
            if HAS_DECAY:
                P = P * w_cc
            else:
                P = tl.where(tri, P, 0.0)
            dfk = dot(tl.trans(P), fq, LOWP, DT)
            inter = dot(vx, tl.trans(R), LOWP, DT) + r[None, :]
            if HAS_DECAY:
                dfk = dfk + k_dec[:, None] * inter
            else:
                dfk = dfk + inter
            kx = tl.load(k_base + pos[:, None] * s_kn + rm[None, :], mask=k_in[:, None] & m_ok[None, :], other=0.0)
            dk = dfk * _dphi(kx.to(tl.float32), FMAP)
            dk = tl.where(keep_ok[:, None], dk, 0.0)
            tl.store(DK + (pid_bh * Nk + pos)[:, None] * M + rm[None, :], dk, mask=k_in[:, None] & m_ok[None, :])
        else:
            kx = tl.load(k_base + pos[:, None] * s_kn + rm[None, :], mask=k_in[:, None] & m_ok[None, :], other=0.0)
            fk = tl.where(keep_ok[:, None] & m_ok[None, :], phi(kx.to(tl.float32), FMAP), 0.0)
            A = dot(fq, tl.trans(fk), LOWP, DT)
            if HAS_DECAY:
                A = A * w_cc
            else:
                A = tl.where(tri, A, 0.0)
            dv = dot(tl.trans(A), dn, LOWP, DT)
            if HAS_DECAY:
                dv = dv + k_dec[:, None] * dot(fk, R, LOWP, DT)
            else:
                dv = dv + dot(fk, R, LOWP, DT)
            tl.store(DV + (pid_bh * Nk + pos)[:, None] * Dv + rv[None, :], dv, mask=k_in[:, None] & v_ok[None, :])
        if HAS_DECAY:
            fq = fq * q_dec[:, None]
            R = R * step + dot(tl.trans(fq), dn, LOWP, DT)
            if HAS_DD:
                r = r * step + tl.sum(fq * dd[:, None], axis=0)
        else:
            R = R + dot(tl.trans(fq), dn, LOWP, DT)
            if HAS_DD:
                r = r + tl.sum(fq * dd[:, None], axis=0)


# ---------------------------------------------------------------------------------------------
# host launchers (shared by the linear and decay entry points)
# ---------------------------------------------------------------------------------------------



def _blocks(M: int, Dv: int, BH: int) -> tuple[int, int, int, int]:
    """(BC, BM-split, BV-split, num_warps) by shape. A program keeps a [BM, BV] fp32 state in
    registers; 64×64 (16 KiB over 4 warps) leaves room for the C×C tile at C = 64. The scan is
    sequential over chunks, so the grid is only B·H·(width / split) programs: when that would
    leave an H200's 132 SMs idle (B·H·width/64 < 264), the split drops to 32 (tl.dot's tiles stay
    >= 16). The interpreter gets C = 16 so that small test shapes still span several chunks."""
    if interpreting():
        return 16, min(64, pow2(M)), min(64, pow2(Dv)), 4
    split = 64 if BH * triton.cdiv(max(M, Dv), 64) >= 264 else 32
    return 64, min(split, pow2(M)), min(split, pow2(Dv)), 8 if max(M, Dv) >= 128 else 4


def _keep_arg(keep: Optional[Tensor], like: Tensor) -> tuple[Tensor, bool]:
    if keep is None:
        return like, False
    return keep.to(torch.int8).contiguous(), True


def chunk_forward(q, k, v, keep, log2g, fmap: int, normalize: bool, scale: float, eps: float, wrap: bool):
    """q [B, H, Nq, M], k [B, Hk, Nk, M], v [B, Hv, Nk, Dv] -> (out [B, H, Nq, Dv] in q's dtype,
    den [B, H, Nq] fp32, the normaliser incl. eps; zeros when not normalize)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Nq, M = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    BC, _, BV, nw = _blocks(M, Dv, B * H)
    out = torch.zeros(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    den = torch.zeros(B, H, Nq, device=q.device, dtype=torch.float32)
    keep_t, has_keep = _keep_arg(keep, q)
    lg = q if log2g is None else log2g
    grid = (B * H, triton.cdiv(Dv, BV))
    launcher(_chunk_fwd_kernel, wrap)[grid](
        q, k, v, keep_t, lg, out, den,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, Nq, Nk, M, Dv, H // k.shape[1], H // v.shape[1], scale, eps,
        FMAP=fmap, HAS_KEEP=has_keep, HAS_DECAY=log2g is not None, NORMALIZE=normalize,
        LOWP=low_precision(q.dtype), BC=BC, BM=pow2(M), BV=BV, num_warps=nw,
    )
    return out, den


def chunk_backward(g, q, k, v, keep, log2g, out, den, fmap: int, normalize: bool, scale: float, wrap: bool):
    """Gradients (dq, dk, dv) of `chunk_forward`'s out, in the inputs' dtypes."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Nq, M = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    Hv, Dv = v.shape[1], v.shape[3]
    BC, BMs, BVs, nw = _blocks(M, Dv, B * H)
    g = g.to(torch.float32)
    if normalize:
        # o = n / den: dn = g / den, dden = -(g·o) / den (rows that saw nothing have den 0: no gradient)
        inv = torch.where(den == 0, 0.0, 1.0 / torch.where(den == 0, 1.0, den))
        dn = (g * inv[..., None]).contiguous()
        dd = (-(g * out.to(torch.float32)).sum(-1) * inv).contiguous()
    else:
        dn = (g * scale).contiguous()
        dd = dn  # unused (HAS_DD=False)
    keep_t, has_keep = _keep_arg(keep, q)
    lg = q if log2g is None else log2g
    dq = torch.zeros(B, H, Nq, M, device=q.device, dtype=torch.float32)
    dk = torch.zeros(B, H, Nk, M, device=q.device, dtype=torch.float32)
    dv = torch.zeros(B, H, Nk, Dv, device=q.device, dtype=torch.float32)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    shape = (H, Nq, Nk, M, Dv, H // Hk, H // Hv)
    flags = dict(FMAP=fmap, HAS_KEEP=has_keep, HAS_DECAY=log2g is not None, HAS_DD=normalize,
                 LOWP=low_precision(q.dtype), BC=BC, num_warps=nw)
    launcher(_dq_kernel, wrap)[(B * H, triton.cdiv(M, BMs))](
        q, k, v, keep_t, lg, dn, dd, dq, *strides, *shape, BM=BMs, BV=pow2(Dv), **flags)
    launcher(_dkv_kernel, wrap)[(B * H, triton.cdiv(M, BMs))](
        q, k, v, keep_t, lg, dn, dd, dk, dv, *strides, *shape, FOR_K=True, BM=BMs, BV=pow2(Dv), **flags)
    launcher(_dkv_kernel, wrap)[(B * H, triton.cdiv(Dv, BVs))](
        q, k, v, keep_t, lg, dn, dd, dk, dv, *strides, *shape, FOR_K=False, BM=pow2(M), BV=BVs, **flags)
    # dk/dv were written per query head: sum each GQA group (no repeated K/V was ever read).
    dk = dk.view(B, Hk, H // Hk, Nk, M).sum(2)
    dv = dv.view(B, Hv, H // Hv, Nk, Dv).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
