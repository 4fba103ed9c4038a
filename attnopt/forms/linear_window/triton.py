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

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.kernels.feature_maps import FeatureMap, make_feature_map
from attnopt.kernels.layout import check_int
from attnopt.kernels.triton.band import LOG2E, band_keys, band_part, band_queries, clamp_window, sink_range, sinks_of
from attnopt.kernels.triton.chunk_scan import carry, key_features
from attnopt.kernels.triton.runtime import FMAP_CODES, checked_call, concrete, dims, interpreting, keep_arg, launcher
from attnopt.kernels.triton.runtime import low_precision, pow2, row_strides, scale_or_default, shared_checks
from attnopt.kernels.triton.softmax import attend, softmax_init
from attnopt.kernels.triton.tiles import dot, kept, load_phi, load_tile, program_head, span, store_tile

MAX_FEATURES = 128


@triton.jit
def _boundary_state(SP, ZP, row, M, Dv, rm, m_ok, rv, v_ok):
    """(S [BM, BV], z [BM]) of one block boundary: row (b·Hf + hf)·(NC + 1) + c of SP / ZP."""
    return load_tile(SP + row * M * Dv, rm, Dv, rv, m_ok, v_ok), tl.load(ZP + row * M + rm, mask=m_ok, other=0.0)


@triton.jit
def _prefix_state_kernel(
    FK, V, KEEP, SINK, SP, ZP,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    Hf, Nk, M, Dv, RKV, NC,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BK: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    pid_bh, b, hf = program_head(Hf)
    rm, m_ok = span(0, M, BM)
    rv, v_ok = span(tl.program_id(1) * BV, Dv, BV)
    s0, s1 = sinks_of(SINK, b)
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c in range(0, NC + 1):
        row = pid_bh * (NC + 1) + c
        store_tile(SP + row * M * Dv, rm, Dv, rv, m_ok, v_ok, S)
        if tl.program_id(1) == 0:
            tl.store(ZP + row * M + rm, z, mask=m_ok)
        j, j_in = span(c * BK, Nk, BK)
        ok = kept(KEEP + b * Nk, j, j_in & ~((j >= s0) & (j < s1)), HAS_KEEP)  # sinks are always window keys
        fk, vx = key_features(FK + b * s_kb + hf * s_kh, s_kn, V + b * s_vb + (hf // RKV) * s_vh, s_vn, j, ok,
                              rm, m_ok, rv, v_ok, FMAP)
        S = carry(S, fk, vx, 1.0, False, LOWP, FK.dtype.element_ty)
        z += tl.sum(fk, axis=0)


@triton.jit
def _hybrid_fwd_kernel(
    Q, K, V, FQ, FK, KEEP, SINK, SP, ZP, BETA, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_fqb, s_fqh, s_fqn, s_fkb, s_fkh, s_fkn,
    s_ob, s_oh, s_on,
    H, Hf, Nq, Nk, D, M, Dv, G, GF, W, scale2, NC,
    CAUSAL: tl.constexpr, FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    _, b, h = program_head(H)
    DT = Q.dtype.element_ty
    rq, q_ok, p, band_lo, band_hi, s0, s1 = band_queries(SINK, b, tl.program_id(1), Nq, Nk, W, BQ, BK, CAUSAL)
    band_end = tl.maximum(tl.cdiv(band_hi, BK), band_lo // BK)  # blocks the band loop covers: [band_lo/BK, band_end)
    rd, d_ok = span(0, D, BD)
    rm, m_ok = span(0, M, BM)
    rv, v_ok = span(0, Dv, BV)
    qx = load_tile(Q + b * s_qb + h * s_qh, rq, s_qn, rd, q_ok, d_ok)
    fq = load_phi(FQ + b * s_fqb + h * s_fqh, rq, s_fqn, rm, q_ok, m_ok, FMAP)
    # linear part from the block-boundary states: keys left of the band (and right of it, bidirectional)
    st_row = (b * Hf + h // GF) * (NC + 1)
    S_l, z_l = _boundary_state(SP, ZP, st_row + band_lo // BK, M, Dv, rm, m_ok, rv, v_ok)
    if not CAUSAL:
        S_all, z_all = _boundary_state(SP, ZP, st_row + NC, M, Dv, rm, m_ok, rv, v_ok)
        S_end, z_end = _boundary_state(SP, ZP, st_row + band_end, M, Dv, rm, m_ok, rv, v_ok)
        S_l = S_l + S_all - S_end
        z_l = z_l + z_all - z_end
    lin_num = dot(fq, S_l, LOWP, DT)
    lin_den = tl.sum(fq * z_l[None, :], axis=1)
    m, l, acc = softmax_init(BQ, BV)
    for part in range(0, 2):
        j_start, j_end = band_part(part, s0, s1, band_lo, band_end * BK, BK)
        for j0 in range(j_start, j_end, BK):
            j, kx, vx, keep_j, vis = band_keys(K, V, KEEP, b, h // G, j0, p, s0, s1, s_kb, s_kh, s_kn, s_vb, s_vh,
                                               s_vn, Nk, D, Dv, W, CAUSAL, HAS_KEEP, BK, BD, BV)
            m, l, acc = attend(qx, kx, vx, vis, m, l, acc, scale2, LOWP, DT)
            if part == 1:  # allowed, kept keys of the band blocks outside the window: linear part
                lin = keep_j[None, :] & ~vis
                if CAUSAL:
                    lin = lin & (p[:, None] >= j[None, :])
                fk = load_phi(FK + b * s_fkb + (h // GF) * s_fkh, j, s_fkn, rm, j < Nk, m_ok, FMAP)
                a = tl.where(lin, dot(fq, tl.trans(fk), LOWP, DT), 0.0)
                lin_num += dot(a, vx, LOWP, DT)
                lin_den += tl.sum(a, axis=1)
    # one normaliser: shift both parts by c = max(m, log2(β·den_L)) so every weight is <= 1
    lw = tl.load(BETA + h) * lin_den
    has_lin = lw > 0.0
    lg_lw = tl.where(has_lin, tl.log2(tl.where(has_lin, lw, 1.0)), -1.0e30)
    c = tl.maximum(m, lg_lw)
    a_w = tl.exp2(m - c)
    r = tl.where(has_lin, tl.exp2(lg_lw - c), 0.0)
    lin_avg = lin_num / tl.where(lin_den > 0.0, lin_den, 1.0)[:, None]
    num = acc * a_w[:, None] + lin_avg * r[:, None]
    den = l * a_w + r
    out = tl.where((den > 0.0)[:, None], num / tl.where(den > 0.0, den, 1.0)[:, None], 0.0)
    store_tile(O + b * s_ob + h * s_oh, rq, s_on, rv, q_ok, v_ok, out)


def _blocks(D: int, M: int, Dv: int) -> tuple[int, int, int]:
    if interpreting():
        return 16, 16, 4
    return 64, 64, 4 if max(D, M, Dv) <= 64 else 8


def hybrid_forward(q, k, v, fq, fk, keep, sinkr, beta, window: int, causal: bool, fmap: int, scale: float, wrap: bool):
    q, k, v, fq, fk = (t.contiguous() for t in (q, k, v, fq, fk))
    B, H, Hkv, Nq, Nk, D, Dv = dims(q, k, v)
    Hf, M = fk.shape[1], fk.shape[3]
    BQ, BK, nw = _blocks(D, M, Dv)
    NC = triton.cdiv(Nk, BK)
    BV = min(64, pow2(Dv))
    keep_t, has_keep = keep_arg(keep, q)
    lowp = low_precision(q.dtype)
    SP = torch.empty(B, Hf, NC + 1, M, Dv, device=q.device, dtype=torch.float32)
    ZP = torch.empty(B, Hf, NC + 1, M, device=q.device, dtype=torch.float32)
    launcher(_prefix_state_kernel, wrap)[(B * Hf, triton.cdiv(Dv, BV))](
        fk, v, keep_t, sinkr, SP, ZP, *row_strides(fk, v), Hf, Nk, M, Dv, Hf // Hkv, NC,
        FMAP=fmap, HAS_KEEP=has_keep, LOWP=lowp, BK=BK, BM=pow2(M), BV=BV,
    )
    out = torch.empty(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    launcher(_hybrid_fwd_kernel, wrap)[(B * H, triton.cdiv(Nq, BQ))](
        q, k, v, fq, fk, keep_t, sinkr, SP, ZP, beta, out, *row_strides(q, k, v, fq, fk, out),
        H, Hf, Nq, Nk, D, M, Dv, H // Hkv, H // Hf, window, scale * LOG2E, NC,
        CAUSAL=causal, FMAP=fmap, HAS_KEEP=has_keep, LOWP=lowp,
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


def _linear_window(*args) -> Tensor:
    return _HybridInterpreted.apply(*args) if interpreting() else _linear_window_op(*args)


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


unsupported = shared_checks(linear_window_unsupported)


def linear_window_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, sinks: int = 0, causal: bool,
                            feature_map: Union[str, FeatureMap] = "elu", scale: Optional[float] = None,
                            linear_weight: Union[float, Tensor] = 1.0, key_mask: Optional[Tensor] = None) -> Tensor:
    """Forward of the linear + window hybrid on the Triton kernels (see the module docstring)."""
    who = "linear_window_attention"
    checked_call(who, q, k, v, key_mask, lambda: linear_window_unsupported(q.detach(), feature_map))
    window, sinks = check_int(who, "window", window, 1), check_int(who, "sinks", sinks, 0)
    name = feature_map.name if isinstance(feature_map, FeatureMap) else feature_map
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    s = scale_or_default(q, scale)
    beta = torch.as_tensor(linear_weight, dtype=torch.float32, device=q.device).reshape(-1)
    beta = (beta.expand(H) if beta.numel() == 1 else beta).contiguous()
    if tuple(beta.shape) != (H,) or (concrete(beta) and bool((beta < 0).any())):
        raise ValueError(f"{who}: linear_weight must be a float or [H] = [{H}] values >= 0")
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
    sinkr = sink_range(key_mask, B, Nk, sinks, q.device)
    return _linear_window(q, k, v, fq, fk, key_mask, sinkr, beta, clamp_window(window, Nq, Nk), bool(causal), fmap, s)
