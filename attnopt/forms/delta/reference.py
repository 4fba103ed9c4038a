"""Gated delta-rule attention (Gated DeltaNet), chunked (WY / UT form), causal.

The recurrence, per key/value head, with a log-gate g_t <= 0 and a write strength β_t per head:

    S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ          state [D, Dv]
    o_t = s · S_tᵀ q_t                                                 s = scale, default 1/sqrt(D)

Keys are used as given (the form normalises them if it wants to; the op does not). g and β are
[B, Hkv, N].

Chunk algorithm. Write the update as S_t = exp(g_t) S_{t-1} + k_t δ_tᵀ with the pseudo-value
δ_t = β_t (v_t - exp(g_t) S_{t-1}ᵀ k_t). Inside a chunk (b_i = Σ_{s<=i} g_s within the chunk, Γ_ij =
exp(Σ_{j<s<=i} g_s) for j <= i, S0 the state entering the chunk):

    S_i = exp(b_i) S0 + Σ_{j<=i} Γ_ij k_j δ_jᵀ
    (I + L) Δ = diag(β) V - diag(β ⊙ exp b) K S0,     L = strictly_lower(diag(β) K Kᵀ ⊙ Γ)

so with the unit-lower-triangular solve (I + L)⁻¹ applied once per chunk to [βV, diag(β exp b) K]
(the WY / UT transform: U and W), Δ = U - W S0. Everything but the S0 products is batched over all
chunks; a Python loop over chunks then carries the state, S <- A_c S + B_c with A_c = exp(b_C) I −
K̃_cᵀW_c and B_c = K̃_cᵀU_c (K̃ = K ⊙ exp(b_C − b), both batched beforehand: one fused multiply-add
per chunk), and Δ_c = U_c − W_c S_c follows batched. Outputs, batched again: O = s[(Q ⊙ exp b) S0 + (Q Kᵀ ⊙ Γ ⊙ tril) Δ].
When every chunk spans at most 60 of decay (`factorable`, every practical gate), Γ_ij is formed as
exp(b_i)·exp(−b_j) and folded into the operands (K ⊙ e^{−b}, Q ⊙ e^{b}), so L and Q Kᵀ ⊙ Γ are one
matmul and a triangle each and no C×C decay matrix exists; factors stay within e^{±60}. Stronger
gates first try chunks of C/2, C/4, ... down to 16 (`factored_chunk`). Otherwise Γ
and the exponents are range sums of log-gates formed by masked cumsums (never differences of a
long prefix), masked to -inf before the exp: every factor is exp(<= 0).
Memory O(N·(C·G + D + Dv) + (N/C)·D·Dv) per kv head: chunk-local C×C only, a state per chunk.

Masks and padding: a masked key (`key_mask` False) leaves the state unchanged (g and β zeroed: no
decay, no write), so a left-padded row equals the row alone; the tail chunk is padded the same way.
Alignment: Nq <= Nk, queries are the last Nq positions. GQA: query head h reads kv head
h // (H // Hkv); k, v, g, β and the state are per kv head, never repeated.
dtypes: fp16/bf16 compute in fp32 with fp32 states; fp32/fp64 keep their own. Output in q's dtype.

The stateless prefill is the custom op `torch.ops.attnopt.gated_delta_attention` (one node under
torch.export; fake and recompute-autograd registered; gradients for q, k, v, g and β). Stateful use
(`state=`, `gated_delta_attention_step`) is plain differentiable PyTorch.
On CUDA, a stateless call that needs no gradient runs the Triton forward kernel instead
(`attnopt.forms.delta.triton`, when Triton imports and its `unsupported` returns None).

Letters: B batch, H query heads, Hkv kv heads, G = H // Hkv, N length, D head dim of q/k, Dv head
dim of v, C chunk, nc chunks, X = B·Hkv.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.common.plain_autograd import wants_plain_autograd
from attnopt.forms.gla.reference import check_log_gate, factored_chunk, pad_positions, rev_cumsum_exclusive, segsum
from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.layout import check_causal_inputs, check_scan_options, compute_dtype, values_known
from attnopt.kernels.registration import prefill_op

__all__ = ["gated_delta_attention", "gated_delta_attention_step", "init_gated_delta_state", "gated_delta_chunked",
           "unit_lower_solve"]

# Chunk length of the CPU op. At 16k on 2 cores, 128 beat 64 in both ops_cpu runs quietly (4.08x vs 3.98x,
# 4.58x vs 4.02x SDPA); at 32k and beside busy processes the runs disagree (results/ops_cpu keeps both rows).
CHUNK = 128

_WHO = "gated_delta_attention"


def _check_beta(who, beta, B, Hkv, N) -> None:
    if not isinstance(beta, Tensor):
        raise TypeError(f"{who}: beta must be a tensor of shape [B, Hkv, N] = {[B, Hkv, N]}, got {type(beta).__name__}")
    if not beta.is_floating_point():
        raise TypeError(f"{who}: beta must be floating point, got {beta.dtype}")
    if tuple(beta.shape) != (B, Hkv, N):
        raise ValueError(f"{who}: beta must have shape [B, Hkv, N] = {[B, Hkv, N]} (one write strength per kv head and key), got {list(beta.shape)}")
    if values_known(beta) and not bool(torch.isfinite(beta).all()):
        raise ValueError(f"{who}: beta must be finite")


def _check_inputs(q, k, v, g, beta, key_mask, who=_WHO) -> None:
    check_causal_inputs(who, "gated delta attention", q, k, v, key_mask)
    B, Hkv, Nk, _ = k.shape
    check_log_gate(who, g, B, Hkv, Nk, None, per_channel_ok=False)
    _check_beta(who, beta, B, Hkv, Nk)


def _check_options(scale, chunk_size, who=_WHO) -> None:
    check_scan_options(who, scale, chunk_size)


def _check_state(S, B, Hkv, D, Dv, who=_WHO) -> Tensor:
    if not isinstance(S, Tensor) or tuple(S.shape) != (B, Hkv, D, Dv):
        got = list(S.shape) if isinstance(S, Tensor) else type(S).__name__
        raise ValueError(f"{who}: state must be a tensor S of shape [B, Hkv, D, Dv] = {[B, Hkv, D, Dv]}, got {got}; see init_gated_delta_state")
    return S


def _chunk_operands_exact(qc, kc, vc, gc, bc):
    """The chunk-local operands with every decay a masked-cumsum range sum (any gate strength):
    (L, rhs, q_in, QK, k_out, decay), shapes as in `_delta_chunks`."""
    X, nc, C, D = kc.shape
    G = qc.shape[2] // C
    b_in = torch.cumsum(gc, dim=2)[..., 0]  # Σ_{s<=i} g_s within the chunk         [X, nc, C]
    to_end = rev_cumsum_exclusive(gc, dim=2)[..., 0]  # Σ_{i<s<C} g_s
    Gam = torch.exp(segsum(gc)[..., 0])  # Γ_ij = exp Σ_{j<s<=i} g_s, 0 above      [X, nc, C, C]
    idx = torch.arange(C, device=kc.device)
    strict = idx[:, None] > idx[None, :]
    Lmat = torch.where(strict, (kc @ kc.transpose(-1, -2)) * Gam * bc[..., :, None], torch.zeros_like(Gam))
    rhs = torch.cat([vc * bc[..., None], kc * (bc * torch.exp(b_in))[..., None]], dim=-1)
    QK = (qc @ kc.transpose(-1, -2)).view(X, nc, G, C, C) * Gam[:, :, None]
    q_in = (qc.view(X, nc, G, C, D) * torch.exp(b_in)[:, :, None, :, None]).view(X, nc, G * C, D)
    k_out = kc * torch.exp(to_end)[..., None]  # each key decayed to its chunk's end
    return Lmat, rhs, q_in, QK.view(X, nc, G * C, C), k_out, torch.exp(b_in[..., -1])


def _chunk_operands_factored(qc, kc, vc, gc, bc):
    """`_chunk_operands_exact` for gates whose chunks pass `factorable` (|Σ g| <= 60 per chunk):
    Γ_ij = e^{b_i}·e^{−b_j} folds into the operands, so L and QKᵀ are one matmul and a triangle each,
    and no C×C decay matrix is formed (every factor within e^{±60}, products exact to rounding)."""
    X, nc, C, D = kc.shape
    G = qc.shape[2] // C
    b = torch.cumsum(gc, dim=2)  # [X, nc, C, 1]
    e = torch.exp(b)
    k_neg = kc * torch.exp(-b)  # k_j e^{−b_j}; not kc / e, whose gradient (÷ e²) underflows to NaN for b < −52
    rhs = torch.cat([vc * bc[..., None], kc * (bc[..., None] * e)], dim=-1)  # [βV, diag(β e^b) K]
    Lmat = (rhs[..., vc.shape[-1]:] @ k_neg.transpose(-1, -2)).tril_(-1)
    q_in = (qc.view(X, nc, G, C, D) * e[:, :, None]).view(X, nc, G * C, D)
    QK = (q_in @ k_neg.transpose(-1, -2)).view(X, nc, G, C, C).tril_().view(X, nc, G * C, C)
    decay = e[:, :, -1, 0]  # [X, nc]
    return Lmat, rhs, q_in, QK, k_neg * decay[..., None, None], decay


def _delta_chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor, C: int, factored: bool,
                  solve_block: int = 0):
    """q [X, G, L, D] (scale applied), k [X, L, D], v [X, L, Dv], g/beta [X, L] (L a multiple of C),
    S0 [X, D, Dv] -> (out [X, G, L, Dv], final state [X, D, Dv]). factored: every chunk of g passes
    `factorable` (the operands then fold the decays in). solve_block: see `unit_lower_solve`.

    The chunk-local work is laid out chunk-major, [nc, X, ·, ·] (the chunk operands' "X, nc" read as
    "nc, X"), so every step of the carry across chunks reads contiguous blocks: sliced along a middle
    dimension, each step's baddbmm copied its operands first, one more small op per chunk, and small
    ops are what a busy machine's thread pool makes slow."""
    X, G, L, D = q.shape
    Dv = v.shape[-1]
    nc = L // C
    qc = q.reshape(X, G, nc, C, D).permute(2, 0, 1, 3, 4).reshape(nc, X, G * C, D)  # the G heads share each product
    kc, vc = k.reshape(X, nc, C, D).transpose(0, 1), v.reshape(X, nc, C, Dv).transpose(0, 1)
    gc, bc = g.reshape(X, nc, C, 1).transpose(0, 1), beta.reshape(X, nc, C).transpose(0, 1)
    operands = _chunk_operands_factored if factored else _chunk_operands_exact
    Lmat, rhs, q_in, QK, k_out, decay = operands(qc, kc.contiguous(), vc.contiguous(), gc.contiguous(), bc.contiguous())

    # WY / UT transform: (I + L)⁻¹ [βV, diag(β exp b) K] by one unit-lower-triangular solve per chunk.
    sol = unit_lower_solve(Lmat, rhs, solve_block)
    U, Wm = sol[..., :Dv], sol[..., Dv:]

    # Across chunks S' = e^{b_C} S + K̃ᵀ(U − W S) = A S + Bᵀ with A = e^{b_C} I − K̃ᵀW [D, D] and
    # B = K̃ᵀU, both batched over every chunk first; the loop then carries S by one fused
    # multiply-add per chunk, and Δ = U − W S_before is one batched product after it.
    k_out_T = k_out.transpose(-1, -2)
    A_t = -(k_out_T @ Wm)  # [nc, X, D, D]
    A_t.diagonal(dim1=-2, dim2=-1).add_(decay[..., None])
    B_t = k_out_T @ U  # [nc, X, D, Dv]
    S = S0
    befores = []
    for i in range(nc):
        befores.append(S)
        S = torch.baddbmm(B_t[i], A_t[i], S)
    S_before = torch.stack(befores).view(nc * X, D, Dv)
    Delta = torch.baddbmm(U.reshape(nc * X, C, Dv), Wm.reshape(nc * X, C, D), S_before, alpha=-1)
    out = torch.baddbmm(q_in.reshape(nc * X, G * C, D) @ S_before, QK.reshape(nc * X, G * C, C), Delta)
    return out.view(nc, X, G, C, Dv).permute(1, 2, 0, 3, 4).reshape(X, G, L, Dv), S


def unit_lower_solve(L: Tensor, rhs: Tensor, block: int = 0) -> Tensor:
    """(I + L)⁻¹ rhs for L [..., C, C] read as unit lower triangular (its diagonal and above unread).

    block 0: one LAPACK solve (trsm) per chunk. block b dividing C: the b×b diagonal blocks inverted
    by one batched solve, then forward substitution by block rows, C/b steps of batched matmuls
    (FLA's blocked inverse, applied to the right-hand side instead of formed)."""
    C = L.shape[-1]
    if not block or C <= block or C % block:
        return torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    nb = C // block
    rows = L.unflatten(-2, (nb, block))  # [..., nb, b, C]
    diag = torch.diagonal(rows.unflatten(-1, (nb, block)), dim1=-4, dim2=-2).movedim(-1, -3)  # [..., nb, b, b]
    eye = torch.eye(block, dtype=L.dtype, device=L.device).expand(diag.shape)
    inv = torch.linalg.solve_triangular(diag, eye, upper=False, unitriangular=True)  # (I + L_ii)⁻¹
    xs = []
    for i in range(nb):
        r = rhs[..., i * block:(i + 1) * block, :]
        if i:
            r = r - rows[..., i, :, : i * block] @ torch.cat(xs, dim=-2)
        xs.append(inv[..., i, :, :] @ r)
    return torch.cat(xs, dim=-2)


def _delta_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, key_mask: Optional[Tensor], scale: float,
                   chunk_size: int, S0: Optional[Tensor] = None, solve_block: int = 0):
    """Chunked prefill, differentiable plain PyTorch. Returns (out, S)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    out_dtype = q.dtype
    cdt = compute_dtype(out_dtype)
    qq = q.to(cdt) * scale
    kk, vv, gg, bb = k.to(cdt), v.to(cdt), g.to(cdt), beta.to(cdt)
    if key_mask is not None:  # a masked key neither decays nor writes: the state passes it unchanged
        keep = key_mask[:, None, :]
        gg = torch.where(keep, gg, torch.zeros_like(gg))
        bb = torch.where(keep, bb, torch.zeros_like(bb))
        kk = torch.where(keep[..., None], kk, torch.zeros_like(kk))
        vv = torch.where(keep[..., None], vv, torch.zeros_like(vv))
    S = S0.to(cdt) if S0 is not None else kk.new_zeros(B, Hkv, D, Dv)
    if Nk == 0:
        return qq.new_zeros(B, H, 0, Dv).to(out_dtype), S
    C = max(1, min(chunk_size, Nk))
    L = -(-Nk // C) * C
    qq = pad_positions(qq, Nk - Nq, L - Nk)  # queries are the last Nq positions
    kk, vv = (pad_positions(t, 0, L - Nk) for t in (kk, vv))
    if L > Nk:  # tail: g = 0, β = 0 changes nothing
        gg, bb = (F.pad(t, (0, L - Nk)) for t in (gg, bb))
    Cf = factored_chunk(gg.reshape(B * Hkv, L, 1), C)  # strong gates: a shorter chunk that still factors
    out, S = _delta_chunks(
        qq.reshape(B * Hkv, G, L, D), kk.reshape(B * Hkv, L, D), vv.reshape(B * Hkv, L, Dv),
        gg.reshape(B * Hkv, L), bb.reshape(B * Hkv, L), S.reshape(B * Hkv, D, Dv), Cf or C, Cf is not None,
        solve_block,
    )
    out = out.reshape(B, H, L, Dv)[:, :, Nk - Nq : Nk]
    return out.to(out_dtype), S.reshape(B, Hkv, D, Dv)


# The stateless prefill as one opaque node; gradients reach q, k, v, g and β.
prefill_op("attnopt::gated_delta_attention", _delta_forward, differentiable=(0, 1, 2, 3, 4))


# ---- public API ----


def init_gated_delta_state(B: int, Hkv: int, D: int, Dv: int, *, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """Zero state S [B, Hkv, D, Dv] in the compute dtype of `dtype` (fp32 for fp16/bf16)."""
    return torch.zeros(B, Hkv, D, Dv, dtype=compute_dtype(dtype), device=device)


def gated_delta_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
    state: Optional[Tensor] = None,
    chunk_size: int = CHUNK,
):
    """Causal gated delta rule over q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] with
    log-gates g <= 0 and write strengths β, both [B, Hkv, Nk].

    S_t = exp(g_t)(I - β_t k_t k_tᵀ)S_{t-1} + β_t k_t v_tᵀ, o_t = s·S_tᵀq_t (s = scale, default
    1/sqrt(D)). key_mask [B, Nk] (True = keep): a masked key leaves the state unchanged.
    Returns [B, H, Nq, Dv] in q's dtype; with `state` S [B, Hkv, D, Dv] it continues from it and
    returns (out, new_state). Stateless calls run as `torch.ops.attnopt.gated_delta_attention`.
    """
    _check_inputs(q, k, v, g, beta, key_mask)
    _check_options(scale, chunk_size)
    B, H, _, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    tk = None if state is not None else cuda_kernels(q, __package__)
    if tk is not None and tk.unsupported(q, k=k, v=v, g=g, beta=beta) is None:
        return tk.gated_delta_attention(q, k, v, g, beta, scale=s, key_mask=key_mask)
    if state is None and wants_plain_autograd(q, k, v, g, beta):  # a compile-time fit: no recompute in the backward
        return _delta_forward(q, k, v, g, beta, key_mask, s, chunk_size)[0]
    if state is None:
        return torch.ops.attnopt.gated_delta_attention(q, k, v, g, beta, key_mask, s, chunk_size)
    S0 = _check_state(state, B, Hkv, D, Dv)
    return _delta_forward(q, k, v, g, beta, key_mask, s, chunk_size, S0)


def gated_delta_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: Optional[float] = None,
                        key_mask: Optional[Tensor] = None, chunk_size: int = CHUNK, solve_block: int = 0) -> Tensor:
    """`gated_delta_attention`'s chunked body as plain differentiable PyTorch (no custom op), with its
    algorithmic choices open: the chunk length and the intra-chunk solve (`unit_lower_solve`'s
    block; 0 = LAPACK). For measuring them (benchmarks/ops_cpu.py); same arguments and result."""
    _check_inputs(q, k, v, g, beta, key_mask)
    _check_options(scale, chunk_size)
    if isinstance(solve_block, bool) or not isinstance(solve_block, int) or solve_block < 0:
        raise ValueError(f"gated_delta_chunked: solve_block must be an int >= 0 (0: LAPACK), got {solve_block!r}")
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _delta_forward(q, k, v, g, beta, key_mask, s, chunk_size, solve_block=solve_block)[0]


def gated_delta_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Optional[Tensor],
    *,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
):
    """One decoding step: q [B, H, 1, D], k [B, Hkv, 1, D], v [B, Hkv, 1, Dv], g/β [B, Hkv, 1];
    state None means zeros; key_mask [B, 1] (False: state unchanged). Returns (o [B, H, 1, Dv], S)."""
    who = "gated_delta_attention_step"
    _check_inputs(q, k, v, g, beta, key_mask, who)
    if q.shape[2] != 1 or k.shape[2] != 1:
        raise ValueError(f"{who}: expects one token (N = 1); got q N={q.shape[2]}, k N={k.shape[2]}. Use gated_delta_attention for prefill")
    _check_options(scale, None, who)
    B, H, _, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    G = H // Hkv
    cdt = compute_dtype(q.dtype)
    S = init_gated_delta_state(B, Hkv, D, Dv, dtype=q.dtype, device=q.device) if state is None else state
    S = _check_state(S, B, Hkv, D, Dv, who).to(cdt)
    kt, vt = k.to(cdt)[:, :, 0], v.to(cdt)[:, :, 0]  # [B, Hkv, D], [B, Hkv, Dv]
    a, bt = torch.exp(g.to(cdt)[:, :, 0]), beta.to(cdt)[:, :, 0]  # [B, Hkv]
    if key_mask is not None:
        keep = key_mask[:, :1].to(cdt)  # [B, 1]
        a, bt = a * keep + (1 - keep), bt * keep
    decayed = a[..., None, None] * S
    pred = (kt[..., :, None] * decayed).sum(-2)  # (exp(g) S)ᵀ k   [B, Hkv, Dv]
    S = decayed + (bt[..., None] * kt)[..., :, None] * (vt - pred)[..., None, :]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = s * (q.to(cdt).reshape(B, Hkv, G, D) @ S)  # [B, Hkv, G, Dv]
    return out.reshape(B, H, 1, Dv).to(q.dtype), S
