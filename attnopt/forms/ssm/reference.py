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
from attnopt.kernels.layout import (
    check_sdpa_inputs,
    compute_dtype,
    is_fake_tensor,
    ratio_or_zero,
)
from attnopt.kernels.registration import register_recompute_autograd
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
    """SDPA layout checks, plus causality's Nq <= Nk."""
    check_sdpa_inputs(who, q, k, v, key_mask)
    Nq = q.shape[2]
    if Nq > k.shape[2]:
        raise ValueError(
            f"{who}: {Nq} queries but only {k.shape[2]} keys; decayed attention is causal and needs Nq <= Nk "
            "(queries are the last Nq positions)"
        )


def _check_options(feature_map, normalize, scale, eps, chunk_size, who="decay_attention") -> None:
    if feature_map not in DECAY_FEATURE_MAPS:
        raise ValueError(f"{who}: unknown feature_map {feature_map!r}; allowed: {', '.join(DECAY_FEATURE_MAPS)}")
    if not isinstance(normalize, bool):
        raise TypeError(f"{who}: normalize must be a bool, got {normalize!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"{who}: scale must be a finite float or None (1/sqrt(D)), got {scale!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{who}: eps must be a float >= 0, got {eps!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{who}: chunk_size must be an int >= 1, got {chunk_size!r}")


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


def _decay_forward(
    q_BHND: Tensor,
    k_BHkvND: Tensor,
    v_BHkvND: Tensor,
    gamma_H: Tensor,
    key_mask_BN: Optional[Tensor],
    feature_map: str,
    normalize: bool,
    scale: float,
    eps: float,
    chunk_size: int,
    S0: Optional[Tensor] = None,
    z0: Optional[Tensor] = None,
):
    """Chunk-parallel prefill; differentiable plain PyTorch. Returns (out, S, z-or-None)."""
    B, H, Nq, Dk = q_BHND.shape
    Nk, Dv = k_BHkvND.shape[2], v_BHkvND.shape[3]
    out_dtype = q_BHND.dtype
    cdt = compute_dtype(out_dtype)
    device = q_BHND.device

    phi_q = _feature(q_BHND.to(cdt), feature_map)
    if not normalize:
        phi_q = phi_q * scale
    phi_k = _feature(_expand_kv(k_BHkvND, H).to(cdt), feature_map)
    v = _expand_kv(v_BHkvND, H).to(cdt)
    if key_mask_BN is not None:
        phi_k = phi_k * key_mask_BN[:, None, :, None].to(cdt)
    if Nq < Nk:  # bottom-right: the queries are the last Nq positions; earlier rows are discarded
        phi_q = F.pad(phi_q, (0, 0, Nk - Nq, 0))
    if normalize:  # carry z as an extra value column: one pass yields numerator and denominator
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    Dv1 = v.shape[-1]

    S = S0.to(cdt) if S0 is not None else phi_q.new_zeros(B, H, Dk, Dv)
    if normalize:
        z = z0.to(cdt) if z0 is not None else phi_q.new_zeros(B, H, Dk)
        S = torch.cat([S, z[..., None]], dim=-1)
    log_gamma_H = torch.log(gamma_H.to(torch.float64)).to(device=device, dtype=cdt)

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
    if normalize:
        out = ratio_or_zero(out[..., :Dv], out[..., Dv:], eps)
        S, z = S[..., :Dv], S[..., Dv]
    else:
        z = None
    return out.to(out_dtype), S, z


# ---- custom op: the stateless prefill as one opaque node, fake + autograd registered ----


@torch.library.custom_op("attnopt::decay_attention", mutates_args=())
def _decay_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    decay: Tensor,
    key_mask: Optional[Tensor],
    feature_map: str,
    normalize: bool,
    scale: float,
    eps: float,
    chunk_size: int,
) -> Tensor:
    out, _, _ = _decay_forward(q, k, v, decay, key_mask, feature_map, normalize, scale, eps, chunk_size)
    return out


@_decay_attention_op.register_fake
def _(q, k, v, decay, key_mask, feature_map, normalize, scale, eps, chunk_size):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


# Gradients reach q, k, v; the decays, mask and options are constants.
register_recompute_autograd(_decay_attention_op, lambda *a: _decay_forward(*a)[0], differentiable=(0, 1, 2))


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


def _check_state(state, B, H, Dk, Dv, normalize, who) -> tuple:
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"{who}: state must be a pair (S [B, H, Dk, Dv], z [B, H, Dk] or None); see init_decay_state")
    S, z = state
    if not isinstance(S, Tensor) or tuple(S.shape) != (B, H, Dk, Dv):
        got = tuple(S.shape) if isinstance(S, Tensor) else type(S).__name__
        raise ValueError(f"{who}: state S must have shape [B, H, Dk, Dv] = {(B, H, Dk, Dv)}, got {got}")
    if normalize:
        if not isinstance(z, Tensor) or tuple(z.shape) != (B, H, Dk):
            raise ValueError(f"{who}: normalize=True needs state z of shape [B, H, Dk] = {(B, H, Dk)}; use init_decay_state(..., normalize=True)")
    elif z is not None:
        raise ValueError(f"{who}: state carries z but normalize=False; pass (S, None) or set normalize=True")
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
    S0, z0 = _check_state(state, B, H, D, v.shape[3], normalize, "decay_attention")
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
    S, z = _check_state(state, B, H, D, Dv, normalize, who)
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


def packed_decay_state(state: DecayState, cdt: torch.dtype) -> Tensor:
    """The buffer the in-place token step (`attnopt.kernels.token_step`) works on: [S ‖ z] [B, H, Dk, Dv + 1] when
    normalising (S and z its views, made once when they are not), else S itself in `cdt`."""
    S, z = state
    if z is None:
        return S if S.dtype == cdt and S.is_contiguous() else S.to(cdt).contiguous()
    base = S._base
    if (base is not None and base is z._base and base.dtype == cdt and base.dim() == 4 and base.is_contiguous()
            and base.shape[-1] == S.shape[-1] + 1 and S.data_ptr() == base.data_ptr()
            and z.data_ptr() == base.data_ptr() + S.shape[-1] * base.element_size()):
        return base
    return torch.cat([S.to(cdt), z.to(cdt)[..., None]], dim=-1)


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
