"""fp64 oracles for the gated ops: the recurrences stepped token by token, written from the issue's
formulas. They import nothing from attnopt and share no code with the ops: feature maps are spelled
out, the kv head of query head h is h // G by explicit index, a masked key is skipped by an `if`,
the gate is applied as an explicit diag(exp g) / exp(g)(I − β k kᵀ) matrix product.

Letters: B batch, H query heads, Hkv kv heads, G = H // Hkv, Nq/Nk query/key length (query i at
position Nk − Nq + i), D head dim, Dv value dim, M feature width (= D here).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

F64 = torch.float64


def phi(name: str, x: Tensor) -> Tensor:
    x = x.to(F64)
    if name == "identity":
        return x
    if name == "elu":  # ELU(x) + 1
        return torch.where(x > 0, x + 1.0, torch.exp(x))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    raise AssertionError(f"no oracle for feature map {name!r}")


def _kept(key_mask, b, j) -> bool:
    return key_mask is None or bool(key_mask[b, j])


def gla_oracle(
    q, k, v, g, *, feature_map="identity", normalize=False, scale=None, eps=1e-6, key_mask=None, S0=None, z0=None
):
    """Steps S_t = diag(exp g_t) S_{t−1} + φ(k_t)v_tᵀ (z alike) per (batch, kv head), reading out every
    query head of the group at its position. g [B, Hkv, Nk, M] or [B, Hkv, Nk] (one gate for all M).
    Returns (out [B, H, Nq, Dv], S [B, Hkv, M, Dv], z [B, Hkv, M])."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    s = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, H, Nq, Dv, dtype=F64)
    S_all = torch.zeros(B, Hkv, D, Dv, dtype=F64)
    z_all = torch.zeros(B, Hkv, D, dtype=F64)
    for b in range(B):
        for kv in range(Hkv):
            S = torch.zeros(D, Dv, dtype=F64) if S0 is None else S0[b, kv].to(F64).clone()
            z = torch.zeros(D, dtype=F64) if z0 is None else z0[b, kv].to(F64).clone()
            for t in range(Nk):
                if _kept(key_mask, b, t):
                    gt = g[b, kv, t].to(F64)
                    gate = torch.exp(gt) if gt.dim() == 1 else torch.full((D,), math.exp(float(gt)), dtype=F64)
                    fk = phi(feature_map, k[b, kv, t])
                    S = torch.diag(gate) @ S + torch.outer(fk, v[b, kv, t].to(F64))
                    z = gate * z + fk
                i = t - (Nk - Nq)
                if i < 0:
                    continue
                for h in range(kv * G, (kv + 1) * G):
                    fq = phi(feature_map, q[b, h, i])
                    if normalize:
                        den = fq @ z + eps
                        out[b, h, i] = (fq @ S) / den if den != 0 else 0.0
                    else:
                        out[b, h, i] = s * (fq @ S)
            S_all[b, kv], z_all[b, kv] = S, z
    return out, S_all, z_all


def ungated_causal_linear(q, k, v, *, scale=None, key_mask=None) -> Tensor:
    """Plain causal linear attention, identity map, as the explicit sum s·Σ_{j<=t, kept} (q_t·k_j) v_j."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    s = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, H, Nq, v.shape[3], dtype=F64)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                t = Nk - Nq + i
                for j in range(t + 1):
                    if _kept(key_mask, b, j):
                        out[b, h, i] += s * float(q[b, h, i].to(F64) @ k[b, h // G, j].to(F64)) * v[b, h // G, j].to(F64)
    return out


def delta_oracle(q, k, v, g, beta, *, scale=None, key_mask=None, S0=None):
    """Steps S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ with the identity matrix spelled
    out; o_t = s·S_tᵀ q_t. Returns (out [B, H, Nq, Dv], S [B, Hkv, D, Dv])."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    s = 1.0 / math.sqrt(D) if scale is None else scale
    eye = torch.eye(D, dtype=F64)
    out = torch.zeros(B, H, Nq, Dv, dtype=F64)
    S_all = torch.zeros(B, Hkv, D, Dv, dtype=F64)
    for b in range(B):
        for kv in range(Hkv):
            S = torch.zeros(D, Dv, dtype=F64) if S0 is None else S0[b, kv].to(F64).clone()
            for t in range(Nk):
                if _kept(key_mask, b, t):
                    kt, vt = k[b, kv, t].to(F64), v[b, kv, t].to(F64)
                    bt, gt = float(beta[b, kv, t]), float(g[b, kv, t])
                    S = math.exp(gt) * (eye - bt * torch.outer(kt, kt)) @ S + bt * torch.outer(kt, vt)
                i = t - (Nk - Nq)
                if i < 0:
                    continue
                for h in range(kv * G, (kv + 1) * G):
                    out[b, h, i] = s * (S.T @ q[b, h, i].to(F64))
            S_all[b, kv] = S
    return out, S_all


def gla_window_oracle(q, k, v, phi_q, phi_k, g, *, window, sinks=0, scale=None, beta=None, key_mask=None):
    """The gla+window formula stepped token by token: a GLA state over the keys that have left the
    window (a key joins it W steps after it arrived, with the gates since then applied one diag at a
    time), the window and sinks as an explicit softmax list, one normaliser:
    o = (Σ_win e^{s q·k} v + β φ(q)ᵀS) / (Σ_win e^{s q·k} + β φ(q)ᵀz). φ(q), φ(k) are given."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    M = phi_k.shape[3]
    G = H // Hkv
    s = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, H, Nq, Dv, dtype=F64)
    for b in range(B):
        real = [j for j in range(Nk) if _kept(key_mask, b, j)]
        sink_set = set(real[:sinks])
        for kv in range(Hkv):
            S, z = torch.zeros(M, Dv, dtype=F64), torch.zeros(M, dtype=F64)
            pending = []  # (column, decayed φ(k)) of kept non-sink keys still inside the band
            for t in range(Nk):
                if _kept(key_mask, b, t):
                    gt = g[b, kv, t].to(F64)
                    gate = torch.exp(gt) if gt.dim() == 1 else torch.full((M,), math.exp(float(gt)), dtype=F64)
                    S, z = torch.diag(gate) @ S, gate * z
                    pending = [(j, gate * f) for j, f in pending]
                    if t not in sink_set:
                        pending.append((t, phi_k[b, kv, t].to(F64)))
                left = [(j, f) for j, f in pending if j <= t - window]
                pending = [(j, f) for j, f in pending if j > t - window]
                for j, f in left:
                    S = S + torch.outer(f, v[b, kv, j].to(F64))
                    z = z + f
                i = t - (Nk - Nq)
                if i < 0:
                    continue
                visible = [j for j in range(t + 1) if _kept(key_mask, b, j) and (t - j < window or j in sink_set)]
                for h in range(kv * G, (kv + 1) * G):
                    qh = q[b, h, i].to(F64)
                    logits = [s * float(qh @ k[b, kv, j].to(F64)) for j in visible]
                    top = max(logits) if logits else 0.0
                    w = [math.exp(x - top) for x in logits]
                    num = sum((wi * v[b, kv, j].to(F64) for wi, j in zip(w, visible)), torch.zeros(Dv, dtype=F64))
                    den = sum(w)
                    bh = 1.0 if beta is None else float(beta[h])
                    fq = phi_q[b, h, i].to(F64)
                    num = num + bh * math.exp(-top) * (fq @ S)
                    den = den + bh * math.exp(-top) * float(fq @ z)
                    out[b, h, i] = num / den if den > 0 else 0.0
    return out
