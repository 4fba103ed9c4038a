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

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.forms.gla.triton import check_gate
from attnopt.kernels.triton.chunk_scan import chunk_rows, gate_chunk
from attnopt.kernels.triton.runtime import checked_call, dims, keep_arg, launch, launcher, low_precision, pow2
from attnopt.kernels.triton.runtime import row_strides, scale_or_default, shared_checks
from attnopt.kernels.triton.tiles import dot, kept, load_tile, program_head, span, store_tile

__all__ = ["gated_delta_attention", "unsupported", "gated_delta_unsupported", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 128


@triton.jit
def _delta_fwd_kernel(
    Q, K, V, GATE, BETA, KEEP, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_gb, s_gh, s_gn, s_ob, s_oh, s_on,
    Hkv, Nq, Nk, D, Dv, GROUP, scale,
    HAS_KEEP: tl.constexpr, LOWP: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    _, b, hk = program_head(Hkv)
    DT = Q.dtype.element_ty
    rd, d_ok = span(0, D, BD)
    rv, v_ok = span(tl.program_id(1) * BV, Dv, BV)
    rc = tl.arange(0, BC)
    strict = rc[:, None] > rc[None, :]
    eye = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    S = tl.zeros([BD, BV], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos, k_in, qi, q_in = chunk_rows(c0, Nq, Nk, BC)
        ok = kept(KEEP + b * Nk, pos, k_in, HAS_KEEP)  # a masked key: g = 0, β = 0, k = 0
        kx = load_tile(K + b * s_kb + hk * s_kh, pos, s_kn, rd, ok, d_ok).to(tl.float32)
        vx = load_tile(V + b * s_vb + hk * s_vh, pos, s_vn, rv, ok, v_ok).to(tl.float32)
        bc, b_last, gam = gate_chunk(GATE + b * s_gb + hk * s_gh, pos, s_gn, ok, BC)  # gam: Γ, 0 above the diagonal
        bx = tl.load(BETA + b * s_gb + hk * s_gh + pos * s_gn, mask=ok, other=0.0).to(tl.float32)  # β: g's layout
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
        for gi in range(0, GROUP):  # the query heads that read this kv head
            h = hk * GROUP + gi
            qx = load_tile(Q + b * s_qb + h * s_qh, qi, s_qn, rd, q_in, d_ok).to(tl.float32)
            A = dot(qx, tl.trans(kx), LOWP, DT) * gam
            out = scale * (tl.dot(A, delta, input_precision="ieee") + dot(qx * tl.exp(bc)[:, None], S, LOWP, DT))
            store_tile(O + b * s_ob + h * s_oh, qi, s_on, rv, q_in, v_ok, out)
        k_out = kx * tl.exp(b_last - bc)[:, None]
        S = tl.exp(b_last) * S + tl.dot(tl.trans(k_out), delta, input_precision="ieee")


def _launch(q, k, v, g, beta, keep, scale: float, wrap: bool) -> Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous().to(g.dtype)  # one layout for both
    B, H, Hkv, Nq, Nk, D, Dv = dims(q, k, v)
    BV = min(64, pow2(Dv))
    out = torch.zeros(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    keep_t, has_keep = keep_arg(keep, q)
    launcher(_delta_fwd_kernel, wrap)[(B * Hkv, triton.cdiv(Dv, BV))](
        q, k, v, g, beta, keep_t, out, *row_strides(q, k, v, g, out), Hkv, Nq, Nk, D, Dv, H // Hkv, scale,
        HAS_KEEP=has_keep, LOWP=low_precision(q.dtype), BC=16, BD=pow2(D), BV=BV, num_warps=4,
    )
    return out


@triton_op("attnopt_triton::gated_delta", mutates_args={})
def _gated_delta_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, keep: Optional[Tensor], scale: float) -> Tensor:
    return _launch(q, k, v, g, beta, keep, scale, wrap=True)


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


unsupported = shared_checks(gated_delta_unsupported)


def gated_delta_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: Optional[float] = None,
                          key_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """`attnopt.forms.delta.reference.gated_delta_attention` (stateless, forward) on the Triton kernel;
    same arguments and result. `chunk_size` is accepted for compatibility: the kernel uses 16."""
    who = "gated_delta_attention"
    checked_call(who, q, k, v, key_mask, lambda: unsupported(q, k=k, v=v, g=g, beta=beta),
                 causal="gated delta attention")
    check_gate(who, g, k, per_channel_ok=False)
    if not isinstance(beta, Tensor) or not beta.is_floating_point() or tuple(beta.shape) != tuple(g.shape):
        raise ValueError(f"{who}: beta must be a float tensor of shape [B, Hkv, N] = {list(g.shape)}")
    return launch("gated_delta", _launch, q, k, v, g, beta, key_mask, scale_or_default(q, scale))
