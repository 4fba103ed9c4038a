"""Linear + sliding-window hybrid attention (LoLCATs-style) with one shared normaliser, in Triton.

    o_i = (Σ_{j∈W(i)} e^{s q_i·k_j} v_j + β_h Σ_{j∈L(i)} φ(q_i)·φ(k_j) v_j)
          / (Σ_{j∈W(i)} e^{s q_i·k_j} + β_h Σ_{j∈L(i)} φ(q_i)·φ(k_j))

W(i): the window + sinks of `window.py` (same band, sinks = first S real tokens, key_mask);
L(i): every other allowed, kept key (causal j <= p_i, bidirectional all). Rows that see nothing
return 0. β [H] >= 0 (`linear_weight`, a float or a per-head tensor).

Two kernels. `_prefix_state_kernel` writes, per (batch, φ(k) head), the state of every key block
boundary, P[c] = Σ_{j < c·BK, j kept, j not a sink} φ(k_j)[v_j, 1] ([nC+1, M, Dv] and [nC+1, M]):
sinks are always in W(i) when allowed, so excluding them here is exact. `_hybrid_fwd_kernel` runs
the window kernel's online softmax over its band (and the sink blocks before it); inside the band
blocks a key that is allowed but not window-visible goes to the linear sums explicitly, keys left
of the band come from P[band_lo / BK] and (bidirectional) keys right of it from P[nC] − P[end].
All query rows of a block share those two states: keys left of the block's band are outside every
row's window and allowed for every row.

The two parts are combined under one shift c = max(m, log2(β·den_L)) (log2 units, m the window
row max): both weights 2^(m−c) and β·den_L·2^(−c) are <= 1, so neither overflows even when all
window logits are very negative -- the same ratio as subtracting m from both parts.

Backward: not implemented (calling backward raises); calibration through the hybrid runs on the
PyTorch reference for now.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.kernels.feature_maps import FeatureMap, make_feature_map
from attnopt.kernels.layout import check_sdpa_inputs
from attnopt.kernels.triton.band import LOG2E, key_range, sink_range, visible
from attnopt.kernels.triton.chunk_scan import dot, phi
from attnopt.kernels.triton.runtime import (
    FMAP_CODES,
    call_unsupported,
    concrete,
    interpreting,
    launcher,
    low_precision,
    pow2,
    require_runtime,
)

MAX_FEATURES = 128


@triton.jit
def _prefix_state_kernel(
    FK, V, KEEP, SINK, SP, ZP,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    Hf, Nk, M, Dv, RKV, NC,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BK: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // Hf
    hf = pid_bh % Hf
    DT = FK.dtype.element_ty
    rk = tl.arange(0, BK)
    rm = tl.arange(0, BM)
    rv = pid_v * BV + tl.arange(0, BV)
    m_ok = rm < M
    v_ok = rv < Dv
    s0 = tl.load(SINK + 2 * b)
    s1 = tl.load(SINK + 2 * b + 1)
    k_base = FK + b * s_kb + hf * s_kh
    v_base = V + b * s_vb + (hf // RKV) * s_vh
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c in range(0, NC):
        base = pid_bh * (NC + 1) + c
        tl.store(SP + (base * M + rm)[:, None] * Dv + rv[None, :], S, mask=m_ok[:, None] & v_ok[None, :])
        if pid_v == 0:
            tl.store(ZP + base * M + rm, z, mask=m_ok)
        j = c * BK + rk
        ok = (j < Nk) & ~((j >= s0) & (j < s1))
        if HAS_KEEP:
            ok = ok & (tl.load(KEEP + b * Nk + j, mask=j < Nk, other=0) != 0)
        kx = tl.load(k_base + j[:, None] * s_kn + rm[None, :], mask=(j < Nk)[:, None] & m_ok[None, :], other=0.0)
        fk = tl.where(ok[:, None] & m_ok[None, :], phi(kx.to(tl.float32), FMAP), 0.0)
        vx = tl.load(v_base + j[:, None] * s_vn + rv[None, :], mask=(j < Nk)[:, None] & v_ok[None, :], other=0.0)
        S += dot(tl.trans(fk), vx.to(tl.float32), LOWP, DT)
        z += tl.sum(fk, axis=0)
    base = pid_bh * (NC + 1) + NC
    tl.store(SP + (base * M + rm)[:, None] * Dv + rv[None, :], S, mask=m_ok[:, None] & v_ok[None, :])
    if pid_v == 0:
        tl.store(ZP + base * M + rm, z, mask=m_ok)


@triton.jit
def _hybrid_fwd_kernel(
    Q, K, V, FQ, FK, KEEP, SINK, SP, ZP, BETA, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_fqb, s_fqh, s_fqn, s_fkb, s_fkh, s_fkn,
    s_ob, s_oh, s_on,
    H, Hf, Nq, Nk, D, M, Dv, G, GF, W, scale2, NC,
    CAUSAL: tl.constexpr, FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
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
    rm = tl.arange(0, BM)
    rv = tl.arange(0, BV)
    q_ok = rq < Nq
    d_ok = rd < D
    m_ok = rm < M
    v_ok = rv < Dv
    p = off + rq
    s0 = tl.load(SINK + 2 * b)
    s1 = tl.load(SINK + 2 * b + 1)
    beta = tl.load(BETA + h)
    k_base = K + b * s_kb + (h // G) * s_kh
    v_base = V + b * s_vb + (h // G) * s_vh
    fk_base = FK + b * s_fkb + (h // GF) * s_fkh
    qx = tl.load(Q + b * s_qb + h * s_qh + rq[:, None] * s_qn + rd[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if not LOWP:
        qx = qx.to(tl.float32)
    fqx = tl.load(FQ + b * s_fqb + h * s_fqh + rq[:, None] * s_fqn + rm[None, :], mask=q_ok[:, None] & m_ok[None, :], other=0.0)
    fq = tl.where(q_ok[:, None] & m_ok[None, :], phi(fqx.to(tl.float32), FMAP), 0.0)
    m = tl.full([BQ], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, BV], dtype=tl.float32)
    p_lo = off + pid_q * BQ
    p_hi = off + tl.minimum(pid_q * BQ + BQ, Nq) - 1
    band_lo, band_hi = key_range(p_lo, p_hi, Nk, W, BK, CAUSAL)
    band_end = tl.maximum(tl.cdiv(band_hi, BK), band_lo // BK)  # blocks the band loop covers: [band_lo/BK, band_end)
    # linear part from the block-boundary states: keys left of the band (and right of it, bidirectional)
    st_base = (b * Hf + h // GF) * (NC + 1)
    mv = m_ok[:, None] & v_ok[None, :]
    S_l = tl.load(SP + ((st_base + band_lo // BK) * M + rm)[:, None] * Dv + rv[None, :], mask=mv, other=0.0)
    z_l = tl.load(ZP + (st_base + band_lo // BK) * M + rm, mask=m_ok, other=0.0)
    if not CAUSAL:
        S_l += tl.load(SP + ((st_base + NC) * M + rm)[:, None] * Dv + rv[None, :], mask=mv, other=0.0)
        S_l -= tl.load(SP + ((st_base + band_end) * M + rm)[:, None] * Dv + rv[None, :], mask=mv, other=0.0)
        z_l += tl.load(ZP + (st_base + NC) * M + rm, mask=m_ok, other=0.0)
        z_l -= tl.load(ZP + (st_base + band_end) * M + rm, mask=m_ok, other=0.0)
    lin_num = dot(fq, S_l, LOWP, DT)
    lin_den = tl.sum(fq * z_l[None, :], axis=1)
    sink_hi = tl.minimum(s1, band_lo)
    for part in range(0, 2):
        if part == 0:
            j_start = (s0 // BK) * BK
            j_end = sink_hi
        else:
            j_start = band_lo
            j_end = band_end * BK
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
            if part == 1:  # allowed, kept keys of the band blocks outside the window: linear part
                if CAUSAL:
                    lin = (p[:, None] >= j[None, :]) & (keep_j & j_in)[None, :] & ~vis
                else:
                    lin = (keep_j & j_in)[None, :] & ~vis
                fkx = tl.load(fk_base + j[:, None] * s_fkn + rm[None, :], mask=j_in[:, None] & m_ok[None, :], other=0.0)
                fk = tl.where(j_in[:, None] & m_ok[None, :], phi(fkx.to(tl.float32), FMAP), 0.0)
                a = tl.where(lin, dot(fq, tl.trans(fk), LOWP, DT), 0.0)
                lin_num += dot(a, vx, LOWP, DT)
                lin_den += tl.sum(a, axis=1)
    # one normaliser: shift both parts by c = max(m, log2(β·den_L)) so every weight is <= 1
    lw = beta * lin_den
    has_lin = lw > 0.0
    lg_lw = tl.where(has_lin, tl.log2(tl.where(has_lin, lw, 1.0)), -1.0e30)
    c = tl.maximum(m, lg_lw)
    a_w = tl.exp2(m - c)
    r = tl.where(has_lin, tl.exp2(lg_lw - c), 0.0)
    lin_avg = lin_num / tl.where(lin_den > 0.0, lin_den, 1.0)[:, None]
    num = acc * a_w[:, None] + lin_avg * r[:, None]
    den = l * a_w + r
    out = tl.where((den > 0.0)[:, None], num / tl.where(den > 0.0, den, 1.0)[:, None], 0.0)
    tl.store(O + b * s_ob + h * s_oh + rq[:, None] * s_on + rv[None, :], out.to(O.dtype.element_ty),
             mask=q_ok[:, None] & v_ok[None, :])


def _blocks(D: int, M: int, Dv: int) -> tuple[int, int, int]:
    if interpreting():
        return 16, 16, 4
    return 64, 64, 4 if max(D, M, Dv) <= 64 else 8


def hybrid_forward(q, k, v, fq, fk, keep, sinkr, beta, window: int, causal: bool, fmap: int, scale: float, wrap: bool):
    q, k, v, fq, fk = (t.contiguous() for t in (q, k, v, fq, fk))
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    Hf, M = fk.shape[1], fk.shape[3]
    BQ, BK, nw = _blocks(D, M, Dv)
    NC = triton.cdiv(Nk, BK)
    BV = min(64, pow2(Dv))
    keep_t = q if keep is None else keep.to(torch.int8).contiguous()
    lowp = low_precision(q.dtype)
    SP = torch.empty(B, Hf, NC + 1, M, Dv, device=q.device, dtype=torch.float32)
    ZP = torch.empty(B, Hf, NC + 1, M, device=q.device, dtype=torch.float32)
    launcher(_prefix_state_kernel, wrap)[(B * Hf, triton.cdiv(Dv, BV))](
        fk, v, keep_t, sinkr, SP, ZP, fk.stride(0), fk.stride(1), fk.stride(2), v.stride(0), v.stride(1), v.stride(2),
        Hf, Nk, M, Dv, Hf // Hkv, NC, FMAP=fmap, HAS_KEEP=keep is not None, LOWP=lowp, BK=BK, BM=pow2(M), BV=BV,
    )
    out = torch.empty(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    launcher(_hybrid_fwd_kernel, wrap)[(B * H, triton.cdiv(Nq, BQ))](
        q, k, v, fq, fk, keep_t, sinkr, SP, ZP, beta, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        fq.stride(0), fq.stride(1), fq.stride(2), fk.stride(0), fk.stride(1), fk.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        H, Hf, Nq, Nk, D, M, Dv, H // Hkv, H // Hf, window, scale * LOG2E, NC,
        CAUSAL=causal, FMAP=fmap, HAS_KEEP=keep is not None, LOWP=lowp,
        BQ=BQ, BK=BK, BD=pow2(D), BM=pow2(M), BV=pow2(Dv), num_warps=nw,
    )
    return out


@triton_op("attnopt_triton::linear_window", mutates_args={})
def _linear_window_op(
    q: Tensor, k: Tensor, v: Tensor, fq: Tensor, fk: Tensor, keep: Optional[Tensor], sinkr: Tensor, beta: Tensor,
    window: int, causal: bool, fmap: int, scale: float,
) -> Tensor:
    return hybrid_forward(q, k, v, fq, fk, keep, sinkr, beta, window, causal, fmap, scale, wrap=True)


def _no_backward(ctx, g):
    raise NotImplementedError(
        "linear_window_attention: the Triton path has no backward yet; train through "
        "attnopt.forms.linear_window.reference (PyTorch) instead"
    )


_linear_window_op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


class _HybridInterpreted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        return hybrid_forward(*args, wrap=False)

    @staticmethod
    def backward(ctx, g):
        _no_backward(ctx, g)


def unsupported(q: Tensor, **kwargs) -> Optional[str]:
    """None if these kernels can run the reference op's call (its keywords, plus k= to check the key
    length), else a one-line reason; the reference op's CUDA dispatch asks it before handing over."""
    return call_unsupported(q, kwargs.get("k")) or linear_window_unsupported(q, **kwargs)


def linear_window_unsupported(q: Tensor, feature_map="elu", **_) -> Optional[str]:
    name = feature_map.name if isinstance(feature_map, FeatureMap) else feature_map
    if name == "taylor":
        return "linear_window_attention: taylor features (1 + D + D²) are too wide for the hybrid kernel"
    if name not in ("elu", "relu", "favor", "hedgehog"):
        return f"linear_window_attention: unknown feature map {name!r}"
    M = feature_map.num_features(q.shape[-1]) if isinstance(feature_map, FeatureMap) else (
        q.shape[-1] if name in ("elu", "relu") else 2 * q.shape[-1])
    if M > MAX_FEATURES or q.shape[-1] > MAX_FEATURES:
        return f"linear_window_attention: {M} features / head dim {q.shape[-1]} exceed the kernel's {MAX_FEATURES}"
    if q.requires_grad:
        return "linear_window_attention: no Triton backward yet"
    return None


def linear_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    sinks: int = 0,
    causal: bool,
    feature_map: Union[str, FeatureMap] = "elu",
    scale: Optional[float] = None,
    linear_weight: Union[float, Tensor] = 1.0,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """Forward of the linear + window hybrid on the Triton kernels (see the module docstring)."""
    check_sdpa_inputs("linear_window_attention", q, k, v, key_mask)
    require_runtime("linear_window_attention", q)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"linear_window_attention: window must be an int >= 1, got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"linear_window_attention: sinks must be an int >= 0, got {sinks!r}")
    name = feature_map.name if isinstance(feature_map, FeatureMap) else feature_map
    reason = linear_window_unsupported(q.detach(), feature_map)
    if reason:
        raise ValueError(reason)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    beta = torch.as_tensor(linear_weight, dtype=torch.float32, device=q.device).reshape(-1)
    beta = (beta.expand(H) if beta.numel() == 1 else beta).contiguous()
    if tuple(beta.shape) != (H,) or (concrete(beta) and bool((beta < 0).any())):
        raise ValueError(f"linear_window_attention: linear_weight must be a float or [H] = [{H}] values >= 0")
    if name in ("elu", "relu"):
        fmap, fq, fk = FMAP_CODES[name], q, k
    else:
        fmap = FMAP_CODES["identity"]
        module = feature_map if isinstance(feature_map, FeatureMap) else make_feature_map(name, D, H)
        weight = module.op_weight()
        weight = None if weight is None else weight.to(device=q.device, dtype=torch.float32)
        # FAVOR+'s stabilisers would rescale the linear part against the window part: use the
        # unstabilised features here (the one normaliser needs true kernel values)
        fq = module.features(q.float(), s, weight).to(q.dtype)
        kr = k if not module.per_head else k.repeat_interleave(H // k.shape[1], dim=1)
        fk = module.features(kr.float(), s, weight).to(q.dtype)
    window = min(window, Nk + abs(Nk - Nq) + Nq + 1)
    sinkr = sink_range(key_mask, B, Nk, sinks, q.device)
    args = (q, k, v, fq, fk, key_mask, sinkr, beta, window, bool(causal), fmap, s)
    if interpreting():
        return _HybridInterpreted.apply(*args)
    return torch.ops.attnopt_triton.linear_window(*args)
