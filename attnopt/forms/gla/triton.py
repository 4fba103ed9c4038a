"""Gated linear attention prefill (forward) as a fused-chunk Triton scan.

Semantics of `attnopt.forms.gla.reference.gated_linear_attention` (stateless): S_t = diag(exp g_t) S_{t-1} + φ(k_t)v_tᵀ, o_t = s·φ(q_t)ᵀS_t, or the normalised ratio with
z_t = exp(g_t) ⊙ z_{t-1} + φ(k_t); g [B, Hkv, N, M] per channel or [B, Hkv, N] per head, <= 0.

One program owns one (batch, kv head, block of BV value columns) and walks the key positions in
chunks of BC, carrying S [BM, BV] (and z [BM]) in registers, so the kv recurrence runs once per kv
head; inside each chunk it loops over the G query heads that read that kv head (GQA without
repeated K/V). Per chunk, with b the in-chunk inclusive cumsum of g:

    out_i = (φq_i ⊙ exp b_i)·S + Σ_{j<=i} A_ij v_j,   A_ij = Σ_m φq_im φk_jm exp(b_im − b_jm)
    S    <- exp(b_last) ⊙ S + (φk ⊙ exp(b_last − b))ᵀ V

Per head, A is the C×C product φq φkᵀ times a scalar decay matrix (one tl.dot). Per channel the
exact [C, C, M] block is formed in M-slices of BMS (no exp(b)·exp(−b) factorisation, which
overflows for strong gates), so the per-channel chunk is kept at BC = 16. Every exponent is masked
to -inf before exp2-free `tl.exp`, so each factor is exp(<= 0).

A masked key (key_mask False) and the positions past Nk have φk = 0 and g = 0: the state passes
unchanged. Queries are the last Nq positions. Forward only: a call that needs gradients, carries a
state, or has an unsupported shape runs on the PyTorch path (`gated_linear_unsupported`).

Letters: B batch, H query heads, Hkv kv heads, GROUP = H // Hkv, M feature width (= D), Dv value
dim, BC chunk, BM / BV / BMS block widths.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.forms.ssm.schedule import DECAY_FEATURE_MAPS
from attnopt.kernels.layout import check_sdpa_inputs
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

__all__ = ["gated_linear_attention", "unsupported", "gated_linear_unsupported", "check_gate", "MAX_FEATURES"]

MAX_FEATURES = 128  # a [128, 64] fp32 state plus the chunk tiles per program


@triton.jit
def _gla_fwd_kernel(
    Q, K, V, GATE, KEEP, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_gb, s_gh, s_gn, s_ob, s_oh, s_on,
    Hkv, Nq, Nk, M, Dv, GROUP, scale, eps,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, PER_CHANNEL: tl.constexpr, NORMALIZE: tl.constexpr,
    LOWP: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, BMS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    DT = Q.dtype.element_ty
    rc = tl.arange(0, BC)
    rm = tl.arange(0, BM)
    rv = pid_v * BV + tl.arange(0, BV)
    m_ok = rm < M
    v_ok = rv < Dv
    off = Nk - Nq
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    g_base = GATE + b * s_gb + hk * s_gh
    tri = rc[:, None] >= rc[None, :]
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos = c0 + rc
        kept = pos < Nk
        if HAS_KEEP:
            keep = tl.load(KEEP + b * Nk + pos, mask=kept, other=0)
            kept = kept & (keep != 0)
        km = kept[:, None] & m_ok[None, :]
        kx = tl.load(k_base + pos[:, None] * s_kn + rm[None, :], mask=km, other=0.0)
        fk = tl.where(km, phi(kx.to(tl.float32), FMAP), 0.0)
        vx = tl.load(v_base + pos[:, None] * s_vn + rv[None, :], mask=kept[:, None] & v_ok[None, :], other=0.0)
        vx = vx.to(tl.float32)
        if PER_CHANNEL:
            gx = tl.load(g_base + pos[:, None] * s_gn + rm[None, :], mask=km, other=0.0).to(tl.float32)
            bc = tl.cumsum(gx, axis=0)  # [BC, BM]
            b_last = tl.sum(gx, axis=0)  # [BM]
            q_dec = tl.exp(bc)
            k_dec = tl.exp(b_last[None, :] - bc)
            S_dec = tl.exp(b_last)
        else:
            gx = tl.load(g_base + pos * s_gn, mask=kept, other=0.0).to(tl.float32)
            bc = tl.cumsum(gx, axis=0)  # [BC]
            b_last = tl.sum(gx, axis=0)
            w_cc = tl.exp(tl.where(tri, bc[:, None] - bc[None, :], float("-inf")))
            q_dec = tl.exp(bc)[:, None]
            k_dec = tl.exp(b_last - bc)[:, None]
            S_dec = tl.exp(b_last)
        qi = pos - off
        q_in = (qi >= 0) & (pos < Nk)
        qm = q_in[:, None] & m_ok[None, :]
        for gi in range(0, GROUP):
            h = hk * GROUP + gi
            q_base = Q + b * s_qb + h * s_qh
            qx = tl.load(q_base + qi[:, None] * s_qn + rm[None, :], mask=qm, other=0.0)
            fq = tl.where(qm, phi(qx.to(tl.float32), FMAP), 0.0)
            if PER_CHANNEL:
                A = tl.zeros([BC, BC], dtype=tl.float32)
                for m0 in tl.static_range(0, BM, BMS):
                    rs = m0 + tl.arange(0, BMS)
                    sm = rs < M
                    qs = tl.load(q_base + qi[:, None] * s_qn + rs[None, :], mask=q_in[:, None] & sm[None, :], other=0.0)
                    qs = tl.where(q_in[:, None] & sm[None, :], phi(qs.to(tl.float32), FMAP), 0.0)
                    ks_m = kept[:, None] & sm[None, :]
                    ks = tl.load(k_base + pos[:, None] * s_kn + rs[None, :], mask=ks_m, other=0.0)
                    ks = tl.where(ks_m, phi(ks.to(tl.float32), FMAP), 0.0)
                    gs = tl.load(g_base + pos[:, None] * s_gn + rs[None, :], mask=ks_m, other=0.0).to(tl.float32)
                    bs = tl.cumsum(gs, axis=0)
                    expo = tl.where(tri[:, :, None], bs[:, None, :] - bs[None, :, :], float("-inf"))
                    A += tl.sum(qs[:, None, :] * ks[None, :, :] * tl.exp(expo), axis=2)
            else:
                A = dot(fq, tl.trans(fk), LOWP, DT) * w_cc
            fq_in = fq * q_dec
            num = dot(A, vx, LOWP, DT) + dot(fq_in, S, LOWP, DT)
            if NORMALIZE:
                den = tl.sum(A, axis=1) + tl.sum(fq_in * z[None, :], axis=1) + eps
                out = num / tl.where(den == 0.0, 1.0, den)[:, None]
            else:
                out = num * scale
            o_base = O + b * s_ob + h * s_oh
            tl.store(o_base + qi[:, None] * s_on + rv[None, :], out.to(O.dtype.element_ty), mask=q_in[:, None] & v_ok[None, :])
        fk_out = fk * k_dec
        if PER_CHANNEL:
            S = S_dec[:, None] * S + dot(tl.trans(fk_out), vx, LOWP, DT)
            z = S_dec * z + tl.sum(fk_out, axis=0)
        else:
            S = S_dec * S + dot(tl.trans(fk_out), vx, LOWP, DT)
            z = S_dec * z + tl.sum(fk_out, axis=0)


def _config(M: int, Dv: int, per_channel: bool) -> tuple[int, int, int, int, int]:
    """(BC, BM, BV, BMS, num_warps). Per channel the [BC, BC, BMS] block lives in registers: BC 16,
    BMS 16 (4K fp32 over 4 warps). The interpreter uses the same tiles (small test shapes span
    several chunks)."""
    BM = pow2(M)
    BV = min(64, pow2(Dv))
    if per_channel or interpreting():
        return 16, BM, BV, min(16, BM), 4
    return 64, BM, BV, BM, 8 if BM >= 128 else 4


def _launch(q, k, v, g, keep, fmap: int, normalize: bool, scale: float, eps: float, wrap: bool) -> Tensor:
    q, k, v, g = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous()
    B, H, Nq, M = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    per_channel = g.dim() == 4
    BC, BM, BV, BMS, nw = _config(M, Dv, per_channel)
    out = torch.zeros(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    keep_t = q if keep is None else keep.to(torch.int8).contiguous()
    grid = (B * Hkv, triton.cdiv(Dv, BV))
    launcher(_gla_fwd_kernel, wrap)[grid](
        q, k, v, g, keep_t, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, Nq, Nk, M, Dv, H // Hkv, scale, eps,
        FMAP=fmap, HAS_KEEP=keep is not None, PER_CHANNEL=per_channel, NORMALIZE=normalize,
        LOWP=low_precision(q.dtype), BC=BC, BM=BM, BV=BV, BMS=BMS, num_warps=nw,
    )
    return out


@triton_op("attnopt_triton::gated_linear", mutates_args={})
def _gated_linear_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, keep: Optional[Tensor], fmap: int, normalize: bool, scale: float, eps: float
) -> Tensor:
    return _launch(q, k, v, g, keep, fmap, normalize, scale, eps, wrap=True)


def unsupported(q: Tensor, **kwargs) -> Optional[str]:
    """None if this kernel can run the reference op's call (its keywords, plus k= to check the key
    length), else a one-line reason; the reference op's CUDA dispatch asks it before handing over."""
    return call_unsupported(q, kwargs.get("k")) or gated_linear_unsupported(q, **kwargs)


def gated_linear_unsupported(q: Tensor, feature_map="identity", state=None, k=None, v=None, g=None, **_) -> Optional[str]:
    """This kernel's own limits (after the checks every form's kernels share), one line, or None."""
    who = "gated_linear_attention"
    if state is not None:
        return f"{who}: a carried state (decoding / chunked prefill) runs on the PyTorch path"
    if feature_map not in DECAY_FEATURE_MAPS:
        return f"{who}: unknown feature map {feature_map!r}"
    if q.shape[-1] > MAX_FEATURES:
        return f"{who}: head dim {q.shape[-1]} exceeds the kernel's {MAX_FEATURES}"
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, g)):
        return f"{who}: the Triton kernel is forward-only; a call that needs gradients runs on the PyTorch path"
    return None


def check_gate(who: str, g, k: Tensor, per_channel_ok: bool) -> None:
    """The kernels' own check of the log-gates (the reference ops run their fuller checks before they
    dispatch here; the kernels do not import the reference ops, which reach them by dispatch)."""
    B, Hkv, N, D = k.shape
    shapes = [(B, Hkv, N)] + ([(B, Hkv, N, D)] if per_channel_ok else [])
    if not isinstance(g, Tensor) or not g.is_floating_point() or tuple(g.shape) not in shapes:
        got = list(g.shape) if isinstance(g, Tensor) else type(g).__name__
        raise ValueError(f"{who}: g (log-gates) must be a float tensor of shape {' or '.join(map(str, map(list, shapes)))}, got {got}")
    if concrete(g) and g.numel() and not bool(((g <= 0) & torch.isfinite(g)).all()):
        raise ValueError(f"{who}: g holds log-gates and must be finite and <= 0")


def gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    feature_map: str = "identity",
    normalize: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    key_mask: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> Tensor:
    """`attnopt.forms.gla.reference.gated_linear_attention` (stateless, forward) on the Triton kernel;
    same arguments and result. `chunk_size` is accepted for compatibility: the kernel picks its own."""
    who = "gated_linear_attention"
    check_sdpa_inputs(who, q, k, v, key_mask)
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"{who}: {q.shape[2]} queries but {k.shape[2]} keys; causal gated attention needs Nq <= Nk")
    check_gate(who, g, k, per_channel_ok=True)
    require_runtime(who, q)
    reason = unsupported(q, feature_map=feature_map, k=k, v=v, g=g)
    if not isinstance(normalize, bool):
        reason = f"{who}: normalize must be a bool, got {normalize!r}"
    if reason:
        raise ValueError(reason)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (q, k, v, g, key_mask, FMAP_CODES[feature_map], bool(normalize), s, float(eps))
    if interpreting():
        return _launch(*args, wrap=False)
    return torch.ops.attnopt_triton.gated_linear(*args)
