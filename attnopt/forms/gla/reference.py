"""Gated linear attention (GLA / data-dependent decay), chunked-parallel, causal.

The recurrence, per key/value head, with a log-gate g_t <= 0 per feature channel (or per head):

    S_t = diag(exp g_t) S_{t-1} + φ(k_t) v_tᵀ                 state  [M, Dv]
    o_t = s · φ(q_t)ᵀ S_t                                      normalize=False (s = scale)
    z_t = exp(g_t) ⊙ z_{t-1} + φ(k_t);  o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps)      normalize=True

g is [B, Hkv, N, M] (one gate per feature channel, GLA) or [B, Hkv, N] (one per head, a
data-dependent RetNet / Mamba-2 style decay). `scale` s defaults to 1/sqrt(D) and is not applied
when normalize=True (the ratio makes it redundant), as in `decay_attention`.
Feature maps φ (the names of `attnopt.forms.ssm.schedule.DECAY_FEATURE_MAPS`): "identity", "elu"
(ELU + 1), "relu"; M = D for all three. A caller with another map (the `gla` form's hedgehog)
featurises q and k itself and passes feature_map="identity": M is then the width of what it passes.

Chunk algorithm. When no chunk spans more than FACTOR_RANGE (60) of decay -- every practical gate:
that is a mean decay of e^(−60/C) per step and chunk -- the in-chunk weights exp(b_i − b_j) are
formed as exp(b_i)·exp(−b_j) (b the in-chunk cumsum), both within e^(±60), so the chunk is two
matmuls for any gate kind (`_gla_chunks_factored`); products carry no cancellation, so this is as
accurate as the exact form. Stronger gates first try chunks of C/2, C/4, ... down to 16
(`factored_chunk`). Otherwise (very strong gates), the exact two-level form below, in which every
exponent is a sum of log-gates over a causal range, so every factor is exp(<= 0) and strong gates
underflow to 0 instead of overflowing:

* chunks of C = chunk_size positions. Each chunk's keys become one state [M, Dv'] at its end (the
  normaliser z folded in as an extra value column); the states entering the chunks follow from
  S_{c+1} = diag(exp a_c) S_c + U_c, one fused multiply-add per chunk (`_scan_chunks`, shared by
  both paths);
* inside a chunk, sub-chunks of c positions (c = 16 for per-head gates, 8 per channel; the chunk
  is zero-padded to a multiple of c, and a padded position has g = 0 and φ(k) = 0, so it changes
  nothing). The state entering every sub-chunk comes from per-sub-chunk key states by a C/c-step
  scan vectorised over all chunks; a query i reads (φq_i ⊙ exp l_i) · S_entry (l the in-sub-chunk
  inclusive cumsum of g) plus its own sub-chunk exactly: Σ_m φq_im φk_jm exp(l_im − l_jm), j <= i
  (a scalar c×c decay matrix for per-head gates, a [c, c, M] block per channel), masked to -inf
  before the exp. No factorisation exp(l_i)·exp(−l_j), which overflows for strong gates.
  Ranges longer than a sub-chunk are summed by masked cumsums (the Mamba-2 "segsum") or reversed
  cumsums, never as differences of a long prefix sum, so long decayed spans cost no precision.

Memory O(N·(c·M + G·c + M·Dv/c)) per kv head: never N×N, no state per position.

Masks and padding: `key_mask` [B, Nk] (True = keep). A masked key leaves the state unchanged: its
φ(k) and its gate are both zeroed (no addition, no decay), so a left-padded row equals the row
alone. Alignment: Nq <= Nk; the queries are the last Nq positions (query i at Nk - Nq + i).
GQA: query head h reads kv head h // (H // Hkv); k, v, g and the state stay per kv head (K/V are
never repeated; the G query heads of a kv head share each product with its keys and states).

dtypes: fp16/bf16 inputs compute in fp32 and states are fp32; fp32/fp64 keep their own precision.
Output in q's dtype.

The stateless prefill is the custom op `torch.ops.attnopt.gated_linear_attention` (one node under
torch.export; fake and recompute-autograd registered; gradients for q, k, v and g). Stateful use
(`state=`, `gated_linear_attention_step`) is plain differentiable PyTorch, as for decay_attention.
On CUDA, a stateless call that needs no gradient runs the Triton forward kernel instead
(`attnopt.forms.gla.triton`, when Triton imports and its `unsupported` returns None).

The range-sum helpers (`segsum`, `rev_cumsum_exclusive`) and `check_log_gate` are public: the delta form's op uses them too.

Letters: B batch, H query heads, Hkv key/value heads, G = H // Hkv, N length, D head dim of q/k,
M feature width of φ, Mg gate width (M or 1), Dv head dim of v, C chunk, c sub-chunk, nc chunks,
ns sub-chunks per chunk, X = B·Hkv.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.common.plain_autograd import wants_plain_autograd
from attnopt.forms.ssm.schedule import DECAY_FEATURE_MAPS
from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.feature_maps import feature_map_class
from attnopt.kernels.layout import check_causal_inputs, check_scan_options, compute_dtype, ratio_or_zero, values_known
from attnopt.kernels.normaliser import check_state, normalised_out, start_state, with_ones
from attnopt.kernels.registration import prefill_op

__all__ = [
    "gated_linear_attention",
    "gated_linear_attention_step",
    "init_gated_linear_state",
    "GATED_LINEAR_FEATURE_MAPS",
    "check_log_gate",
    "segsum",
    "rev_cumsum_exclusive",
    "pad_positions",
    "factored_chunk",
]

GATED_LINEAR_FEATURE_MAPS = DECAY_FEATURE_MAPS  # the same vocabulary, not a second list
SUB_CHUNK = {"head": 16, "channel": 8}  # c: sub-chunk width by gate kind (the exact in-sub-chunk blocks)

GatedLinearState = tuple  # (S [B, Hkv, M, Dv], z [B, Hkv, M] or None)

_WHO = "gated_linear_attention"


# ---- small helpers ----


def _feature(x: Tensor, feature_map: str) -> Tensor:
    """φ(x); "elu"/"relu" are attnopt.kernels.feature_maps' own definitions."""
    if feature_map == "identity":
        return x
    return feature_map_class(feature_map).features(x, 1.0, None)


def segsum(x: Tensor) -> Tensor:
    """x [..., T, W] -> [..., T(i), T(j), W]: Σ_{j<s<=i} x_s for j <= i (0 on the diagonal), -inf above.

    A masked cumsum down each column, not a difference of prefix sums: exact to the rounding of the
    range itself however large the prefix grows."""
    T = x.shape[-2]
    idx = torch.arange(T, device=x.device)
    strict = (idx[:, None] > idx[None, :])[:, :, None]  # [T, T, 1]: s = i-th row counts for j < i
    rep = x[..., :, None, :].expand(*x.shape[:-2], T, T, x.shape[-1])
    seg = torch.cumsum(rep.masked_fill(~strict, 0.0), dim=-3)
    return seg.masked_fill(~(idx[:, None] >= idx[None, :])[:, :, None], float("-inf"))


def _tril(n: int, device) -> Tensor:
    idx = torch.arange(n, device=device)
    return idx[:, None] >= idx[None, :]


def pad_positions(t: Tensor, before: int, after: int) -> Tensor:
    """Zero-pad dim -2 (positions) of t; t itself when nothing is added (F.pad would copy it)."""
    return t if before == 0 and after == 0 else F.pad(t, (0, 0, before, after))


def rev_cumsum_exclusive(x: Tensor, dim: int) -> Tensor:
    """Σ_{s>j} x_s along `dim` (0 at the last position), summed from the end (no subtraction)."""
    shifted = torch.cat([x.narrow(dim, 1, x.shape[dim] - 1), torch.zeros_like(x.narrow(dim, 0, 1))], dim=dim)
    return shifted.flip(dim).cumsum(dim).flip(dim)


# ---- checks ----


def _check_options(feature_map, normalize, scale, eps, chunk_size, who=_WHO) -> None:
    if not isinstance(feature_map, str) or feature_map not in GATED_LINEAR_FEATURE_MAPS:
        raise ValueError(f"{who}: unknown feature_map {feature_map!r}; allowed: {', '.join(GATED_LINEAR_FEATURE_MAPS)}")
    check_scan_options(who, scale, chunk_size, normalize=normalize, eps=eps)


def _check_inputs(q, k, v, g, key_mask, who=_WHO) -> None:
    check_causal_inputs(who, "gated attention", q, k, v, key_mask)
    B, Hkv, Nk, D = k.shape
    check_log_gate(who, g, B, Hkv, Nk, D, per_channel_ok=True)


def check_log_gate(who: str, g, B: int, Hkv: int, N: int, M: Optional[int], per_channel_ok: bool) -> None:
    """g must be a float tensor [B, Hkv, N] (per head) or, when per_channel_ok, [B, Hkv, N, M],
    finite and <= 0. The value check is one reduction, skipped while tracing (`values_known`)."""
    shapes = f"[B, Hkv, N] = {[B, Hkv, N]}" + (f" or [B, Hkv, N, M] = {[B, Hkv, N, M]}" if per_channel_ok else "")
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{who}: g (log-gates) must be a tensor of shape {shapes}, got {type(g).__name__}")
    if not g.is_floating_point():
        raise TypeError(f"{who}: g (log-gates) must be floating point, got {g.dtype}")
    ok = tuple(g.shape) == (B, Hkv, N) or (per_channel_ok and tuple(g.shape) == (B, Hkv, N, M))
    if not ok:
        raise ValueError(f"{who}: g (log-gates) must have shape {shapes}, got {list(g.shape)}")
    if values_known(g) and not bool(((g <= 0) & torch.isfinite(g)).all()):
        bad = g[~((g <= 0) & torch.isfinite(g))].flatten()[0].item()
        raise ValueError(
            f"{who}: g holds log-gates and must be finite and <= 0 (got {bad}); pass e.g. F.logsigmoid(x), not the gate itself"
        )


# ---- the chunked core ----


def _scan_chunks(U: Tensor, log_decay: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """States entering each chunk of S_{c+1} = diag(exp a_c) S_c + U_c, S_0 = S0.

    U [X, nc, M, W] (chunk c's keys as a state at its end), a = log_decay [X, nc, Mg] (the chunk's
    summed log-gates, Mg = M or 1), S0 [X, M, W]. One fused multiply-add per chunk, the recurrence
    itself: every factor is exp(<= 0), exact for any gate strength, and on CPU far cheaper than a
    masked decay matmul over groups of chunks (per channel that was [n, n] per feature, 40% of the op).
    Returns (S_before [X, nc, M, W], S_end)."""
    nc = U.shape[1]
    decay = torch.exp(log_decay)[..., None]  # [X, nc, Mg, 1]
    S = S0
    befores = []
    for c in range(nc):
        befores.append(S)
        S = torch.addcmul(U[:, c], decay[:, c], S)
    return torch.stack(befores, dim=1), S


def _gla_chunks(fq: Tensor, fk: Tensor, v: Tensor, g: Tensor, T0: Tensor, C: int) -> tuple[Tensor, Tensor]:
    """fq [X, G, L, M], fk [X, L, M], v [X, L, W], g [X, L, Mg] (L a multiple of C), T0 [X, M, W].

    Returns (out [X, G, L, W], state after position L-1 [X, M, W])."""
    X, G, L, M = fq.shape
    W, Mg = v.shape[-1], g.shape[-1]
    nc = L // C
    c = min(SUB_CHUNK["head" if Mg == 1 else "channel"], C)
    Cp = -(-C // c) * c
    ns = Cp // c

    def kv_blocks(t):  # [X, L, w] -> [X, nc, ns, c, w]
        t = t.reshape(X, nc, C, t.shape[-1])
        if Cp > C:
            t = F.pad(t, (0, 0, 0, Cp - C))
        return t.reshape(X, nc, ns, c, t.shape[-1])

    q6 = fq.reshape(X, G, nc, C, M)
    if Cp > C:
        q6 = F.pad(q6, (0, 0, 0, Cp - C))
    q6 = q6.reshape(X, G, nc, ns, c, M).permute(0, 2, 3, 1, 4, 5).contiguous()  # [X, nc, ns, G, c, M]
    k5, v5, g5 = kv_blocks(fk), kv_blocks(v), kv_blocks(g)

    local = torch.cumsum(g5, dim=-2)  # Σ_{start(sub) <= s <= i} g_s          [X, nc, ns, c, Mg]
    to_end = rev_cumsum_exclusive(g5, dim=-2)  # Σ_{i < s <= end(sub)} g_s        [X, nc, ns, c, Mg]
    sub_total = local[..., -1, :]  # [X, nc, ns, Mg]

    # Each sub-chunk's keys as a state at its own end, then the states entering each sub-chunk
    # from this chunk's earlier sub-chunks (a short scan, vectorised over all chunks).
    U = (k5 * torch.exp(to_end)).transpose(-1, -2) @ v5  # [X, nc, ns, M, W]
    decay_sub = torch.exp(sub_total)[..., None]  # [X, nc, ns, Mg, 1]
    inner = [torch.zeros_like(U[:, :, 0])]
    for s in range(ns):
        inner.append(decay_sub[:, :, s] * inner[-1] + U[:, :, s])
    chunk_U = inner[-1]  # this chunk's keys as a state at its end   [X, nc, M, W]
    inner = torch.stack(inner[:ns], dim=2)  # [X, nc, ns, M, W]

    # Across chunks: the recurrence over chunk states, one fused multiply-add per chunk.
    S_before, S = _scan_chunks(chunk_U, sub_total.sum(2), T0)  # [X, nc, M, W], [X, M, W]

    # A query reads the state entering its sub-chunk: the chunk's entry state decayed to the query
    # (exp of the in-chunk inclusive sum: earlier sub-chunks' totals + the local cumsum) plus this
    # chunk's earlier sub-chunks (the inner scan, decayed by the local cumsum). Two products; the
    # per-sub-chunk states S_before + inner are never formed.
    into_sub = torch.cumsum(F.pad(sub_total[:, :, :-1], (0, 0, 1, 0)), dim=2)  # Σ over earlier sub-chunks
    q_in = q6 * torch.exp(local)[:, :, :, None]  # [X, nc, ns, G, c, M]
    q_chunk = q6 * torch.exp(local + into_sub[:, :, :, None])[:, :, :, None]
    out = q_in.reshape(X, nc, ns, G * c, M) @ inner  # [X, nc, ns, G·c, W]
    out = out + (q_chunk.reshape(X, nc, ns * G * c, M) @ S_before).view(X, nc, ns, G * c, W)

    # Own sub-chunk, j <= i: Σ_m φq_im φk_jm exp(Σ_{j<s<=i} g_sm).
    if Mg == 1:  # one gate per head: a scalar c×c decay matrix
        A = (q6.reshape(X, nc, ns, G * c, M) @ k5.transpose(-1, -2)).view(X, nc, ns, G, c, c)
        A = A * torch.exp(segsum(g5)[..., 0])[:, :, :, None]
    else:  # per channel: the [c, c, M] decays, from in-sub-chunk cumsums (at most c terms each)
        expo = (local[..., :, None, :] - local[..., None, :, :]).masked_fill(~_tril(c, g.device)[:, :, None], float("-inf"))
        kd = k5[..., None, :, :] * torch.exp(expo)  # [X, nc, ns, c(i), c(j), M]
        A = torch.einsum("xnsgim,xnsijm->xnsgij", q6, kd)
    out = out + A.reshape(X, nc, ns, G * c, c) @ v5
    out = out.view(X, nc, ns, G, c, W).permute(0, 3, 1, 2, 4, 5).reshape(X, G, nc, Cp, W)[:, :, :, :C]
    return out.reshape(X, G, L, W), S


# Largest in-chunk decay range |Σ g| the factorised chunk path takes: exp(±60) stays far inside
# fp32's range (1e±38 is reached at 88), so both factors and their products are finite.
FACTOR_RANGE = 60.0


def factorable(g: Tensor, C: int) -> bool:
    """Whether every chunk of C positions of the log-gates g [X, L, Mg] (L a multiple of C) spans at
    most FACTOR_RANGE of decay, so exp(b_i − b_j) may be formed as exp(b_i)·exp(−b_j). A traced g
    (fake tensors under torch.export / AOT, torch.compile) has no values to look at: it takes the
    exact form, which is right for every gate."""
    if not values_known(g):
        return False
    X, L, Mg = g.shape
    return bool((g.reshape(X, L // C, C, Mg).sum(2) >= -FACTOR_RANGE).all())


# The shortest chunk `factored_chunk` halves down to: below it the per-chunk loop of `_scan_chunks`
# costs more than the exact blocks save. With the forms' gates (g >= −3.75, form.GATE_PRE_LIMIT) a
# chunk of 16 always spans at most 60.
MIN_FACTOR_CHUNK = 16


def factored_chunk(g: Tensor, C: int) -> Optional[int]:
    """The longest chunk among C, C/2, C/4, ... (>= MIN_FACTOR_CHUNK, dividing C) at which the log-gates
    g [X, L, Mg] (L a multiple of C) pass `factorable`, or None (then the exact blocks at C). Strong
    gates, as a fit at a short look-back makes them, then still take the two-matmul chunks."""
    c = C
    while True:
        if factorable(g, c):
            return c
        if c % 2 or c // 2 < MIN_FACTOR_CHUNK:
            return None
        c //= 2


def _gla_chunks_factored(fq: Tensor, fk: Tensor, v: Tensor, g: Tensor, T0: Tensor, C: int) -> tuple[Tensor, Tensor]:
    """`_gla_chunks` for gates whose in-chunk range passes `factorable`: with b the in-chunk inclusive
    cumsum, A_ij = Σ_m (φq_im e^{b_im})(φk_jm e^{−b_jm}) for j <= i is one C×C matmul per chunk (every
    factor within e^{±60}, each product exact to rounding: no difference of large terms is formed).
    Same arguments and result; per channel or per head alike."""
    X, G, L, M = fq.shape
    W, nc = v.shape[-1], L // C
    q5 = fq.reshape(X, G, nc, C, M).transpose(1, 2)  # [X, nc, G, C, M]
    k4, v4, g4 = fk.reshape(X, nc, C, M), v.reshape(X, nc, C, W), g.reshape(X, nc, C, -1)
    b = torch.cumsum(g4, dim=2)  # [X, nc, C, Mg]
    total = b[:, :, -1]  # [X, nc, Mg]
    e = torch.exp(b)
    q_in = (q5 * e[:, :, None]).reshape(X, nc, G * C, M)  # decayed from the chunk start to the query
    # A product with exp(−b), not a division by exp(b): the division's gradient divides by exp(b)²,
    # which underflows to 0 in fp32 once b < −52 (inside FACTOR_RANGE) and made the gate fit NaN.
    k_in = k4 * torch.exp(-b)
    A = (q_in @ k_in.transpose(-1, -2)).masked_fill_(~_tril(C, fq.device).repeat(G, 1), 0.0)  # [X, nc, G·C, C]
    # chunk keys as a state at its end [X, nc, M, W]: rows scaled by exp(total) after the product
    U = (k_in.transpose(-1, -2) @ v4).mul_(torch.exp(total)[..., None])
    S_before, S = _scan_chunks(U, total, T0)
    out = (A @ v4).add_(q_in @ S_before)
    return out.view(X, nc, G, C, W).transpose(1, 2).reshape(X, G, L, W), S


def _gla_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, key_mask: Optional[Tensor], feature_map: str,
                 normalize: bool, scale: float, eps: float, chunk_size: int, S0: Optional[Tensor] = None,
                 z0: Optional[Tensor] = None):
    """Chunked prefill, differentiable plain PyTorch. Returns (out, S, z-or-None)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    out_dtype = q.dtype
    cdt = compute_dtype(out_dtype)

    fq = _feature(q.to(cdt), feature_map)
    if not normalize:
        fq = fq * scale
    fk = _feature(k.to(cdt), feature_map)
    vv = v.to(cdt)
    gg = (g if g.dim() == 4 else g[..., None]).to(cdt)
    M, Mg = fk.shape[-1], gg.shape[-1]
    if key_mask is not None:  # a masked key neither adds nor decays: the state passes it unchanged
        keep = key_mask[:, None, :, None]
        fk = torch.where(keep, fk, torch.zeros_like(fk))
        vv = torch.where(keep, vv, torch.zeros_like(vv))
        gg = torch.where(keep, gg, torch.zeros_like(gg))
    vv = with_ones(vv, normalize)  # z travels as an extra value column
    W = vv.shape[-1]
    T0 = start_state(S0, z0, (B, Hkv, M, Dv), fk, normalize)
    if Nk == 0:
        out = fq.new_zeros(B, H, 0, Dv)
        T = T0
    else:
        C = max(1, min(chunk_size, Nk))
        L = -(-Nk // C) * C
        # Queries are the last Nq positions; positions past Nk are zero keys with zero gates.
        fq = pad_positions(fq, Nk - Nq, L - Nk)
        fk, vv, gg = (pad_positions(t, 0, L - Nk) for t in (fk, vv, gg))
        g3 = gg.reshape(B * Hkv, L, Mg)
        Cf = factored_chunk(g3, C)
        chunks = _gla_chunks_factored if Cf is not None else _gla_chunks
        out, T = chunks(
            fq.reshape(B * Hkv, G, L, M), fk.reshape(B * Hkv, L, M), vv.reshape(B * Hkv, L, W),
            g3, T0.reshape(B * Hkv, M, W), Cf or C,
        )
        out = out.reshape(B, H, L, W)[:, :, Nk - Nq : Nk]
        T = T.reshape(B, Hkv, M, W)
    out, S, z = normalised_out(out, T, Dv, normalize, eps)
    return out.to(out_dtype), S, z


# The stateless prefill as one opaque node; gradients reach q, k, v and the gates (the mask and
# options are constants).
prefill_op("attnopt::gated_linear_attention", _gla_forward, differentiable=(0, 1, 2, 3))


# ---- public API ----


def init_gated_linear_state(
    B: int, Hkv: int, M: int, Dv: int, *, normalize: bool = False, dtype: torch.dtype = torch.float32, device=None
) -> GatedLinearState:
    """Zero state (S [B, Hkv, M, Dv], z [B, Hkv, M] when normalize else None) = no earlier tokens,
    in the compute dtype of `dtype` (fp32 for fp16/bf16)."""
    cdt = compute_dtype(dtype)
    S = torch.zeros(B, Hkv, M, Dv, dtype=cdt, device=device)
    return S, (torch.zeros(B, Hkv, M, dtype=cdt, device=device) if normalize else None)


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
    state: Optional[GatedLinearState] = None,
    chunk_size: int = 64,
):
    """Causal gated linear attention over q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]
    with log-gates g <= 0 of shape [B, Hkv, Nk, M] (per feature channel) or [B, Hkv, Nk] (per head).

    S_t = diag(exp g_t) S_{t-1} + φ(k_t)v_tᵀ; o_t = s·φ(q_t)ᵀS_t (s = scale, default 1/sqrt(D)), or
    with normalize=True o_t = φ(q_t)ᵀS_t / (φ(q_t)ᵀz_t + eps), z_t = exp(g_t) ⊙ z_{t-1} + φ(k_t)
    (no scale). key_mask [B, Nk] (True = keep): a masked key leaves the state unchanged.
    Returns [B, H, Nq, Dv] in q's dtype; with `state` (S [B, Hkv, M, Dv], z-or-None) it continues
    from it and returns (out, new_state). Stateless calls run as `torch.ops.attnopt.gated_linear_attention`.
    """
    _check_inputs(q, k, v, g, key_mask)
    _check_options(feature_map, normalize, scale, eps, chunk_size)
    B, H, _, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    tk = None if state is not None else cuda_kernels(q, __package__)
    if tk is not None and tk.unsupported(q, k=k, v=v, g=g, feature_map=feature_map) is None:
        return tk.gated_linear_attention(q, k, v, g, feature_map=feature_map, normalize=normalize, scale=s,
                                         eps=float(eps), key_mask=key_mask)
    if state is None and wants_plain_autograd(q, k, v, g):  # a compile-time fit: no recompute in the backward
        return _gla_forward(q, k, v, g, key_mask, feature_map, normalize, s, float(eps), chunk_size)[0]
    if state is None:
        return torch.ops.attnopt.gated_linear_attention(q, k, v, g, key_mask, feature_map, normalize, s, float(eps), chunk_size)
    sizes = {"B": B, "Hkv": Hkv, "M": D, "Dv": Dv}
    S0, z0 = check_state(_WHO, state, sizes, normalize, "init_gated_linear_state")
    out, S, z = _gla_forward(q, k, v, g, key_mask, feature_map, normalize, s, float(eps), chunk_size, S0, z0)
    return out, (S, z)


def gated_linear_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    state: Optional[GatedLinearState],
    *,
    feature_map: str = "identity",
    normalize: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    key_mask: Optional[Tensor] = None,
):
    """One decoding step: q [B, H, 1, D], k [B, Hkv, 1, D], v [B, Hkv, 1, Dv], g [B, Hkv, 1, M] or
    [B, Hkv, 1]; state None means zeros. key_mask [B, 1] (False: the state is left unchanged).
    Returns (o [B, H, 1, Dv], (S, z-or-None)): the same maths as `gated_linear_attention`."""
    who = "gated_linear_attention_step"
    _check_inputs(q, k, v, g, key_mask, who)
    if q.shape[2] != 1 or k.shape[2] != 1:
        raise ValueError(f"{who}: expects one token (N = 1); got q N={q.shape[2]}, k N={k.shape[2]}. Use gated_linear_attention for prefill")
    _check_options(feature_map, normalize, scale, eps, None, who)
    B, H, _, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    G = H // Hkv
    cdt = compute_dtype(q.dtype)
    if state is None:
        state = init_gated_linear_state(B, Hkv, D, Dv, normalize=normalize, dtype=q.dtype, device=q.device)
    S, z = check_state(who, state, {"B": B, "Hkv": Hkv, "M": D, "Dv": Dv}, normalize, "init_gated_linear_state")
    fq = _feature(q.to(cdt), feature_map).reshape(B, Hkv, G, D)
    fk = _feature(k.to(cdt), feature_map)[:, :, 0]  # [B, Hkv, M]
    vv = v.to(cdt)[:, :, 0]
    gate = torch.exp((g if g.dim() == 4 else g[..., None]).to(cdt)[:, :, 0])  # [B, Hkv, M or 1]
    if key_mask is not None:
        keep = key_mask[:, :, None].to(cdt)  # [B, 1, 1]
        gate = gate * keep + (1 - keep)
        fk = fk * keep
    S = gate[..., None] * S.to(cdt) + fk[..., :, None] * vv[..., None, :]
    num = fq @ S  # [B, Hkv, G, Dv]
    if normalize:
        z = gate * z.to(cdt) + fk
        out = ratio_or_zero(num, (fq * z[:, :, None]).sum(-1, keepdim=True), eps)
    else:
        out = (1.0 / math.sqrt(D) if scale is None else float(scale)) * num
    return out.reshape(B, H, 1, Dv).to(q.dtype), (S, z)
