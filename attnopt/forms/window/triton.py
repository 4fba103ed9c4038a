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

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.kernels.layout import check_int
from attnopt.kernels.triton.band import LOG2E, band_keys, band_part, band_queries, clamp_window, sink_range, sinks_of
from attnopt.kernels.triton.band import visible
from attnopt.kernels.triton.differentiable import differentiable
from attnopt.kernels.triton.runtime import checked_call, dims, interpreting, keep_arg, launcher
from attnopt.kernels.triton.runtime import low_precision, pow2, row_strides, scale_or_default, shared_checks
from attnopt.kernels.triton.softmax import attend, key_tile, softmax_init, softmax_out
from attnopt.kernels.triton.state_step import check_one_token
from attnopt.kernels.triton.tiles import dot, load_tile, program_head, span, store_tile


@triton.jit
def _window_fwd_kernel(
    Q, K, V, KEEP, SINK, O, LSE,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
    H, Nq, Nk, D, Dv, G, W, scale2,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    pid_bh, b, h = program_head(H)
    rq, q_ok, p, band_lo, band_hi, s0, s1 = band_queries(SINK, b, tl.program_id(1), Nq, Nk, W, BQ, BK, CAUSAL)
    rd, d_ok = span(0, D, BD)
    qx = load_tile(Q + b * s_qb + h * s_qh, rq, s_qn, rd, q_ok, d_ok)
    m, l, acc = softmax_init(BQ, BV)
    for part in range(0, 2):
        j_start, j_end = band_part(part, s0, s1, band_lo, band_hi, BK)
        for j0 in range(j_start, j_end, BK):
            _j, kx, vx, _keep, vis = band_keys(K, V, KEEP, b, h // G, j0, p, s0, s1, s_kb, s_kh, s_kn, s_vb, s_vh,
                                               s_vn, Nk, D, Dv, W, CAUSAL, HAS_KEEP, BK, BD, BV)
            m, l, acc = attend(qx, kx, vx, vis, m, l, acc, scale2, LOWP, Q.dtype.element_ty)
    out, lse = softmax_out(m, l, acc)
    rv, v_ok = span(0, Dv, BV)
    store_tile(O + b * s_ob + h * s_oh, rq, s_on, rv, q_ok, v_ok, out)
    tl.store(LSE + pid_bh * Nq + rq, lse, mask=q_ok)


@triton.jit
def _query_side(q_base, s_qn, DO, LSE, DELTA, bh, ri, i_ok, Nq, D, Dv, BD: tl.constexpr, BV: tl.constexpr):
    """What the backward reads of the query rows ri of query head bh (pid b·H + h): (q, dO, lse, delta)."""
    rd, d_ok = span(0, D, BD)
    rv, v_ok = span(0, Dv, BV)
    row = bh * Nq
    return (load_tile(q_base, ri, s_qn, rd, i_ok, d_ok), load_tile(DO + row * Dv, ri, Dv, rv, i_ok, v_ok),
            tl.load(LSE + row + ri, mask=i_ok, other=0.0), tl.load(DELTA + row + ri, mask=i_ok, other=0.0))


@triton.jit
def _score_grads(qx, kx, vx, do, lse, delta, vis, scale2, LOWP: tl.constexpr, DT: tl.constexpr):
    """(P, dS) of one [queries, keys] tile: P = 2^(s − lse) where visible, dS = P ⊙ (dO·vᵀ − delta)."""
    pr = tl.where(vis, tl.exp2(dot(qx, tl.trans(kx), LOWP, DT) * scale2 - lse[:, None]), 0.0)
    return pr, pr * (dot(do, tl.trans(vx), LOWP, DT) - delta[:, None])


@triton.jit
def _window_dq_kernel(
    Q, K, V, KEEP, SINK, DO, LSE, DELTA, DQ,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    H, Nq, Nk, D, Dv, G, W, scale2, scale,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """DO [B, H, Nq, Dv] (contiguous), LSE/DELTA [B, H, Nq] fp32 -> DQ [B, H, Nq, D] fp32."""
    pid_bh, b, h = program_head(H)
    DT = Q.dtype.element_ty
    rq, q_ok, p, band_lo, band_hi, s0, s1 = band_queries(SINK, b, tl.program_id(1), Nq, Nk, W, BQ, BK, CAUSAL)
    qx, do, lse, delta = _query_side(Q + b * s_qb + h * s_qh, s_qn, DO, LSE, DELTA, pid_bh, rq, q_ok, Nq, D, Dv, BD, BV)
    dq = tl.zeros([BQ, BD], dtype=tl.float32)
    for part in range(0, 2):
        j_start, j_end = band_part(part, s0, s1, band_lo, band_hi, BK)
        for j0 in range(j_start, j_end, BK):
            _j, kx, vx, _keep, vis = band_keys(K, V, KEEP, b, h // G, j0, p, s0, s1, s_kb, s_kh, s_kn, s_vb, s_vh,
                                               s_vn, Nk, D, Dv, W, CAUSAL, HAS_KEEP, BK, BD, BV)
            _pr, ds = _score_grads(qx, kx, vx, do, lse, delta, vis, scale2, LOWP, DT)
            dq += dot(ds, kx, LOWP, DT)
    rd, d_ok = span(0, D, BD)
    store_tile(DQ + pid_bh * Nq * D, rq, D, rd, q_ok, d_ok, dq * scale)


@triton.jit
def _dkv_over_queries(
    Q, DO, LSE, DELTA, kx, vx, dk, dv, j, keep_j, s0, s1, b, hk, qb_start, qb_end, qb_step,
    s_qb, s_qh, s_qn, Hkv, Nq, Nk, D, Dv, G, W, scale2,
    CAUSAL: tl.constexpr, LOWP: tl.constexpr, BQ: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """Add to (dk, dv) of the key tile j the terms of the query blocks qb_start, +qb_step, .. < qb_end
    of every query head of kv head hk."""
    DT = Q.dtype.element_ty
    for g in range(0, G):
        h = hk * G + g
        for qb in range(qb_start, qb_end, qb_step):
            ri, i_ok = span(qb * BQ, Nq, BQ)
            qx, do, lse, delta = _query_side(Q + b * s_qb + h * s_qh, s_qn, DO, LSE, DELTA, b * Hkv * G + h, ri, i_ok,
                                             Nq, D, Dv, BD, BV)
            vis = visible(Nk - Nq + ri, j, keep_j, s0, s1, Nk, W, CAUSAL) & i_ok[:, None]
            pr, ds = _score_grads(qx, kx, vx, do, lse, delta, vis, scale2, LOWP, DT)
            dv += dot(tl.trans(pr), do, LOWP, DT)
            dk += dot(tl.trans(ds), qx, LOWP, DT)
    return dk, dv


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
def _store_dkv(DK, DV, row, j, j_in, dk, dv, D, Dv, ATOMIC: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr):
    """Write (ATOMIC: add) the rows j of DK/DV [B, Hkv, Nk, ·] fp32 from row (b·Hkv + hk)·Nk on."""
    rd, d_ok = span(0, D, BD)
    rv, v_ok = span(0, Dv, BV)
    if ATOMIC:
        tl.atomic_add(DK + (row + j)[:, None] * D + rd[None, :], dk, mask=j_in[:, None] & d_ok[None, :])
        tl.atomic_add(DV + (row + j)[:, None] * Dv + rv[None, :], dv, mask=j_in[:, None] & v_ok[None, :])
    else:
        store_tile(DK + row * D, j, D, rd, j_in, d_ok, dk)
        store_tile(DV + row * Dv, j, Dv, rv, j_in, v_ok, dv)


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
    pid_bh, b, hk = program_head(Hkv)
    s0, s1 = sinks_of(SINK, b)
    j0 = tl.program_id(1) * BK
    j, j_in = span(j0, Nk, BK)
    kx, vx, keep_j = key_tile(K, V, KEEP, b, hk, j, j_in, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv,
                              HAS_KEEP, BD, BV)
    qb_lo, qb_hi = _band_query_blocks(j0, Nq, Nk, W, BQ, BK, CAUSAL)
    dk, dv = _dkv_over_queries(Q, DO, LSE, DELTA, kx, vx, tl.zeros([BK, BD], dtype=tl.float32),
                               tl.zeros([BK, BV], dtype=tl.float32), j, keep_j, s0, s1, b, hk, qb_lo, qb_hi, 1,
                               s_qb, s_qh, s_qn, Hkv, Nq, Nk, D, Dv, G, W, scale2, CAUSAL, LOWP, BQ, BD, BV)
    _store_dkv(DK, DV, pid_bh * Nk, j, j_in, dk * scale, dv, D, Dv, False, BD, BV)


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
    pid_bh, b, hk = program_head(Hkv)
    pid_z = tl.program_id(1)
    s0, s1 = sinks_of(SINK, b)
    n_qb = tl.cdiv(Nq, BQ)
    for kb in range(s0 // BK, tl.cdiv(s1, BK)):
        j0 = kb * BK
        j, j_in = span(j0, Nk, BK)
        kx, vx, keep_j = key_tile(K, V, KEEP, b, hk, j, j_in, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv,
                                  HAS_KEEP, BD, BV)
        qb_lo, qb_hi = _band_query_blocks(j0, Nq, Nk, W, BQ, BK, CAUSAL)
        if CAUSAL:
            first = tl.maximum(j0 - (Nk - Nq), 0) // BQ
        else:
            first = 0
        dk = tl.zeros([BK, BD], dtype=tl.float32)
        dv = tl.zeros([BK, BV], dtype=tl.float32)
        # query blocks before the band (bidirectional) and after it
        for before in range(0, 2):
            if before == 0:
                qb_start = first + pid_z
                qb_end = tl.minimum(qb_lo, n_qb)
            else:
                qb_start = tl.maximum(qb_hi, first) + pid_z
                qb_end = n_qb
            dk, dv = _dkv_over_queries(Q, DO, LSE, DELTA, kx, vx, dk, dv, j, keep_j, s0, s1, b, hk, qb_start, qb_end,
                                       NSPLIT, s_qb, s_qh, s_qn, Hkv, Nq, Nk, D, Dv, G, W, scale2, CAUSAL, LOWP, BQ,
                                       BD, BV)
        _store_dkv(DK, DV, pid_bh * Nk, j, j_in, dk * scale, dv, D, Dv, True, BD, BV)


def _blocks(D: int, Dv: int) -> tuple[int, int, int]:
    """(BQ, BK, num_warps): 64×64 tiles with 4 warps (8 at D=128 for the register-held q and acc)."""
    if interpreting():
        return 16, 16, 4
    return 64, 64, 4 if max(D, Dv) <= 64 else 8


def window_forward(q, k, v, keep, sinkr, window: int, causal: bool, scale: float, wrap: bool):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Hkv, Nq, Nk, D, Dv = dims(q, k, v)
    BQ, BK, nw = _blocks(D, Dv)
    out = torch.empty(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    keep_t, has_keep = keep_arg(keep, q)
    launcher(_window_fwd_kernel, wrap)[(B * H, triton.cdiv(Nq, BQ))](
        q, k, v, keep_t, sinkr, out, lse, *row_strides(q, k, v, out), H, Nq, Nk, D, Dv, H // Hkv, window, scale * LOG2E,
        CAUSAL=causal, HAS_KEEP=has_keep, LOWP=low_precision(q.dtype), BQ=BQ, BK=BK, BD=pow2(D), BV=pow2(Dv),
        num_warps=nw,
    )
    return out, lse


def window_backward(g, q, k, v, keep, sinkr, out, lse, window: int, causal: bool, scale: float, wrap: bool):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Hkv, Nq, Nk, D, Dv = dims(q, k, v)
    BQ, BK, nw = _blocks(D, Dv)
    g = g.to(q.dtype).contiguous()
    delta = (g.to(torch.float32) * out.to(torch.float32)).sum(-1).contiguous()
    keep_t, has_keep = keep_arg(keep, q)
    dq = torch.empty(B, H, Nq, D, device=q.device, dtype=torch.float32)
    dk = torch.empty(B, Hkv, Nk, D, device=q.device, dtype=torch.float32)
    dv = torch.empty(B, Hkv, Nk, Dv, device=q.device, dtype=torch.float32)
    strides, shape = row_strides(q, k, v), (Nq, Nk, D, Dv, H // Hkv, window, scale * LOG2E, scale)
    flags = dict(CAUSAL=causal, HAS_KEEP=has_keep, LOWP=low_precision(q.dtype),
                 BQ=BQ, BK=BK, BD=pow2(D), BV=pow2(Dv), num_warps=nw)
    launcher(_window_dq_kernel, wrap)[(B * H, triton.cdiv(Nq, BQ))](
        q, k, v, keep_t, sinkr, g, lse, delta, dq, *strides, H, *shape, **flags)
    launcher(_window_dkv_kernel, wrap)[(B * Hkv, triton.cdiv(Nk, BK))](
        q, k, v, keep_t, sinkr, g, lse, delta, dk, dv, *strides, Hkv, *shape, **flags)
    # The sink pass: each program walks ~`per` query blocks per sink block (the interpreter takes 2,
    # so that small tests cover several programs). Without sinks its key-block loop is empty; it is
    # launched anyway because the sink count lives in `sinkr` on the device, not on the host.
    per = 2 if interpreting() else 16
    nsplit = max(1, triton.cdiv(triton.cdiv(Nq, BQ), per))
    launcher(_window_sink_dkv_kernel, wrap)[(B * Hkv, nsplit)](
        q, k, v, keep_t, sinkr, g, lse, delta, dk, dv, *strides, Hkv, *shape, nsplit, **flags)
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


# the backward reads q, k, v, keep, sinkr, (out, lse) and the options window, causal, scale
_window = differentiable(_window_op, _window_backward_op, window_forward, window_backward, saved=5, opts=(5, 6, 7))


def window_unsupported(q: Tensor, window=None, sinks=0, **_) -> Optional[str]:
    if max(q.shape[-1], 1) > 256:
        return f"window_attention: head dim {q.shape[-1]} > 256 does not fit the kernels' register tiles"
    return None


unsupported = shared_checks(window_unsupported)


def window_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool, sinks: int = 0,
                     scale: Optional[float] = None, key_mask: Optional[Tensor] = None,
                     block_size: Optional[int] = None) -> Tensor:
    """`attnopt.forms.window.reference.window_attention` on the Triton kernels (forward and backward).
    `block_size` is accepted for compatibility: the kernels pick their own tiles."""
    who = "window_attention"
    checked_call(who, q, k, v, key_mask, lambda: window_unsupported(q))
    window, sinks = check_int(who, "window", window, 1), check_int(who, "sinks", sinks, 0)
    B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
    sinkr = sink_range(key_mask, B, Nk, sinks, q.device)
    return _window(q, k, v, key_mask, sinkr, clamp_window(window, Nq, Nk), bool(causal), scale_or_default(q, scale))


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
    return (torch.zeros(B, Hkv, L, D, dtype=dtype, device=device),
            torch.zeros(B, Hkv, L, Dv, dtype=dtype, device=device), torch.full((B, L), -1, dtype=torch.int32, device=device))


def window_decode_step(q_t: Tensor, k_t: Tensor, v_t: Tensor, cache: tuple, position: int, *, window: int,
                       sinks: int = 0, scale: Optional[float] = None):
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
    out = torch.empty(B, H, 1, Dv, device=q_t.device, dtype=q_t.dtype)
    BL = 16 if interpreting() else 64
    _ring_attend_kernel[(B * H,)](
        q_t.contiguous(), kc, vc, pos, out, H, L, D, Dv, H // k_t.shape[1], sinks, window, int(position),
        scale_or_default(q_t, scale) * LOG2E,
        BL=BL, BD=pow2(D), BV=pow2(Dv),
    )
    return out, (kc, vc, pos)
