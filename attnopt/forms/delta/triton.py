"""Gated delta-rule prefill (forward) as a fused-chunk Triton scan in the WY / UT form.

Semantics of `attnopt.forms.delta.reference.gated_delta_attention` (stateless): S_t = exp(g_t)(I − β_t k_t k_tᵀ)S_{t-1} + β_t k_t v_tᵀ, o_t = s·S_tᵀq_t, g and β [B, Hkv, N].

The columns of S evolve independently, so one program owns one (batch, kv head, block of BV value
columns) with the full key width BD, carries S [BD, BV] in registers across chunks of BC = 16
positions, and loops over the G query heads of its kv head inside each chunk. Per chunk, with b
the in-chunk inclusive cumsum of g and Γ_ij = exp(b_i − b_j) (j <= i, -inf-masked before exp):

    L = strictly_lower(diag(β) K Kᵀ ⊙ Γ);  T = (I + L)⁻¹ by forward substitution (BC row steps)
    U = T (β ⊙ V),  W = T (β exp b ⊙ K),  Δ = U − W S
    out = s[(Q ⊙ exp b) S + (Q Kᵀ ⊙ Γ) Δ];   S <- exp(b_last) S + (K ⊙ exp(b_last − b))ᵀ Δ

Forward substitution rather than a power series for T: (I + L)⁻¹ = Σ (−L)^p cancels
catastrophically for nearly parallel keys, the row recurrence does not.
A masked key and the positions past Nk get g = 0, β = 0 and k = 0: the state passes unchanged.
Queries are the last Nq positions. Forward only (`gated_delta_unsupported` says when the PyTorch
path runs instead).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.forms.gla.triton import check_gate
from attnopt.kernels.layout import check_sdpa_inputs
from attnopt.kernels.triton.chunk_scan import dot
from attnopt.kernels.triton.runtime import (
    call_unsupported,
    interpreting,
    launcher,
    low_precision,
    pow2,
    require_runtime,
)

__all__ = ["gated_delta_attention", "unsupported", "gated_delta_unsupported", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 128


@triton.jit
def _delta_fwd_kernel(
    Q, K, V, GATE, BETA, KEEP, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_gb, s_gh, s_gn, s_ob, s_oh, s_on,
    Hkv, Nq, Nk, D, Dv, GROUP, scale,
    HAS_KEEP: tl.constexpr, LOWP: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    DT = Q.dtype.element_ty
    rc = tl.arange(0, BC)
    rd = tl.arange(0, BD)
    rv = pid_v * BV + tl.arange(0, BV)
    d_ok = rd < D
    v_ok = rv < Dv
    off = Nk - Nq
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    g_base = GATE + b * s_gb + hk * s_gh
    be_base = BETA + b * s_gb + hk * s_gh  # β shares g's layout [B, Hkv, N]
    incl = rc[:, None] >= rc[None, :]
    strict = rc[:, None] > rc[None, :]
    eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    S = tl.zeros([BD, BV], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos = c0 + rc
        kept = pos < Nk
        if HAS_KEEP:
            keep = tl.load(KEEP + b * Nk + pos, mask=kept, other=0)
            kept = kept & (keep != 0)
        kx = tl.load(k_base + pos[:, None] * s_kn + rd[None, :], mask=kept[:, None] & d_ok[None, :], other=0.0)
        kx = kx.to(tl.float32)
        vx = tl.load(v_base + pos[:, None] * s_vn + rv[None, :], mask=kept[:, None] & v_ok[None, :], other=0.0)
        vx = vx.to(tl.float32)
        gx = tl.load(g_base + pos * s_gn, mask=kept, other=0.0).to(tl.float32)
        bx = tl.load(be_base + pos * s_gn, mask=kept, other=0.0).to(tl.float32)
        bc = tl.cumsum(gx, axis=0)
        b_last = tl.sum(gx, axis=0)
        gam = tl.exp(tl.where(incl, bc[:, None] - bc[None, :], float("-inf")))  # Γ, 0 above the diagonal
        Lm = tl.where(strict, dot(kx, tl.trans(kx), LOWP, DT) * gam * bx[:, None], 0.0)
        # T = (I + L)⁻¹, row by row: T_i = e_i − Σ_{j<i} L_ij T_j (rows >= i are still e_j, and L_ij = 0 there)
        T = eye
        for i in range(1, BC):
            sel = rc[:, None] == i
            l_i = tl.sum(tl.where(sel, Lm, 0.0), axis=0)  # row i of L
            row = tl.where(rc == i, 1.0, 0.0) - tl.sum(l_i[:, None] * T, axis=0)
            T = tl.where(sel, row[None, :], T)
        U = tl.dot(T, vx * bx[:, None], input_precision="ieee")
        W = tl.dot(T, kx * (bx * tl.exp(bc))[:, None], input_precision="ieee")
        delta = U - tl.dot(W, S, input_precision="ieee")  # [BC, BV]
        qi = pos - off
        q_in = (qi >= 0) & (pos < Nk)
        qm = q_in[:, None] & d_ok[None, :]
        for gi in range(0, GROUP):
            h = hk * GROUP + gi
            qx = tl.load(Q + b * s_qb + h * s_qh + qi[:, None] * s_qn + rd[None, :], mask=qm, other=0.0).to(tl.float32)
            A = dot(qx, tl.trans(kx), LOWP, DT) * gam
            out = scale * (tl.dot(A, delta, input_precision="ieee") + dot(qx * tl.exp(bc)[:, None], S, LOWP, DT))
            tl.store(O + b * s_ob + h * s_oh + qi[:, None] * s_on + rv[None, :], out.to(O.dtype.element_ty),
                     mask=q_in[:, None] & v_ok[None, :])
        k_out = kx * tl.exp(b_last - bc)[:, None]
        S = tl.exp(b_last) * S + tl.dot(tl.trans(k_out), delta, input_precision="ieee")


def _launch(q, k, v, g, beta, keep, scale: float, wrap: bool) -> Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous().to(g.dtype)  # one layout for both
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    BD, BV = pow2(D), min(64, pow2(Dv))
    out = torch.zeros(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    keep_t = q if keep is None else keep.to(torch.int8).contiguous()
    grid = (B * Hkv, triton.cdiv(Dv, BV))
    launcher(_delta_fwd_kernel, wrap)[grid](
        q, k, v, g, beta, keep_t, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, Nq, Nk, D, Dv, H // Hkv, scale,
        HAS_KEEP=keep is not None, LOWP=low_precision(q.dtype), BC=16, BD=BD, BV=BV, num_warps=4,
    )
    return out


@triton_op("attnopt_triton::gated_delta", mutates_args={})
def _gated_delta_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, keep: Optional[Tensor], scale: float) -> Tensor:
    return _launch(q, k, v, g, beta, keep, scale, wrap=True)


def unsupported(q: Tensor, **kwargs) -> Optional[str]:
    """None if this kernel can run the reference op's call (its keywords, plus k= to check the key
    length), else a one-line reason; the reference op's CUDA dispatch asks it before handing over."""
    return call_unsupported(q, kwargs.get("k")) or gated_delta_unsupported(q, **kwargs)


def gated_delta_unsupported(q: Tensor, state=None, k=None, v=None, g=None, beta=None, **_) -> Optional[str]:
    """This kernel's own limits (after the checks every form's kernels share), one line, or None."""
    who = "gated_delta_attention"
    if state is not None:
        return f"{who}: a carried state (decoding / chunked prefill) runs on the PyTorch path"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"{who}: head dim {q.shape[-1]} exceeds the kernel's {MAX_HEAD_DIM}"
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v, g, beta)):
        return f"{who}: the Triton kernel is forward-only; a call that needs gradients runs on the PyTorch path"
    return None


def gated_delta_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> Tensor:
    """`attnopt.forms.delta.reference.gated_delta_attention` (stateless, forward) on the Triton kernel;
    same arguments and result. `chunk_size` is accepted for compatibility: the kernel uses 16."""
    who = "gated_delta_attention"
    check_sdpa_inputs(who, q, k, v, key_mask)
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"{who}: {q.shape[2]} queries but {k.shape[2]} keys; causal gated attention needs Nq <= Nk")
    check_gate(who, g, k, per_channel_ok=False)
    if not isinstance(beta, Tensor) or not beta.is_floating_point() or tuple(beta.shape) != tuple(g.shape):
        raise ValueError(f"{who}: beta must be a float tensor of shape [B, Hkv, N] = {list(g.shape)}")
    require_runtime(who, q)
    reason = unsupported(q, k=k, v=v, g=g, beta=beta)
    if reason:
        raise ValueError(reason)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (q, k, v, g, beta, key_mask, s)
    if interpreting():
        return _launch(*args, wrap=False)
    return torch.ops.attnopt_triton.gated_delta(*args)
