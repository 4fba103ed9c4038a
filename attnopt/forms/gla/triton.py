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

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.forms.ssm.schedule import DECAY_FEATURE_MAPS
from attnopt.kernels.triton.chunk_scan import carry, carry_sum, chunk_out, chunk_rows, gate_chunk, key_features
from attnopt.kernels.triton.runtime import FMAP_CODES, checked_call, concrete, dims, interpreting, keep_arg, launch
from attnopt.kernels.triton.runtime import launcher, low_precision, pow2, row_strides, scale_or_default, shared_checks
from attnopt.kernels.triton.tiles import dot, kept, load_phi, load_tile, program_head, span, store_tile

__all__ = ["gated_linear_attention", "unsupported", "gated_linear_unsupported", "check_gate", "MAX_FEATURES"]

MAX_FEATURES = 128  # a [128, 64] fp32 state plus the chunk tiles per program


@triton.jit
def _channel_scores(q_base, s_qn, qi, q_in, k_base, s_kn, g_base, s_gn, pos, ok, M, FMAP: tl.constexpr,
                    BC: tl.constexpr, BM: tl.constexpr, BMS: tl.constexpr):
    """A_ij = Σ_m φq_im φk_jm exp(b_im − b_jm) (j <= i) of a chunk, per-channel gates: the exact
    [C, C, M] block in M-slices of BMS (no exp(b)·exp(−b) factorisation: it overflows for strong gates)."""
    rc = tl.arange(0, BC)
    tri = rc[:, None] >= rc[None, :]
    A = tl.zeros([BC, BC], dtype=tl.float32)
    for m0 in tl.static_range(0, BM, BMS):
        rs, sm = span(m0, M, BMS)
        qs = load_phi(q_base, qi, s_qn, rs, q_in, sm, FMAP)
        ks = load_phi(k_base, pos, s_kn, rs, ok, sm, FMAP)
        bs = tl.cumsum(load_tile(g_base, pos, s_gn, rs, ok, sm).to(tl.float32), axis=0)
        expo = tl.where(tri[:, :, None], bs[:, None, :] - bs[None, :, :], float("-inf"))
        A += tl.sum(qs[:, None, :] * ks[None, :, :] * tl.exp(expo), axis=2)
    return A


@triton.jit
def _gla_fwd_kernel(
    Q, K, V, GATE, KEEP, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_gb, s_gh, s_gn, s_ob, s_oh, s_on,
    Hkv, Nq, Nk, M, Dv, GROUP, scale, eps,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, PER_CHANNEL: tl.constexpr, NORMALIZE: tl.constexpr,
    LOWP: tl.constexpr, BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr, BMS: tl.constexpr,
):
    _, b, hk = program_head(Hkv)
    DT = Q.dtype.element_ty
    rm, m_ok = span(0, M, BM)
    rv, v_ok = span(tl.program_id(1) * BV, Dv, BV)
    k_base = K + b * s_kb + hk * s_kh
    g_base = GATE + b * s_gb + hk * s_gh
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos, k_in, qi, q_in = chunk_rows(c0, Nq, Nk, BC)
        ok = kept(KEEP + b * Nk, pos, k_in, HAS_KEEP)  # a masked key: φk = 0 and g = 0
        fk, vx = key_features(k_base, s_kn, V + b * s_vb + hk * s_vh, s_vn, pos, ok, rm, m_ok, rv, v_ok, FMAP)
        if PER_CHANNEL:
            gx = load_tile(g_base, pos, s_gn, rm, ok, m_ok).to(tl.float32)
            bc = tl.cumsum(gx, axis=0)  # [BC, BM]
            b_last = tl.sum(gx, axis=0)
            q_dec = tl.exp(bc)
            k_dec = tl.exp(b_last[None, :] - bc)
            S_step = tl.exp(b_last)[:, None]
        else:
            bc, b_last, w_cc = gate_chunk(g_base, pos, s_gn, ok, BC)
            q_dec = tl.exp(bc)[:, None]
            k_dec = tl.exp(b_last - bc)[:, None]
            S_step = tl.exp(b_last)
        for gi in range(0, GROUP):  # the query heads that read this kv head
            h = hk * GROUP + gi
            fq = load_phi(Q + b * s_qb + h * s_qh, qi, s_qn, rm, q_in, m_ok, FMAP)
            if PER_CHANNEL:
                A = _channel_scores(Q + b * s_qb + h * s_qh, s_qn, qi, q_in, k_base, s_kn, g_base, s_gn, pos, ok, M,
                                    FMAP, BC, BM, BMS)
            else:
                A = dot(fq, tl.trans(fk), LOWP, DT) * w_cc
            out, _den = chunk_out(A, fq * q_dec, vx, S, z, scale, eps, NORMALIZE, LOWP, DT)
            store_tile(O + b * s_ob + h * s_oh, qi, s_on, rv, q_in, v_ok, out)
        fk_out = fk * k_dec
        S = carry(S, fk_out, vx, S_step, True, LOWP, DT)
        z = carry_sum(z, fk_out, tl.exp(b_last), True)


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
    B, H, Hkv, Nq, Nk, M, Dv = dims(q, k, v)
    per_channel = g.dim() == 4
    BC, BM, BV, BMS, nw = _config(M, Dv, per_channel)
    out = torch.zeros(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    keep_t, has_keep = keep_arg(keep, q)
    launcher(_gla_fwd_kernel, wrap)[(B * Hkv, triton.cdiv(Dv, BV))](
        q, k, v, g, keep_t, out, *row_strides(q, k, v, g, out), Hkv, Nq, Nk, M, Dv, H // Hkv, scale, eps,
        FMAP=fmap, HAS_KEEP=has_keep, PER_CHANNEL=per_channel, NORMALIZE=normalize,
        LOWP=low_precision(q.dtype), BC=BC, BM=BM, BV=BV, BMS=BMS, num_warps=nw,
    )
    return out


@triton_op("attnopt_triton::gated_linear", mutates_args={})
def _gated_linear_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, keep: Optional[Tensor], fmap: int, normalize: bool, scale: float, eps: float
) -> Tensor:
    return _launch(q, k, v, g, keep, fmap, normalize, scale, eps, wrap=True)


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


unsupported = shared_checks(gated_linear_unsupported)


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


def gated_linear_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, feature_map: str = "identity",
                           normalize: bool = False, scale: Optional[float] = None, eps: float = 1e-6,
                           key_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """`attnopt.forms.gla.reference.gated_linear_attention` (stateless, forward) on the Triton kernel;
    same arguments and result. `chunk_size` is accepted for compatibility: the kernel picks its own."""
    who = "gated_linear_attention"
    checked_call(who, q, k, v, key_mask, lambda: unsupported(q, feature_map=feature_map, k=k, v=v, g=g),
                 causal="gated linear attention")
    check_gate(who, g, k, per_channel_ok=True)
    if not isinstance(normalize, bool):
        raise ValueError(f"{who}: normalize must be a bool, got {normalize!r}")
    args = (q, k, v, g, key_mask, FMAP_CODES[feature_map], normalize, scale_or_default(q, scale), float(eps))
    return launch("gated_linear", _launch, *args)
