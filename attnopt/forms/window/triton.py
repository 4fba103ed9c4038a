"""Sliding-window softmax attention with attention sinks: Triton forward and backward.

Visibility of key j from the query at position p (bottom-right: query i sits at p = Nk − Nq + i):

* band: causal p − W < j <= p; bidirectional |p − j| < W (`window` W counts keys including self,
  as `attnopt.forms.window.reference` and ORT GQA's local_window_size do);
* sinks: the first S keys whose key_mask is True, i.e. the first S *real* tokens of each row, so
  left-padded rows keep their real first tokens as sinks; causal: a sink is visible only if j <= p;
* key_mask [B, Nk] bool (True = keep) applies to both; a query that sees no key returns 0.

Per batch row the sinks are the keys j in [s0, s1) with key_mask True (s0 the first real key, s1
one past the S-th), computed on the host; the kernels read only those two ints.

Forward: one program per (batch, query head, block of BQ queries), online softmax in log2 units
over the key blocks of its band (blocks outside the band are never visited), then over the sink
blocks that lie before the band. It writes the log-sum-exp for the backward.
Backward (FlashAttention-2 order): dq per query block over the same key blocks; dk/dv per
(batch, kv head, key block) looping over the query heads of its GQA group and the query blocks of
its band (no per-query-head buffer). Sink keys are also seen from every later query: those terms
come from a second kernel that splits the far query blocks over NSPLIT programs and adds them
atomically, so no single program walks all N queries (that tail would dominate at long N).

Letters: B batch, H query heads, Hkv kv heads, G = H // Hkv, Nq/Nk lengths, D head dim, Dv value
dim, W window, BQ/BK query/key block.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.kernels.layout import check_sdpa_inputs
from attnopt.kernels.triton.band import LOG2E, key_range, sink_range, visible
from attnopt.kernels.triton.chunk_scan import dot
from attnopt.kernels.triton.runtime import (
    call_unsupported,
    interpreting,
    launcher,
    low_precision,
    pow2,
    require_runtime,
)
from attnopt.kernels.triton.state_step import check_one_token


@triton.jit
def _window_fwd_kernel(
    Q, K, V, KEEP, SINK, O, LSE,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
    H, Nq, Nk, D, Dv, G, W, scale2,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_q = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    DT = Q.dtype.element_ty
    off = Nk - Nq
    rq = pid_q * BQ + tl.arange(0, BQ)
    rk = tl.arange(0, BK)
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    q_ok = rq < Nq
    d_ok = rd < D
    v_ok = rv < Dv
    p = off + rq
    s0 = tl.load(SINK + 2 * b)
    s1 = tl.load(SINK + 2 * b + 1)
    k_base = K + b * s_kb + (h // G) * s_kh
    v_base = V + b * s_vb + (h // G) * s_vh
    qx = tl.load(Q + b * s_qb + h * s_qh + rq[:, None] * s_qn + rd[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if not LOWP:
        qx = qx.to(tl.float32)
    m = tl.full([BQ], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, BV], dtype=tl.float32)
    p_lo = off + pid_q * BQ
    p_hi = off + tl.minimum(pid_q * BQ + BQ, Nq) - 1
    band_lo, band_hi = key_range(p_lo, p_hi, Nk, W, BK, CAUSAL)
    sink_hi = tl.minimum(s1, band_lo)  # sink blocks wholly before the band; the band loop sees the rest
    for part in range(0, 2):
        if part == 0:
            j_start = (s0 // BK) * BK
            j_end = sink_hi
        else:
            j_start = band_lo
            j_end = band_hi
        for j0 in range(j_start, j_end, BK):
            j = j0 + rk
            j_in = j < Nk
            if HAS_KEEP:
                keep_j = tl.load(KEEP + b * Nk + j, mask=j_in, other=0) != 0
            else:
                keep_j = j_in
            kx = tl.load(k_base + j[:, None] * s_kn + rd[None, :], mask=j_in[:, None] & d_ok[None, :], other=0.0)
            vx = tl.load(v_base + j[:, None] * s_vn + rv[None, :], mask=j_in[:, None] & v_ok[None, :], other=0.0)
            s = dot(qx, tl.trans(kx), LOWP, DT) * scale2
            vis = visible(p, j, keep_j, s0, s1, Nk, W, CAUSAL)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            pr = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + dot(pr, vx, LOWP, DT)
            m = m_new
    seen = l > 0.0
    out = acc / tl.where(seen, l, 1.0)[:, None]
    tl.store(O + b * s_ob + h * s_oh + rq[:, None] * s_on + rv[None, :], out.to(O.dtype.element_ty),
             mask=q_ok[:, None] & v_ok[None, :])
    tl.store(LSE + pid_bh * Nq + rq, tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), 0.0), mask=q_ok)


@triton.jit
def _window_dq_kernel(
    Q, K, V, KEEP, SINK, DO, LSE, DELTA, DQ,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    H, Nq, Nk, D, Dv, G, W, scale2, scale,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """DO [B, H, Nq, Dv] (contiguous), LSE/DELTA [B, H, Nq] fp32 -> DQ [B, H, Nq, D] fp32."""
    pid_bh = tl.program_id(0)
    pid_q = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    DT = Q.dtype.element_ty
    off = Nk - Nq
    rq = pid_q * BQ + tl.arange(0, BQ)
    rk = tl.arange(0, BK)
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    q_ok = rq < Nq
    d_ok = rd < D
    v_ok = rv < Dv
    p = off + rq
    s0 = tl.load(SINK + 2 * b)
    s1 = tl.load(SINK + 2 * b + 1)
    k_base = K + b * s_kb + (h // G) * s_kh
    v_base = V + b * s_vb + (h // G) * s_vh
    qx = tl.load(Q + b * s_qb + h * s_qh + rq[:, None] * s_qn + rd[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + (pid_bh * Nq + rq)[:, None] * Dv + rv[None, :], mask=q_ok[:, None] & v_ok[None, :], other=0.0)
    if not LOWP:
        qx = qx.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + pid_bh * Nq + rq, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + pid_bh * Nq + rq, mask=q_ok, other=0.0)
    dq = tl.zeros([BQ, BD], dtype=tl.float32)
    p_lo = off + pid_q * BQ
    p_hi = off + tl.minimum(pid_q * BQ + BQ, Nq) - 1
    band_lo, band_hi = key_range(p_lo, p_hi, Nk, W, BK, CAUSAL)
    sink_hi = tl.minimum(s1, band_lo)
    for part in range(0, 2):
        if part == 0:
            j_start = (s0 // BK) * BK
            j_end = sink_hi
        else:
            j_start = band_lo
            j_end = band_hi
        for j0 in range(j_start, j_end, BK):
            j = j0 + rk
            j_in = j < Nk
            if HAS_KEEP:
                keep_j = tl.load(KEEP + b * Nk + j, mask=j_in, other=0) != 0
            else:
                keep_j = j_in
            kx = tl.load(k_base + j[:, None] * s_kn + rd[None, :], mask=j_in[:, None] & d_ok[None, :], other=0.0)
            vx = tl.load(v_base + j[:, None] * s_vn + rv[None, :], mask=j_in[:, None] & v_ok[None, :], other=0.0)
            s = dot(qx, tl.trans(kx), LOWP, DT) * scale2
            vis = visible(p, j, keep_j, s0, s1, Nk, W, CAUSAL)
            pr = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            dp = dot(do, tl.trans(vx), LOWP, DT)
            ds = pr * (dp - delta[:, None])
            dq += dot(ds, kx, LOWP, DT)
    tl.store(DQ + (pid_bh * Nq + rq)[:, None] * D + rd[None, :], dq * scale, mask=q_ok[:, None] & d_ok[None, :])


@triton.jit
def _dkv_over_queries(
    Q, DO, LSE, DELTA, kx, vx, dk, dv, j, keep_j, s0, s1, b, hk, qb_start, qb_end, qb_step,
    s_qb, s_qh, s_qn, Hkv, Nq, Nk, D, Dv, G, W, scale2,
    CAUSAL: tl.constexpr, LOWP: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """Add to (dk, dv) of the key tile j the terms of the query blocks qb_start, +qb_step, .. < qb_end
    of every query head of kv head hk."""
    DT = Q.dtype.element_ty
    off = Nk - Nq
    rq = tl.arange(0, BQ)
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    d_ok = rd < D
    v_ok = rv < Dv
    for g in range(0, G):
        bh = b * Hkv * G + hk * G + g
        q_base = Q + b * s_qb + (hk * G + g) * s_qh
        for qb in range(qb_start, qb_end, qb_step):
            ri = qb * BQ + rq
            i_ok = ri < Nq
            qx = tl.load(q_base + ri[:, None] * s_qn + rd[None, :], mask=i_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(DO + (bh * Nq + ri)[:, None] * Dv + rv[None, :], mask=i_ok[:, None] & v_ok[None, :], other=0.0)
            if not LOWP:
                qx = qx.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + bh * Nq + ri, mask=i_ok, other=0.0)
            delta = tl.load(DELTA + bh * Nq + ri, mask=i_ok, other=0.0)
            s = dot(qx, tl.trans(kx), LOWP, DT) * scale2
            vis = visible(off + ri, j, keep_j, s0, s1, Nk, W, CAUSAL) & i_ok[:, None]
            pr = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            dv += dot(tl.trans(pr), do, LOWP, DT)
            dp = dot(do, tl.trans(vx), LOWP, DT)
            ds = pr * (dp - delta[:, None])
            dk += dot(tl.trans(ds), qx, LOWP, DT)
    return dk, dv


@triton.jit
def _load_key_tile(K, V, KEEP, b, hk, j, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv,
                   HAS_KEEP: tl.constexpr, LOWP: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr):
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    j_in = j < Nk
    if HAS_KEEP:
        keep_j = tl.load(KEEP + b * Nk + j, mask=j_in, other=0) != 0
    else:
        keep_j = j_in
    kx = tl.load(K + b * s_kb + hk * s_kh + j[:, None] * s_kn + rd[None, :], mask=j_in[:, None] & (rd < D)[None, :], other=0.0)
    vx = tl.load(V + b * s_vb + hk * s_vh + j[:, None] * s_vn + rv[None, :], mask=j_in[:, None] & (rv < Dv)[None, :], other=0.0)
    if not LOWP:
        kx = kx.to(tl.float32)
        vx = vx.to(tl.float32)
    return kx, vx, keep_j


@triton.jit
def _band_query_blocks(j0, Nq, Nk, W, BQ: tl.constexpr, BK: tl.constexpr, CAUSAL: tl.constexpr):
    """[first, end) of the query blocks whose band can reach a key of block j0..j0+BK-1."""
    off = Nk - Nq
    j_hi = tl.minimum(j0 + BK, Nk) - 1
    if CAUSAL:
        p_lo = j0
    else:
        p_lo = j0 - W + 1
    i_lo = tl.maximum(p_lo - off, 0)
    i_hi = tl.minimum(j_hi + W - 1 - off + 1, Nq)
    return i_lo // BQ, tl.maximum(tl.cdiv(i_hi, BQ), i_lo // BQ)


@triton.jit
def _window_dkv_kernel(
    Q, K, V, KEEP, SINK, DO, LSE, DELTA, DK, DV,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    Hkv, Nq, Nk, D, Dv, G, W, scale2, scale,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """One key block of one kv head: dk/dv over its G query heads and the query blocks of its band
    -> DK/DV [B, Hkv, Nk, ·] fp32. Sink keys seen from beyond the band: `_window_sink_dkv_kernel`."""
    pid_bh = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    j0 = pid_k * BK
    j = j0 + tl.arange(0, BK)
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    j_in = j < Nk
    s0 = tl.load(SINK + 2 * b)
    s1 = tl.load(SINK + 2 * b + 1)
    kx, vx, keep_j = _load_key_tile(K, V, KEEP, b, hk, j, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv,
                                    HAS_KEEP, LOWP, BD, BV)
    dk = tl.zeros([BK, BD], dtype=tl.float32)
    dv = tl.zeros([BK, BV], dtype=tl.float32)
    qb_lo, qb_hi = _band_query_blocks(j0, Nq, Nk, W, BQ, BK, CAUSAL)
    dk, dv = _dkv_over_queries(Q, DO, LSE, DELTA, kx, vx, dk, dv, j, keep_j, s0, s1, b, hk, qb_lo, qb_hi, 1,
                               s_qb, s_qh, s_qn, Hkv, Nq, Nk, D, Dv, G, W, scale2, CAUSAL, LOWP, BQ, BD, BV)
    base = pid_bh * Nk + j
    tl.store(DK + base[:, None] * D + rd[None, :], dk * scale, mask=j_in[:, None] & (rd < D)[None, :])
    tl.store(DV + base[:, None] * Dv + rv[None, :], dv, mask=j_in[:, None] & (rv < Dv)[None, :])


@triton.jit
def _window_sink_dkv_kernel(
    Q, K, V, KEEP, SINK, DO, LSE, DELTA, DK, DV,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    Hkv, Nq, Nk, D, Dv, G, W, scale2, scale, NSPLIT,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """The sink keys' gradient from the queries outside their block's band: every later query sees
    a sink, so one program per sink block would walk all N queries while the band programs walk
    ~W. Program (b·Hkv, z) takes every NSPLIT-th such query block, for each key block of the sink
    range [s0, s1), and atomically adds into DK/DV (the band kernel stored first)."""
    pid_bh = tl.program_id(0)
    pid_z = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    off = Nk - Nq
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    s0 = tl.load(SINK + 2 * b)
    s1 = tl.load(SINK + 2 * b + 1)
    n_qb = tl.cdiv(Nq, BQ)
    for kb in range(s0 // BK, tl.cdiv(s1, BK)):
        j0 = kb * BK
        j = j0 + tl.arange(0, BK)
        j_in = j < Nk
        kx, vx, keep_j = _load_key_tile(K, V, KEEP, b, hk, j, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv,
                                        HAS_KEEP, LOWP, BD, BV)
        qb_lo, qb_hi = _band_query_blocks(j0, Nq, Nk, W, BQ, BK, CAUSAL)
        if CAUSAL:
            first = tl.maximum(j0 - off, 0) // BQ
        else:
            first = 0
        dk = tl.zeros([BK, BD], dtype=tl.float32)
        dv = tl.zeros([BK, BV], dtype=tl.float32)
        # query blocks before the band (bidirectional) and after it
        dk, dv = _dkv_over_queries(Q, DO, LSE, DELTA, kx, vx, dk, dv, j, keep_j, s0, s1, b, hk,
                                   first + pid_z, tl.minimum(qb_lo, n_qb), NSPLIT,
                                   s_qb, s_qh, s_qn, Hkv, Nq, Nk, D, Dv, G, W, scale2, CAUSAL, LOWP, BQ, BD, BV)
        dk, dv = _dkv_over_queries(Q, DO, LSE, DELTA, kx, vx, dk, dv, j, keep_j, s0, s1, b, hk,
                                   tl.maximum(qb_hi, first) + pid_z, n_qb, NSPLIT,
                                   s_qb, s_qh, s_qn, Hkv, Nq, Nk, D, Dv, G, W, scale2, CAUSAL, LOWP, BQ, BD, BV)
        base = pid_bh * Nk + j
        tl.atomic_add(DK + base[:, None] * D + rd[None, :], dk * scale, mask=j_in[:, None] & (rd < D)[None, :])
        tl.atomic_add(DV + base[:, None] * Dv + rv[None, :], dv, mask=j_in[:, None] & (rv < Dv)[None, :])


def _blocks(D: int, Dv: int) -> tuple[int, int, int]:
    """(BQ, BK, num_warps): 64×64 tiles with 4 warps (8 at D=128 for the register-held q and acc)."""
    if interpreting():
        return 16, 16, 4
    return 64, 64, 4 if max(D, Dv) <= 64 else 8


def window_forward(q, k, v, keep, sinkr, window: int, causal: bool, scale: float, wrap: bool):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    BQ, BK, nw = _blocks(D, Dv)
    out = torch.empty(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    keep_t = q if keep is None else keep.to(torch.int8).contiguous()
    launcher(_window_fwd_kernel, wrap)[(B * H, triton.cdiv(Nq, BQ))](
        q, k, v, keep_t, sinkr, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, Nq, Nk, D, Dv, H // Hkv, window, scale * LOG2E,
        CAUSAL=causal, HAS_KEEP=keep is not None, LOWP=low_precision(q.dtype),
        BQ=BQ, BK=BK, BD=pow2(D), BV=pow2(Dv), num_warps=nw,
    )
    return out, lse


def window_backward(g, q, k, v, keep, sinkr, out, lse, window: int, causal: bool, scale: float, wrap: bool):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    BQ, BK, nw = _blocks(D, Dv)
    g = g.to(q.dtype).contiguous()
    delta = (g.to(torch.float32) * out.to(torch.float32)).sum(-1).contiguous()
    keep_t = q if keep is None else keep.to(torch.int8).contiguous()
    dq = torch.empty(B, H, Nq, D, device=q.device, dtype=torch.float32)
    dk = torch.empty(B, Hkv, Nk, D, device=q.device, dtype=torch.float32)
    dv = torch.empty(B, Hkv, Nk, Dv, device=q.device, dtype=torch.float32)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    flags = dict(CAUSAL=causal, HAS_KEEP=keep is not None, LOWP=low_precision(q.dtype),
                 BQ=BQ, BK=BK, BD=pow2(D), BV=pow2(Dv), num_warps=nw)
    launcher(_window_dq_kernel, wrap)[(B * H, triton.cdiv(Nq, BQ))](
        q, k, v, keep_t, sinkr, g, lse, delta, dq, *strides,
        H, Nq, Nk, D, Dv, H // Hkv, window, scale * LOG2E, scale, **flags)
    launcher(_window_dkv_kernel, wrap)[(B * Hkv, triton.cdiv(Nk, BK))](
        q, k, v, keep_t, sinkr, g, lse, delta, dk, dv, *strides,
        Hkv, Nq, Nk, D, Dv, H // Hkv, window, scale * LOG2E, scale, **flags)
    # The sink pass: each program walks ~`per` query blocks per sink block (the interpreter takes 2,
    # so that small tests cover several programs). Without sinks its key-block loop is empty; it is
    # launched anyway because the sink count lives in `sinkr` on the device, not on the host.
    per = 2 if interpreting() else 16
    nsplit = max(1, triton.cdiv(triton.cdiv(Nq, BQ), per))
    launcher(_window_sink_dkv_kernel, wrap)[(B * Hkv, nsplit)](
        q, k, v, keep_t, sinkr, g, lse, delta, dk, dv, *strides,
        Hkv, Nq, Nk, D, Dv, H // Hkv, window, scale * LOG2E, scale, nsplit, **flags)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@triton_op("attnopt_triton::window", mutates_args={})
def _window_op(
    q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], sinkr: Tensor, window: int, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    return window_forward(q, k, v, keep, sinkr, window, causal, scale, wrap=True)


@triton_op("attnopt_triton::window_backward", mutates_args={})
def _window_backward_op(
    g: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], sinkr: Tensor, out: Tensor, lse: Tensor,
    window: int, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return window_backward(g, q, k, v, keep, sinkr, out, lse, window, causal, scale, wrap=True)


def _setup(ctx, inputs, output):
    q, k, v, keep, sinkr, window, causal, scale = inputs
    ctx.save_for_backward(q, k, v, keep, sinkr, *output)
    ctx.opts = (window, causal, scale)


def _backward(ctx, g, _g_lse):
    q, k, v, keep, sinkr, out, lse = ctx.saved_tensors
    grads = torch.ops.attnopt_triton.window_backward(g, q, k, v, keep, sinkr, out, lse, *ctx.opts)
    return (*grads, None, None, None, None, None)


_window_op.register_autograd(_backward, setup_context=_setup)


class _WindowInterpreted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, sinkr, window, causal, scale):
        out, lse = window_forward(q, k, v, keep, sinkr, window, causal, scale, wrap=False)
        ctx.save_for_backward(q, k, v, keep, sinkr, out, lse)
        ctx.opts = (window, causal, scale)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, keep, sinkr, out, lse = ctx.saved_tensors
        grads = window_backward(g, q, k, v, keep, sinkr, out, lse, *ctx.opts, wrap=False)
        return (*grads, None, None, None, None, None)


def unsupported(q: Tensor, **kwargs) -> Optional[str]:
    """None if these kernels can run the reference op's call (its keywords, plus k= to check the key
    length), else a one-line reason; the reference op's CUDA dispatch asks it before handing over."""
    return call_unsupported(q, kwargs.get("k")) or window_unsupported(q, **kwargs)


def window_unsupported(q: Tensor, window=None, sinks=0, **_) -> Optional[str]:
    if max(q.shape[-1], 1) > 256:
        return f"window_attention: head dim {q.shape[-1]} > 256 does not fit the kernels' register tiles"
    return None


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"window_attention: {name} must be an int >= {minimum}, got {value!r}")
    return value


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    causal: bool,
    sinks: int = 0,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
    block_size: Optional[int] = None,
) -> Tensor:
    """`attnopt.forms.window.reference.window_attention` on the Triton kernels (forward and backward).
    `block_size` is accepted for compatibility: the kernels pick their own tiles."""
    check_sdpa_inputs("window_attention", q, k, v, key_mask)
    require_runtime("window_attention", q)
    window = _check_int("window", window, 1)
    sinks = _check_int("sinks", sinks, 0)
    reason = window_unsupported(q)
    if reason:
        raise ValueError(reason)
    B, _, Nq, D = q.shape
    Nk = k.shape[2]
    window = min(window, Nk + abs(Nk - Nq) + Nq + 1)  # a wider window sees nothing more (keeps int32)
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    sinkr = sink_range(key_mask, B, Nk, sinks, q.device)
    args = (q, k, v, key_mask, sinkr, window, bool(causal), s)
    if interpreting():
        return _WindowInterpreted.apply(*args)
    return torch.ops.attnopt_triton.window(*args)[0]


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
    check_one_token(who, q_t, k_t, v_t)
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
