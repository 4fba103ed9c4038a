"""Linear (kernelised) attention: oᵢ = φ(qᵢ)ᵀS / (φ(qᵢ)ᵀz + ε), S = Σⱼ φ(kⱼ)vⱼᵀ, z = Σⱼ φ(kⱼ).

Letters: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per kv head, Hf the
heads keys are featurised on (Hkv, or H for per-head maps such as hedgehog), Nq/Nk query/key
length, D head dim of q and k, Dv head dim of v, M feature count, C chunk size.

Layout is SDPA's: q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] -> out [B, H, Nq, Dv] in q's
dtype; query head h reads kv head h // G. fp16/bf16 compute in fp32, fp32/fp64 in their own dtype.

Causal alignment is bottom-right (as with a KV cache): query i sits at absolute position
Nk − Nq + i and sums over keys j ≤ Nk − Nq + i. A query that sees no key (Nq > Nk, or every visible
key masked) gets an all-zero output row.

Causal form is chunked and vectorised over chunks (no Python loop): within a chunk of C queries the
C×C block φ(q)φ(k)ᵀ is masked and applied directly; the keys of earlier chunks enter through the
prefix state (S, z) entering that chunk, a cumsum of the per-chunk states φ(K_c)ᵀV_c. Neither an
N×N matrix nor a per-position [N, M, Dv] state is ever built: the per-chunk states take
(N/C)·M·Dv, no more than φ(k) itself for C ≥ Dv. The default C depends on the feature count M
(`default_chunk`). The stateless causal prefill (every map but FAVOR+, whose key stabiliser spans
all keys) runs the same maths one block of `BLOCK_CHUNKS` chunks at a time from the raw q, k, v
(`causal_linear_blocks`), so no N-sized intermediate is ever made.

`attnopt::linear_attention` is the torch.library op (one node under torch.export; fake and autograd
registered). It takes the feature map as a name plus its one weight tensor (FAVOR+ ω or hedgehog W).
The carried-state path (decoding, chunked prefill) is plain PyTorch sharing the same core, because
an op returning an optional state would need a second schema for little gain; it is differentiable
through ordinary autograd.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from attnopt.kernels.chunk_scan import causal_chunks, causal_linear_blocks, grouped_heads, state_times
from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.feature_maps import (
    FavorFeatureMap,
    FeatureMap,
    check_weight,
    feature_map_class,
    query_key_features,
    resolve_feature_map,
)
from attnopt.kernels.layout import compute_dtype
from attnopt.kernels.registration import prefill_op

__all__ = ["linear_attention", "linear_attention_reference", "linear_attention_op"]

State = tuple[Tensor, Tensor]  # (S [B, H, M, Dv], z [B, H, M])

# Chunks per block of the causal prefill (`causal_linear_blocks`): enough for few large ops, small
# enough that a block's intermediates stay in cache. Measured on 2 CPU cores at N = 16k (GQA 8/2,
# D = 64): elu ran fastest at 512 rows of C = 32, hedgehog (M = 128) at 1024 rows of C = 64.
BLOCK_CHUNKS = 16


def default_chunk(num_features: int) -> int:
    """The chunk C when the caller names none: 32 up to M = 64 features, else 64. The in-chunk block
    costs O(C·(M + Dv)) per query and the state read O(M·Dv): at N = 16k on 2 cores, elu (M = 64) took
    43.4 ms at C = 32 against 58.9 ms at C = 64, hedgehog (M = 128) 134.9 ms against 129.7 ms
    (benchmarks/results/linear_prefill_chunks_*_16k.json)."""
    return 32 if num_features <= 64 else 64


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], scale: float, eps: float, chunk_size: int
) -> None:
    """SDPA layout checks with messages that say what to change."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D in SDPA layout [B, heads, N, dim], got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    B, H, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[-1] != D:
        raise ValueError(f"q and k head dims differ: q {D}, k {k.shape[-1]}; they must match")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [B, Hkv, Nk]; only the last dim may differ"
        )
    hkv = k.shape[1]
    if hkv < 1 or H % hkv != 0:
        raise ValueError(
            f"query heads H={H} must be a multiple of key/value heads Hkv={hkv} "
            f"(GQA: head h reads kv head h // (H // Hkv))"
        )
    if key_mask is not None:
        if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, k.shape[2]):
            raise ValueError(
                f"key_mask must be a bool tensor [B, Nk] = [{B}, {k.shape[2]}] (True = keep), "
                f"got {key_mask.dtype} {tuple(key_mask.shape)}"
            )
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _safe_ratio(num: Tensor, den: Tensor, eps: float) -> Tensor:
    """num / (den + eps), with rows of zero denominator (no visible key, eps = 0) set to 0."""
    den = den + eps
    if eps >= torch.finfo(den.dtype).tiny:
        # Every map's kernel is >= 0, so den >= 0 and den + eps > 0: the zero guard would only add
        # two passes over the output (each a thread-pool round trip on a busy CPU).
        return num / den[..., None]
    return num / torch.where(den == 0, 1.0, den)[..., None]


def _linear_core(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    eps: float,
    chunk_size: int,
    S0: Optional[Tensor] = None,
    z0: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Grouped linear attention: phi_q [B, Hf, G, Nq, M], phi_k [B, Hf, Nk, M], v [B, Hf, Nk, Dv].

    Returns out [B, Hf, G, Nq, Dv] and the final state S [B, Hf, G|1, M, Dv], z [B, Hf, G|1, M]
    (G dim 1 unless an incoming per-query-head state S0/z0 forced it). On the causal path v gets a
    column of ones so that each product yields numerator and denominator together (W = Dv + 1) and
    (S, z) travels as one [M, W] tensor T: fewer ops, which is what a busy CPU charges for.
    Cost: non-causal O(Nk·M·Dv + G·Nq·M·Dv); causal adds O(G·Nq·C·(M + Dv)) for the in-chunk
    blocks; memory O(N·M·(1 + Dv/C) + G·N·C) per kv head.
    """
    B, Hf, G, Nq, M = phi_q.shape
    Nk, Dv = phi_k.shape[2], v.shape[-1]
    if not causal:  # one contraction; separate S and z here, as a ones column would cost a copy of v
        S = (phi_k.transpose(-1, -2) @ v)[:, :, None]
        z = phi_k.sum(2)[:, :, None]
        S, z = (S, z) if S0 is None else (S0 + S, z0 + z)
        return _safe_ratio(state_times(phi_q, S), state_times(phi_q, z[..., None])[..., 0], eps), S, z

    v1 = torch.cat([v, v.new_ones(B, Hf, Nk, 1)], dim=-1)
    T0 = None if S0 is None else torch.cat([S0, z0[..., None]], dim=-1)  # [B, Hf, G|1, M, W]
    offset = Nk - Nq  # query i sits at absolute position offset + i
    blind = max(0, -offset)  # leading queries placed before key 0 see nothing
    if offset > 0:  # keys before the first query are visible to every query: fold them into the state
        T_pre = (phi_k[:, :, :offset].transpose(-1, -2) @ v1[:, :, :offset])[:, :, None]
        T0 = T_pre if T0 is None else T0 + T_pre
    k0 = max(offset, 0)
    L = Nq - blind  # queries blind.. pair one-to-one with keys k0..
    if L > 0:
        fq = phi_q[:, :, :, blind:]
        out, T = causal_chunks(fq, phi_k[:, :, k0:], v1[:, :, k0:], chunk_size)
        if T0 is not None:
            out = out + state_times(fq, T0)
            T = T0 + T
        out = _safe_ratio(out[..., :Dv], out[..., Dv], eps)
    else:
        T = T0 if T0 is not None else phi_q.new_zeros(B, Hf, 1, M, Dv + 1)
        out = phi_q.new_zeros(B, Hf, G, 0, Dv)
    if blind:
        out = torch.cat([phi_q.new_zeros(B, Hf, G, blind, Dv), out], dim=3)
    return out, T[..., :Dv], T[..., Dv]


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    feature_map: str,
    weight: Optional[Tensor],
    causal: bool,
    scale: float,
    eps: float,
    key_mask: Optional[Tensor],
    chunk_size: int,
    state: Optional[State] = None,
) -> tuple[Tensor, Optional[State]]:
    """Shared body of the op and the state path; returns out [B, H, Nq, Dv] and the new state (if asked)."""
    _check_inputs(q, k, v, key_mask, scale, eps, chunk_size)
    cls = feature_map_class(feature_map)
    cdt = compute_dtype(q.dtype)
    B, H, Nq, _ = q.shape
    weight = None if weight is None else weight.to(device=q.device, dtype=cdt)
    if state is None and causal and Nq == k.shape[2] and cls is not FavorFeatureMap:
        # A prefill: block by block from the raw inputs (FAVOR+ keeps the whole-sequence path: its
        # key stabiliser is one max over all keys).
        check_weight(feature_map, weight, q.shape[-1])
        out = causal_linear_blocks(q, k, v, lambda x: cls.features(x, scale, weight), per_head=cls.per_head,
                                   eps=eps, chunk_size=chunk_size, block_size=BLOCK_CHUNKS * chunk_size, cdt=cdt,
                                   keep_BN=key_mask)
        return out, None
    phi_q, phi_k, log_scale_k = query_key_features(feature_map, q.to(cdt), k.to(cdt), scale, weight, key_mask)
    phi_q, v_f, G = grouped_heads(phi_q, phi_k, v.to(cdt))
    Hf, M, Dv = phi_k.shape[1], phi_k.shape[-1], v.shape[-1]
    S0 = z0 = None
    if state is not None:
        S0, z0 = _state_in(state, B, H, Hf, M, Dv, cdt)
        if log_scale_k is not None:
            # The state is kept in true feature units; rescale it and the new keys to one shared
            # constant that covers both, so neither overflows and the constant still cancels.
            # (clamped: an all-zero start state must not put log(0) and a NaN gradient in the graph)
            log_state = torch.log(z0.amax(dim=(2, 3), keepdim=True).clamp_min(torch.finfo(cdt).tiny))
            shared = torch.maximum(log_scale_k, log_state)
            phi_k = phi_k * torch.exp(log_scale_k - shared)
            S0 = S0 * torch.exp(-shared)[..., None]
            z0 = z0 * torch.exp(-shared)
            log_scale_k = shared
    out, S, z = _linear_core(phi_q, phi_k, v_f, causal=causal, eps=eps, chunk_size=chunk_size, S0=S0, z0=z0)
    out = out.reshape(B, H, Nq, Dv).to(q.dtype)
    if state is None:
        return out, None
    if log_scale_k is not None:
        S = S * torch.exp(log_scale_k)[..., None]
        z = z * torch.exp(log_scale_k)
    return out, (S.expand(B, Hf, G, M, Dv).reshape(B, H, M, Dv), z.expand(B, Hf, G, M).reshape(B, H, M))


def _state_in(state: State, B: int, H: int, Hf: int, M: int, Dv: int, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Check a carried (S [B, H, M, Dv], z [B, H, M]) and view it per kv head as [B, Hf, G, ...]."""
    if not (isinstance(state, (tuple, list)) and len(state) == 2 and all(isinstance(t, Tensor) for t in state)):
        raise TypeError(
            "state must be a pair of tensors (S [B, H, M, Dv], z [B, H, M]) as returned by linear_attention"
        )
    S, z = state
    if tuple(S.shape) != (B, H, M, Dv) or tuple(z.shape) != (B, H, M):
        raise ValueError(
            f"state shapes S {tuple(S.shape)}, z {tuple(z.shape)} do not fit this call; expected "
            f"S [{B}, {H}, {M}, {Dv}] and z [{B}, {H}, {M}] (same feature map, heads and value dim)"
        )
    G = H // Hf
    return S.to(cdt).reshape(B, Hf, G, M, Dv), z.to(cdt).reshape(B, Hf, G, M)


# ---------------------------------------------------------------------------------------------
# torch.library op
# ---------------------------------------------------------------------------------------------


def _check_op_inputs(q, k, v, feature_map, scale, eps, key_mask, chunk_size, **_) -> None:
    _check_inputs(q, k, v, key_mask, scale, eps, chunk_size)
    feature_map_class(feature_map)


# `attnopt::linear_attention`, the op behind `linear_attention` (no state): `weight` is FAVOR+ ω [D, M],
# hedgehog W [H, D, P], else None. Out [B, H, Nq, Dv] is laid out in memory as [B, Nq, H, Dv].
# Gradients reach q, k, v and the feature map's weight.
linear_attention_op = prefill_op("attnopt::linear_attention", _forward, differentiable=(0, 1, 2, 4),
                                 check=_check_op_inputs, heads_inner=True)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap] = "elu",
    causal: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    key_mask: Optional[Tensor] = None,
    state: Optional[State] = None,
    chunk_size: Optional[int] = None,
) -> Union[Tensor, tuple[Tensor, State]]:
    """Linear attention in SDPA layout; returns out [B, H, Nq, Dv], or (out, new_state) when `state` is given.

    `feature_map`: a name (elu, relu, favor, hedgehog, taylor; built with defaults: favor seed 0,
    M = 2·D, hedgehog identity init) or a module from `make_feature_map` (use a module to keep ω/W
    fixed or learnable). `scale` defaults to 1/√D. `key_mask` bool [B, Nk], True = keep. `state`
    (S [B, H, M, Dv], z [B, H, M]) summarises earlier tokens placed before all of this call's keys
    (start a sequence with zeros); it comes back in the compute dtype (fp32 for fp16/bf16 inputs), and
    for FAVOR+ in true, unstabilised feature units (the per-call key stabiliser is folded in and out,
    so ε acts in per-call units: split and whole runs agree exactly only at ε = 0). The stateless
    call is one `attnopt::linear_attention` node; the state path is plain PyTorch. Under
    torch.export pass favor/hedgehog as a module: a name rebuilds ω/W inside the traced call.
    `chunk_size` C of the causal scan: None picks `default_chunk` for the map's feature count.

    Cost per (B, H): time O((Nq + Nk)·M·Dv + N·cost(φ)), plus O(Nq·C·(M + Dv)) when causal;
    memory O((Nq + Nk)·M + M·Dv), plus O(N·(C + M·Dv/C)) when causal. M: elu/relu D, favor 2·D by
    default, hedgehog 2·D by default, taylor 1 + D + D².
    """
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor [B, H, Nq, D], got {getattr(q, 'shape', type(q).__name__)}")
    fmap = resolve_feature_map(feature_map, q.shape[-1], q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    weight = fmap.op_weight()
    if chunk_size is None:
        chunk_size = default_chunk(fmap.num_features(q.shape[-1]))
    tk = cuda_kernels(q, __package__) if state is None else None
    if tk is not None and tk.unsupported(q, feature_map=fmap, k=k) is None:
        return tk.linear_attention(q, k, v, feature_map=fmap, causal=bool(causal), scale=scale, eps=float(eps),
                                   key_mask=key_mask)
    if state is None:
        return torch.ops.attnopt.linear_attention(
            q, k, v, fmap.name, weight, bool(causal), scale, float(eps), key_mask, int(chunk_size)
        )
    if q.shape[2] == 1 and k.shape[2] == 1 and fmap.name != "favor":
        return _one_token(q, k, v, fmap.name, weight, scale, float(eps), key_mask, state)
    return _forward(q, k, v, fmap.name, weight, bool(causal), scale, float(eps), key_mask, int(chunk_size), state)


def _one_token(q, k, v, feature_map, weight, scale, eps, key_mask, state) -> tuple[Tensor, State]:
    """One decoding step from a carried state, O(M·Dv) per head with no chunk machinery: the same
    sums as `_forward` (FAVOR+ keeps the general path, whose stabiliser is folded in and out)."""
    _check_inputs(q, k, v, key_mask, scale, eps, 1)
    cdt = compute_dtype(q.dtype)
    B, H = q.shape[0], q.shape[1]
    weight = None if weight is None else weight.to(device=q.device, dtype=cdt)
    phi_q, phi_k, _ = query_key_features(feature_map, q.to(cdt), k.to(cdt), scale, weight, key_mask)
    M, Dv = phi_k.shape[-1], v.shape[-1]
    S, z = _state_in(state, B, H, phi_k.shape[1], M, Dv, cdt)  # [B, Hf, G, M, Dv], [B, Hf, G, M]
    G = H // phi_k.shape[1]
    v_f = v.to(cdt) if v.shape[1] == phi_k.shape[1] else v.to(cdt).repeat_interleave(phi_k.shape[1] // v.shape[1], 1)
    phi_k1 = phi_k[:, :, None, 0]  # [B, Hf, 1, M]
    S = S + phi_k1[..., None] * v_f[:, :, None, 0, None, :]
    z = z + phi_k1
    phi_q1 = phi_q.reshape(B, phi_k.shape[1], G, M)
    num = (phi_q1[..., None] * S).sum(-2)  # [B, Hf, G, Dv]
    out = _safe_ratio(num, (phi_q1 * z).sum(-1), eps).reshape(B, H, 1, Dv).to(q.dtype)
    return out, (S.reshape(B, H, M, Dv), z.reshape(B, H, M))


def linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap] = "elu",
    causal: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """The explicit quadratic formula: A = φ(q)φ(k)ᵀ [B, H, Nq, Nk], causal-masked (bottom-right),
    out = A v / (rowsum(A) + eps). Same φ (and FAVOR+ stabilisers) as `linear_attention`; the
    oracle for tests and verification. Cost O(Nq·Nk·(M + Dv)) time, O(Nq·Nk) memory per (B, H).
    """
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor [B, H, Nq, D], got {getattr(q, 'shape', type(q).__name__)}")
    fmap = resolve_feature_map(feature_map, q.shape[-1], q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    _check_inputs(q, k, v, key_mask, scale, eps, 1)
    cdt = compute_dtype(q.dtype)
    weight = fmap.op_weight()
    weight = None if weight is None else weight.to(device=q.device, dtype=cdt)
    phi_q, phi_k, _ = query_key_features(fmap.name, q.to(cdt), k.to(cdt), scale, weight, key_mask)
    H, Nq, Nk = q.shape[1], q.shape[2], k.shape[2]
    phi_k = phi_k.repeat_interleave(H // phi_k.shape[1], dim=1)
    v_h = v.to(cdt).repeat_interleave(H // v.shape[1], dim=1)
    scores = phi_q @ phi_k.transpose(-1, -2)  # [B, H, Nq, Nk]
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        scores = scores * (j <= Nk - Nq + i).to(cdt)
    return _safe_ratio(scores @ v_h, scores.sum(-1), eps).to(q.dtype)
