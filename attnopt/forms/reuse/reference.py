"""Residual-reuse attention: layer l attends with an earlier anchor layer's q/k plus a low-rank residual.

Letters: B batch, H query heads, Hkv value heads of layer l, Hkv_a key heads of the anchor, N sequence,
D anchor head dim, Dv value head dim, C hidden size, C' = C or C+1 (homogeneous coordinates), r rank.

Layer l's logits are replaced by

    logits_l = s · (q_a k_aᵀ + (x̂_l A_l)(x̂_l B_l)ᵀ)          per head h,

where q_a [B, H, N, D] and k_a [B, Hkv_a, N, D] are the anchor's cached projections, x_l [B, N, C] is
layer l's input and A_l, B_l [H, C', r] are the residual factors. When C' = C + 1 the input is read
in homogeneous coordinates x̂ = [x, 1], so the factors also carry the projection biases. The whole
thing is ONE `F.scaled_dot_product_attention` call over concatenated head dimensions,

    q' = [q_a, x̂ A] and k' = [k_a, x̂ B]  (last dim D + r),   out = SDPA(q', k', v_l, scale=s),

because q'k'ᵀ = q_a k_aᵀ + (x̂A)(x̂B)ᵀ. Memory stays O(N·(D + r)); no N×N matrix is built (except the
[B, 1, N, N] bool mask when `causal` and `key_mask` are combined, which SDPA cannot take separately).
Rank 0 is pure reuse (q' = q_a, k' = k_a); then x, A and B may be None.

What it saves (per sequence of N tokens, non-causal count; causal halves the N² terms):
  * Q/K projections of layer l: 2·N·C·(H + Hkv)·D FLOPs become 2·N·C'·2·H·r (the two residual
    factors). With MHA (Hkv = H) this is a saving whenever r < D.
  * K cache of layer l: Hkv·N·D elements become H·N·r (x̂B per query head); k_a is already cached by
    the anchor layer itself. V is untouched.
What it costs:
  * the logits run over D + r dims instead of D: +2·H·N²·r FLOPs. The projection saving grows as N,
    the logit cost as N², so the net FLOP saving turns negative past N* = C·((H+Hkv)·D − 2·H·r)/(H·r);
    the K-cache saving does not depend on N. `reuse_savings` computes all of this.
  * the anchor's q must be kept alive until layer l (H·N·D elements during prefill, one token in decode).

The useful rank is at most min(C', 2·D): M_l − M_a is a difference of two rank-≤D forms, so rank 2·D is
already exact (when x_a = x_l); ranks past that buy nothing.

Initialisation (`init_reuse_factors`) is training-free. The weight-only fit truncates M_l − M_a by SVD;
it is exact only when x_a = x_l, and when the hidden states drift between the layers it can even get
worse as the rank grows (the residual corrects the weights, not the inputs). The optional calibration
fit, from a few hundred unlabelled tokens seen at both layers, regresses x_a on x_l and truncates in the
data-weighted norm: same op, same rank and cost, the logit-optimal residual on those tokens, exact
under any affine drift — in our tests it roughly halves the held-out error at equal rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.kernels.registration import register_recompute_autograd

__all__ = [
    "reuse_attention",
    "reuse_attention_reference",
    "init_reuse_factors",
    "reuse_savings",
]


# ---------------------------------------------------------------------------------------------
# validation shared by the op, its fake kernel and the reference
# ---------------------------------------------------------------------------------------------


def _rank_of(A: Optional[Tensor]) -> int:
    return 0 if A is None else int(A.shape[-1])


def _check_inputs(
    q_anchor: Tensor,
    k_anchor: Tensor,
    v: Tensor,
    x: Optional[Tensor],
    A: Optional[Tensor],
    B_: Optional[Tensor],
    scale: float,
    key_mask: Optional[Tensor],
) -> None:
    """Raise ValueError/TypeError naming the bad argument and the fix; shapes only, so fake tensors pass."""
    for name, t in (("q_anchor", q_anchor), ("k_anchor", k_anchor), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"reuse_attention: {name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"reuse_attention: {name} must be [B, heads, N, dim] (4-D), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"reuse_attention: {name} must be floating point, got {t.dtype}")
    Bq, H, N, D = q_anchor.shape
    Bk, Hkv_a, Nk, Dk = k_anchor.shape
    Bv, Hkv, Nv, Dv = v.shape
    if (Bk, Nk) != (Bq, N) or (Bv, Nv) != (Bq, N):
        raise ValueError(
            "reuse_attention: q_anchor, k_anchor and v must share batch and sequence length "
            f"(self-attention); got q_anchor {tuple(q_anchor.shape)}, k_anchor {tuple(k_anchor.shape)}, v {tuple(v.shape)}"
        )
    if Dk != D:
        raise ValueError(f"reuse_attention: k_anchor head dim {Dk} != q_anchor head dim {D}; pass the anchor's own q and k")
    for name, h in (("k_anchor", Hkv_a), ("v", Hkv)):
        if h < 1 or H % h != 0:
            raise ValueError(
                f"reuse_attention: {name} has {h} heads, which does not divide the {H} query heads of q_anchor "
                "(grouped-query attention needs H to be a multiple of the key/value head count)"
            )
    if k_anchor.dtype != q_anchor.dtype or v.dtype != q_anchor.dtype:
        raise TypeError(
            f"reuse_attention: dtypes differ (q_anchor {q_anchor.dtype}, k_anchor {k_anchor.dtype}, v {v.dtype}); cast them to one dtype"
        )
    if not isinstance(scale, (float, int)) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"reuse_attention: scale must be a finite positive float (usually 1/sqrt(D)), got {scale!r}")

    if (A is None) != (B_ is None):
        raise ValueError("reuse_attention: pass both residual factors A and B_ or neither (None means rank 0, pure reuse)")
    r = 0
    if A is not None:
        if A.dim() != 3 or B_.dim() != 3:
            raise ValueError(
                f"reuse_attention: A and B_ must be [H, C or C+1, r]; got A {tuple(A.shape)}, B_ {tuple(B_.shape)}"
            )
        if A.shape != B_.shape:
            raise ValueError(
                f"reuse_attention: A {tuple(A.shape)} and B_ {tuple(B_.shape)} must have the same shape [H, C', r]"
            )
        if A.shape[0] != H:
            raise ValueError(
                f"reuse_attention: A/B_ have {A.shape[0]} heads but q_anchor has {H}; the residual is per query head"
            )
        if A.dtype != q_anchor.dtype or B_.dtype != q_anchor.dtype:
            raise TypeError(f"reuse_attention: A/B_ dtype {A.dtype}/{B_.dtype} must match q_anchor ({q_anchor.dtype})")
        r = int(A.shape[-1])
    if r > 0:
        if x is None:
            raise ValueError("reuse_attention: rank > 0 needs x, layer l's input hidden states [B, N, C]")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != Bq or x.shape[1] != N:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"reuse_attention: x must be [B, N, C] = [{Bq}, {N}, C], got {shape}")
        if x.dtype != q_anchor.dtype:
            raise TypeError(f"reuse_attention: x dtype {x.dtype} must match q_anchor ({q_anchor.dtype})")
        C = x.shape[2]
        if A.shape[1] not in (C, C + 1):
            raise ValueError(
                f"reuse_attention: A/B_ have {A.shape[1]} input rows but x has C = {C} channels; "
                f"use C = {C} rows, or C + 1 = {C + 1} for homogeneous coordinates (bias row last)"
            )
    if key_mask is not None:
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            raise TypeError("reuse_attention: key_mask must be a bool Tensor [B, N] with True = attend to this key")
        if tuple(key_mask.shape) != (Bq, N):
            raise ValueError(f"reuse_attention: key_mask must be [B, N] = [{Bq}, {N}], got {tuple(key_mask.shape)}")


def _project(x_BNC: Tensor, F_HCr: Tensor) -> Tensor:
    """x̂ F per head → [B, H, N, r]; a C+1-th row of F is the bias of the homogeneous coordinate."""
    C = x_BNC.shape[-1]
    out_BHNr = torch.einsum("bnc,hcr->bhnr", x_BNC, F_HCr[:, :C])
    if F_HCr.shape[1] == C + 1:
        out_BHNr = out_BHNr + F_HCr[:, C][None, :, None, :]
    return out_BHNr


def _expand_heads(t_BhND: Tensor, H: int) -> Tensor:
    """Repeat each of h heads H/h times (head i serves query heads i·H/h … (i+1)·H/h − 1, as HF's repeat_kv)."""
    h = t_BhND.shape[1]
    return t_BhND if h == H else t_BhND.repeat_interleave(H // h, dim=1)


def _sdpa_mask(key_mask: Optional[Tensor], causal: bool, N: int) -> tuple[Optional[Tensor], bool]:
    """SDPA takes is_causal or attn_mask, not both; combining them needs the [B, 1, N, N] bool mask."""
    if key_mask is None:
        return None, causal
    keep_B11N = key_mask[:, None, None, :]
    if not causal:
        return keep_B11N, False
    tril_NN = torch.ones(N, N, dtype=torch.bool, device=key_mask.device).tril()
    return keep_B11N & tril_NN, False


def _reuse_forward(q_anchor, k_anchor, v, x, A, B_, scale, causal, key_mask) -> Tensor:
    """The op body: build q' and k' by concatenating head dims, then one SDPA call."""
    H, N = q_anchor.shape[1], q_anchor.shape[2]
    r = _rank_of(A)
    if r == 0:
        q_BHNd, k_BhNd = q_anchor, k_anchor
    else:
        q_BHNd = torch.cat([q_anchor, _project(x, A)], dim=-1)
        k_BhNd = torch.cat([_expand_heads(k_anchor, H), _project(x, B_)], dim=-1)
    k_BHNd = _expand_heads(k_BhNd, H)
    v_BHND = _expand_heads(v, H)
    # The fused CPU (flash) SDPA kernel needs q/k and v to share a head dim; otherwise SDPA falls back
    # to the math backend, which builds the N×N logits (6× slower at N=1k and O(N²) memory). Zero
    # columns change neither q'k'ᵀ nor the kept part of the output, so pad the smaller side.
    d, Dv = q_BHNd.shape[-1], v_BHND.shape[-1]
    if d < Dv:
        q_BHNd, k_BHNd = F.pad(q_BHNd, (0, Dv - d)), F.pad(k_BHNd, (0, Dv - d))
    elif d > Dv:
        v_BHND = F.pad(v_BHND, (0, d - Dv))
    mask, is_causal = _sdpa_mask(key_mask, causal, N)
    out_BHNd = F.scaled_dot_product_attention(q_BHNd, k_BHNd, v_BHND, attn_mask=mask, is_causal=is_causal, scale=float(scale))
    return out_BHNd[..., :Dv]


# ---------------------------------------------------------------------------------------------
# torch.library op: one node under torch.export, fake kernel, recompute-based autograd
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("attnopt::reuse_attention", mutates_args=())
def _reuse_op(
    q_anchor: Tensor,
    k_anchor: Tensor,
    v: Tensor,
    x: Optional[Tensor],
    A: Optional[Tensor],
    B_: Optional[Tensor],
    scale: float,
    causal: bool,
    key_mask: Optional[Tensor],
) -> Tensor:
    _check_inputs(q_anchor, k_anchor, v, x, A, B_, scale, key_mask)
    # SDPA may return a view-like or input-aliasing result for degenerate shapes; custom ops must not alias.
    return _reuse_forward(q_anchor, k_anchor, v, x, A, B_, scale, causal, key_mask).contiguous()


@_reuse_op.register_fake
def _reuse_fake(q_anchor, k_anchor, v, x, A, B_, scale, causal, key_mask):
    _check_inputs(q_anchor, k_anchor, v, x, A, B_, scale, key_mask)
    B, H, N, _ = q_anchor.shape
    return q_anchor.new_empty(B, H, N, v.shape[-1])


register_recompute_autograd(_reuse_op, _reuse_forward, differentiable=(0, 1, 2, 3, 4, 5))


def reuse_attention(
    q_anchor: Tensor,
    k_anchor: Tensor,
    v: Tensor,
    x: Optional[Tensor] = None,
    A: Optional[Tensor] = None,
    B_: Optional[Tensor] = None,
    *,
    scale: float,
    causal: bool = False,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """Attention of layer l from the anchor's q/k plus a rank-r residual of its own input → [B, H, N, Dv].

    q_anchor [B, H, N, D], k_anchor [B, Hkv_a, N, D]: the anchor layer's projections (after any
    position encoding the anchor applies). v [B, Hkv, N, Dv]: layer l's values. x [B, N, C]: layer l's
    input. A, B_ [H, C', r] with C' = C, or C + 1 to read x in homogeneous coordinates (last row = bias).
    Rank 0 (pure reuse): A = B_ = None (x may then be None), or [H, C', 0] tensors — both mean the same.
    Key/value heads are shared by groups of query heads (GQA): head h reads kv head h // (H / Hkv).
    key_mask bool [B, N], True = keep. Query rows that can see no key follow SDPA's convention.
    """
    _check_inputs(q_anchor, k_anchor, v, x, A, B_, scale, key_mask)
    if _rank_of(A) == 0:
        x = A = B_ = None  # one spelling of rank 0, so the graph and the backward see no empty tensors
    return _reuse_op(q_anchor, k_anchor, v, x, A, B_, float(scale), bool(causal), key_mask)


def reuse_attention_reference(
    q_anchor: Tensor,
    k_anchor: Tensor,
    v: Tensor,
    x: Optional[Tensor] = None,
    A: Optional[Tensor] = None,
    B_: Optional[Tensor] = None,
    *,
    scale: float,
    causal: bool = False,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """Oracle: the explicit N×N logits s·(q_a k_aᵀ + x̂ A Bᵀ x̂ᵀ), masked softmax, times v. Test use only."""
    _check_inputs(q_anchor, k_anchor, v, x, A, B_, scale, key_mask)
    H, N = q_anchor.shape[1], q_anchor.shape[2]
    logits_BHNN = q_anchor @ _expand_heads(k_anchor, H).transpose(-1, -2)
    if _rank_of(A) > 0:
        C = x.shape[-1]
        x_hat = x if A.shape[1] == C else torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)
        # A Bᵀ first: a different association from the op's (x̂A)(x̂B)ᵀ, so the two paths are independent.
        M_HCC = A @ B_.transpose(-1, -2)
        logits_BHNN = logits_BHNN + torch.einsum("bic,hcd,bjd->bhij", x_hat, M_HCC, x_hat)
    logits_BHNN = logits_BHNN * scale
    keep = torch.ones(N, N, dtype=torch.bool, device=q_anchor.device)
    if causal:
        keep = keep.tril()
    keep_B1NN = keep[None, None]
    if key_mask is not None:
        keep_B1NN = keep_B1NN & key_mask[:, None, None, :]
    logits_BHNN = logits_BHNN.masked_fill(~keep_B1NN, float("-inf"))
    return torch.softmax(logits_BHNN, dim=-1) @ _expand_heads(v, H)


# ---------------------------------------------------------------------------------------------
# training-free initialisation
# ---------------------------------------------------------------------------------------------


def _bilinear_forms(Wq: Tensor, bq: Optional[Tensor], Wk: Tensor, bk: Optional[Tensor], H: int, D: int) -> Tensor:
    """M_h = Ŵ_q,hᵀ Ŵ_k,h in homogeneous coordinates → [H, C+1, C+1], so q_h·k_h = x̂ M_h x̂ᵀ."""
    C = Wq.shape[1]
    Hkv = Wk.shape[0] // D
    zeros_q = Wq.new_zeros(Wq.shape[0])
    zeros_k = Wk.new_zeros(Wk.shape[0])
    Wq_hat = torch.cat([Wq, (zeros_q if bq is None else bq)[:, None]], dim=1).reshape(H, D, C + 1)
    Wk_hat = torch.cat([Wk, (zeros_k if bk is None else bk)[:, None]], dim=1).reshape(Hkv, D, C + 1)
    Wk_hat = Wk_hat.repeat_interleave(H // Hkv, dim=0)
    return Wq_hat.transpose(-1, -2) @ Wk_hat


def _check_projection(name: str, W: Tensor, b: Optional[Tensor], C: int, D: int, H: int, is_query: bool) -> None:
    if not isinstance(W, Tensor) or W.dim() != 2:
        raise ValueError(f"init_reuse_factors: {name} must be an nn.Linear weight [heads·D, C], got {getattr(W, 'shape', W)!r}")
    if W.shape[1] != C:
        raise ValueError(f"init_reuse_factors: {name} has {W.shape[1]} input channels, Wq_l has {C}; all four projections read the same hidden size")
    rows = W.shape[0]
    if is_query and rows != H * D:
        raise ValueError(f"init_reuse_factors: {name} has {rows} rows; expected heads·D = {H}·{D} (same heads and head dim as Wq_l)")
    if not is_query and (rows % D != 0 or H % (rows // D) != 0):
        raise ValueError(
            f"init_reuse_factors: {name} has {rows} rows, not Hkv·D with Hkv dividing heads = {H} (D = {D})"
        )
    if b is not None and (not isinstance(b, Tensor) or tuple(b.shape) != (rows,)):
        raise ValueError(f"init_reuse_factors: bias of {name} must be [{rows}] or None, got {getattr(b, 'shape', b)!r}")


def init_reuse_factors(
    Wq_l: Tensor,
    bq_l: Optional[Tensor],
    Wk_l: Tensor,
    bk_l: Optional[Tensor],
    Wq_a: Tensor,
    bq_a: Optional[Tensor],
    Wk_a: Tensor,
    bk_a: Optional[Tensor],
    heads: int,
    rank: int,
    *,
    calibration: Optional[tuple[Tensor, Tensor]] = None,
) -> tuple[Tensor, Tensor]:
    """Training-free residual factors (A, B_), each [H, C+1, rank], from the four projection weights.

    Weights follow nn.Linear: W [heads·D, C], bias [heads·D] or None (k may have Hkv·D rows, GQA).
    Per head, M_h = Ŵ_q,hᵀ Ŵ_k,h over homogeneous coordinates (C+1, bias as last column); the residual
    M_l − M_a is truncated by SVD to U_r Σ_r V_rᵀ and split as A_h = U_r Σ_r^½, B_h = V_r Σ_r^½.
    The result is deterministic (SVD in float64, each singular pair's sign fixed so the largest
    |entry| of u is positive) and returned in Wq_l's dtype.

    Exactness: q_a k_aᵀ = x_a M_a x_aᵀ is computed from the anchor's input x_a, while the residual uses
    x_l, so reuse reproduces layer l's logits exactly only when x_a = x_l (and rank ≥ rank(M_l − M_a)
    ≤ min(C+1, 2D)). Across real layers x_a ≠ x_l and this is a training-free approximation that
    removes the weight difference but not the drift of the hidden states between the two layers.
    Position encodings applied after the projection (RoPE) are not part of M and are ignored.
    The logit scale is the caller's: pass layer l's own scale to `reuse_attention`.

    calibration=(x_a, x_l), hidden states [..., C] of the same tokens at the anchor's and layer l's
    inputs (no labels, no gradient steps), switches to the data-aware fit, which minimises the logit
    error on those tokens instead of the weight-space error: with X̂ = x̂_l and G = X̂⁺ x̂_a (least
    squares, x̂_a ≈ X̂ G), the best residual is R = M_l − G M_a Gᵀ, truncated in the X̂-weighted norm
    (SVD of Lᵀ R L with X̂ᵀX̂ = L Lᵀ, mapped back by L⁻ᵀ). It is exact whenever x_a is a linear function
    of x_l (x_a = x_l included), and never worse than the weight-only fit on the calibration tokens.
    Use at least C + 1 tokens; a tiny ridge keeps X̂ᵀX̂ invertible.
    """
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"init_reuse_factors: heads must be a positive int, got {heads!r}")
    if not isinstance(Wq_l, Tensor) or Wq_l.dim() != 2:
        raise ValueError(f"init_reuse_factors: Wq_l must be an nn.Linear weight [heads·D, C], got {getattr(Wq_l, 'shape', Wq_l)!r}")
    if Wq_l.shape[0] % heads != 0:
        raise ValueError(f"init_reuse_factors: Wq_l has {Wq_l.shape[0]} rows, not divisible by heads = {heads}")
    C, D = Wq_l.shape[1], Wq_l.shape[0] // heads
    for name, W, b, is_q in (
        ("Wq_l", Wq_l, bq_l, True), ("Wk_l", Wk_l, bk_l, False),
        ("Wq_a", Wq_a, bq_a, True), ("Wk_a", Wk_a, bk_a, False),
    ):
        _check_projection(name, W, b, C, D, heads, is_q)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or rank > C + 1:
        raise ValueError(
            f"init_reuse_factors: rank must be an int in [0, C+1] = [0, {C + 1}], got {rank!r} "
            f"(ranks above min(C+1, 2·D) = {min(C + 1, 2 * D)} are exact already and only add cost)"
        )

    def f64(t):
        return None if t is None else t.detach().to(torch.float64)

    M_l = _bilinear_forms(f64(Wq_l), f64(bq_l), f64(Wk_l), f64(bk_l), heads, D)
    M_a = _bilinear_forms(f64(Wq_a), f64(bq_a), f64(Wk_a), f64(bk_a), heads, D)
    if calibration is None:
        A, B_ = _truncated_factors(M_l - M_a, rank)
    else:
        L_CC, G_CC = _calibration_maps(calibration, C)
        R = M_l - G_CC @ M_a @ G_CC.T
        A_w, B_w = _truncated_factors(L_CC.T @ R @ L_CC, rank)
        # R_r = L⁻ᵀ (A_w B_wᵀ) L⁻¹, so both factors map back through L⁻ᵀ.
        A = torch.linalg.solve_triangular(L_CC.T, A_w, upper=True)
        B_ = torch.linalg.solve_triangular(L_CC.T, B_w, upper=True)
    return A.to(Wq_l.dtype), B_.to(Wq_l.dtype)


def _truncated_factors(M_HCC: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Rank-r SVD split M ≈ (U Σ^½)(V Σ^½)ᵀ per head, signs fixed (largest |u| entry positive)."""
    U, S, Vh = torch.linalg.svd(M_HCC)
    U, S, V = U[..., :rank], S[..., :rank], Vh[..., :rank, :].transpose(-1, -2)
    # SVD signs are arbitrary (u, v) ~ (−u, −v); fix them so the factors do not depend on the LAPACK build.
    idx = U.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(U, -2, idx))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    root = S.sqrt()[..., None, :]
    return U * sign * root, V * sign * root


def _calibration_maps(calibration, C: int) -> tuple[Tensor, Tensor]:
    """(L, G) from calibration tokens: X̂_lᵀX̂_l = L Lᵀ (Cholesky) and x̂_a ≈ X̂_l G (least squares)."""
    if not isinstance(calibration, (tuple, list)) or len(calibration) != 2:
        raise ValueError("init_reuse_factors: calibration must be a pair (x_anchor, x_layer) of [..., C] tensors")
    x_a, x_l = calibration
    for name, t in (("x_anchor", x_a), ("x_layer", x_l)):
        if not isinstance(t, Tensor) or t.dim() < 2 or t.shape[-1] != C:
            raise ValueError(f"init_reuse_factors: calibration {name} must be [..., C] with C = {C}, got {getattr(t, 'shape', t)!r}")
    if x_a.shape != x_l.shape:
        raise ValueError(
            f"init_reuse_factors: calibration x_anchor {tuple(x_a.shape)} and x_layer {tuple(x_l.shape)} must hold the same tokens"
        )

    def hat(t):
        t = t.detach().reshape(-1, C).to(torch.float64)
        return torch.cat([t, t.new_ones(t.shape[0], 1)], dim=1)

    Xa, Xl = hat(x_a), hat(x_l)
    gram = Xl.T @ Xl
    # A relative ridge: LayerNorm'd inputs or few tokens can make X̂ᵀX̂ singular.
    gram = gram + 1e-10 * gram.diagonal().mean() * torch.eye(C + 1, dtype=gram.dtype)
    L = torch.linalg.cholesky(gram)
    G = torch.cholesky_solve(Xl.T @ Xa, L)
    return L, G


# ---------------------------------------------------------------------------------------------
# cost model
# ---------------------------------------------------------------------------------------------


def reuse_savings(C: int, H: int, Hkv: int, D: int, r: int, N: int) -> dict:
    """What reuse saves and costs for one sequence of N tokens (non-causal counts; causal halves N² terms).

    Projection FLOPs count the multiply-adds of x·W (2 per MAC); cache sizes are in elements per layer.
    The residual's homogeneous bias row (C+1) is ignored, as a bias add is.
    """
    for name, val in (("C", C), ("H", H), ("Hkv", Hkv), ("D", D), ("N", N)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"reuse_savings: {name} must be a positive int, got {val!r}")
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"reuse_savings: r must be a non-negative int, got {r!r}")
    if H % Hkv != 0:
        raise ValueError(f"reuse_savings: Hkv = {Hkv} must divide H = {H}")
    proj_orig = 2 * N * C * (H + Hkv) * D
    proj_reuse = 2 * N * C * 2 * H * r
    kcache_orig = Hkv * N * D
    kcache_reuse = H * N * r
    logits_orig = 2 * H * N * N * D
    logits_reuse = 2 * H * N * N * (D + r)
    net = (proj_orig - proj_reuse) - (logits_reuse - logits_orig)
    per_token_proj_saving = 2 * C * ((H + Hkv) * D - 2 * H * r)
    break_even = math.inf if r == 0 else per_token_proj_saving / (2 * H * r)
    return {
        "qk_proj_flops_original": proj_orig,
        "qk_proj_flops_reuse": proj_reuse,
        "qk_proj_flops_saved": proj_orig - proj_reuse,
        "k_cache_elems_original": kcache_orig,
        "k_cache_elems_reuse": kcache_reuse,
        "k_cache_elems_saved": kcache_orig - kcache_reuse,
        "logit_flops_original": logits_orig,
        "logit_flops_reuse": logits_reuse,
        "logit_flops_extra": logits_reuse - logits_orig,
        "net_flops_saved": net,
        # N below which the net FLOP saving is positive (inf for pure reuse; <= 0 means never).
        "break_even_N": break_even,
        "max_useful_rank": min(C + 1, 2 * D),
    }
