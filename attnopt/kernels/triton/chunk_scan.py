"""Chunked causal scans for linear attention and its decayed form (retention / diagonal SSM), and the
chunk pieces the gated scans (gla, delta) share with them.

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
  dφk_j = Σ_{i>=j} w_ij (dn_i·v_j + dd_i) φq_i      reverse scan, state (R, r)      -> `_dkv_kernel` FOR_K
  dv_j  = Σ_{i>=j} w_ij (φq_i·φk_j) dn_i            reverse scan, state R           -> `_dkv_kernel`
with R = Σ_i w φq_i dn_iᵀ [M, Dv], r = Σ_i w φq_i dd_i [M]. The forward and dq kernels are one scan
(`_forward_scan`: the same state, read out two ways). The dq/dk programs split the feature dim M,
the forward and dv programs split Dv (`split_tiles`); each program keeps a [BM, BV] state.
dk/dv are written per query head (fp32) and summed over the GQA group on the host.

The pieces of a chunk step are `@triton.jit` helpers the gated scans (gla, delta) and the
linear+window prefix states reuse: `chunk_rows` (positions and their queries), `key_features`
(φ(k) and v of the kept keys), `chunk_decay` / `causal_weights` / `decayed` (the in-chunk decay),
`gate_chunk` (the same from per-head log-gates), `chunk_out` (a chunk's output rows) and
`carry` / `carry_sum` (the state after the chunk).

Letters: B batch, H query heads, Hk heads of k (Hkv, or H for per-head maps), Hv heads of v,
Nq/Nk lengths, M feature width (= D for fused maps), Dv value dim, C = BC chunk length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnopt.kernels.triton.runtime import interpreting, keep_arg, launcher, low_precision, pow2, row_strides
from attnopt.kernels.triton.tiles import dot, dphi, kept, load_phi, load_tile, program_head, span, store_tile


@triton.jit
def chunk_decay(LOG2G, h, BC: tl.constexpr, HAS_DECAY: tl.constexpr):
    """The decay inside a chunk of BC positions, γ = 2^LOG2G[h]: (w_cc [BC, BC] = γ^(i−j) for j <= i
    and 0 above, q_dec = γ^(i+1) from the previous chunk's end, k_dec = γ^(C−1−j) to this chunk's end,
    step = γ^C). Without decay: the causal mask (bool) and 1s, which `causal_weights` / `decayed` /
    `carry` do not multiply by."""
    rc = tl.arange(0, BC)
    tri = rc[:, None] >= rc[None, :]
    if HAS_DECAY:
        lg = tl.load(LOG2G + h)
        w_cc = tl.exp2(tl.where(tri, (rc[:, None] - rc[None, :]).to(tl.float32) * lg, float("-inf")))
        return w_cc, tl.exp2((rc + 1).to(tl.float32) * lg), tl.exp2((BC - 1 - rc).to(tl.float32) * lg), tl.exp2(BC * lg)
    else:
        return tri, 1.0, 1.0, 1.0


@triton.jit
def causal_weights(A, w_cc, HAS_DECAY: tl.constexpr):
    """A [C, C] times the in-chunk weights of `chunk_decay` (0 above the diagonal)."""
    if HAS_DECAY:
        return A * w_cc
    else:
        return tl.where(w_cc, A, 0.0)


@triton.jit
def decayed(x, dec, HAS_DECAY: tl.constexpr):
    """x [C, ·] with row i times dec_i (`chunk_decay`'s q_dec or k_dec); x itself without decay."""
    if HAS_DECAY:
        return x * dec[:, None]
    else:
        return x


@triton.jit
def carry(S, a, x, step, HAS_DECAY: tl.constexpr, LOWP: tl.constexpr, DT: tl.constexpr):
    """A state [·, BV] after a chunk: γ^C·S + aᵀx, a [C, ·] already decayed to the chunk's end."""
    if HAS_DECAY:
        return S * step + dot(tl.trans(a), x, LOWP, DT)
    else:
        return S + dot(tl.trans(a), x, LOWP, DT)


@triton.jit
def carry_sum(z, a, step, HAS_DECAY: tl.constexpr):
    """A sum state [·] after a chunk: γ^C·z + Σ_rows a."""
    if HAS_DECAY:
        return z * step + tl.sum(a, axis=0)
    else:
        return z + tl.sum(a, axis=0)


@triton.jit
def chunk_rows(c0, Nq, Nk, BC: tl.constexpr):
    """The key positions c0 + [0, C) and the queries at them (bottom-right: query i sits at position
    Nk − Nq + i; one before key 0 sees nothing): (pos, k_in, qi, q_in)."""
    pos, k_in = span(c0, Nk, BC)
    qi = pos - (Nk - Nq)
    return pos, k_in, qi, (qi >= 0) & k_in


@triton.jit
def key_features(k_base, s_kn, v_base, s_vn, pos, ok, rm, m_ok, rv, v_ok, FMAP: tl.constexpr):
    """(φ(k) [C, BM], v [C, BV]) in fp32 at the key positions pos; 0 where not ok (past Nk or dropped)."""
    return load_phi(k_base, pos, s_kn, rm, ok, m_ok, FMAP), load_tile(v_base, pos, s_vn, rv, ok, v_ok).to(tl.float32)


@triton.jit
def gate_chunk(g_base, pos, s_gn, ok, BC: tl.constexpr):
    """The per-head log-gates g <= 0 of a chunk (0 where not ok, so the state passes unchanged): (b, the
    in-chunk inclusive cumsum; b_last = Σ g; Γ [C, C] = exp(b_i − b_j) for j <= i, 0 above -- masked
    to −inf before exp, so every factor is exp(<= 0))."""
    gx = tl.load(g_base + pos * s_gn, mask=ok, other=0.0).to(tl.float32)
    bc = tl.cumsum(gx, axis=0)
    rc = tl.arange(0, BC)
    gam = tl.exp(tl.where(rc[:, None] >= rc[None, :], bc[:, None] - bc[None, :], float("-inf")))
    return bc, tl.sum(gx, axis=0), gam


@triton.jit
def chunk_out(A, fq_in, vx, S, z, scale, eps, NORMALIZE: tl.constexpr, LOWP: tl.constexpr, DT: tl.constexpr):
    """A chunk's output rows (out, den): the in-chunk A·v plus the carried φq_in·S, divided by
    A·1 + φq_in·z + eps (0 where that is 0) when NORMALIZE, else times scale (den is then 0)."""
    num = dot(A, vx, LOWP, DT) + dot(fq_in, S, LOWP, DT)
    if NORMALIZE:
        den = tl.sum(A, axis=1) + tl.sum(fq_in * z[None, :], axis=1) + eps
        return num / tl.where(den == 0.0, 1.0, den)[:, None], den
    else:
        return num * scale, 0.0


@triton.jit
def split_tiles(pid_x, M, Dv, BM: tl.constexpr, BV: tl.constexpr, SPLIT_M: tl.constexpr):
    """(rm, m_ok, rv, v_ok) of a program that owns block pid_x of the features (SPLIT_M) or of the
    values, and the whole other dimension (padded to BM / BV)."""
    if SPLIT_M:
        rm, m_ok = span(pid_x * BM, M, BM)
        rv, v_ok = span(0, Dv, BV)
    else:
        rm, m_ok = span(0, M, BM)
        rv, v_ok = span(pid_x * BV, Dv, BV)
    return rm, m_ok, rv, v_ok


@triton.jit
def _forward_scan(
    Q, K, V, KEEP, LOG2G, O, DEN, DN, DD, DQ,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
    H, Nq, Nk, M, Dv, GK, GV, scale, eps,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_DECAY: tl.constexpr, NORMALIZE: tl.constexpr,
    GRAD: tl.constexpr, LOWP: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """The scan in key order with the state (S, z) of the keys so far, for one query head. GRAD False:
    the outputs of one block of BV values (NORMALIZE: divided by the normaliser, written to DEN).
    GRAD True: dq of one block of BM features from the same state read the other way round,
    dφq_i = Σ_{j<=i} w_ij (dn_i·v_j + dd_i) φk_j (NORMALIZE: the normaliser's gradient dd enters)."""
    pid_bh, b, h = program_head(H)
    DT = Q.dtype.element_ty
    rm, m_ok, rv, v_ok = split_tiles(tl.program_id(1), M, Dv, BM, BV, GRAD)  # dq splits the features
    q_base = Q + b * s_qb + h * s_qh
    w_cc, q_dec, k_dec, step = chunk_decay(LOG2G, h, BC, HAS_DECAY)
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos, k_in, qi, q_in = chunk_rows(c0, Nq, Nk, BC)
        fk, vx = key_features(K + b * s_kb + (h // GK) * s_kh, s_kn, V + b * s_vb + (h // GV) * s_vh, s_vn, pos,
                              kept(KEEP + b * Nk, pos, k_in, HAS_KEEP), rm, m_ok, rv, v_ok, FMAP)
        if GRAD:
            dn = load_tile(DN + pid_bh * Nq * Dv, qi, Dv, rv, q_in, v_ok)
            P = dot(dn, tl.trans(vx), LOWP, DT)
            if NORMALIZE:
                dd = tl.load(DD + pid_bh * Nq + qi, mask=q_in, other=0.0)
                P = P + dd[:, None]
            dfq = dot(causal_weights(P, w_cc, HAS_DECAY), fk, LOWP, DT)
            inter = dot(dn, tl.trans(S), LOWP, DT)
            if NORMALIZE:
                inter = inter + dd[:, None] * z[None, :]
            dfq = dfq + decayed(inter, q_dec, HAS_DECAY)
            qx = load_tile(q_base, qi, s_qn, rm, q_in, m_ok)
            store_tile(DQ + pid_bh * Nq * M, qi, M, rm, q_in, m_ok, dfq * dphi(qx.to(tl.float32), FMAP))
        else:
            fq = load_phi(q_base, qi, s_qn, rm, q_in, m_ok, FMAP)
            A = causal_weights(dot(fq, tl.trans(fk), LOWP, DT), w_cc, HAS_DECAY)
            out, den = chunk_out(A, decayed(fq, q_dec, HAS_DECAY), vx, S, z, scale, eps, NORMALIZE, LOWP, DT)
            if NORMALIZE:
                if tl.program_id(1) == 0:
                    tl.store(DEN + pid_bh * Nq + qi, den, mask=q_in)
            store_tile(O + b * s_ob + h * s_oh, qi, s_on, rv, q_in, v_ok, out)
        fk_out = decayed(fk, k_dec, HAS_DECAY)
        S = carry(S, fk_out, vx, step, HAS_DECAY, LOWP, DT)
        z = carry_sum(z, fk_out, step, HAS_DECAY)


@triton.jit
def _chunk_fwd_kernel(
    Q, K, V, KEEP, LOG2G, O, DEN,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
    H, Nq, Nk, M, Dv, GK, GV, scale, eps,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_DECAY: tl.constexpr, NORMALIZE: tl.constexpr,
    LOWP: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """Outputs O [B, H, Nq, Dv] (and DEN [B, H, Nq] fp32 when NORMALIZE) of one query head and BV values."""
    _forward_scan(Q, K, V, KEEP, LOG2G, O, DEN, O, O, O,  # (DN, DD, DQ): unused by the forward
                  s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
                  H, Nq, Nk, M, Dv, GK, GV, scale, eps, FMAP, HAS_KEEP, HAS_DECAY, NORMALIZE, False, LOWP, BC, BM, BV)


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
    _forward_scan(Q, K, V, KEEP, LOG2G, DQ, DD, DN, DD, DQ,  # (O, DEN): unused by the dq scan
                  s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, 0, 0, 0,
                  H, Nq, Nk, M, Dv, GK, GV, 1.0, 0.0, FMAP, HAS_KEEP, HAS_DECAY, HAS_DD, True, LOWP, BC, BM, BV)


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
    pid_bh, b, h = program_head(H)
    DT = Q.dtype.element_ty
    rm, m_ok, rv, v_ok = split_tiles(tl.program_id(1), M, Dv, BM, BV, FOR_K)
    k_base = K + b * s_kb + (h // GK) * s_kh
    w_cc, q_dec, k_dec, step = chunk_decay(LOG2G, h, BC, HAS_DECAY)
    R = tl.zeros([BM, BV], dtype=tl.float32)
    r = tl.zeros([BM], dtype=tl.float32)
    n_chunks = tl.cdiv(Nk, BC)
    for t in range(0, n_chunks):
        pos, k_in, qi, q_in = chunk_rows((n_chunks - 1 - t) * BC, Nq, Nk, BC)
        keep_ok = kept(KEEP + b * Nk, pos, k_in, HAS_KEEP)
        # the query side: φ(q) on this program's features, dn on its values
        fq = load_phi(Q + b * s_qb + h * s_qh, qi, s_qn, rm, q_in, m_ok, FMAP)
        dn = load_tile(DN + pid_bh * Nq * Dv, qi, Dv, rv, q_in, v_ok)
        if HAS_DD:
            dd = tl.load(DD + pid_bh * Nq + qi, mask=q_in, other=0.0)
        if FOR_K:
            vx = load_tile(V + b * s_vb + (h // GV) * s_vh, pos, s_vn, rv, k_in, v_ok).to(tl.float32)
            P = dot(dn, tl.trans(vx), LOWP, DT)  # [C_i, C_j]
            if HAS_DD:
                P = P + dd[:, None]
            dfk = dot(tl.trans(causal_weights(P, w_cc, HAS_DECAY)), fq, LOWP, DT)
            dfk += decayed(dot(vx, tl.trans(R), LOWP, DT) + r[None, :], k_dec, HAS_DECAY)
            kx = load_tile(k_base, pos, s_kn, rm, k_in, m_ok)
            dk = tl.where(keep_ok[:, None], dfk * dphi(kx.to(tl.float32), FMAP), 0.0)
            store_tile(DK + pid_bh * Nk * M, pos, M, rm, k_in, m_ok, dk)
        else:
            fk = load_phi(k_base, pos, s_kn, rm, keep_ok, m_ok, FMAP)
            A = causal_weights(dot(fq, tl.trans(fk), LOWP, DT), w_cc, HAS_DECAY)
            dv = dot(tl.trans(A), dn, LOWP, DT) + decayed(dot(fk, R, LOWP, DT), k_dec, HAS_DECAY)
            store_tile(DV + pid_bh * Nk * Dv, pos, Dv, rv, k_in, v_ok, dv)
        fq_out = decayed(fq, q_dec, HAS_DECAY)
        R = carry(R, fq_out, dn, step, HAS_DECAY, LOWP, DT)
        if HAS_DD:
            r = carry_sum(r, fq_out * dd[:, None], step, HAS_DECAY)


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


def chunk_forward(q, k, v, keep, log2g, fmap: int, normalize: bool, scale: float, eps: float, wrap: bool):
    """q [B, H, Nq, M], k [B, Hk, Nk, M], v [B, Hv, Nk, Dv] -> (out [B, H, Nq, Dv] in q's dtype,
    den [B, H, Nq] fp32, the normaliser incl. eps; zeros when not normalize)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Nq, M = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    BC, _, BV, nw = _blocks(M, Dv, B * H)
    out = torch.zeros(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    den = torch.zeros(B, H, Nq, device=q.device, dtype=torch.float32)
    keep_t, has_keep = keep_arg(keep, q)
    launcher(_chunk_fwd_kernel, wrap)[(B * H, triton.cdiv(Dv, BV))](
        q, k, v, keep_t, q if log2g is None else log2g, out, den, *row_strides(q, k, v, out),
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
    keep_t, has_keep = keep_arg(keep, q)
    lg = q if log2g is None else log2g
    dq = torch.zeros(B, H, Nq, M, device=q.device, dtype=torch.float32)
    dk = torch.zeros(B, H, Nk, M, device=q.device, dtype=torch.float32)
    dv = torch.zeros(B, H, Nk, Dv, device=q.device, dtype=torch.float32)
    strides, shape = row_strides(q, k, v), (H, Nq, Nk, M, Dv, H // Hk, H // Hv)
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
