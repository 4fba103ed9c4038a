"""Decayed linear attention (RetNet retention / a diagonal SSM), chunked-parallel, causal.

The recurrence, per query head h with decay γ_h in (0, 1]:

    S_t = γ_h S_{t-1} + φ(k_t) v_tᵀ                      state  [Dk, Dv]
    o_t = s · φ(q_t)ᵀ S_t                                 normalize=False (s = scale)
    z_t = γ_h z_{t-1} + φ(k_t);  o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + eps)     normalize=True

i.e. o_t = s Σ_{j<=t} γ^(t-j) (φ(q_t)·φ(k_j)) v_j: causal by construction. `scale` s defaults to
1/sqrt(D) (the softmax logit scale, so the identity map keeps q·k at the magnitude the model was
trained with); it is NOT applied when normalize=True, where the ratio makes it redundant.
Feature maps φ: "identity", "elu" (ELU(x) + 1, positive), "relu".

Prefill runs chunk-parallel: inside a chunk of C tokens the decay matrix D[i, j] = γ^(i-j) (j <= i)
is built in log space as exp((i-j)·log γ) with the upper triangle set to -inf BEFORE the exp, so
no γ^(negative) overflow meets a zero (inf·0 = NaN); across chunks a state [B, H, Dk, Dv] (+ the
normaliser folded in as an extra value column) is carried by the same trick one level up (groups
of 64 chunks, a loop over the groups). Never N×N and never a state per position (one per chunk). Every decay factor is γ to a non-negative power, so small γ
underflows to 0 instead of overflowing.

Alignment: Nq <= Nk; the queries are the last Nq positions (query i at position Nk - Nq + i).
`key_mask` [B, Nk] (True = keep) removes a key's contribution; positions still count for decay.
GQA: query head h reads kv head h // (H // Hkv); the state is per query head (γ differs per head).

Stateful use (`state=`, `decay_attention_step`) is plain PyTorch, not the custom op: the op is the
stateless prefill that graph rewrites insert; decoding loops call the functions directly.
States are kept in the compute dtype (fp32 for fp16/bf16 inputs, else the input dtype).

Letters: B batch, H query heads, Hkv key/value heads, G = H // Hkv, N length, D = Dk head dim of
q and k, Dv head dim of v, C chunk length, nc number of chunks.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.ssm.schedule import DECAY_FEATURE_MAPS, retnet_decay
from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.layout import check_causal_inputs, check_scan_options, compute_dtype, is_fake_tensor, ratio_or_zero
from attnopt.kernels.normaliser import check_state, normalised_out, start_state, with_ones
from attnopt.kernels.registration import prefill_op
from attnopt.kernels.token_step import elu_plus_one

__all__ = [
    "decay_attention",
    "decay_attention_step",
    "decay_attention_reference",
    "init_decay_state",
    "retnet_decay",
    "DECAY_FEATURE_MAPS",
]

DecayState = tuple  # (S [B, H, Dk, Dv], z [B, H, Dk] or None)

CHUNK = 64  # the scan's default chunk C


def _feature(x: Tensor, feature_map: str) -> Tensor:
    if feature_map == "identity":
        return x
    if feature_map == "elu":
        return F.elu(x) + 1.0
    if feature_map == "relu":
        return F.relu(x)
    raise ValueError(f"decay_attention: unknown feature_map {feature_map!r}; allowed: {', '.join(DECAY_FEATURE_MAPS)}")


def decay_features(feature_map: str) -> Callable[[Tensor], Tensor]:
    """φ of a decay feature-map name as one callable, resolved once (the in-place token step's)."""
    if feature_map == "elu":
        return elu_plus_one
    if feature_map in DECAY_FEATURE_MAPS:
        return functools.partial(_feature, feature_map=feature_map)
    raise ValueError(f"decay_attention: unknown feature_map {feature_map!r}; allowed: {', '.join(DECAY_FEATURE_MAPS)}")


def _decay_tensor(decay, H: int, device) -> Tensor:
    """None or "retnet" / float / H floats / tensor [H] -> float64 tensor [H], checked in (0, 1]."""
    if decay is None or (isinstance(decay, str) and decay == "retnet"):
        gamma = retnet_decay(H)
    elif isinstance(decay, bool):
        raise TypeError(f"decay_attention: decay must be a float in (0, 1] or {H} floats, got {decay!r}")
    elif isinstance(decay, (int, float)):
        _check_gamma_values([float(decay)])
        gamma = torch.full((H,), float(decay), dtype=torch.float64)
    elif isinstance(decay, Tensor):
        gamma = decay.reshape(1).expand(H) if decay.numel() == 1 else decay
        if tuple(gamma.shape) != (H,):
            raise ValueError(f"decay_attention: decay tensor must have shape [H] = [{H}], got {tuple(decay.shape)}")
        if not gamma.is_floating_point():
            gamma = gamma.to(torch.float64)
    elif isinstance(decay, Sequence) and not isinstance(decay, str):
        if len(decay) != H:
            raise ValueError(f"decay_attention: got {len(decay)} decays for H={H} query heads; give one per head or one float")
        try:
            values = [float(g) for g in decay]
        except (TypeError, ValueError) as e:
            raise TypeError(f"decay_attention: decay values must be floats, got {decay!r}") from e
        _check_gamma_values(values)
        gamma = torch.tensor(values, dtype=torch.float64)
    else:
        raise TypeError(
            f"decay_attention: decay must be None or 'retnet' (RetNet schedule), a float, {H} floats or a tensor [H]; "
            f"got {type(decay).__name__}"
        )
    if isinstance(decay, Tensor) and not is_fake_tensor(gamma):  # values of a traced tensor are unknown
        _check_gamma_values(gamma.detach().to("cpu", torch.float64).tolist())
    return gamma.to(device=device, dtype=torch.float64)


def _check_gamma_values(values: list) -> None:
    if not all(0.0 < g <= 1.0 for g in values):  # also rejects NaN
        raise ValueError(f"decay_attention: every decay γ must lie in (0, 1] (1 = no decay); got {values}")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], who: str = "decay_attention") -> None:
    check_causal_inputs(who, "decayed attention", q, k, v, key_mask)


def _check_options(feature_map, normalize, scale, eps, chunk_size, who="decay_attention") -> None:
    if not isinstance(feature_map, str) or feature_map not in DECAY_FEATURE_MAPS:
        raise ValueError(f"{who}: unknown feature_map {feature_map!r}; allowed: {', '.join(DECAY_FEATURE_MAPS)}")
    check_scan_options(who, scale, chunk_size, normalize=normalize, eps=eps)


def _expand_kv(x_BHkvND: Tensor, H: int) -> Tensor:
    """GQA: kv head h // G serves query head h; the state is per query head since γ is."""
    Hkv = x_BHkvND.shape[1]
    return x_BHkvND if Hkv == H else x_BHkvND.repeat_interleave(H // Hkv, dim=1)


def _scan_chunk_states(U: Tensor, S0: Tensor, log_step_H: Tensor, group: int = 64):
    """States before each chunk: S_before[c] = γ^C S_before[c-1] + U[c-1], S_before[0] = S0.

    The same chunked trick one level up: a group of `group` chunks is one masked decay matmul, and
    only the state between groups is carried by a Python loop (nc / group steps, not nc tiny ops).
    U [B, H, nc, Dk, Dv'], S0 [B, H, Dk, Dv'], log_step_H = C·log γ [H]. Returns (S_before, S_end).
    """
    B, H, nc, Dk, Dv = U.shape
    U_f = U.reshape(B, H, nc, Dk * Dv)
    S = S0.reshape(B, H, 1, Dk * Dv)
    lg = log_step_H.view(H, 1, 1)
    befores = []
    for a in range(0, nc, group):
        n = min(nc, a + group) - a
        idx = torch.arange(n, device=U.device)
        diff = (idx[:, None] - 1 - idx[None, :]).to(lg.dtype) * lg
        # Strictly lower triangle γ^(C(i-1-j)); the rest masked to -inf before the exp.
        M_H_n_n = torch.exp(torch.where(idx[:, None] > idx[None, :], diff, torch.full_like(diff, float("-inf"))))
        carry_H_n = torch.exp(idx.to(lg.dtype) * log_step_H[:, None])  # γ^(C i) on the carried state
        S_b = torch.matmul(M_H_n_n, U_f[:, :, a : a + n]) + carry_H_n[None, :, :, None] * S
        befores.append(S_b)
        S = torch.exp(log_step_H).view(1, H, 1, 1) * S_b[:, :, n - 1 : n] + U_f[:, :, a + n - 1 : a + n]
    S_before = torch.cat(befores, dim=2) if len(befores) > 1 else befores[0]
    return S_before.view(B, H, nc, Dk, Dv), S.view(B, H, Dk, Dv)


def _chunk_pass(q_c: Tensor, k_c: Tensor, v_c: Tensor, S0: Tensor, log_gamma_H: Tensor):
    """Chunks of equal length C: q_c/k_c [B, H, nc, C, Dk], v_c [B, H, nc, C, Dv'], S0 [B, H, Dk, Dv'].

    Returns (out [B, H, nc, C, Dv'], state after the last chunk)."""
    C = q_c.shape[3]
    nc = q_c.shape[2]
    idx = torch.arange(C, device=q_c.device)
    lg = log_gamma_H.view(-1, 1, 1)
    diff = (idx[:, None] - idx[None, :]).to(log_gamma_H.dtype)
    # Mask the upper triangle to -inf before the exp: (i-j)·log γ > 0 there and, for γ -> 0,
    # overflows to inf, which a later multiply by 0 would turn into NaN.
    expo = torch.where(idx[:, None] >= idx[None, :], diff * lg, torch.full_like(diff * lg, float("-inf")))
    decay_H_C_C = torch.exp(expo)  # γ^(i-j) for j <= i, else 0
    q_decay_H_C = torch.exp((idx + 1).to(lg.dtype) * log_gamma_H[:, None])  # γ^(i+1): from previous chunk end
    k_decay_H_C = torch.exp((C - 1 - idx).to(lg.dtype) * log_gamma_H[:, None])  # γ^(C-1-j): to this chunk end

    intra = torch.matmul(torch.matmul(q_c, k_c.transpose(-1, -2)) * decay_H_C_C[None, :, None], v_c)
    U = torch.matmul((k_c * k_decay_H_C[None, :, None, :, None]).transpose(-1, -2), v_c)  # [B,H,nc,Dk,Dv']

    S_before, S = _scan_chunk_states(U, S0, C * log_gamma_H)
    inter = torch.matmul(q_c * q_decay_H_C[None, :, None, :, None], S_before)
    return intra + inter, S


def _decay_forward(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, key_mask: Optional[Tensor], feature_map: str,
                   normalize: bool, scale: float, eps: float, chunk_size: int, S0: Optional[Tensor] = None,
                   z0: Optional[Tensor] = None):
    """Chunk-parallel prefill; differentiable plain PyTorch. Returns (out, S, z-or-None)."""
    B, H, Nq, Dk = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    out_dtype = q.dtype
    cdt = compute_dtype(out_dtype)
    device = q.device

    phi_q = _feature(q.to(cdt), feature_map)
    if not normalize:
        phi_q = phi_q * scale
    phi_k = _feature(_expand_kv(k, H).to(cdt), feature_map)
    v = _expand_kv(v, H).to(cdt)
    if key_mask is not None:
        phi_k = phi_k * key_mask[:, None, :, None].to(cdt)
    if Nq < Nk:  # bottom-right: the queries are the last Nq positions; earlier rows are discarded
        phi_q = F.pad(phi_q, (0, 0, Nk - Nq, 0))
    v = with_ones(v, normalize)  # one pass yields numerator and denominator
    Dv1 = v.shape[-1]
    S = start_state(S0, z0, (B, H, Dk, Dv), phi_q, normalize)
    log_gamma_H = torch.log(decay.to(torch.float64)).to(device=device, dtype=cdt)

    C = max(1, min(chunk_size, Nk))
    n_full = (Nk // C) * C
    outs = []
    # Full chunks in one batched pass, then the remainder as one shorter chunk: no padding, so
    # the final state is not decayed by phantom positions.
    for a, e, c in ((0, n_full, C), (n_full, Nk, Nk - n_full)):
        if e <= a:
            continue
        nc = (e - a) // c
        o, S = _chunk_pass(
            phi_q[:, :, a:e].reshape(B, H, nc, c, Dk),
            phi_k[:, :, a:e].reshape(B, H, nc, c, Dk),
            v[:, :, a:e].reshape(B, H, nc, c, Dv1),
            S,
            log_gamma_H,
        )
        outs.append(o.reshape(B, H, e - a, Dv1))
    out = torch.cat(outs, dim=2)[:, :, Nk - Nq :] if outs else phi_q.new_zeros(B, H, 0, Dv1)
    out, S, z = normalised_out(out, S, Dv, normalize, eps)
    return out.to(out_dtype), S, z


# The stateless prefill as one opaque node; gradients reach q, k, v (the decays, mask and options
# are constants).
prefill_op("attnopt::decay_attention", _decay_forward, differentiable=(0, 1, 2))


# ---- public API ----


def init_decay_state(
    B: int,
    H: int,
    Dk: int,
    Dv: int,
    *,
    normalize: bool = False,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> DecayState:
    """Zero state (S [B, H, Dk, Dv], z [B, H, Dk] when normalize else None) = no earlier tokens."""
    S = torch.zeros(B, H, Dk, Dv, dtype=compute_dtype(dtype), device=device)
    z = torch.zeros(B, H, Dk, dtype=compute_dtype(dtype), device=device) if normalize else None
    return S, z


def decay_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    decay: Union[None, float, Sequence[float], Tensor] = None,
    feature_map: str = "identity",
    normalize: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    key_mask: Optional[Tensor] = None,
    state: Optional[DecayState] = None,
    chunk_size: int = CHUNK,
):
    """Decayed (retention / SSM) attention over q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv].

    o_t = s·φ(q_t)ᵀS_t with S_t = γ_h S_{t-1} + φ(k_t)v_tᵀ (normalize=False, s = scale, default
    1/sqrt(D)), or φ(q_t)ᵀS_t / (φ(q_t)ᵀz_t + eps) with z_t = γ_h z_{t-1} + φ(k_t) (normalize=True,
    no scale). decay: None or "retnet" = RetNet γ_h = 1 - 2^(-5-h); a float; or H floats / a
    tensor [H], all in (0, 1].
    Returns [B, H, Nq, Dv] in q's dtype; with `state` (S, z-or-None) given, continues from it and
    returns (out, new_state). Stateless calls run as the custom op `torch.ops.attnopt.decay_attention`.
    """
    _check_inputs(q, k, v, key_mask)
    _check_options(feature_map, normalize, scale, eps, chunk_size)
    B, H, _, D = q.shape
    gamma = _decay_tensor(decay, H, q.device)
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    tk = cuda_kernels(q, __package__) if state is None else None
    if tk is not None and tk.unsupported(q, feature_map=feature_map, k=k) is None:
        return tk.decay_attention(q, k, v, decay=gamma, feature_map=feature_map, normalize=normalize, scale=s,
                                  eps=eps, key_mask=key_mask)
    if state is None:
        return torch.ops.attnopt.decay_attention(q, k, v, gamma, key_mask, feature_map, normalize, s, float(eps), chunk_size)
    S0, z0 = check_state("decay_attention", state, {"B": B, "H": H, "Dk": D, "Dv": v.shape[3]}, normalize,
                         "init_decay_state")
    out, S, z = _decay_forward(q, k, v, gamma, key_mask, feature_map, normalize, s, float(eps), chunk_size, S0, z0)
    return out, (S, z)


def decay_attention_step(
    q_t: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    state: Optional[DecayState],
    *,
    decay: Union[None, float, Sequence[float], Tensor] = None,
    feature_map: str = "identity",
    normalize: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
):
    """One decoding step with O(1) state: q_t [B, H, 1, D], k_t [B, Hkv, 1, D], v_t [B, Hkv, 1, Dv].

    state None means zeros. Returns (o_t [B, H, 1, Dv], (S, z-or-None)). Same maths as
    `decay_attention`, so a prefill of T tokens followed by steps equals one full prefill."""
    who = "decay_attention_step"
    _check_inputs(q_t, k_t, v_t, None, who)
    if q_t.shape[2] != 1 or k_t.shape[2] != 1:
        raise ValueError(f"{who}: expects one token (N = 1); got q N={q_t.shape[2]}, k N={k_t.shape[2]}. Use decay_attention for prefill")
    _check_options(feature_map, normalize, scale, eps, None, who)
    B, H, _, D = q_t.shape
    Dv = v_t.shape[3]
    cdt = compute_dtype(q_t.dtype)
    if state is None:
        state = init_decay_state(B, H, D, Dv, normalize=normalize, dtype=q_t.dtype, device=q_t.device)
    S, z = check_state(who, state, {"B": B, "H": H, "Dk": D, "Dv": Dv}, normalize, "init_decay_state")
    gamma = _decay_tensor(decay, H, q_t.device).to(cdt)
    phi_q = _feature(q_t.to(cdt), feature_map)  # [B, H, 1, Dk]
    phi_k = _feature(_expand_kv(k_t, H).to(cdt), feature_map)
    v = _expand_kv(v_t, H).to(cdt)
    S = gamma.view(1, H, 1, 1) * S.to(cdt) + phi_k.transpose(-1, -2) @ v
    num = phi_q @ S  # [B, H, 1, Dv]
    if normalize:
        z = gamma.view(1, H, 1) * z.to(cdt) + phi_k[:, :, 0]
        out = ratio_or_zero(num, (phi_q[:, :, 0] * z).sum(-1)[..., None, None], eps)
    else:
        s = 1.0 / math.sqrt(D) if scale is None else float(scale)
        out = s * num
    return out.to(q_t.dtype), (S, z)


def decay_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    decay: Union[None, float, Sequence[float], Tensor] = None,
    feature_map: str = "identity",
    normalize: bool = False,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """The explicit sum o_t = Σ_{j<=t} γ^(t-j) (φ(q_t)·φ(k_j)) v_j as an N×N matrix (γ^n by pow,
    not the log-space path). O(N²): tests and verification only."""
    _check_inputs(q, k, v, key_mask)
    _check_options(feature_map, normalize, scale, eps, None)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cdt = compute_dtype(q.dtype)
    gamma = _decay_tensor(decay, H, q.device).to(cdt)
    phi_q = _feature(q.to(cdt), feature_map)
    phi_k = _feature(_expand_kv(k, H).to(cdt), feature_map)
    v_ = _expand_kv(v, H).to(cdt)
    t = (Nk - Nq) + torch.arange(Nq, device=q.device)[:, None]
    j = torch.arange(Nk, device=q.device)[None, :]
    diff = t - j
    weight_H_Nq_Nk = torch.pow(gamma.view(H, 1, 1), diff.clamp(min=0).to(cdt)) * (diff >= 0).to(cdt)
    A = (phi_q @ phi_k.transpose(-1, -2)) * weight_H_Nq_Nk
    if key_mask is not None:
        A = A * key_mask[:, None, None, :].to(cdt)
    if normalize:
        out = (A @ v_) / (A.sum(-1, keepdim=True) + eps)
    else:
        out = (1.0 / math.sqrt(D) if scale is None else float(scale)) * (A @ v_)
    return out.to(q.dtype)
