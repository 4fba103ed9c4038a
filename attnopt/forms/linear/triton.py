"""Linear attention oᵢ = φ(qᵢ)ᵀSᵢ / (φ(qᵢ)ᵀzᵢ + ε) as Triton kernels, SDPA layout.

Causal: the chunked scan of `chunk_scan` (forward and backward in Triton). Non-causal: two kernels,
the key state S = φ(K)ᵀV, z = Σ φ(k) per (batch, key head), then every query block against it; its
backward is PyTorch autograd through the same two contractions (O(N·M·Dv), nothing quadratic:
GEMM-shaped work that cuBLAS already does at peak).

Feature maps: ELU+1 and ReLU are fused into the kernels' loads. FAVOR+, hedgehog and Taylor run
as a PyTorch projection first (`attnopt.kernels.feature_maps.query_key_features`, the reference
op's own stabilised features, differentiable into ω / W), then the kernels with the identity map.
The kernels keep a [M, BV] state per program, so M is capped (`MAX_FEATURES`).

Letters: B batch, H query heads, Hk heads of φ(k) (Hkv, or H for per-head maps), Hv heads of v,
Nq/Nk lengths, D head dim, M feature width, Dv value dim.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.kernels.feature_maps import FeatureMap, make_feature_map, query_key_features
from attnopt.kernels.triton.chunk_scan import carry, chunk_backward, chunk_forward, key_features
from attnopt.kernels.triton.differentiable import differentiable
from attnopt.kernels.triton.runtime import FMAP_CODES, checked_call, interpreting, keep_arg, launcher, low_precision
from attnopt.kernels.triton.runtime import pow2, row_strides, scale_or_default, shared_checks
from attnopt.kernels.triton.state_step import check_one_token, state_step
from attnopt.kernels.triton.tiles import dot, kept, load_phi, load_tile, program_head, span, store_tile

FUSED_MAPS = ("elu", "relu")
PROJECTED_MAPS = ("favor", "hedgehog", "taylor")
MAX_FEATURES = 256  # a [256, 64] fp32 state is the most one program keeps in registers


@triton.jit
def _kv_state_kernel(
    K, V, KEEP, S, Z,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    Hk, Nk, M, Dv, RKV,
    FMAP: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BC: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """S [B, Hk, M, Dv] = Σ_j φ(k_j) v_jᵀ and Z [B, Hk, M] = Σ_j φ(k_j), fp32; v head = k head // RKV."""
    pid_bh, b, hk = program_head(Hk)
    rm, m_ok = span(0, M, BM)
    rv, v_ok = span(tl.program_id(1) * BV, Dv, BV)
    acc = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    for c0 in range(0, Nk, BC):
        pos, k_in = span(c0, Nk, BC)
        fk, vx = key_features(K + b * s_kb + hk * s_kh, s_kn, V + b * s_vb + (hk // RKV) * s_vh, s_vn, pos,
                              kept(KEEP + b * Nk, pos, k_in, HAS_KEEP), rm, m_ok, rv, v_ok, FMAP)
        acc = carry(acc, fk, vx, 1.0, False, LOWP, K.dtype.element_ty)
        z += tl.sum(fk, axis=0)
    store_tile(S + pid_bh * M * Dv, rm, Dv, rv, m_ok, v_ok, acc)
    if tl.program_id(1) == 0:
        tl.store(Z + pid_bh * M + rm, z, mask=m_ok)


@triton.jit
def _query_state_kernel(
    Q, S, Z, O, DEN,
    s_qb, s_qh, s_qn, s_ob, s_oh, s_on,
    H, Hk, Nq, M, Dv, GK, eps,
    FMAP: tl.constexpr, LOWP: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
):
    """O = φ(Q)S / (φ(Q)z + eps) for one query block; DEN [B, H, Nq] gets the denominator."""
    pid_bh, b, h = program_head(H)
    rq, q_ok = span(tl.program_id(1) * BQ, Nq, BQ)
    rm, m_ok = span(0, M, BM)
    rv, v_ok = span(tl.program_id(2) * BV, Dv, BV)
    fq = load_phi(Q + b * s_qb + h * s_qh, rq, s_qn, rm, q_ok, m_ok, FMAP)
    sh = b * Hk + h // GK
    num = dot(fq, load_tile(S + sh * M * Dv, rm, Dv, rv, m_ok, v_ok), LOWP, Q.dtype.element_ty)
    den = tl.sum(fq * tl.load(Z + sh * M + rm, mask=m_ok, other=0.0)[None, :], axis=1) + eps
    store_tile(O + b * s_ob + h * s_oh, rq, s_on, rv, q_ok, v_ok, num / tl.where(den == 0.0, 1.0, den)[:, None])
    if tl.program_id(2) == 0:
        tl.store(DEN + pid_bh * Nq + rq, den, mask=q_ok)


def noncausal_forward(q, k, v, keep, fmap: int, eps: float, wrap: bool):
    """q [B, H, Nq, M], k [B, Hk, Nk, M], v [B, Hv, Nk, Dv] -> out [B, H, Nq, Dv] (q's dtype)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Nq, M = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    Hv, Dv = v.shape[1], v.shape[3]
    BC = 16 if interpreting() else 64
    BV = min(64, pow2(Dv))
    S = torch.empty(B, Hk, M, Dv, device=q.device, dtype=torch.float32)
    Z = torch.empty(B, Hk, M, device=q.device, dtype=torch.float32)
    keep_t, has_keep = keep_arg(keep, q)
    lowp = low_precision(q.dtype)
    launcher(_kv_state_kernel, wrap)[(B * Hk, triton.cdiv(Dv, BV))](
        k, v, keep_t, S, Z, *row_strides(k, v), Hk, Nk, M, Dv, Hk // Hv,
        FMAP=fmap, HAS_KEEP=has_keep, LOWP=lowp, BC=BC, BM=pow2(M), BV=BV,
    )
    out = torch.empty(B, H, Nq, Dv, device=q.device, dtype=q.dtype)
    den = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    BQ = 16 if interpreting() else 64
    launcher(_query_state_kernel, wrap)[(B * H, triton.cdiv(Nq, BQ), triton.cdiv(Dv, BV))](
        q, S, Z, out, den, *row_strides(q, out), H, Hk, Nq, M, Dv, H // Hk, eps,
        FMAP=fmap, LOWP=lowp, BQ=BQ, BM=pow2(M), BV=BV,
    )
    return out


def _torch_phi(x: Tensor, fmap: int) -> tuple[Tensor, Tensor]:
    """(φ(x), φ'(x)) for the fused maps, in x's dtype."""
    if fmap == FMAP_CODES["elu"]:
        e = torch.exp(x.clamp(max=0))
        return torch.where(x > 0, x + 1.0, e), torch.where(x > 0, 1.0, e)
    if fmap == FMAP_CODES["relu"]:
        return x.clamp(min=0), (x > 0).to(x.dtype)
    return x, torch.ones_like(x)


def noncausal_backward(g, q, k, v, keep, fmap: int, eps: float):
    """Closed-form gradients of φ(q)(φ(K)ᵀV) / (φ(q)·Σφ(k) + eps), fp32, plain tensor ops (no
    nested autograd, so it traces under torch.compile): O(N·M·Dv), GEMM-shaped.
    With n = φ(q)S, den = φ(q)·z + eps, dn = g/den, dd = −(g·o)/den:
    dφ(q) = dn Sᵀ + dd z, dφ(k) = V Rᵀ + r, dV = φ(K) R, R = Σ_i φ(q_i) dn_iᵀ, r = Σ_i φ(q_i) dd_i."""
    B, H, Nq, M = q.shape
    Hk, Nk = k.shape[1], k.shape[2]
    Hv, Dv = v.shape[1], v.shape[3]
    G = H // Hk
    fq, dfq_dx = _torch_phi(q.to(torch.float32), fmap)
    fk, dfk_dx = _torch_phi(k.to(torch.float32), fmap)
    if keep is not None:
        kf = keep[:, None, :, None].to(torch.float32)
        fk, dfk_dx = fk * kf, dfk_dx * kf
    vk = v.to(torch.float32)
    vk = vk.repeat_interleave(Hk // Hv, dim=1) if Hk != Hv else vk  # [B, Hk, Nk, Dv] (hedgehog: Hk = H)
    fq = fq.view(B, Hk, G, Nq, M)
    S = fk.transpose(-1, -2) @ vk  # [B, Hk, M, Dv]
    z = fk.sum(2)  # [B, Hk, M]
    num = fq @ S[:, :, None]
    den = (fq * z[:, :, None, None, :]).sum(-1) + eps  # [B, Hk, G, Nq]
    inv = torch.where(den == 0, 0.0, 1.0 / torch.where(den == 0, 1.0, den))
    gf = g.to(torch.float32).view(B, Hk, G, Nq, Dv)
    dn = gf * inv[..., None]
    dd = -(gf * num).sum(-1) * inv * inv
    dfq = dn @ S.transpose(-1, -2)[:, :, None] + dd[..., None] * z[:, :, None, None, :]
    R = torch.einsum("bhgnm,bhgnv->bhmv", fq, dn)
    r = torch.einsum("bhgnm,bhgn->bhm", fq, dd)
    dfk = vk @ R.transpose(-1, -2) + r[:, :, None, :]
    dvk = fk @ R
    if Hk != Hv:
        dvk = dvk.view(B, Hv, Hk // Hv, Nk, Dv).sum(2)
    dq = dfq.reshape(B, H, Nq, M) * dfq_dx
    return dq.to(q.dtype), (dfk * dfk_dx).to(k.dtype), dvk.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# triton_op registrations (GPU path) and the interpreter's autograd.Function
# ---------------------------------------------------------------------------------------------

def _causal_forward(q, k, v, keep, fmap: int, eps: float, wrap: bool):
    return chunk_forward(q, k, v, keep, None, fmap, True, 1.0, eps, wrap=wrap)


def _causal_backward(g, q, k, v, keep, out, den, fmap: int, wrap: bool):
    return chunk_backward(g, q, k, v, keep, None, out, den, fmap, True, 1.0, wrap=wrap)


@triton_op("attnopt_triton::linear_causal", mutates_args={})
def _linear_causal_op(
    q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], fmap: int, eps: float
) -> tuple[Tensor, Tensor]:
    return _causal_forward(q, k, v, keep, fmap, eps, wrap=True)


@triton_op("attnopt_triton::linear_causal_backward", mutates_args={})
def _linear_causal_backward_op(
    g: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], out: Tensor, den: Tensor, fmap: int
) -> tuple[Tensor, Tensor, Tensor]:
    return _causal_backward(g, q, k, v, keep, out, den, fmap, wrap=True)


# the backward reads q, k, v, keep, (out, den) and the feature map
_linear_causal = differentiable(_linear_causal_op, _linear_causal_backward_op, _causal_forward, _causal_backward,
                                saved=4, opts=(4,))


@triton_op("attnopt_triton::linear_noncausal", mutates_args={})
def _linear_noncausal_op(q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], fmap: int, eps: float) -> Tensor:
    return noncausal_forward(q, k, v, keep, fmap, eps, wrap=True)


def _noncausal_setup(ctx, inputs, output):
    q, k, v, keep, fmap, eps = inputs
    ctx.save_for_backward(q, k, v, keep)
    ctx.fmap, ctx.eps = fmap, eps


def _noncausal_backward(ctx, g):
    q, k, v, keep = ctx.saved_tensors
    return (*noncausal_backward(g, q, k, v, keep, ctx.fmap, ctx.eps), None, None, None)


_linear_noncausal_op.register_autograd(_noncausal_backward, setup_context=_noncausal_setup)


class _NoncausalInterpreted(torch.autograd.Function):
    """The non-causal op's forward kernels launched raw (TRITON_INTERPRET=1), with its PyTorch backward."""

    @staticmethod
    def forward(ctx, q, k, v, keep, fmap, eps):
        _noncausal_setup(ctx, (q, k, v, keep, fmap, eps), None)
        return noncausal_forward(q, k, v, keep, fmap, eps, wrap=False)

    @staticmethod
    def backward(ctx, g):
        return _noncausal_backward(ctx, g)


def _linear_noncausal(*args) -> Tensor:
    return _NoncausalInterpreted.apply(*args) if interpreting() else _linear_noncausal_op(*args)


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------


def _map_name(feature_map: Union[str, FeatureMap]) -> str:
    return feature_map.name if isinstance(feature_map, FeatureMap) else feature_map


def linear_unsupported(q: Tensor, feature_map="elu", state=None, **_) -> Optional[str]:
    """Why the Triton path cannot run these arguments, or None."""
    name = _map_name(feature_map)
    if state is not None:
        return "linear_attention: a carried state (decoding / chunked prefill) runs on the PyTorch path"
    if name not in FUSED_MAPS + PROJECTED_MAPS:
        return f"linear_attention: unknown feature map {name!r}"
    D = q.shape[-1]
    if name == "taylor":
        M = 1 + D + D * D
    elif isinstance(feature_map, FeatureMap):
        M = feature_map.num_features(D)
    else:
        M = 2 * D if name in ("favor", "hedgehog") else D
    if M > MAX_FEATURES:
        return f"linear_attention: {M} features ({name}, D={D}) exceed the Triton kernels' {MAX_FEATURES}"
    return None


unsupported = shared_checks(linear_unsupported)


def linear_attention(q: Tensor, k: Tensor, v: Tensor, *, feature_map: Union[str, FeatureMap] = "elu",
                     causal: bool = False, scale: Optional[float] = None, eps: float = 1e-6,
                     key_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """`attnopt.forms.linear.reference.linear_attention` (stateless) on the Triton kernels; same arguments
    and result. `chunk_size` is accepted for signature compatibility: the kernels pick their own."""
    checked_call("linear_attention", q, k, v, key_mask, lambda: linear_unsupported(q, feature_map))
    name = _map_name(feature_map)
    keep = key_mask
    if name in FUSED_MAPS:
        fmap = FMAP_CODES[name]
        fq, fk = q, k
    else:
        fmap = FMAP_CODES["identity"]
        module = feature_map if isinstance(feature_map, FeatureMap) else make_feature_map(name, q.shape[-1], q.shape[1])
        weight = module.op_weight()
        weight = None if weight is None else weight.to(device=q.device, dtype=torch.float32)
        fq, fk, _ = query_key_features(name, q.float(), k.float(), scale_or_default(q, scale), weight, key_mask)
        # φ(k) of dropped keys is already 0; bf16/fp16 inputs keep their dtype into the kernel's dots
        fq, fk, keep = fq.to(q.dtype), fk.to(q.dtype), None
    return (_linear_causal if causal else _linear_noncausal)(fq, fk, v, keep, fmap, float(eps))


def linear_decode_step(
    q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[tuple], *, feature_map: str = "elu", eps: float = 1e-6
):
    """One token of causal linear attention. state (S [B, H, M, Dv], z [B, H, M]) or None (zeros).
    Returns (o_t [B, H, 1, Dv], (S, z)), the layout of `linear_attention(..., state=)`."""
    who = "linear_decode_step"
    check_one_token(who, q_t, k_t, v_t)
    if feature_map not in ("elu", "relu"):
        raise ValueError(f"{who}: only the fused maps elu / relu decode on the Triton path, got {feature_map!r}")
    B, H, _, M = q_t.shape
    Dv = v_t.shape[3]
    if state is None:
        state = (q_t.new_zeros(B, H, M, Dv, dtype=torch.float32), q_t.new_zeros(B, H, M, dtype=torch.float32))
    S, z = state
    out, S, z = state_step(q_t, k_t, v_t, S, z, None, FMAP_CODES[feature_map], True, 1.0, float(eps))
    return out, (S, z)
